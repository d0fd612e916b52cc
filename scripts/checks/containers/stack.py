#!/usr/bin/env python3
"""Runs the compose stack of deploy/compose in real containers and drives it (run by
scripts/checks/containers.sh, after the images are built; needs the openai SDK: the front end's
venv).

Usage: stack.py --docker DOCKER --project NAME --compose-dir deploy/compose --check-file FILE
                --work DIR --summary FILE        (EXL3_TAG: the images' tag)

The stack: docker-compose.yml + docker-compose.cpu.yml + FILE (docker-compose 1.29), services
model-init and tokenizer-init (the generated test model and its tokenizer), worker-0, worker-1,
worker-2 (a replica of worker-1), router (--generate), frontend and prometheus, all with host
networking on 127.0.0.1. What it checks, every wait bounded:
  1. the init containers exit 0; every other container becomes healthy (its HEALTHCHECK); they
     run as non-root users, with host networking, listening on 127.0.0.1 only;
  2. `exl3-loadgen --verify` (in the router container) through the router and the workers: every
     answer matches the CPU reference;
  3. chat completions through the front end with the openai SDK, streamed and not (greedy: the
     same text both ways);
  4. worker-1 killed (docker kill, SIGKILL) under exl3-loadgen load: 0 failed (worker-2 serves),
     the router stays healthy and reports worker-1 down; started again, it is healthy and up at
     the router; then worker-2's process killed from the host: the restart policy brings it back;
  5. Prometheus: every scrape target of deploy/prometheus/prometheus.yml up, the rules loaded;
  6. `docker-compose stop` (SIGTERM): every container exits 0 within its grace period, router and
     workers log that they drained;
  7. `docker-compose down -v`: no container, volume or network of the project is left.
Writes `requests=R ok=R failed=0, worker kill failed=0, scrape targets up=U/U` to --summary.
Exit status 1 on any failure.
"""
import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

LONG_RUNNING = ["worker-0", "worker-1", "worker-2", "router", "frontend", "prometheus"]
INITS = ["model-init", "tokenizer-init"]
# Ports the stack binds on 127.0.0.1 (deploy/compose/docker-compose.yml and the check file).
PORTS = [50051, 9451, 50061, 9461, 50062, 9462, 50063, 9463, 8000, 9090]
ROUTER, ROUTER_METRICS, FRONTEND, PROMETHEUS = "127.0.0.1:50051", 9451, 8000, 9090
DRAIN_LOG = {"router": "drained (", "worker-0": "drained", "worker-1": "drained", "worker-2": "drained"}
LOADGEN_SUMMARY = re.compile(r"requests=(\d+) ok=(\d+) failed=(\d+) verified=(\d+) mismatched=(\d+)")

problems = []


def log(msg):
    print(f"stack: {msg}", flush=True)


def fail(msg):
    problems.append(msg)
    print(f"FAIL: {msg}", file=sys.stderr, flush=True)


