#!/usr/bin/env python3
"""Service benchmark: exl3-router + one exl3-worker (CPU backend, small experts) on loopback.

Measures, in one run:
  1. per-layer round trip at T = 1, 8, 64 through router + worker against the transport floor
     (exl3-loadgen --echo-baseline: a plain gRPC bidi echo of the same payloads; floor = 2 echo
     round trips, one per hop);
  2. throughput (layer requests/s) for 1..64 concurrent streams;
  3. the router's CPU time per layer request (utime+stime from /proc around each throughput run).
Writes a Markdown report (default bench/results/service.md).

With --in-process there is no exl3-router process: exl3-loadgen runs the router's logic itself
(--in-process-router, services/router/in_process_router.h), so the path has one gRPC hop and the
tables compare against one and two echo round trips; the CPU column is then left out (the router
shares the loadgen's process).

By default the two-hop path is measured twice, one router per router->worker transport against
the same worker: `shm` (same-host shared memory, the router's default) and `grpc`
(--worker-shm-mb 0).

Usage: bench/service_bench.py [--build-dir build] [--out bench/results/service.md] [--quick]
                              [--in-process] [--transports shm,grpc]
"""

import argparse
import datetime
import os
import platform
import re
import signal
import statistics
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc):
    """SIGTERM (the services drain), then SIGKILL if it takes over 15 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker_compute(metrics_addr):
    """(sum seconds, count) of the worker's compute stage over all layers, from its /metrics."""
    import urllib.request
    text = urllib.request.urlopen(f"http://{metrics_addr}/metrics").read().decode()
    tot, n = 0.0, 0
    for m in re.finditer(r'^exl3_worker_layer_latency_seconds_(sum|count)\{[^}]*stage="compute"[^}]*\} '
                         r'([\d.e+-]+)$', text, re.M):
        if m.group(1) == "sum":
            tot += float(m.group(2))
        else:
            n += int(float(m.group(2)))
    return tot, n


