#!/usr/bin/env python3
"""Generation throughput of the attention/router service (exl3-router's Generator) on the CPU:
decode tokens/s at several concurrencies, client-side time to first token and inter-token
latency, and the engine's step time by phase (from its /metrics), with the experts in the
router's process and on an exl3-worker. Results as a Markdown table on stdout.

  bench/engine_bench.py --build build [--model DIR] [--concurrency 1,8,32] [--requests-per-stream 4]

Without --model it generates the demo's model (exl3-tool make-test-model --arch glm4_moe)."""

import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import grpc

from service_logs import wait_log

PHASES = ["embed", "attention", "moe", "dense_mlp", "head", "forward", "schedule", "sample",
          "bookkeeping"]




def phase_sums(metrics):
    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5).read().decode()
    m = re.search(r'^exl3_engine_step_phase_seconds_count{phase="forward"} (\S+)$', text, re.M)
    out = {"steps": float(m.group(1)) if m else 0.0}
    for p in PHASES:
        m = re.search(rf'^exl3_engine_step_phase_seconds_sum{{phase="{p}"}} (\S+)$', text, re.M)
        out[p] = float(m.group(1)) if m else 0.0
    return out


def run_load(pb, stub, concurrency, per_stream, prompt_len, max_tokens, vocab):
    ttft, itl, generated, failed = [], [], [0], [0]
    lock = threading.Lock()

    def stream(i):
        rng = random.Random(i)
        for _ in range(per_stream):
            prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
            req = pb.GenerateRequest(prompt_token_ids=prompt, max_tokens=max_tokens,
                                     ignore_eos=True, sampling=pb.SamplingParams(temperature=0))
            t0 = time.perf_counter()
            last, first, gaps, n = None, None, [], 0
            try:
                for r in stub.Generate(req, timeout=600):
                    now = time.perf_counter()
                    if r.tokens:
                        if first is None:
                            first = now - t0
                        elif last is not None:
                            gaps.append((now - last) / len(r.tokens))
                        last = now
                        n += len(r.tokens)
            except grpc.RpcError:
                with lock:
                    failed[0] += 1
                continue
            with lock:
                generated[0] += n
                ttft.append(first)
                itl.extend(gaps)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"tok_s": generated[0] / wall, "ttft_ms": 1000 * statistics.median(ttft),
            "itl_ms": 1000 * statistics.median(itl) if itl else 0.0, "failed": failed[0],
            "tokens": generated[0], "wall_s": wall}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--model", default="")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests-per-stream", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--engine-threads", type=int, default=0)
    ap.add_argument("--modes", default="local,workers",
                    help="local (experts in the router), workers (one exl3-worker), "
                         "workers-mb2 (workers with the micro-batch ping-pong)")
    a = ap.parse_args()
    sys.path.insert(0, os.path.join(a.build, "python"))
    from exl3serve.v1 import exl3serve_pb2 as pb, exl3serve_pb2_grpc as pbg

    work = tempfile.mkdtemp(prefix="exl3-engine-bench-")
    model = a.model
    if not model:
        model = os.path.join(work, "model")
        subprocess.run([os.path.join(a.build, "bin", "exl3-tool"), "make-test-model", "--arch",
                        "glm4_moe", "--output", model, "--quiet"], check=True)
    procs = []
    rows = []
    try:
        for mode in a.modes.split(","):
            extra = []
            if mode.startswith("workers"):
                port = 50000 + os.getpid() % 10000
                mp = os.path.join(work, "map.yaml")
                with open(mp, "w") as f:
                    f.write(f"workers:\n  - name: w\n    address: 127.0.0.1:{port}\n    experts: all\n")
                wlog = os.path.join(work, "worker.log")
                procs.append(subprocess.Popen(
                    [os.path.join(a.build, "bin", "exl3-worker"), "--model", model, "--expert-map", mp,
                     "--worker", "w", "--listen", f"127.0.0.1:{port}", "--metrics-listen", "",
                     "--progress=false", "--mlock=false"], stdout=open(wlog, "w"),
                    stderr=subprocess.STDOUT))
                wait_log(wlog, r"serving on ")
                extra = ["--expert-map", mp] + (["--micro-batches", "2"] if mode == "workers-mb2" else [])
            rlog = os.path.join(work, f"router-{mode}.log")
            procs.append(subprocess.Popen(
                [os.path.join(a.build, "bin", "exl3-router"), "--model", model, "--listen",
                 "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--engine-threads",
                 str(a.engine_threads), *extra], stdout=open(rlog, "w"), stderr=subprocess.STDOUT))
            m = wait_log(rlog, r"exl3-router listening on (\S+) .*metrics on (\S+),")
            address, metrics = m.group(1), m.group(2)
            stub = pbg.GeneratorStub(grpc.insecure_channel(address))
            vocab = stub.DescribeModel(pb.DescribeModelRequest(), timeout=30).vocab_size
            run_load(pb, stub, 1, 1, a.prompt_len, 8, vocab)  # warm-up
            for c in [int(x) for x in a.concurrency.split(",")]:
                before = phase_sums(metrics)
                r = run_load(pb, stub, c, a.requests_per_stream, a.prompt_len, a.max_tokens, vocab)
                after = phase_sums(metrics)
                d = {p: after[p] - before[p] for p in PHASES + ["steps"]}
                overhead = d["schedule"] + d["sample"] + d["bookkeeping"]
                step = d["forward"] + overhead
                rows.append((mode, c, r, d, overhead / step if step else 0.0))
            for p in procs:
                p.terminate()
                p.wait(timeout=30)
            procs = []
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=30)

    print("| experts | streams | decode tok/s | TTFT p50 ms | ITL p50 ms | failed | attention | moe "
          "| dense mlp | head | step µs | schedule / sample / bookkeeping µs | engine overhead |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for mode, c, r, d, ov in rows:
        fwd = d["forward"] or 1.0
        pct = lambda k: f"{100 * d[k] / fwd:.0f} %"  # noqa: E731
        print(f"| {mode} | {c} | {r['tok_s']:.1f} | {r['ttft_ms']:.1f} | {r['itl_ms']:.2f} | "
              f"{r['failed']} | {pct('attention')} | {pct('moe')} | {pct('dense_mlp')} | "
              f"{pct('head')} | {1e6 * (d['forward'] + d['schedule'] + d['sample'] + d['bookkeeping']) / max(d['steps'], 1):.0f} | "
              f"{1e6 * d['schedule'] / max(d['steps'], 1):.0f} / {1e6 * d['sample'] / max(d['steps'], 1):.0f} / "
              f"{1e6 * d['bookkeeping'] / max(d['steps'], 1):.0f} | {100 * ov:.1f} % |")


if __name__ == "__main__":
    main()
