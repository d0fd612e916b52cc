"""System tests with real processes on loopback for two router features:

- cancellation propagated to the workers: a layer request cancelled by the engine (per request or
  by ending its stream), or whose deadline passes, has its sub-requests withdrawn from the workers;
  a worker drops a withdrawn request that is still queued (never computes it, answers CANCELLED)
  and the other requests and streams go on;
- the shared expert on a named worker (--shared-expert worker:NAME): answers equal the CPU
  reference (exl3-loadgen --verify, shared expert included) and the router's local shared expert;
  the named worker's replica takes over when it dies; without any, only UNAVAILABLE naming it.

Workers are started on kernel-picked ports (parsed from their logs) and the expert maps written
afterwards; each case on a cluster of its own. Run by ctest (EXL3_BUILD_DIR set)."""

import os
import re
import subprocess
import sys
import threading
import time
import unittest
import urllib.request

import grpc
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from harness import BIN, Cluster, Proc, wait_for  # noqa: E402

from exl3serve.v1 import exl3serve_pb2 as pb  # noqa: E402
from exl3serve.v1 import exl3serve_pb2_grpc as pb_grpc  # noqa: E402
from exl3serve_client import MoeRouterClient  # noqa: E402
from exl3serve_client.client import make_request  # noqa: E402

LAYER = 1
HIDDEN = 256
SLOW_WINDOW_US = 2_000_000  # the slow worker holds a batch this long: requests sit in its queue


def scrape(address):
    return urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()


def counter(text, name, **labels):
    """Value of one series (labels in any order), 0 when absent."""
    for line in text.splitlines():
        m = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    return 0.0


def topk_req(ids, T=1, timeout_ms=0, seed=0):
    x = np.random.default_rng(seed).standard_normal((T, HIDDEN)).astype(np.float32)
    return make_request(LAYER, x, topk_ids=np.array([ids] * T),
                        topk_weights=np.array([[0.5] * len(ids)] * T), timeout_ms=timeout_ms)


def final_counts(out):
    m = re.search(r"^requests=(\d+) ok=(\d+) failed=(\d+) verified=(\d+) mismatched=(\d+)$", out,
                  re.M)
    assert m, f"no final line in:\n{out}"
    return dict(zip(("requests", "ok", "failed", "verified", "mismatched"), map(int, m.groups())))


