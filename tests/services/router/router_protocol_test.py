"""Protocol edges of exl3-router and exl3-worker, with real processes on loopback, each case on its
own cluster (harness.Cluster: a holds experts 0-3 alone, b holds 4-7 with b2 its replica):

- a message that does not parse ends the Forward stream with INVALID_ARGUMENT saying why (router
  and worker), and a Describe request that does not parse is answered INVALID_ARGUMENT;
- a request above --max-message-bytes (below gRPC's limit, twice that) and a request whose answer
  would be above it are answered in-band with RESOURCE_EXHAUSTED, and the stream goes on;
- timeout_us of 2^60 and more is clamped, not taken as expired;
- topk.k above the model's top_k and token_ids of the wrong length are refused by the router;
- exl3_router_failovers_total counts only failovers that happened, and the drain's log line says
  it drains. Run by ctest (EXL3_BUILD_DIR set)."""

import os
import re
import signal
import sys
import threading
import time
import unittest
import urllib.request

import grpc
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from harness import Cluster, wait_for  # noqa: E402

from exl3serve.v1 import exl3serve_pb2 as pb  # noqa: E402
from exl3serve_client import MoeRouterClient  # noqa: E402
from exl3serve_client.client import make_request  # noqa: E402

LAYER = 1
HIDDEN = 256
GARBAGE = b"\x0a\xff\xff\xff\x0f"  # field 1, length-delimited, length 2^32 - 1: truncated


def topk_req(ids, T=1, **kw):
    x = np.random.default_rng(T).standard_normal((T, HIDDEN)).astype(np.float32)
    return make_request(LAYER, x, topk_ids=np.array([ids] * T),
                        topk_weights=np.array([[0.5] * len(ids)] * T), **kw)