def machine():
    model = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def InProcessReport(a, commit, load, cmd, rows_rt, rows_tp):
    out = [
        "# Service benchmark: in-process router + one worker vs the transport floor",
        "",
        f"- date: {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC",
        f"- commit: {commit}",
        f"- machine: {machine()}; load average at the end {' '.join(load)}",
        f"- command: `{cmd}`",
        f"- setup: test model (random EXL3 trellis), hidden {a.hidden}, 8 experts x intermediate "
        f"{a.inter}, top-2, 2 MoE layers; one exl3-worker (CPU backend, --threads "
        f"{a.worker_threads}) holding all experts; the router's logic inside exl3-loadgen "
        "(--in-process-router; requests without the shared expert), fp16 in, fp32 out, closed "
        "loop, all on loopback",
        "",
        "| T | requests | p50 us | p90 | p99 | echo p50 us | echo p99 | p50 / 1 echo | p50 / 2 echo | worker compute mean us | (p50 - compute) / 1 echo | router gate+dispatch+combine us |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows_rt:
        out.append("| {} | {} | {:.0f} | {:.0f} | {:.0f} | {:.0f} | {:.0f} | {:.2f}x | {:.2f}x | {:.0f} | {:.2f}x | {:.0f} |".format(*r))
    out += ["", "| streams | answered | layer-requests/s | p50 us | p99 us |", "| --- | --- | --- | --- | --- |"]
    for r in rows_tp:
        out.append("| {} | {} | {:.0f} | {:.0f} | {:.0f} |".format(*r[:5]))
    out.append("")
    return out


def measure(loadgen, a, wmetrics, router):
    """Per-layer round trips at T = 1, 8, 64 (with the echo floor) and the throughput sweep for one
    router configuration. Returns (rows_rt, rows_tp); rows_rt entries are
    (T, n, p50, p90, p99, echo p50, echo p99, worker compute mean, gate+dispatch+combine)."""
    # Wait until the router serves.
    for _ in range(200):
        p = subprocess.run(loadgen + ["--requests", "2", "--allow-failures"],
                           capture_output=True, text=True)
        if " failed=0 " in p.stdout:
            break
        time.sleep(0.1)
    rows_rt, rows_tp = [], []
    for T in (1, 8, 64):
        n = a.requests if T < 64 else max(a.requests // 3, 50)
        runs = []
        for _ in range(a.repeats):
            w0 = worker_compute(f"127.0.0.1:{wmetrics}")
            p = subprocess.run(loadgen + ["--tokens", str(T), "--requests", str(n), "--warmup",
                                          "20", "--echo-baseline"], capture_output=True, text=True,
                               check=True)
            w1 = worker_compute(f"127.0.0.1:{wmetrics}")
            compute_us = 1e6 * (w1[0] - w0[0]) / max(w1[1] - w0[1], 1)
            st = re.search(r"router stages \(mean us, from the answers\): gate ([\d.]+) dispatch "
                           r"([\d.]+) workers ([\d.]+) combine ([\d.]+) total ([\d.]+)", p.stdout)
            gate, disp, _, comb, _ = map(float, st.groups())
            m = re.search(r"summary: router_p50_us=([\d.]+) router_p90_us=([\d.]+) "
                          r"router_p99_us=([\d.]+) router_rps=([\d.]+) echo_p50_us=([\d.]+) "
                          r"echo_p99_us=([\d.]+)", p.stdout)
            r50, r90, r99, _, e50, e99 = map(float, m.groups())
            runs.append((r50, r90, r99, e50, e99, compute_us, gate + disp + comb))
            print(p.stdout, file=sys.stderr)
        # Medians over the runs, each figure on its own (the machine is shared: single runs vary).
        med = [statistics.median(col) for col in zip(*runs)]
        ratios = sorted(r[0] / (2 * r[3]) for r in runs)
        rows_rt.append((T, n, *med, ratios))
    for C in (1, 2, 4, 8, 16, 32, 64):
        c0 = cpu_seconds(router.pid) if router else 0
        p = subprocess.run(loadgen + ["--tokens", "1", "--concurrency", str(C), "--duration",
                                      str(a.duration)], capture_output=True, text=True,
                           check=True)
        cpu = cpu_seconds(router.pid) - c0 if router else 0
        m = re.search(r"summary: router_p50_us=([\d.]+) router_p90_us=([\d.]+) "
                      r"router_p99_us=([\d.]+) router_rps=([\d.]+)", p.stdout)
        ok = int(re.search(r" ok=(\d+) ", p.stdout).group(1))
        r50, _, r99, rps = map(float, m.groups())
        rows_tp.append((C, ok, rps, r50, r99, 1e6 * cpu / max(ok, 1)))
        print(p.stdout, file=sys.stderr)
    return rows_rt, rows_tp


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build"))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/results/service.md"))
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--inter", type=int, default=128)
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=3,
                    help="loadgen runs per token count (medians reported)")
    ap.add_argument("--worker-threads", type=int, default=1)
    ap.add_argument("--transports", default="shm,grpc",
                    help="router->worker transports to measure, in this order: shm (same-host "
                         "shared memory, the default) and/or grpc (--worker-shm-mb 0)")
    ap.add_argument("--quick", action="store_true", help="fewer requests (smoke run)")
    ap.add_argument("--in-process", action="store_true",
                    help="the router's logic inside exl3-loadgen (--in-process-router)")
    a = ap.parse_args()
    if a.quick:
        a.requests, a.duration, a.repeats = 100, 1.0, 1
    bindir = os.path.join(a.build_dir, "bin")
    tmp = tempfile.mkdtemp(prefix="exl3-service-bench-")
    model = os.path.join(tmp, "model")
    subprocess.run([os.path.join(a.build_dir, "tests", "exl3-test-model"), model, "--hidden",
                    str(a.hidden), "--inter", str(a.inter), "--layers", "3", "--experts", "8",
                    "--top-k", "2"], check=True)
    wport, wmetrics = free_port(), free_port()
    with open(os.path.join(tmp, "map.yaml"), "w") as f:
        f.write(f"workers:\n  - name: w\n    address: 127.0.0.1:{wport}\n    experts: all\n")
    log = open(os.path.join(tmp, "procs.log"), "ab")
    worker = subprocess.Popen([os.path.join(bindir, "exl3-worker"), "--model", model, "--expert-map",
                               os.path.join(tmp, "map.yaml"), "--worker", "w", "--listen",
                               f"127.0.0.1:{wport}", "--metrics-listen", f"127.0.0.1:{wmetrics}",
                               "--progress=false", "--mlock=false", "--threads",
                               str(a.worker_threads)], stdout=log, stderr=log)
    results = {}  # transport -> (rows_rt, rows_tp)
    try:
        if a.in_process:
            where = ["--in-process-router", "--expert-map", os.path.join(tmp, "map.yaml")]
            loadgen = [os.path.join(bindir, "exl3-loadgen"), *where, "--model", model,
                       "--shared=false"]
            results["in-process"] = measure(loadgen, a, wmetrics, None)
        else:
            for transport in a.transports.split(","):
                rport, rmetrics = free_port(), free_port()
                router = subprocess.Popen(
                    [os.path.join(bindir, "exl3-router"), "--model", model, "--expert-map",
                     os.path.join(tmp, "map.yaml"), "--listen", f"127.0.0.1:{rport}",
                     "--metrics-listen", f"127.0.0.1:{rmetrics}", "--shared-expert", "none",
                     "--worker-shm-mb", "8" if transport == "shm" else "0"],
                    stdout=log, stderr=log)
                loadgen = [os.path.join(bindir, "exl3-loadgen"), "--target", f"127.0.0.1:{rport}",
                           "--model", model, "--shared=false"]
                try:
                    results[transport] = measure(loadgen, a, wmetrics, router)
                finally:
                    stop(router)
    finally:
        stop(worker)

    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    load = open("/proc/loadavg").read().split()[:3]
    cmd = "bench/service_bench.py " + " ".join(sys.argv[1:])
    if a.in_process:
        rows_rt, rows_tp = results["in-process"]
        rows = [(T, n, r50, r90, r99, e50, e99, r50 / e50, r50 / (2 * e50), c, (r50 - c) / e50, g)
                for (T, n, r50, r90, r99, e50, e99, c, g, _) in rows_rt]
        out = InProcessReport(a, commit, load, cmd, rows, rows_tp)
        with open(a.out, "w") as f:
            f.write("\n".join(out))
        print("\n".join(out))
        return
    out = [
        "# Service benchmark: router + one worker vs the transport floor",
        "",
        f"- date: {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC",
        f"- commit: {commit}",
        f"- machine: {machine()}; load average at the end {' '.join(load)} "
        "(the development machine is shared: other builds ran at the same time)",
        f"- command: `{cmd}`",
        f"- setup: test model (random EXL3 trellis), hidden {a.hidden}, 8 experts x intermediate "
        f"{a.inter}, top-2, 2 MoE layers; one exl3-worker (CPU backend, --threads "
        f"{a.worker_threads}) holding all experts; exl3-router with --shared-expert none; "
        "exl3-loadgen, fp16 in, fp32 out, closed loop, all on loopback. One router per transport, "
        "measured one after the other against the same worker: `shm` = the router->worker stream "
        "through same-host shared memory (the default, `--worker-shm-mb 8`), `grpc` = "
        "`--worker-shm-mb 0`. The engine->router hop is gRPC in both.",
        "",
        "## Per-layer round trip (one stream)",
        "",
        "Floor = two echo round trips of the same payloads (engine->router and router->worker), "
        "measured in the same run by `exl3-loadgen --echo-baseline` against its built-in echo "
        "server. The router path also contains the worker's expert compute, which the floor does not.",
        "",
        "Also shown: the worker's mean compute per sub-request (its own metrics), the ratio with "
        "that compute taken out, and the router's own mean gate + dispatch + combine time "
        "(RouterTimings).",
        "",
        f"Each row: medians over {a.repeats} loadgen runs (each run measures the router path, then "
        "the echo floor); the last column lists every run's own p50 / floor.",
        "",
        "| transport | T | requests per run | router p50 us | p90 | p99 | echo p50 us | echo p99 | floor (2x echo p50) | router p50 / floor | worker compute mean us | (p50 - compute) / floor | router gate+dispatch+combine us | per-run p50 / floor |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for transport, (rows_rt, _) in results.items():
        for (T, n, r50, r90, r99, e50, e99, c, g, ratios) in rows_rt:
            out.append(f"| {transport} | {T} | {n} | {r50:.0f} | {r90:.0f} | {r99:.0f} | {e50:.0f} | "
                       f"{e99:.0f} | {2 * e50:.0f} | {r50 / (2 * e50):.2f}x | {c:.0f} | "
                       f"{(r50 - c) / (2 * e50):.2f}x | {g:.0f} | "
                       f"{', '.join(f'{x:.2f}' for x in ratios)} |")
    out += [
        "",
        "## Throughput (T = 1, closed loop, one request in flight per stream)",
        "",
        "| transport | streams | answered | layer-requests/s | p50 us | p99 us | router CPU us / request |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for transport, (_, rows_tp) in results.items():
        for (C, ok, rps, r50, r99, cpu) in rows_tp:
            out.append(f"| {transport} | {C} | {ok} | {rps:.0f} | {r50:.0f} | {r99:.0f} | {cpu:.0f} |")
    out.append("")
    with open(a.out, "w") as f:
        f.write("\n".join(out))
    print("\n".join(out))


if __name__ == "__main__":
    main()