class CancelAndSharedExpertTest(unittest.TestCase):
    """Each case starts the workers and routers it needs on a fresh cluster (its test model only:
    the workers here are started on kernel-picked ports, not from the cluster's map)."""

    def setUp(self):
        self.c = Cluster()
        self.addCleanup(self.c.stop)
        self.w = {}

    def start_worker(self, name, args):
        p = Proc(f"worker-{name}-{time.time():.0f}", [
            os.path.join(BIN, "exl3-worker"), "--model", self.c.model, "--listen", "127.0.0.1:0",
            "--metrics-listen", "127.0.0.1:0", "--progress=false", "--mlock=false",
            "--threads", "1", *args], self.c.dir)
        self.c.workers[f"x-{name}-{len(self.c.workers)}"] = p  # stopped with the cluster
        m = p.wait_for_log(r"serving on (\S+), metrics on (\S+)")
        p.address, p.metrics = m.group(1), m.group(2)
        return p

    def write_map(self, name, text):
        path = os.path.join(self.c.dir, name)
        with open(path, "w") as f:
            f.write(text)
        return path

    def start_router(self, extra):
        r = self.c.start_router(extra)
        r.cluster = self.c
        r.client = MoeRouterClient(r.address)
        self.addCleanup(r.client.close)
        wait_for(lambda: r.client.describe(timeout=2).state == pb.STATE_SERVING, 30,
                 f"router {r.name} ready")
        return r

    def restart(self, name, args):
        self.w[name] = self.start_worker(name, args)
        return self.w[name]

    def start_shared_workers(self):
        """Routed experts on a (0-3) and b (4-7); the shared expert on s, s2 its replica; their
        map in self.shared_map."""
        self.w["a"] = self.start_worker("a", ["--experts", "0-3"])
        self.w["b"] = self.start_worker("b", ["--experts", "4-7"])
        self.w["s"] = self.start_worker("s", ["--shared-expert"])
        self.w["s2"] = self.start_worker("s2", ["--shared-expert"])
        self.shared_map = self.write_map("shared.yaml", f"""workers:
  - name: a
    address: {self.w['a'].address}
    experts: 0-3
  - name: b
    address: {self.w['b'].address}
    experts: 4-7
  - name: s
    address: {self.w['s'].address}
    shared_expert: true
  - name: s2
    address: {self.w['s2'].address}
    replica_of: s
""")

    def start_shared_routers(self):
        """Over start_shared_workers' workers: self.local (the router computes the shared expert)
        and self.remote (--shared-expert worker:s)."""
        self.local = self.start_router(["--expert-map", self.shared_map])
        self.remote = self.start_router(["--expert-map", self.shared_map,
                                         "--shared-expert", "worker:s"])

    def start_cancel_cluster(self):
        """slow holds experts 0-3 with a long batch window, b holds 4-7; self.canc routes to
        them."""
        self.w["slow"] = self.start_worker("slow", ["--experts", "0-3", "--batch-window-us",
                                                    str(SLOW_WINDOW_US)])
        self.w["b"] = self.start_worker("b", ["--experts", "4-7"])
        cancel_map = self.write_map("cancel.yaml", f"""workers:
  - name: slow
    address: {self.w['slow'].address}
    experts: 0-3
  - name: b
    address: {self.w['b'].address}
    experts: 4-7
""")
        self.canc = self.start_router(["--expert-map", cancel_map, "--default-deadline-ms",
                                       "20000"])

    # ---- the shared expert on a worker ----

    def test_shared_expert_worker_matches_reference_and_local(self):
        self.start_shared_workers()
        self.start_shared_routers()
        d = self.remote.client.describe()
        self.assertEqual(d.shared_expert, "worker:s")
        self.assertTrue(d.cancel_supported)
        self.assertEqual({w.name: w.shared_expert for w in d.workers},
                         {"a": False, "b": False, "s": True, "s2": True})
        self.assertEqual(self.local.client.describe().shared_expert, "local")
        # Whole decode steps against the CPU reference MoE (routing, experts and shared expert).
        p = subprocess.run(
            [os.path.join(BIN, "exl3-loadgen"), "--target", self.remote.address, "--model",
             self.c.model, "--verify", "--concurrency", "2", "--tokens", "3", "--requests", "12"],
            capture_output=True, text=True, timeout=120)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertEqual(final_counts(p.stdout)["verified"], 12, p.stdout)
        # The same answers as the router's local shared expert, one token and many.
        for T in (1, 7):
            x = np.random.default_rng(T).standard_normal((T, HIDDEN)).astype(np.float32)
            remote = self.remote.client.forward_full(LAYER, x)
            local = self.local.client.forward_full(LAYER, x)
            np.testing.assert_array_equal(remote.topk_ids, local.topk_ids)
            scale = np.abs(local.output).max()
            np.testing.assert_allclose(remote.output, local.output, rtol=0, atol=1e-5 * scale)
            # Without the shared expert the answers differ from with it: it was really added.
            bare = self.remote.client.forward(LAYER, x, include_shared_expert=False)
            self.assertGreater(np.abs(bare - remote.output).max(), 1e-3 * scale)
        self.assertGreater(counter(scrape(self.w["s"].metrics) + scrape(self.w["s2"].metrics),
                                   "exl3_worker_tokens_total", layer=str(LAYER)), 0)

    def test_shared_expert_worker_failover_and_failure(self):
        self.start_shared_workers()
        self.start_shared_routers()
        x = np.random.default_rng(3).standard_normal((2, HIDDEN)).astype(np.float32)
        want = self.local.client.forward(LAYER, x)
        try:
            # s dies: its replica s2 serves the shared expert, no request fails.
            self.w["s"].kill9()
            for _ in range(3):
                got = self.remote.client.forward(LAYER, x)
                np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
            # s2 dies too: only requests with the shared expert fail, UNAVAILABLE naming them.
            self.w["s2"].kill9()
            wait_for(lambda: not any(w.up for w in self.remote.client.describe().workers
                                     if w.name in ("s", "s2")), 10, "s and s2 down")
            with self.remote.client.stream() as st:
                r = st.submit_request(make_request(LAYER, x)).result(timeout=10)
                self.assertEqual(r.status.code, pb.UNAVAILABLE, r.status.message)
                self.assertIn("shared expert", r.status.message)
                self.assertIn("held by: s, s2", r.status.message)
                bare = st.submit_request(make_request(LAYER, x, include_shared_expert=False))
                self.assertEqual(bare.result(timeout=10).status.code, pb.OK)
            self.assertNotEqual(self.remote.client.describe().state, pb.STATE_SERVING)
        finally:
            for n in ("s", "s2"):
                if not self.w[n].alive():
                    # Same address as in the map: restart on the port it had.
                    port = self.w[n].address.rsplit(":", 1)[1]
                    self.restart(n, ["--shared-expert", "--listen", f"127.0.0.1:{port}"])
        wait_for(lambda: self.remote.client.describe().state == pb.STATE_SERVING, 20,
                 "router ready again")
        got = self.remote.client.forward(LAYER, x)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())

    def test_shared_expert_worker_checked_at_start(self):
        self.start_shared_workers()
        base = [os.path.join(BIN, "exl3-router"), "--model", self.c.model, "--expert-map",
                self.shared_map, "--listen", "127.0.0.1:0", "--metrics-listen", ""]
        for name, needle in (("a", "not marked `shared_expert: true`"),
                             ("nobody", 'no worker "nobody"')):
            p = subprocess.run(base + ["--shared-expert", f"worker:{name}"], capture_output=True,
                               text=True, timeout=60)
            self.assertNotEqual(p.returncode, 0)
            self.assertIn(needle, p.stderr)
        # A worker the map marks shared_expert that does not hold it stays out of service.
        m = self.write_map("noshared.yaml", f"""workers:
  - name: a
    address: {self.w['a'].address}
    experts: 0-3
  - name: b
    address: {self.w['b'].address}
    experts: 4-7
    shared_expert: true
""")
        r = self.c.start_router(["--expert-map", m, "--shared-expert", "worker:b"])
        try:
            r.wait_for_log(r"worker b .*does not hold the shared expert", timeout=20)
        finally:
            r.stop()

    # ---- cancellation ----

    def wait_queued(self, n):
        wait_for(lambda: counter(scrape(self.w["slow"].metrics), "exl3_worker_queue_depth") == n,
                 10, f"{n} requests queued at the slow worker")

    def test_engine_cancel_reaches_the_queued_worker_request(self):
        self.start_cancel_cluster()
        before = scrape(self.w["slow"].metrics)
        with self.canc.client.stream() as s, self.canc.client.stream() as other:
            t0 = time.time()
            victim_req = topk_req([0, 1], T=3, seed=1)
            victim = s.submit_request(victim_req)
            kept = other.submit_request(topk_req([2, 3], T=2, seed=2))  # same worker, same batch
            fast = other.submit_request(topk_req([4, 5], T=1, seed=3))  # another worker
            self.assertEqual(fast.result(timeout=10).status.code, pb.OK)
            self.wait_queued(2)  # both slow requests wait in slow's batch window
            s.cancel_request(victim_req.id)
            r = victim.result(timeout=10)
            self.assertEqual(r.status.code, pb.CANCELLED, r.status.message)
            self.assertLess(time.time() - t0, SLOW_WINDOW_US / 1e6)  # answered, not computed
            self.assertEqual(kept.result(timeout=20).status.code, pb.OK)
            # The stream goes on.
            self.assertEqual(s.submit_request(topk_req([4, 6])).result(timeout=10).status.code,
                             pb.OK)

        def dropped():
            after = scrape(self.w["slow"].metrics)
            return counter(after, "exl3_worker_cancels_total", reason="client",
                           outcome="dropped") - counter(before, "exl3_worker_cancels_total",
                                                        reason="client", outcome="dropped") == 1
        wait_for(dropped, 10, "the worker dropped the cancelled request")
        after = scrape(self.w["slow"].metrics)
        # Only the kept request's 2 tokens were computed, never the victim's 3.
        self.assertEqual(counter(after, "exl3_worker_tokens_total", layer=str(LAYER)) -
                         counter(before, "exl3_worker_tokens_total", layer=str(LAYER)), 2)
        self.assertGreaterEqual(counter(scrape(self.canc.metrics),
                                        "exl3_router_worker_cancels_total", reason="client"), 1)

    def test_stream_closed_withdraws_worker_requests(self):
        self.start_cancel_cluster()
        before = scrape(self.w["slow"].metrics)
        # An engine stream that goes away with a request queued at the worker.
        ch = grpc.insecure_channel(self.canc.address)
        req = topk_req([0, 2], T=2, seed=4)
        req.id = 1
        stop = threading.Event()

        def requests():  # one request, and the stream stays open until cancelled
            yield req
            stop.wait(30)
        call = pb_grpc.MoeRouterStub(ch).Forward(requests())
        try:
            self.wait_queued(1)
            call.cancel()
        finally:
            stop.set()
            ch.close()

        def dropped():
            after = scrape(self.w["slow"].metrics)
            return counter(after, "exl3_worker_cancels_total", reason="stream_closed",
                           outcome="dropped") - counter(
                before, "exl3_worker_cancels_total", reason="stream_closed", outcome="dropped")
        wait_for(lambda: dropped() == 1, 10, "the worker dropped the request of the closed stream")
        self.assertGreaterEqual(counter(scrape(self.canc.metrics),
                                        "exl3_router_worker_cancels_total",
                                        reason="stream_closed"), 1)
        after = scrape(self.w["slow"].metrics)
        self.assertEqual(counter(after, "exl3_worker_tokens_total", layer=str(LAYER)),
                         counter(before, "exl3_worker_tokens_total", layer=str(LAYER)))
        self.assertEqual(counter(after, "exl3_worker_queue_depth"), 0)

    def test_deadline_passes_while_queued_at_the_worker(self):
        self.start_cancel_cluster()
        before = scrape(self.w["slow"].metrics)
        with self.canc.client.stream() as s:
            late = s.submit_request(topk_req([1, 3], timeout_ms=300, seed=5))
            ok = s.submit_request(topk_req([5, 7], seed=6))
            self.assertEqual(late.result(timeout=10).status.code, pb.DEADLINE_EXCEEDED)
            self.assertEqual(ok.result(timeout=10).status.code, pb.OK)

        # The worker honours the request's timeout_us itself (it usually answers
        # DEADLINE_EXCEEDED first); when the router's deadline fires first, its cancel drops it.
        # Either way it is never computed and leaves the worker's queue at once.
        def ended():
            after = scrape(self.w["slow"].metrics)
            expired = counter(after, "exl3_worker_errors_total", code="DEADLINE_EXCEEDED") - \
                counter(before, "exl3_worker_errors_total", code="DEADLINE_EXCEEDED")
            dropped = counter(after, "exl3_worker_cancels_total", reason="deadline",
                              outcome="dropped") - counter(
                before, "exl3_worker_cancels_total", reason="deadline", outcome="dropped")
            return expired + dropped == 1 and counter(after, "exl3_worker_queue_depth") == 0
        wait_for(ended, 5, "the request expired at the worker")
        after = scrape(self.w["slow"].metrics)
        self.assertEqual(counter(after, "exl3_worker_tokens_total", layer=str(LAYER)),
                         counter(before, "exl3_worker_tokens_total", layer=str(LAYER)))


if __name__ == "__main__":
    unittest.main(verbosity=2)
