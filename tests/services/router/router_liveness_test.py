"""A frozen worker (SIGSTOP) is found by the router's liveness probes (--worker-liveness-ms, default
1500 ms) on either transport (same-host shared memory, gRPC), idle or under load: it is marked
down within 2.5 s, its in-flight sub-requests fail over to the replica or, with no replica, fail
UNAVAILABLE naming the experts well inside the request deadline; after SIGCONT it serves again
without a router restart. Each case starts its own cluster (harness.Cluster: a holds experts 0-3
alone, b holds 4-7 with b2 its replica). Run by ctest (EXL3_BUILD_DIR set)."""

import os
import signal
import sys
import threading
import time
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from harness import Cluster, wait_for, wait_until_workers_up, workers_up  # noqa: E402

from exl3serve.v1 import exl3serve_pb2 as pb  # noqa: E402
from exl3serve_client import MoeRouterClient  # noqa: E402
from exl3serve_client.client import make_request  # noqa: E402

LAYER = 1
HIDDEN = 256
DETECT_S = 2.5      # the default bound (1500 ms + one probe period) with room for a loaded CI host
DEADLINE_MS = 8000  # request deadline: detection must come well inside it


def topk_req(ids, timeout_ms=DEADLINE_MS):
    x = np.random.default_rng(len(ids)).standard_normal((1, HIDDEN)).astype(np.float32)
    return make_request(LAYER, x, topk_ids=np.array([ids]), topk_weights=np.array([[0.5] * len(ids)]),
                        timeout_ms=timeout_ms)


class Load:
    """`streams` threads, each sending requests for `ids` one after another on its own stream and
    recording (sent, answered, code, message) until stop()."""

    def __init__(self, client, ids, streams=3):
        self.results = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(client, ids), daemon=True)
                         for _ in range(streams)]
        for t in self._threads:
            t.start()

    def _run(self, client, ids):
        with client.stream() as s:
            while not self._stop.is_set():
                t0 = time.time()
                r = s.submit_request(topk_req(ids)).result(timeout=30)
                with self._lock:
                    self.results.append((t0, time.time(), r.status.code, r.status.message))

    def stop(self):
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)
        return self.results


class FrozenWorkerTest(unittest.TestCase):
    def cluster(self, transport):
        c = Cluster()
        self.addCleanup(c.stop)
        c.start_workers(("a", "b", "b2"))
        r = c.start_router(["--worker-shm-mb", "0"] if transport == "grpc" else [])
        client = MoeRouterClient(r.address)
        self.addCleanup(client.close)
        wait_until_workers_up(client, transport)
        return c, client

    def freeze_until_down(self, c, client, name):
        """Freezes worker `name`; returns how long the router took to mark it down."""
        w = c.workers[name]
        self.addCleanup(w.signal, signal.SIGCONT)
        t0 = time.time()
        w.freeze()
        wait_for(lambda: not workers_up(client)[name], 10, f"{name} marked down")
        return time.time() - t0

    def thaw_until_up(self, c, client, name):
        c.workers[name].signal(signal.SIGCONT)
        wait_for(lambda: workers_up(client)[name], 15, f"{name} up again")

    def check_idle(self, transport):
        c, client = self.cluster(transport)
        time.sleep(1.0)  # no traffic at all: only the probes can find the freeze
        dt = self.freeze_until_down(c, client, "b")
        self.assertLess(dt, DETECT_S, f"{transport}: idle frozen worker marked down after {dt:.2f}s")
        self.thaw_until_up(c, client, "b")
        with client.stream() as s:
            self.assertEqual(s.submit_request(topk_req([4, 5])).result(timeout=10).status.code, pb.OK)
        print(f"{transport}: idle freeze marked down after {dt:.2f}s", file=sys.stderr)

    def check_busy_replicated(self, transport):
        c, client = self.cluster(transport)
        load = Load(client, [4, 5])
        time.sleep(0.5)
        dt = self.freeze_until_down(c, client, "b")
        time.sleep(1.0)
        results = load.stop()
        self.assertLess(dt, DETECT_S, f"{transport}: busy frozen worker marked down after {dt:.2f}s")
        failed = [r for r in results if r[2] != pb.OK]
        self.assertEqual(failed, [], f"{transport}: requests failed although b2 replicates b")
        slowest = max(done - sent for sent, done, _, _ in results)
        self.assertLess(slowest, DETECT_S, f"{transport}: a request took {slowest:.2f}s")
        self.thaw_until_up(c, client, "b")
        print(f"{transport}: busy freeze of a replicated worker: down after {dt:.2f}s, "
              f"{len(results)} requests ok, slowest {slowest:.2f}s", file=sys.stderr)

    def check_only_holder(self, transport):
        c, client = self.cluster(transport)
        load = Load(client, [0, 1])
        time.sleep(0.5)
        t_freeze = time.time()
        dt = self.freeze_until_down(c, client, "a")
        time.sleep(0.5)
        results = load.stop()
        self.assertLess(dt, DETECT_S)
        # Answered during the freeze: UNAVAILABLE naming the experts, long before the deadline.
        during = [r for r in results if r[1] > t_freeze + 0.2]
        self.assertTrue(during, "no request answered during the freeze")
        for sent, done, code, msg in during:
            self.assertEqual(code, pb.UNAVAILABLE, msg)
            self.assertIn("experts 0-1", msg)
            self.assertLess(done - sent, DETECT_S, msg)
        self.thaw_until_up(c, client, "a")
        with client.stream() as s:
            self.assertEqual(s.submit_request(topk_req([0, 1])).result(timeout=10).status.code, pb.OK)

    def test_idle_shm(self):
        self.check_idle("shm")

    def test_idle_grpc(self):
        self.check_idle("grpc")

    def test_busy_replicated_shm(self):
        self.check_busy_replicated("shm")

    def test_busy_replicated_grpc(self):
        self.check_busy_replicated("grpc")

    def test_only_holder_shm(self):
        self.check_only_holder("shm")

    def test_only_holder_grpc(self):
        self.check_only_holder("grpc")


if __name__ == "__main__":
    unittest.main(verbosity=2)
