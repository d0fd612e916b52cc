"""The Python client (clients/python) against a live exl3-router, and TLS / mutual TLS on both
hops (client -> router, router -> worker) with certificates made by openssl at test time: a client
without a valid certificate is refused."""

import os
import sys
import tempfile
import unittest

import grpc
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from harness import Cluster, make_certs, wait_for  # noqa: E402

from exl3serve.v1 import exl3serve_pb2 as pb  # noqa: E402
from exl3serve_client import MoeRouterClient, RequestError  # noqa: E402

ONE_WORKER = """workers:
  - name: a
    address: 127.0.0.1:{a}
    experts: all
"""


def ready(client):
    d = client.describe(timeout=2)
    return d.state == pb.STATE_SERVING and all(w.up for w in d.workers)


class PythonClientTest(unittest.TestCase):
    def setUp(self):
        """A fresh cluster per case: worker a holding every expert and a router."""
        self.c = Cluster()
        self.addCleanup(self.c.stop)
        self.c.write_map(ONE_WORKER)
        self.c.start_worker("a")
        self.r = self.c.start_router()
        self.client = MoeRouterClient(self.r.address)
        self.addCleanup(self.client.close)
        wait_for(lambda: ready(self.client), 20, "router ready")

    def test_describe(self):
        d = self.client.describe()
        self.assertEqual(d.model.architecture, "Glm4MoeForCausalLM")
        self.assertEqual(d.model.hidden_size, 256)
        self.assertEqual(list(d.model.moe_layers), [1, 2])
        self.assertEqual(d.model.num_experts, 8)
        self.assertEqual(len(d.model.fingerprint), 32)
        self.assertEqual([w.name for w in d.workers], ["a"])
        self.assertEqual(d.unserved_experts, 0)
        self.assertEqual(d.versions.protocol, "exl3serve.v1")

    def test_forward_numpy(self):
        rng = np.random.default_rng(3)
        x = rng.standard_normal((5, 256)).astype(np.float32)
        y = self.client.forward(1, x)
        self.assertEqual(y.shape, (5, 256))
        self.assertEqual(y.dtype, np.float32)
        self.assertTrue(np.isfinite(y).all())
        self.assertGreater(np.abs(y).max(), 0)
        # Deterministic; fp16/bf16 answers are the fp32 answer rounded.
        np.testing.assert_array_equal(self.client.forward(1, x), y)
        y16 = self.client.forward(1, x, output_dtype="fp16")
        self.assertEqual(y16.dtype, np.float16)
        np.testing.assert_allclose(y16.astype(np.float32), y, rtol=2e-3, atol=2e-3 * np.abs(y).max())
        ybf = self.client.forward(1, x, output_dtype="bf16")
        np.testing.assert_allclose(ybf, y, rtol=1e-2, atol=1e-2 * np.abs(y).max())
        # Inputs as fp16 arrays go as fp16 on the wire.
        r = self.client.forward_full(2, x.astype(np.float16))
        self.assertEqual(r.output.shape, (5, 256))
        self.assertEqual(r.topk_ids.shape, (5, 2))
        self.assertTrue(((r.topk_ids >= 0) & (r.topk_ids < 8)).all())

    def test_pipelined_stream(self):
        rng = np.random.default_rng(4)
        xs = [rng.standard_normal((2, 256)).astype(np.float32) for _ in range(16)]
        with self.client.stream() as s:
            futs = [s.submit(1 + i % 2, x) for i, x in enumerate(xs)]
            outs = [f.result(timeout=30).output for f in futs]
        for i, (x, y) in enumerate(zip(xs, outs)):
            np.testing.assert_array_equal(self.client.forward(1 + i % 2, x), y)

    def test_errors_raise_and_stream_goes_on(self):
        x = np.ones((1, 256), np.float32)
        with self.client.stream() as s:
            bad = s.submit(0, x)
            worse = s.submit(1, np.ones((1, 100), np.float32))
            good = s.submit(1, x)
            with self.assertRaises(RequestError) as e:
                bad.result(timeout=10)
            self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)
            with self.assertRaises(RequestError) as e:
                worse.result(timeout=10)
            self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertEqual(good.result(timeout=10).output.shape, (1, 256))


class TlsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        # Certificates are files, made once; every case starts its own processes (setUp).
        cls.certs = make_certs(tempfile.mkdtemp(prefix="exl3-certs-"))

    def setUp(self):
        """A fresh cluster per case: worker a (mTLS server) and a router serving mTLS, with a
        client certificate for the worker."""
        k = self.certs
        server_mtls = ["--tls-cert", k["server_cert"], "--tls-key", k["server_key"],
                       "--tls-ca", k["ca"], "--tls-require-client-cert"]
        self.c = Cluster(worker_tls=server_mtls)
        self.addCleanup(self.c.stop)
        self.c.write_map(ONE_WORKER)
        self.c.start_worker("a")
        worker_client = ["--worker-tls-ca", k["ca"], "--worker-tls-cert", k["client_cert"],
                         "--worker-tls-key", k["client_key"]]
        self.r = self.c.start_router(worker_client, tls=server_mtls)

    def client(self, cert=None, key=None, ca=None):
        k = self.certs
        return MoeRouterClient(self.r.address, tls_ca=ca or k["ca"], tls_cert=cert, tls_key=key)

    def test_mtls_both_hops(self):
        k = self.certs
        good = self.client(k["client_cert"], k["client_key"])
        wait_for(lambda: ready(good), 20, "router ready over mTLS to its worker")
        y = good.forward(1, np.random.default_rng(1).standard_normal((2, 256)).astype(np.float32))
        self.assertEqual(y.shape, (2, 256))
        good.close()

    def test_client_without_valid_certificate_is_refused(self):
        k = self.certs
        for name, cl in (("no client certificate", self.client()),
                         ("certificate from another CA", self.client(k["rogue_cert"], k["rogue_key"])),
                         ("plaintext", MoeRouterClient(self.r.address))):
            with self.assertRaises(grpc.RpcError, msg=name) as e:
                cl.describe(timeout=3)
            self.assertEqual(e.exception.code(), grpc.StatusCode.UNAVAILABLE, name)
            cl.close()

    def test_router_without_worker_certificate_is_refused_by_worker(self):
        k = self.certs
        r2 = self.c.start_router(["--worker-tls-ca", k["ca"]])  # TLS to the worker, no client cert
        try:
            cl = MoeRouterClient(r2.address)
            wait_for(lambda: "Describe failed" in r2.text(), 10, "worker refusing the router")
            d = cl.describe()
            self.assertFalse(d.workers[0].up)
            self.assertEqual(d.unserved_experts, 16)
            cl.close()
        finally:
            r2.stop()


if __name__ == "__main__":
    unittest.main(verbosity=2)
