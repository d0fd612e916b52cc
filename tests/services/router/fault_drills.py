"""The fault drills (their figures: bench/results/faults.md), end to end, with real processes on
loopback (harness.Cluster: a test model; worker a holds experts 0-3 alone, b holds 4-7 with b2 its
replica; a router), each drill on a fresh cluster, every wait bounded. Run by
scripts/checks/fault_drills.sh:

    python3 tests/services/router/fault_drills.py   (EXL3_BUILD_DIR, PYTHONPATH as for ctest)

Drills: kill -9 of a replicated worker under exl3-loadgen load (0 failed, answers verified; the
restarted worker serves again); kill -9 of the only holder of some experts (their requests fail
UNAVAILABLE well inside the deadline, the others go on; after a restart they succeed again, same
router process); SIGSTOP of a worker on each transport, shared memory and gRPC (marked down within
the bound, the replica takes over with 0 failed); SIGTERM of the router under load (exit 0, every
request sent before the signal answered in-band); corrupt models refused at load; a worker's model
files truncated while it serves (it stays up and answers). Prints one line per drill and last
`fault-drills: N drills, N passed, 0 failed` with the key figures; exits 1 if any drill failed."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(__file__))
from harness import BIN, Cluster, wait_for, wait_until_workers_up, workers_up  # noqa: E402
from resource_faults_test import answer, topk_req as sized_req  # noqa: E402
from router_liveness_test import DETECT_S, DEADLINE_MS, Load, topk_req  # noqa: E402

from exl3serve.v1 import exl3serve_pb2 as pb  # noqa: E402
from exl3serve_client import MoeRouterClient  # noqa: E402


class Drill:
    """A started cluster for one drill; close() ends every process it started."""

    def __init__(self, router_extra=(), a_model=None, transport=None):
        self.c = Cluster()
        self.client = None
        try:
            self.c.start_worker("a", model=a_model(self.c) if a_model else None)
            self.c.start_worker("b")
            self.c.start_worker("b2")
            self.r = self.c.start_router(list(router_extra))
            self.client = MoeRouterClient(self.r.address)
            wait_until_workers_up(self.client, transport)
        except BaseException:
            self.close()
            raise

    def close(self):
        if self.client is not None:
            self.client.close()
        self.c.stop()
        shutil.rmtree(self.c.dir, ignore_errors=True)


def loadgen(router, model, seconds, concurrency=8):
    return subprocess.Popen(
        [os.path.join(BIN, "exl3-loadgen"), "--target", router.address, "--model", model,
         "--concurrency", str(concurrency), "--duration", str(seconds), "--tokens", "2",
         "--timeout_ms", str(DEADLINE_MS), "--verify", "--allow_failures"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def loadgen_counts(p, timeout):
    out, _ = p.communicate(timeout=timeout)
    m = re.search(r"requests=(\d+) ok=(\d+) failed=(\d+) verified=(\d+) mismatched=(\d+)", out)
    assert m, f"no summary line from exl3-loadgen:\n{out[-2000:]}"
    return dict(zip(("requests", "ok", "failed", "verified", "mismatched"), map(int, m.groups()))), out


def restart_until_up(d, name):
    """Restarts worker `name` (its port from the map) and returns the seconds from the start of
    the new process until the router marks it up."""
    t0 = time.time()
    d.c.start_worker(name)
    wait_for(lambda: workers_up(d.client)[name], 20, f"{name} up again")
    return time.time() - t0


def drill_kill9_replicated():
    d = Drill()
    try:
        p = loadgen(d.r, d.c.model, seconds=6)
        time.sleep(2.0)
        d.c.workers["b"].kill9()
        counts, out = loadgen_counts(p, timeout=60)
        assert counts["failed"] == 0 and counts["mismatched"] == 0, f"{counts}\n{out[-1500:]}"
        assert counts["verified"] == counts["requests"] > 0, counts
        rejoin = restart_until_up(d, "b")
        return (f"kill -9 of b (replica b2) under 8 streams: {counts['requests']} requests, "
                f"{counts['failed']} failed, {counts['verified']} verified; restarted b up after {rejoin:.2f}s",
                {"kill9_requests": counts["requests"], "kill9_failed": counts["failed"],
                 "kill9_rejoin_s": rejoin})
    finally:
        d.close()


def drill_kill9_only_holder():
    d = Drill()
    try:
        only, other = Load(d.client, [0, 1]), Load(d.client, [4, 5])
        time.sleep(0.5)
        t_kill = time.time()
        d.c.workers["a"].kill9()
        time.sleep(1.0)
        only_res, other_res = only.stop(), other.stop()
        after = [r for r in only_res if r[0] > t_kill]
        assert after, "no request for experts 0-1 sent after the kill"
        for sent, done, code, msg in after:
            assert code == pb.UNAVAILABLE and "experts 0-1" in msg, (code, msg)
        # In flight at the kill, or sent after: how long until each was answered UNAVAILABLE.
        failed_in = max(done - max(sent, t_kill) for sent, done, code, _ in only_res if code != pb.OK)
        assert failed_in < DEADLINE_MS / 1000 / 4, f"UNAVAILABLE only after {failed_in:.3f}s"
        bad_other = [r for r in other_res if r[2] != pb.OK]
        assert not bad_other and other_res, f"requests for experts 4-5 failed: {bad_other[:3]}"
        router_pid = d.r.pid
        t0 = time.time()
        d.c.start_worker("a")
        wait_for(lambda: answer(d.client, [0, 1]).status.code == pb.OK, 20, "experts 0-1 served again")
        recovered = time.time() - t0
        assert d.r.alive() and d.r.pid == router_pid, "the router was restarted"
        return (f"kill -9 of a (only holder of 0-3): its requests UNAVAILABLE within {failed_in * 1e3:.0f} ms "
                f"({len(after)} after the kill), {len(other_res)} requests for b's experts all ok; "
                f"served again {recovered:.2f}s after the restart, same router",
                {"holder_unavailable_ms": failed_in * 1e3, "holder_recovered_s": recovered})
    finally:
        d.close()


def drill_sigstop(transport):
    d = Drill(["--worker-shm-mb", "0"] if transport == "grpc" else [], transport=transport)
    try:
        load = Load(d.client, [4, 5])
        time.sleep(0.5)
        b = d.c.workers["b"]
        t0 = time.time()
        b.freeze()
        try:
            wait_for(lambda: not workers_up(d.client)["b"], 10, "b marked down")
            down = time.time() - t0
            time.sleep(1.0)
        finally:
            b.signal(signal.SIGCONT)
        results = load.stop()
        failed = [r for r in results if r[2] != pb.OK]
        slowest = max(done - sent for sent, done, _, _ in results)
        assert down < DETECT_S, f"marked down after {down:.2f}s"
        assert not failed, f"{len(failed)} requests failed: {failed[:3]}"
        wait_for(lambda: workers_up(d.client)["b"], 15, "b up again after SIGCONT")
        return (f"SIGSTOP of b over {transport}: marked down after {down:.2f}s, {len(results)} requests "
                f"0 failed (slowest {slowest:.2f}s), rejoined after SIGCONT",
                {f"freeze_{transport}_down_s": down})
    finally:
        d.close()


def drill_sigterm_drain():
    d = Drill()
    try:
        records, lock, stop = [], threading.Lock(), threading.Event()

        def stream_loop():
            with d.client.stream() as s:
                while not stop.is_set():
                    sent = time.time()
                    try:
                        r = s.submit_request(sized_req([0, 4], tokens=256))
                        resp = r.result(timeout=30)
                        outcome, msg = resp.status.code, resp.status.message
                    except Exception as e:  # noqa: BLE001 - a lost answer is what is counted
                        outcome, msg = "lost", str(e)
                    with lock:
                        records.append((sent, time.time(), outcome, msg))
                    if not isinstance(outcome, int) or outcome != pb.OK:
                        return

        threads = [threading.Thread(target=stream_loop, daemon=True) for _ in range(8)]
        for t in threads:
            t.start()
        time.sleep(1.5)
        t_term = time.time()
        d.r.signal(signal.SIGTERM)
        rc = d.r.p.wait(timeout=20)
        drained_s = time.time() - t_term
        stop.set()
        for t in threads:
            t.join(timeout=30)
        before = [r for r in records if r[0] < t_term]
        in_flight = [r for r in before if r[1] > t_term]
        lost = [r for r in before if not isinstance(r[2], int)]
        assert rc == 0, f"router exited {rc}"
        assert not lost, f"{len(lost)} requests sent before SIGTERM got no answer: {lost[:3]}"
        assert "drained" in d.r.text(), "no drain in the router's log"
        # In flight at the signal: computed and answered OK, or (still on the wire when the drain
        # began) refused in-band UNAVAILABLE saying so.
        refused = [r for r in in_flight if r[2] != pb.OK]
        for r in refused:
            assert r[2] == pb.UNAVAILABLE and "drain" in r[3], r
        return (f"SIGTERM of the router under 8 streams: {len(in_flight)} in flight answered in-band "
                f"({len(in_flight) - len(refused)} ok, {len(refused)} UNAVAILABLE 'draining': reached the "
                f"router after the signal), {len(before)} sent before it, 0 lost; "
                f"exit {rc} after {drained_s:.2f}s",
                {"drain_in_flight": len(in_flight), "drain_exit": rc})
    finally:
        d.close()


def corrupt_variants(model, root):
    """(name, directory, what the refusal must say) of corrupt copies of `model`."""
    shards = sorted(f for f in os.listdir(model) if f.endswith(".safetensors"))

    def copy(name):
        d = os.path.join(root, name)
        shutil.copytree(model, d)
        return d

    def expert_tensor(d):
        """(shard path, absolute offset, size) of an expert 0 trellis tensor."""
        for s in shards:
            path = os.path.join(d, s)
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
            for name, info in header.items():
                if name != "__metadata__" and "experts.0." in name and "trellis" in name:
                    b, e = info["data_offsets"]
                    return path, 8 + n + b, e - b
        raise AssertionError("no expert trellis tensor in the test model")

    out = []
    d = copy("truncated-shard")
    p = os.path.join(d, shards[0])
    os.truncate(p, os.path.getsize(p) // 2)
    out.append(("truncated shard", d, "outside the data section"))
    d = copy("header-length")
    with open(os.path.join(d, shards[0]), "r+b") as f:
        f.write((1 << 62).to_bytes(8, "little"))
    out.append(("header length past the file", d, "header length"))
    assert os.path.exists(os.path.join(model, "weights.digest.json")), \
        "the test model records no weight digests: a flipped byte could not be found"
    d = copy("flipped-weight-byte")
    path, off, size = expert_tensor(d)
    with open(path, "r+b") as f:
        f.seek(off + size // 2)
        byte = f.read(1)[0]
        f.seek(off + size // 2)
        f.write(bytes([byte ^ 0x5A]))
    out.append(("one weight byte flipped (digest)", d, "content digest"))
    d = copy("config")
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write('{"architectures": ["Glm4MoeForCausalLM"], "hidden_size": ')
    out.append(("config.json cut short", d, "config.json"))
    d = copy("missing-shard")
    os.remove(os.path.join(d, shards[-1]))
    out.append(("a shard missing", d, "which is missing"))
    return out


def drill_corrupt_models():
    c = Cluster()  # only for its test model: no process is started
    try:
        results = []
        for name, d, reason in corrupt_variants(c.model, c.dir):
            t0 = time.time()
            p = subprocess.run([os.path.join(BIN, "exl3-worker"), "--model", d, "--experts", "0-7",
                                "--listen", "127.0.0.1:0", "--metrics-listen", "", "--progress=false",
                                "--mlock=false", "--threads", "1"],
                               capture_output=True, text=True, timeout=30)
            dt = time.time() - t0
            text = p.stdout + p.stderr
            assert p.returncode != 0 and "serving on" not in text, f"{name}: not refused:\n{text[-1500:]}"
            assert reason in text, f"{name}: refused without saying {reason!r}:\n{text[-1500:]}"
            results.append((name, dt, text.strip().splitlines()[-1][-220:]))
        worst = max(dt for _, dt, _ in results)
        detail = "; ".join(f"{n} in {dt:.2f}s" for n, dt, _ in results)
        for n, _, why in results:
            print(f"  {n}: {why}", flush=True)
        return (f"{len(results)} corrupt models refused at load ({detail})",
                {"corrupt_refused": len(results), "corrupt_worst_s": worst})
    finally:
        shutil.rmtree(c.dir, ignore_errors=True)


def drill_truncate_under_worker():
    def own_copy(c):
        d = os.path.join(c.dir, "model-a")
        shutil.copytree(c.model, d)
        return d

    d = Drill(a_model=own_copy)
    try:
        before = answer(d.client, [0, 1])
        assert before.status.code == pb.OK, before.status.message
        load = Load(d.client, [0, 1])
        time.sleep(0.3)
        mdir = os.path.join(d.c.dir, "model-a")
        for f in os.listdir(mdir):
            if f.endswith(".safetensors"):
                os.truncate(os.path.join(mdir, f), 0)
        d.c.workers["a"].wait_for_log(r"changed after the load", timeout=5)
        results = load.stop()
        after = answer(d.client, [0, 1])
        assert d.c.workers["a"].alive(), "worker a died"
        failed = [r for r in results if r[2] != pb.OK]
        assert not failed and after.status.code == pb.OK, (failed[:3], after.status.message)
        assert after.output.data == before.output.data, "another answer after the truncation"
        return (f"model files truncated under worker a serving 3 streams: alive, {len(results)} requests "
                f"0 failed, same answers, change logged", {"truncate_failed": len(failed)})
    finally:
        d.close()


DRILLS = [
    ("kill9-replicated", drill_kill9_replicated),
    ("kill9-only-holder", drill_kill9_only_holder),
    ("sigstop-shm", lambda: drill_sigstop("shm")),
    ("sigstop-grpc", lambda: drill_sigstop("grpc")),
    ("sigterm-drain", drill_sigterm_drain),
    ("corrupt-models", drill_corrupt_models),
    ("truncate-under-worker", drill_truncate_under_worker),
]


def main():
    only = set(sys.argv[1:])
    passed, failed, figures = 0, 0, {}
    t_all = time.time()
    for name, fn in DRILLS:
        if only and name not in only:
            continue
        t0 = time.time()
        try:
            line, figs = fn()
            figures.update(figs)
            passed += 1
            print(f"drill {name}: PASS ({time.time() - t0:.1f}s) {line}", flush=True)
        except Exception:  # noqa: BLE001 - a failed drill is reported and the others still run
            failed += 1
            print(f"drill {name}: FAIL ({time.time() - t0:.1f}s)\n{traceback.format_exc()}", flush=True)
    f = figures
    key = []
    if "kill9_requests" in f:
        key.append(f"kill9 {f['kill9_failed']}/{f['kill9_requests']} failed, rejoin {f['kill9_rejoin_s']:.1f}s")
    if "holder_unavailable_ms" in f:
        key.append(f"only holder UNAVAILABLE in {f['holder_unavailable_ms']:.0f} ms, "
                   f"recovered {f['holder_recovered_s']:.1f}s")
    for t in ("shm", "grpc"):
        if f"freeze_{t}_down_s" in f:
            key.append(f"SIGSTOP {t} down {f[f'freeze_{t}_down_s']:.2f}s")
    if "drain_in_flight" in f:
        key.append(f"drain {f['drain_in_flight']} in flight, exit {f['drain_exit']}")
    if "corrupt_refused" in f:
        key.append(f"{f['corrupt_refused']} corrupt models refused <= {f['corrupt_worst_s']:.2f}s")
    print(f"fault-drills: {passed + failed} drills, {passed} passed, {failed} failed "
          f"({time.time() - t_all:.0f}s): {'; '.join(key)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