class Stack:
    def __init__(self, args):
        self.docker = args.docker
        cdir = os.path.abspath(args.compose_dir)
        self.files = [os.path.join(cdir, "docker-compose.yml"), os.path.join(cdir, "docker-compose.cpu.yml"),
                      os.path.abspath(args.check_file)]
        self.project = args.project
        self.work = args.work
        os.makedirs(os.path.join(self.work, "logs"), exist_ok=True)

    def compose(self, *argv, timeout=120, check=True):
        cmd = ["docker-compose", "-p", self.project]
        for f in self.files:
            cmd += ["-f", f]
        r = subprocess.run(cmd + list(argv), capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"docker-compose {' '.join(argv)}: exit {r.returncode}\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
        return r

    def run(self, *argv, timeout=60):
        return subprocess.run([self.docker] + list(argv), capture_output=True, text=True, timeout=timeout)

    def cid(self, service):
        r = self.compose("ps", "-q", service, check=False)
        ids = r.stdout.split()
        return ids[0] if ids else None

    def inspect(self, service):
        c = self.cid(service)
        if not c:
            return None
        r = self.run("inspect", c)
        return json.loads(r.stdout)[0] if r.returncode == 0 else None

    def logs(self, service, tail=None):
        c = self.cid(service)
        if not c:
            return ""
        r = self.run("logs", *(["--tail", str(tail)] if tail else []), c, timeout=30)
        return r.stdout + r.stderr

    def exec(self, service, *argv, timeout=60):
        return self.run("exec", self.cid(service), *argv, timeout=timeout)

    def save_logs(self):
        for s in INITS + LONG_RUNNING:
            with open(os.path.join(self.work, "logs", f"compose-{s}.log"), "w") as f:
                f.write(self.logs(s))


def wait_for(what, fn, timeout, interval=0.5):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if fn():
                return True
        except (OSError, ValueError, KeyError, subprocess.SubprocessError):
            pass
        time.sleep(interval)
    fail(f"{what}: not within {timeout} s")
    return False


def http_get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def metric(text, name, labels):
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{name}\{{{re.escape(want)}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def worker_up(name):
    return metric(http_get(f"http://127.0.0.1:{ROUTER_METRICS}/metrics"), "exl3_router_worker_up", {"worker": name})


def loopback_listeners():
    """{port: set of local addresses} of listening TCP sockets (IPv4 and IPv6) on this host."""
    out = {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(path).read().splitlines()[1:]:
            f = line.split()
            if f[3] != "0A":
                continue
            addr, port = f[1].split(":")
            out.setdefault(int(port, 16), set()).add(addr)
    return out


# 127.0.0.1, ::1 and ::ffff:127.0.0.1 (gRPC binds an IPv6 socket that takes IPv4 too) as
# /proc/net/tcp{,6} write them.
LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


def loadgen(stack, *extra, timeout=240):
    """exl3-loadgen in the router container (the router image ships it); returns the counts."""
    r = stack.exec("router", "exl3-loadgen", f"--target={ROUTER}", "--model=/models/model", *extra,
                   timeout=timeout)
    m = LOADGEN_SUMMARY.search(r.stdout + r.stderr)
    if not m:
        fail(f"exl3-loadgen {' '.join(extra)}: exit {r.returncode}, no summary line:\n{(r.stdout + r.stderr)[-2000:]}")
        return None
    counts = dict(zip(("requests", "ok", "failed", "verified", "mismatched"), map(int, m.groups())))
    counts["exit"] = r.returncode
    return counts


def check_started(stack):
    t0 = time.time()
    for s in INITS:
        if not wait_for(f"{s} exits", lambda: (stack.inspect(s) or {}).get("State", {}).get("Status") == "exited", 120):
            return False
        st = stack.inspect(s)["State"]
        if st["ExitCode"] != 0:
            fail(f"{s} exited {st['ExitCode']}:\n{stack.logs(s, 20)}")
            return False

    def all_healthy():
        bad = []
        for s in LONG_RUNNING:
            st = (stack.inspect(s) or {}).get("State", {})
            if st.get("Status") in ("exited", "dead"):
                raise RuntimeError(f"{s} exited {st.get('ExitCode')}:\n{stack.logs(s, 20)}")
            if st.get("Health", {}).get("Status") != "healthy":
                bad.append(s)
        return not bad
    try:
        if not wait_for("every container healthy", all_healthy, 240, interval=1):
            for s in LONG_RUNNING:
                st = (stack.inspect(s) or {}).get("State", {})
                log(f"{s}: {st.get('Status')}, health {st.get('Health', {}).get('Status')}: "
                    f"{(st.get('Health', {}).get('Log') or [{}])[-1].get('Output', '').strip()[:200]}")
            return False
    except RuntimeError as e:
        fail(str(e))
        return False
    log(f"model-init and tokenizer-init exited 0; {', '.join(LONG_RUNNING)} healthy "
        f"{time.time() - t0:.0f} s after start")

    # Users, networking, listening addresses.
    for s in INITS + LONG_RUNNING:
        d = stack.inspect(s)
        user = d["Config"].get("User") or "root"
        net = d["HostConfig"]["NetworkMode"]
        if user.split(":")[0] in ("", "root", "0"):
            fail(f"{s} runs as root")
        want_net = "none" if s in INITS else "host"
        if net != want_net:
            fail(f"{s}: network mode {net}, expected {want_net}")
    for s in LONG_RUNNING:
        uid = stack.exec(s, "id", "-u").stdout.strip()
        if uid in ("", "0"):
            fail(f"{s}: the process runs as uid {uid or '?'}")
    listeners = loopback_listeners()
    for p in PORTS:
        addrs = listeners.get(p, set())
        if not addrs:
            fail(f"nothing listens on port {p}")
        elif addrs - LOOPBACK:
            fail(f"port {p} is bound beyond loopback: {sorted(addrs)}")
    shm = stack.logs("router").count("shared-memory channel attached")
    log(f"non-root users, host networking, ports {','.join(map(str, PORTS))} on 127.0.0.1 only; "
        f"router: {shm} shared-memory channel(s) attached")
    return True


def chat(requests_done):
    import openai
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{FRONTEND}/v1", api_key="unused", timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    msgs = [{"role": "user", "content": "Say something about containers."}]
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=16, temperature=0)
    requests_done.append(1)
    text = r.choices[0].message.content
    if not isinstance(text, str) or r.usage.completion_tokens < 1 or r.choices[0].finish_reason not in ("length", "stop"):
        fail(f"chat completion: {r}")
        return 0
    parts, finish = [], None
    for chunk in client.chat.completions.create(model=model, messages=msgs, max_tokens=16, temperature=0, stream=True):
        for c in chunk.choices:
            if c.delta and c.delta.content:
                parts.append(c.delta.content)
            finish = c.finish_reason or finish
    requests_done.append(1)
    if "".join(parts) != text or finish != r.choices[0].finish_reason:
        fail(f"streamed chat completion {''.join(parts)!r} ({finish}) differs from the plain one {text!r} "
             f"({r.choices[0].finish_reason})")
        return 1
    log(f"chat completions through the front end (model {model}): {r.usage.completion_tokens} tokens, "
        f"finish {finish}, streamed = plain (greedy)")
    return 2


def kill_under_load(stack):
    result = {}

    def load():
        result["counts"] = loadgen(stack, "--concurrency=4", "--tokens=2", "--duration=8", "--verify",
                                   "--allow_failures", timeout=120)
    t = threading.Thread(target=load)
    t.start()
    time.sleep(2.5)
    r = stack.run("kill", "-s", "KILL", stack.cid("worker-1"))
    if r.returncode != 0:
        fail(f"docker kill worker-1: {r.stderr}")
    t_kill = time.time()
    wait_for("the router marks worker-1 down", lambda: worker_up("worker-1") == 0, 15, interval=0.2)
    down_s = time.time() - t_kill
    healthy = stack.exec("router", "grpc-health-check", ROUTER).returncode == 0
    t.join(timeout=150)
    counts = result.get("counts")
    if counts is None:
        fail("exl3-loadgen under the kill gave no result")
        return None
    if counts["failed"] or counts["mismatched"] or counts["verified"] != counts["requests"] or not counts["requests"]:
        fail(f"worker-1 killed under load: {counts}")
    if not healthy:
        fail("the router was not SERVING with worker-1 down (worker-2 holds its experts)")
    st = stack.inspect("worker-1")["State"]
    log(f"worker-1 killed (exit {st['ExitCode']}) under 4 streams: {counts['requests']} requests, "
        f"{counts['failed']} failed, {counts['verified']} verified; router marked it down after "
        f"{down_s:.1f} s and stayed SERVING")

    t0 = time.time()
    stack.compose("start", "worker-1", timeout=60)
    ok = wait_for("worker-1 healthy again", lambda: stack.inspect("worker-1")["State"].get("Health", {}).get("Status") == "healthy", 90, 1)
    ok = ok and wait_for("the router marks worker-1 up again", lambda: worker_up("worker-1") == 1, 30)
    if ok:
        log(f"worker-1 started again: healthy and up at the router after {time.time() - t0:.0f} s")

    # A crash: the process dies without docker being asked; the restart policy starts it again.
    before = stack.inspect("worker-2")
    os.kill(before["State"]["Pid"], signal.SIGKILL)
    t0 = time.time()
    ok = wait_for("worker-2 restarted by its restart policy",
                  lambda: stack.inspect("worker-2")["RestartCount"] > before["RestartCount"], 60)
    ok = ok and wait_for("worker-2 healthy after its restart",
                         lambda: stack.inspect("worker-2")["State"].get("Health", {}).get("Status") == "healthy", 90, 1)
    ok = ok and wait_for("the router marks worker-2 up again", lambda: worker_up("worker-2") == 1, 30)
    if ok:
        log(f"worker-2's process killed from the host: restarted by the restart policy "
            f"(unless-stopped), healthy and up at the router after {time.time() - t0:.0f} s")
    return counts


def check_prometheus():
    base = f"http://127.0.0.1:{PROMETHEUS}"
    state = {}

    def all_up():
        targets = json.loads(http_get(f"{base}/api/v1/targets"))["data"]["activeTargets"]
        state["targets"] = targets
        return targets and all(t["health"] == "up" for t in targets)
    if not wait_for("every Prometheus target up", all_up, 45, 1):
        for t in state.get("targets", []):
            log(f"target {t['scrapeUrl']}: {t['health']} {t.get('lastError', '')}")
        return 0, len(state.get("targets", []))
    targets = state["targets"]
    groups = json.loads(http_get(f"{base}/api/v1/rules"))["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    bad = [r["name"] for r in rules if r.get("health") not in ("ok", "unknown")]
    if not rules or bad:
        fail(f"Prometheus rules: {len(rules)} loaded, unhealthy {bad}")
    jobs = sorted({t["labels"]["job"] for t in targets})
    log(f"Prometheus: {len(targets)}/{len(targets)} targets up (jobs {', '.join(jobs)}), {len(rules)} rules loaded")
    return len(targets), len(targets)


def stop_and_remove(stack):
    t0 = time.time()
    stack.compose("stop", timeout=180)
    took = time.time() - t0
    stack.save_logs()
    for s in LONG_RUNNING:
        st = stack.inspect(s)["State"]
        if st["Status"] != "exited" or st["ExitCode"] != 0 or st.get("OOMKilled"):
            fail(f"{s} after SIGTERM: {st['Status']}, exit {st['ExitCode']}, OOMKilled {st.get('OOMKilled')}:\n"
                 f"{stack.logs(s, 10)}")
        want = DRAIN_LOG.get(s)
        if want and want not in stack.logs(s, 30):
            fail(f"{s} did not log that it drained ({want!r}):\n{stack.logs(s, 10)}")
    log(f"docker-compose stop (SIGTERM): {len(LONG_RUNNING)} containers exited 0 in {took:.0f} s, "
        "router and workers drained")
    stack.compose("down", "-v", "--remove-orphans", timeout=180)
    left = []
    for kind in ("ps -a", "volume ls", "network ls"):
        r = stack.run(*kind.split(), "-q", "--filter", f"label=com.docker.compose.project={stack.project}")
        left += [f"{kind.split()[0]} {x}" for x in r.stdout.split()]
    if left:
        fail(f"docker-compose down -v left {left}")
    else:
        log("docker-compose down -v: no container, volume or network of the project left")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docker", required=True)
    ap.add_argument("--project", required=True)
    ap.add_argument("--compose-dir", required=True)
    ap.add_argument("--check-file", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--summary", required=True)
    args = ap.parse_args()
    stack = Stack(args)

    busy = []
    for p in PORTS:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                busy.append(p)
    if busy:
        fail(f"ports {busy} on 127.0.0.1 are taken; the compose stack needs them")
        return 1

    totals = {"requests": 0, "ok": 0, "failed": 0}
    kill_failed, up, targets = None, 0, 0
    started = False
    try:
        t0 = time.time()
        stack.compose("up", "-d", "--no-build", *INITS, *LONG_RUNNING, timeout=300)
        started = True
        log(f"docker-compose up -d: {len(INITS) + len(LONG_RUNNING)} containers created in {time.time() - t0:.0f} s")
        if not check_started(stack):
            return 1
        c = loadgen(stack, "--concurrency=4", "--tokens=1", "--requests=240", "--warmup=2", "--verify")
        if c:
            for k in totals:
                totals[k] += c[k]
            if c["failed"] or c["mismatched"] or c["verified"] != c["requests"] or c["exit"] != 0:
                fail(f"exl3-loadgen --verify: {c}")
            log(f"exl3-loadgen --verify through router and workers: {c['requests']} requests, {c['ok']} ok, "
                f"{c['verified']} verified against the CPU reference")
        done = []
        try:
            ok = chat(done)
        except Exception as e:  # noqa: BLE001 (the SDK's errors are many; any one fails the check)
            fail(f"chat completion through the front end: {type(e).__name__}: {e}")
            ok = 0
        totals["requests"] += len(done)
        totals["ok"] += ok
        totals["failed"] += len(done) - ok
        c = kill_under_load(stack)
        if c:
            kill_failed = c["failed"]
            for k in totals:
                totals[k] += c[k]
        up, targets = check_prometheus()
        if targets == 0:
            fail("Prometheus has no targets")
        stop_and_remove(stack)
        started = False
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        fail(str(e))
    finally:
        if started:
            stack.save_logs()
            log(f"logs: {os.path.join(stack.work, 'logs')}/compose-*.log")
            stack.compose("down", "-v", "--remove-orphans", "-t", "10", timeout=180, check=False)
    with open(args.summary, "w") as f:
        f.write(f"requests={totals['requests']} ok={totals['ok']} failed={totals['failed']}, "
                f"worker kill failed={'?' if kill_failed is None else kill_failed}, "
                f"scrape targets up={up}/{targets}\n")
    if problems:
        print(f"stack: {len(problems)} problem(s)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
