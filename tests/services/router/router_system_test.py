"""System tests of exl3-router with real processes on loopback: three exl3-worker processes (a holds
experts 0-3 alone, b holds 4-7 with b2 a replica of b) on a generated test model.

Covers: whole decode steps equal the CPU reference (exl3-loadgen --verify); kill -9 of a replicated
worker under load (no failed request); kill -9 of an unreplicated worker (only requests needing its
experts fail, with UNAVAILABLE naming worker and experts, within the deadline) and its restart
(served again without restarting the router); bad inputs; deadlines; admission control; drain on
SIGTERM; SIGHUP reload; the router's metric names. Each case starts a cluster of its own. Run by
ctest (EXL3_BUILD_DIR set)."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
import unittest
import urllib.request

import grpc
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from harness import BIN, Cluster, Proc, free_port, wait_for, wait_until_workers_up, workers_up  # noqa: E402

from exl3serve.v1 import exl3serve_pb2 as pb  # noqa: E402
from exl3serve_client import MoeRouterClient, RequestError  # noqa: E402
from exl3serve_client.client import make_request  # noqa: E402

LAYER = 1  # the test model's MoE layers are 1 and 2; layer 0 is dense
HIDDEN = 256


def loadgen(router, *args, timeout=120):
    cmd = [os.path.join(BIN, "exl3-loadgen"), "--target", router.address, "--model",
           router.cluster.model, *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return p


def loadgen_bg(router, *args):
    cmd = [os.path.join(BIN, "exl3-loadgen"), "--target", router.address, "--model",
           router.cluster.model, *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def final_counts(out):
    m = re.search(r"^requests=(\d+) ok=(\d+) failed=(\d+) verified=(\d+) mismatched=(\d+)$", out,
                  re.M)
    assert m, f"no final line in:\n{out}"
    return dict(zip(("requests", "ok", "failed", "verified", "mismatched"), map(int, m.groups())))


def topk_req(ids, weights=None, timeout_ms=0, T=1):
    x = np.random.default_rng(len(ids)).standard_normal((T, HIDDEN)).astype(np.float32)
    k = len(ids)
    w = weights if weights is not None else [0.5] * k
    return make_request(LAYER, x, topk_ids=np.array([ids] * T), topk_weights=np.array([w] * T),
                        timeout_ms=timeout_ms)


class GrpcTransportTest(unittest.TestCase):
    """--worker-shm-mb 0: every message through gRPC, also with the workers on this host; and a
    ring too small for the big messages: those go by gRPC, the small ones through the channel."""

    def test_decode_steps_match_reference_on_either_transport(self):
        c = Cluster()
        self.addCleanup(c.stop)
        c.start_workers(("a", "b", "b2"))
        for extra, transport in ((["--worker-shm-mb", "0"], "grpc"),
                                 (["--worker-shm-mb", "1"], "shm")):
            r = c.start_router(extra)
            r.cluster = c
            client = MoeRouterClient(r.address)
            try:
                wait_until_workers_up(client, transport)
                # 40 tokens of fp32 out (40 KB) fit a quarter of 1 MiB; 300 (300 KB) do not.
                for T in (1, 40, 300):
                    p = loadgen(r, "--verify", "--tokens", str(T), "--requests", "6",
                                "--concurrency", "2")
                    self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
                    self.assertEqual(final_counts(p.stdout)["verified"], 6)
            finally:
                client.close()
                r.stop()


class RouterSystemTest(unittest.TestCase):
    """Each case starts its own cluster (start()): no case sees what another did to workers,
    maps or routers, and any one runs alone."""

    # Cases here freeze worker a (SIGSTOP) to stall requests for their deadlines, drain and
    # admission: a liveness bound above those stalls keeps a up meanwhile (a frozen worker marked
    # down is router_liveness_test's subject).
    ROUTER_ARGS = ("--default-deadline-ms", "3000", "--worker-liveness-ms", "6000")

    def start(self, router_args=ROUTER_ARGS):
        """Workers a, b, b2 and a router with `router_args`; returns when every worker is up and
        the router SERVING. Sets self.c, self.r and self.client."""
        self.c = Cluster()
        self.addCleanup(self.c.stop)
        self.c.start_workers(("a", "b", "b2"))
        self.r = self.c.start_router(list(router_args))
        self.r.cluster = self.c
        self.client = MoeRouterClient(self.r.address)
        self.addCleanup(self.client.close)
        wait_until_workers_up(self.client)
        wait_for(lambda: self.client.describe().state == pb.STATE_SERVING, 10, "router SERVING")

    def thaw(self, w):
        """SIGCONT for a worker frozen by a test, then waits until the router has it up again: one
        frozen for longer than the router's liveness bound (--worker-liveness-ms) was marked down
        and rejoins on its next Describe."""
        w.signal(signal.SIGCONT)
        name = next(n for n, p in self.c.workers.items() if p is w)
        wait_for(lambda: workers_up(self.client)[name], 20, f"worker {name} up again")

    def restart_worker(self, name):
        old = self.c.workers.get(name)
        if old is not None:
            old.stop()
        self.c.start_worker(name)
        wait_for(lambda: workers_up(self.client)[name], 20, f"worker {name} up again")

    # ---- correctness ----

    def test_decode_steps_match_reference(self):
        self.start()
        p = loadgen(self.r, "--verify", "--concurrency", "3", "--tokens", "4", "--requests", "48",
                    "--pipeline", "2")
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        n = final_counts(p.stdout)
        self.assertEqual(n, {"requests": 48, "ok": 48, "failed": 0, "verified": 48,
                             "mismatched": 0})
        # Same host, same user: every worker's stream runs over shared memory.
        self.assertEqual({w.name: w.transport for w in self.client.describe().workers},
                         {"a": "shm", "b": "shm", "b2": "shm"})
        # Every dtype combination, one token and many; 100 tokens is above --inline-max-tokens of
        # router (handled on its handler threads) and worker (computed by its batcher thread).
        for dt, out, T in (("fp32", "fp32", 1), ("bf16", "bf16", 16), ("fp16", "fp16", 33),
                           ("fp16", "fp32", 100)):
            p = loadgen(self.r, "--verify", "--tokens", str(T), "--requests", "4", "--dtype", dt,
                        "--output-dtype", out)
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
            self.assertEqual(final_counts(p.stdout)["verified"], 4)

    def test_routing_sources(self):
        self.start()
        with self.client.stream() as s:
            x = np.random.default_rng(5).standard_normal((3, HIDDEN)).astype(np.float32)
            gated = s.submit(LAYER, x).result()
            # The same routing given as top-k, and the router's own gate given as logits, agree.
            via_topk = s.submit(LAYER, x, topk_ids=gated.topk_ids,
                                topk_weights=gated.topk_weights).result()
            np.testing.assert_allclose(via_topk.output, gated.output, rtol=1e-6, atol=1e-6)
            self.assertEqual(gated.topk_ids.shape, (3, 2))
            self.assertTrue(gated.timings.total_us > 0)
            # Shared expert off: differs from on.
            no_shared = s.submit(LAYER, x, include_shared_expert=False).result()
            self.assertGreater(np.abs(no_shared.output - gated.output).max(), 1e-4)

    # ---- faults ----

    def test_kill_replicated_worker_under_load(self):
        self.start()
        lg = loadgen_bg(self.r, "--concurrency", "4", "--tokens", "2", "--duration", "3",
                        "--timeout-ms", "3000")
        time.sleep(1.0)
        self.c.workers["b"].kill9()
        out, err = lg.communicate(timeout=60)
        n = final_counts(out)
        self.assertEqual(lg.returncode, 0, out + err)
        self.assertGreater(n["ok"], 20, out)
        self.assertEqual(n["failed"], 0, out + err)
        self.assertFalse(workers_up(self.client)["b"])
        metrics = urllib.request.urlopen(f"http://{self.r.metrics}/metrics").read().decode()
        self.assertIn('exl3_router_worker_up{worker="b"} 0', metrics)
        self.restart_worker("b")

    def test_kill_unreplicated_worker(self):
        self.start()
        # Under load: the only failures are UNAVAILABLE.
        lg = loadgen_bg(self.r, "--concurrency", "2", "--tokens", "1", "--duration", "2.5",
                        "--allow-failures")
        time.sleep(0.8)
        self.c.workers["a"].kill9()
        t_kill = time.time()
        out, err = lg.communicate(timeout=60)
        self.assertEqual(lg.returncode, 0, out + err)
        n = final_counts(out)
        self.assertGreater(n["failed"], 0, out)
        m = re.search(r"^failures by code: (.*)$", out, re.M)
        self.assertIsNotNone(m, out)
        self.assertEqual([kv.split("=")[0] for kv in m.group(1).split()], ["UNAVAILABLE"], out)
        # Requests that need a's experts fail fast, naming the worker and the experts; the others
        # go on, on the same stream.
        with self.client.stream() as s:
            t0 = time.time()
            bad = s.submit_request(topk_req([1, 2], timeout_ms=2000))
            good = s.submit_request(topk_req([4, 6]))
            r = bad.result(timeout=10)
            self.assertLess(time.time() - t0, 2.5)
            self.assertEqual(r.status.code, pb.UNAVAILABLE, r.status.message)
            self.assertIn("a", r.status.message)
            self.assertIn("experts 1-2", r.status.message)
            self.assertEqual(good.result(timeout=10).status.code, pb.OK)
        self.assertEqual(self.client.describe().state, pb.STATE_LOADING)  # not ready
        # Restart: served again, by the same router process.
        router_pid = self.r.pid
        self.restart_worker("a")
        wait_for(lambda: self.client.describe().state == pb.STATE_SERVING, 10, "router ready")
        with self.client.stream() as s:
            self.assertEqual(s.submit_request(topk_req([1, 2])).result(timeout=10).status.code,
                             pb.OK)
        self.assertEqual(self.r.pid, router_pid)
        self.assertTrue(self.r.alive())
        print(f"unreplicated kill: {n['failed']} failed of {n['requests']}, "
              f"restart served after {time.time() - t_kill:.1f}s", file=sys.stderr)

    def test_deadline_exceeded(self):
        self.start()
        # A frozen worker (SIGSTOP) keeps its connection but never answers.
        a = self.c.workers["a"]
        a.freeze()
        try:
            with self.client.stream() as s:
                t0 = time.time()
                late = s.submit_request(topk_req([0, 3], timeout_ms=300))
                ok = s.submit_request(topk_req([5, 7]))
                r = late.result(timeout=10)
                dt = time.time() - t0
                self.assertEqual(r.status.code, pb.DEADLINE_EXCEEDED, r.status.message)
                self.assertGreaterEqual(dt, 0.29)
                self.assertLess(dt, 3.0)
                self.assertEqual(ok.result(timeout=10).status.code, pb.OK)
                # A timeout already spent when dispatching.
                r = s.submit_request(topk_req([5, 6], timeout_ms=0.001)).result(timeout=10)
                self.assertEqual(r.status.code, pb.DEADLINE_EXCEEDED)
        finally:
            self.thaw(a)

    def test_admission_control(self):
        self.start(["--max-in-flight", "2", "--worker-liveness-ms", "6000"])
        a = self.c.workers["a"]
        a.freeze()
        try:
            with self.client.stream() as s:
                held = [s.submit_request(topk_req([0, 1], timeout_ms=1500)) for _ in range(2)]
                time.sleep(0.2)
                over = s.submit_request(topk_req([4, 5])).result(timeout=10)
                self.assertEqual(over.status.code, pb.RESOURCE_EXHAUSTED, over.status.message)
                self.assertIn("--max-in-flight", over.status.message)
                for h in held:
                    self.assertEqual(h.result(timeout=10).status.code, pb.DEADLINE_EXCEEDED)
                # Room again.
                self.assertEqual(s.submit_request(topk_req([4, 5])).result(timeout=10)
                                 .status.code, pb.OK)
        finally:
            self.thaw(a)

    # ---- bad input ----

    def test_bad_inputs_fail_alone(self):
        self.start()
        x = np.random.default_rng(1).standard_normal((2, HIDDEN)).astype(np.float32)
        cases = []

        def case(name, code, mutate, needle):
            req = make_request(LAYER, x)
            mutate(req)
            cases.append((name, code, req, needle))

        case("dtype unspecified", pb.INVALID_ARGUMENT,
             lambda r: setattr(r.hidden, "dtype", pb.DTYPE_UNSPECIFIED), "hidden")
        case("hidden size", pb.INVALID_ARGUMENT,
             lambda r: (r.hidden.shape.__setitem__(1, 128), r.hidden.shape.__setitem__(0, 4)),
             "hidden")
        case("byte length", pb.INVALID_ARGUMENT,
             lambda r: setattr(r.hidden, "data", r.hidden.data[:-4]), "hidden")
        case("rank", pb.INVALID_ARGUMENT, lambda r: r.hidden.shape.append(1), "hidden")
        nan = x.copy()
        nan[1, 7] = np.nan
        case("nan", pb.INVALID_ARGUMENT,
             lambda r: setattr(r.hidden, "data", nan.astype("<f4").tobytes()), "hidden")
        inf = x.copy()
        inf[0, 3] = np.inf
        case("inf", pb.INVALID_ARGUMENT,
             lambda r: setattr(r.hidden, "data", inf.astype("<f4").tobytes()), "hidden")
        case("layer out of range", pb.NOT_FOUND, lambda r: setattr(r, "layer", 99), "layer 99")
        case("dense layer", pb.NOT_FOUND, lambda r: setattr(r, "layer", 0), "not an MoE layer")
        case("negative layer", pb.NOT_FOUND, lambda r: setattr(r, "layer", -1), "layer -1")
        case("empty request", pb.INVALID_ARGUMENT, lambda r: r.ClearField("hidden"), "empty")
        case("output dtype", pb.INVALID_ARGUMENT, lambda r: setattr(r, "output_dtype", 9),
             "output_dtype")

        def topk(ids, w, k=2):
            def f(r):
                r.topk.k = k
                r.topk.ids.extend(ids)
                r.topk.weights.extend(w)
            return f
        case("topk expert out of range", pb.INVALID_ARGUMENT,
             topk([0, 8, 1, 2], [0.5] * 4), "not an expert")
        case("topk expert repeated", pb.INVALID_ARGUMENT,
             topk([3, 3, 1, 2], [0.5] * 4), "repeated")
        case("topk weight nan", pb.INVALID_ARGUMENT,
             topk([0, 1, 1, 2], [0.5, float("nan"), 0.5, 0.5]), "not finite")
        case("topk length", pb.INVALID_ARGUMENT, topk([0, 1, 2], [0.5] * 3), "T*k")
        case("topk k", pb.INVALID_ARGUMENT, topk([], [], k=0), "topk.k")

        def logits_and_topk(r):
            topk([0, 1, 1, 2], [0.5] * 4)(r)
            r.router_logits.dtype = pb.DTYPE_FP32
            r.router_logits.shape.extend([2, 8])
            r.router_logits.data = np.zeros((2, 8), "<f4").tobytes()
        case("two routing sources", pb.INVALID_ARGUMENT, logits_and_topk, "at most one")

        def bad_logits(r):
            r.router_logits.dtype = pb.DTYPE_FP32
            r.router_logits.shape.extend([2, 7])
            r.router_logits.data = np.zeros((2, 7), "<f4").tobytes()
        case("logits shape", pb.INVALID_ARGUMENT, bad_logits, "router_logits")

        with self.client.stream() as s:
            futs = [(name, code, s.submit_request(req), needle) for name, code, req, needle in cases]
            for name, code, fut, needle in futs:
                r = fut.result(timeout=10)
                self.assertEqual(r.status.code, code, f"{name}: {r.status}")
                self.assertIn(needle, r.status.message, name)
            # The stream still serves.
            self.assertEqual(s.submit(LAYER, x).result().output.shape, (2, HIDDEN))
        # Duplicate in-flight id: the second fails, the first is answered.
        a = self.c.workers["a"]
        a.freeze()
        try:
            with self.client.stream() as s:
                first = s.submit_request(topk_req([0, 1], timeout_ms=500))
                dup = make_request(LAYER, x, topk_ids=np.array([[4, 5]] * 2),
                                   topk_weights=np.ones((2, 2)))
                fut = s.submit_request(dup)
                # Re-send with the same id as `first` on the raw queue.
                dup2 = make_request(LAYER, x)
                dup2.id = 1
                s._outbox.put(dup2)
                self.assertEqual(fut.result(timeout=10).status.code, pb.OK)
                r = first.result(timeout=10)
                # `first` resolves with one of: its own answer (DEADLINE) or the duplicate's error.
                self.assertIn(r.status.code, (pb.DEADLINE_EXCEEDED, pb.INVALID_ARGUMENT))
                if r.status.code == pb.INVALID_ARGUMENT:
                    self.assertIn("duplicate in-flight id 1", r.status.message)
        finally:
            self.thaw(a)
        metrics = urllib.request.urlopen(f"http://{self.r.metrics}/metrics").read().decode()
        self.assertRegex(metrics, r'exl3_router_errors_total\{code="INVALID_ARGUMENT"\} [1-9]')

    # ---- operations ----

    def test_metric_names_match_docs(self):
        self.start()
        with open(os.path.join(os.path.dirname(__file__), "../../../docs/metrics.md")) as f:
            doc = f.read()
        section = doc.split("## Router", 1)[1]
        names = set(re.findall(r"^\| `(exl3_router_[a-z_]+)`", section, re.M))
        self.assertGreaterEqual(len(names), 13)
        metrics = urllib.request.urlopen(f"http://{self.r.metrics}/metrics").read().decode()
        exposed = set(re.findall(r"^# TYPE (exl3_router_[a-z_]+) ", metrics, re.M))
        self.assertEqual(names, exposed)
        self.assertIn('exl3_router_layer_latency_seconds_count{layer="2",stage="gate"}', metrics)
        self.assertIn("exl3_router_ready 1", metrics)
        self.assertIn('exl3_router_worker_shm{worker="a"} 1', metrics)  # same host: shared memory

    def test_sighup_reload(self):
        self.start()
        with open(self.c.map_path) as f:
            good = f.read()
        try:
            # A map with a gap is refused; the old one stays.
            with open(self.c.map_path, "w") as f:
                f.write(good.replace("experts: 0-3", "experts: 0-2"))
            self.r.signal(signal.SIGHUP)
            wait_for(lambda: "reload refused" in self.r.text(), 5, "reload refused")
            self.assertIn("layers 1-2 experts 3", self.r.text())
            self.assertEqual(len(self.client.describe().workers), 3)
            # Without the replica: two workers.
            with open(self.c.map_path, "w") as f:
                f.write(good.split("  - name: b2")[0])
            self.r.signal(signal.SIGHUP)
            wait_for(lambda: len(self.client.describe().workers) == 2, 5, "map reloaded")
            with self.client.stream() as s:
                self.assertEqual(s.submit_request(topk_req([1, 5])).result(timeout=10).status.code,
                                 pb.OK)
        finally:
            with open(self.c.map_path, "w") as f:
                f.write(good)
            self.r.signal(signal.SIGHUP)
            wait_for(lambda: len(self.client.describe().workers) == 3, 5, "map restored")

    def test_drain_on_sigterm(self):
        self.start(["--drain-grace-ms", "5000", "--worker-liveness-ms", "6000"])
        r3, cl = self.r, self.client
        a = self.c.workers["a"]
        try:
            a.freeze()
            s = cl.stream()
            inflight = [s.submit_request(topk_req([0, 2])) for _ in range(3)]
            time.sleep(0.2)
            r3.signal(signal.SIGTERM)
            time.sleep(0.3)
            refused = s.submit_request(topk_req([4, 5])).result(timeout=5)
            self.assertEqual(refused.status.code, pb.UNAVAILABLE)
            self.assertIn("draining", refused.status.message)
            self.assertTrue(r3.alive())
            a.signal(signal.SIGCONT)
            for f in inflight:
                self.assertEqual(f.result(timeout=10).status.code, pb.OK)
            r3.p.wait(timeout=10)
            self.assertEqual(r3.p.returncode, 0, r3.text())
        finally:
            a.signal(signal.SIGCONT)  # the router is gone: nobody to wait for

    def test_worker_identity_checked(self):
        # A worker on another model (different shapes: another fingerprint), and a worker holding
        # fewer experts than the map gives it, are kept out of service with the reason logged.
        # Only the cluster's test model is used: its workers are these two.
        self.c = Cluster()
        self.addCleanup(self.c.stop)
        other = os.path.join(self.c.dir, "other-model")
        subprocess.run([os.path.join(os.path.dirname(BIN), "tests", "exl3-test-model"), other,
                        "--inter", "256"], check=True)
        pa, pb_ = free_port(), free_port()
        wrong_model = Proc("worker-wrong-model", [
            os.path.join(BIN, "exl3-worker"), "--model", other, "--experts", "all",
            "--listen", f"127.0.0.1:{pa}", "--metrics-listen", "127.0.0.1:0", "--progress=false",
            "--mlock=false", "--threads", "1"], self.c.dir)
        too_few = Proc("worker-too-few", [
            os.path.join(BIN, "exl3-worker"), "--model", self.c.model, "--experts", "0-5",
            "--listen", f"127.0.0.1:{pb_}", "--metrics-listen", "127.0.0.1:0", "--progress=false",
            "--mlock=false", "--threads", "1"], self.c.dir)
        map_path = os.path.join(self.c.dir, "identity.yaml")
        with open(map_path, "w") as f:
            f.write(f"workers:\n  - name: wrong\n    address: 127.0.0.1:{pa}\n    experts: all\n"
                    f"  - name: few\n    address: 127.0.0.1:{pb_}\n    experts: all\n")
        r = self.c.start_router(["--expert-map", map_path])
        try:
            wait_for(lambda: "differs from the router's" in r.text(), 20, "fingerprint refused")
            wait_for(lambda: "does not hold experts the map assigns to it: layer 1 experts 6-7"
                     in r.text(), 20, "missing experts named")
            cl = MoeRouterClient(r.address)
            d = cl.describe()
            self.assertEqual([w.up for w in d.workers], [False, False])
            self.assertEqual(d.unserved_experts, 16)
            self.assertNotEqual(d.state, pb.STATE_SERVING)
            cl.close()
        finally:
            r.stop()
            wrong_model.stop()
            too_few.stop()

    def test_client_that_stops_reading_stalls_only_itself(self):
        self.start()
        # A stream whose client never reads its answers (T=64 answers fill the flow-control
        # window): other streams through the same workers keep being answered.
        from exl3serve.v1 import exl3serve_pb2_grpc as pb_grpc
        ch = grpc.insecure_channel(self.r.address)
        x = np.random.default_rng(2).standard_normal((64, HIDDEN)).astype(np.float32)
        stop = threading.Event()

        def requests():
            for i in range(300):
                r = make_request(LAYER, x)
                r.id = i + 1
                yield r
            stop.wait(30)
        call = pb_grpc.MoeRouterStub(ch).Forward(requests())  # never read
        try:
            time.sleep(2.0)
            t0 = time.time()
            with self.client.stream() as s:
                futs = [s.submit(LAYER, x[:2]) for _ in range(5)]
                for f in futs:
                    self.assertEqual(f.result(timeout=10).output.shape, (2, HIDDEN))
            self.assertLess(time.time() - t0, 5.0)
        finally:
            stop.set()
            call.cancel()
            ch.close()

    def test_frozen_worker_does_not_block_dispatch(self):
        self.start()
        # Enough bytes for a frozen worker (SIGSTOP) to fill its flow-control window: the same
        # stream still dispatches to the other workers at once.
        a = self.c.workers["a"]
        a.freeze()
        try:
            with self.client.stream() as s:
                stuck = [s.submit_request(topk_req([0, 1], timeout_ms=1500, T=64))
                         for _ in range(120)]
                t0 = time.time()
                ok = s.submit_request(topk_req([4, 5])).result(timeout=10)
                self.assertEqual(ok.status.code, pb.OK)
                self.assertLess(time.time() - t0, 1.0)
                for f in stuck:
                    self.assertEqual(f.result(timeout=20).status.code, pb.DEADLINE_EXCEEDED)
        finally:
            self.thaw(a)

    def test_oversized_message(self):
        # gRPC refuses a message over twice --max-message-bytes with RESOURCE_EXHAUSTED, ending
        # that stream only; the next stream is served. (Between the two limits the router answers
        # in-band: router_protocol_test.)
        self.start(["--max-message-bytes", "200000"])
        big = np.ones((400, HIDDEN), np.float32)  # 400 KB
        with self.assertRaises(RequestError) as e:
            self.client.forward(LAYER, big)
        self.assertEqual(e.exception.code, grpc.StatusCode.RESOURCE_EXHAUSTED)
        self.assertEqual(self.client.forward(LAYER, big[:4]).shape, (4, HIDDEN))


if __name__ == "__main__":
    unittest.main(verbosity=2)