def counter(text, name, **labels):
    sel = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{name}\{{{sel}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


class ProtocolTest(unittest.TestCase):
    def cluster(self, workers=("a", "b", "b2"), router_args=(), router=True):
        c = Cluster()
        self.addCleanup(c.stop)
        c.start_workers(workers)
        if not router:
            return c, None, None
        r = c.start_router(list(router_args))
        client = MoeRouterClient(r.address)
        self.addCleanup(client.close)
        wait_for(lambda: client.describe().state == pb.STATE_SERVING, 20, "router SERVING")
        return c, r, client

    def garbage_ends_stream(self, address, method, response_type):
        """Sends one unparseable message on a raw Forward stream kept open; returns the stream's
        final status (code, details)."""
        ch = grpc.insecure_channel(address)
        self.addCleanup(ch.close)
        done = threading.Event()

        def requests():
            yield GARBAGE
            done.wait(20)  # no half-close: the end must come from the server

        call = ch.stream_stream(method, request_serializer=lambda b: b,
                                response_deserializer=response_type.FromString)(requests())
        try:
            answers = list(call)
            code, details = call.code(), call.details()
        except grpc.RpcError as e:
            answers, code, details = [], e.code(), e.details()
        finally:
            done.set()
        self.assertEqual(answers, [])
        return code, details

    # ---- messages that do not parse ----

    def test_unparseable_message_ends_router_stream(self):
        _, r, client = self.cluster()
        code, details = self.garbage_ends_stream(r.address, "/exl3serve.v1.MoeRouter/Forward",
                                                 pb.MoeLayerResponse)
        self.assertEqual(code, grpc.StatusCode.INVALID_ARGUMENT, details)
        self.assertIn("does not parse as exl3serve.v1.MoeLayerRequest", details)
        with client.stream() as s:  # other streams are served
            self.assertEqual(s.submit_request(topk_req([0, 4])).result(timeout=10).status.code,
                             pb.OK)

    def test_unparseable_message_ends_worker_stream(self):
        c, _, _ = self.cluster(workers=("a",), router=False)
        code, details = self.garbage_ends_stream(f"127.0.0.1:{c.ports['a']}",
                                                 "/exl3serve.v1.ExpertWorker/Forward",
                                                 pb.ExpertResponse)
        self.assertEqual(code, grpc.StatusCode.INVALID_ARGUMENT, details)
        self.assertIn("does not parse as exl3serve.v1.ExpertRequest", details)

    def test_unparseable_describe(self):
        c, r, _ = self.cluster()
        for address, method in ((r.address, "/exl3serve.v1.MoeRouter/Describe"),
                                (f"127.0.0.1:{c.ports['a']}", "/exl3serve.v1.ExpertWorker/Describe")):
            ch = grpc.insecure_channel(address)
            self.addCleanup(ch.close)
            call = ch.unary_unary(method, request_serializer=lambda b: b,
                                  response_deserializer=lambda b: b)
            with self.assertRaises(grpc.RpcError) as e:
                call(GARBAGE, timeout=5)
            self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT, method)
            self.assertIn("does not parse as exl3serve.v1.", e.exception.details())
            self.assertTrue(call(b"", timeout=5))  # an empty request is a valid DescribeRequest

    # ---- sizes ----

    def test_oversized_request_and_answer_in_band(self):
        _, _, client = self.cluster(router_args=["--max-message-bytes", "200000"])
        with client.stream() as s:
            # 300 x 256 fp32 = 307 KB: above the limit, below gRPC's (twice the limit).
            big = s.submit_request(topk_req([0, 4], T=300)).result(timeout=10)
            self.assertEqual(big.status.code, pb.RESOURCE_EXHAUSTED, big.status.message)
            self.assertIn("--max-message-bytes", big.status.message)
            # 300 tokens of fp16 in (154 KB) fit; their fp32 answer (307 KB) does not.
            x = np.random.default_rng(3).standard_normal((300, HIDDEN)).astype(np.float16)
            req = make_request(LAYER, x, topk_ids=np.array([[0, 4]] * 300),
                               topk_weights=np.full((300, 2), 0.5))
            ans = s.submit_request(req).result(timeout=10)
            self.assertEqual(ans.status.code, pb.RESOURCE_EXHAUSTED, ans.status.message)
            self.assertIn("answer", ans.status.message)
            # Asked in fp16, the same answer fits; and the stream goes on.
            req = make_request(LAYER, x, topk_ids=np.array([[0, 4]] * 300),
                               topk_weights=np.full((300, 2), 0.5), output_dtype="fp16")
            self.assertEqual(s.submit_request(req).result(timeout=10).status.code, pb.OK)
            self.assertEqual(s.submit_request(topk_req([1, 5])).result(timeout=10).status.code,
                             pb.OK)

    # ---- request fields ----

    def test_huge_timeout_is_clamped(self):
        _, _, client = self.cluster()
        with client.stream() as s:
            for t in (2 ** 60, 2 ** 63, 2 ** 64 - 1):
                req = topk_req([0, 4])
                req.timeout_us = t
                r = s.submit_request(req).result(timeout=10)
                self.assertEqual(r.status.code, pb.OK, f"timeout_us {t}: {r.status.message}")

    def test_routing_fields_checked_by_router(self):
        _, _, client = self.cluster()
        with client.stream() as s:
            r = s.submit_request(topk_req([0, 4, 5])).result(timeout=10)  # the model's top_k is 2
            self.assertEqual(r.status.code, pb.INVALID_ARGUMENT, r.status.message)
            self.assertIn("top_k", r.status.message)
            self.assertNotIn("worker", r.status.message)
            x = np.random.default_rng(4).standard_normal((2, HIDDEN)).astype(np.float32)
            for n in (1, 3):  # layer 1 is not hash-routed: token_ids are still checked
                r = s.submit_request(make_request(LAYER, x, token_ids=list(range(n)))) \
                    .result(timeout=10)
                self.assertEqual(r.status.code, pb.INVALID_ARGUMENT, r.status.message)
                self.assertIn("token_ids", r.status.message)

    # ---- metrics and logs ----

    def test_failover_counted_only_when_it_happens(self):
        c, r, client = self.cluster()
        with client.stream() as s:
            # Sub-requests in flight on a (no replica) and on b (b2 replicates it) when each dies.
            for name, ids, code in (("a", [0, 1], pb.UNAVAILABLE), ("b", [4, 5], pb.OK)):
                w = c.workers[name]
                w.freeze()
                futs = [s.submit_request(topk_req(ids)) for _ in range(4)]
                time.sleep(0.3)
                w.kill9()
                for f in futs:
                    self.assertEqual(f.result(timeout=10).status.code, code, name)
        metrics = urllib.request.urlopen(f"http://{r.metrics}/metrics").read().decode()
        self.assertEqual(counter(metrics, "exl3_router_failovers_total", worker="a"), 0)
        self.assertGreaterEqual(counter(metrics, "exl3_router_failovers_total", worker="b"), 1)
        # Drain: the log says so (not "0 routed experts have no serving worker").
        c.start_worker("a")
        c.start_worker("b")
        wait_for(lambda: client.describe().state == pb.STATE_SERVING, 20, "router SERVING")
        r.signal(signal.SIGTERM)
        r.p.wait(timeout=20)
        self.assertIn("not ready: draining", r.text())
        self.assertNotIn("not ready: 0 ", r.text())


if __name__ == "__main__":
    unittest.main(verbosity=2)
