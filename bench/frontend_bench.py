"""Benchmark of the OpenAI-compatible front end (bench/results/frontend.md): a generated test model,
exl3-router (experts in its process) and exl3serve-openai on loopback; at each concurrency, the same
streamed requests go once straight to the engine (Generate over grpc.aio) and once through the front
end (openai.AsyncOpenAI, chat completions), and it reports TTFT, inter-token latency and output
tokens/s of both, the TTFT the front end adds (p50 through it minus p50 direct) and the front end's
CPU time per streamed token (utime + stime of its processes, the workers' with the parent's, over
the pass / tokens), the same for the load client (this process: when it is near one core per wall second, the client, not the front
end, sets the tokens/s), and the tokens per engine message of the direct pass (1: every token is
its own gRPC message and SSE event). Against the engine's own clocks (its /metrics, over the same
requests): the front end's and a direct grpc.aio client's TTFT over the engine's time to first
token (accepted -> sampled), and the engine's first-token write (a call's first token handed to it
-> gRPC's write of it done, exl3_engine_first_token_write_seconds), which is in both.

    BUILD_DIR/frontend-venv/bin/python bench/frontend_bench.py --build-dir build [--levels 1,8,32,64]
        [--engine-cpus 0-5 --frontend-cpus 6-9 --client-cpus 10-15] [--client-procs N]
        [--frontend-workers 1,3] [--engine-calls stream,per-request] [--engine-args='--engine-threads=5']

The --*-cpus options put the three processes on separate cores (CPU affinity, inherited by each
process's threads; the engine then runs as many forward-pass threads as it has cores):
scripts/gpu/frontend.sh runs it so on the GPU machine's 16 cores. Without them all three share
every core. The load clients of each pass are --client-procs processes (default: one per client
CPU, at most 4; one when unpinned), the streams shared among them. --frontend-workers lists front
end worker counts (exl3serve-openai --workers N): the whole set of levels runs once per count, each
with a front end of its own on the same engine, all in one table. --engine-calls lists the front
end's modes (exl3serve-openai --engine-calls: stream, every request of a process on one
GenerateStream call; per-request, one Generate call each): each worker count runs once per mode,
the mode a column of the table, so that one run is an A/B of the two. Every pass is bounded by its
request count and a timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests/clients/python"))
sys.path.insert(0, str(ROOT / "scripts/lib"))
import stack  # noqa: E402
from generate_demo import chat_load, run_pool  # noqa: E402

from exl3serve_client import AsyncGenerateClient  # noqa: E402
from exl3serve_client.frontend.text import ModelTokenizer  # noqa: E402

CLK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK  # utime, stime


def tree_cpu_seconds(pid: int) -> dict[int, float]:
    """CPU seconds of pid and of each of its descendants (a front end's workers), by pid."""
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(c for c, pp in parent.items() if pp == p)
    out = {}
    for p in tree:
        try:
            out[p] = cpu_seconds(p)
        except OSError:  # exited meanwhile
            pass
    return out


def hist_totals(addr: str, name: str, label: str = "") -> tuple[float, float]:
    """(sum, count) of a histogram over all its series (those whose labels include `label`, e.g.
    'stage="done"', when given), from a /metrics endpoint."""
    total = count = 0.0
    for line in stack.get(f"http://{addr}/metrics")[1].splitlines():
        if label and label not in line:
            continue
        if line.startswith(name + "_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith(name + "_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


# The engine's own clocks (services/router/engine_metrics.cc): accepted -> first token sampled,
# and that first token handed to its Generate call -> gRPC's write of it done.
ENGINE_TTFT = "exl3_engine_time_to_first_token_seconds"
ENGINE_FIRST_WRITE = "exl3_engine_first_token_write_seconds"


def engine_clocks(addr: str) -> tuple[tuple[float, float], tuple[float, float]]:
    return hist_totals(addr, ENGINE_TTFT), hist_totals(addr, ENGINE_FIRST_WRITE, 'stage="done"')


def mean_between(before: tuple[float, float], after: tuple[float, float]) -> float:
    n = after[1] - before[1]
    return (after[0] - before[0]) / n if n else float("nan")


def cpu_list(text: str) -> set[int]:
    """A CPU list as taskset -c takes it (0-5,8) -> {0, 1, 2, 3, 4, 5, 8}."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def pin(cpus: str | None) -> None:
    """Sets this (main) thread's CPU affinity; processes started after it inherit it."""
    if cpus:
        os.sched_setaffinity(0, cpu_list(cpus))


def affinity(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    return "?"


def p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


async def direct_pass(engine: str, prompts: list[list[int]], conc: int, max_tokens: int):
    """The same load straight to the engine: (ttft list, itl list, tokens, wall seconds, messages
    that carried tokens)."""
    ttft, itl, ntok, nmsg = [], [], [0], [0]
    async with AsyncGenerateClient(engine) as g:
        async def one(i: int) -> None:
            t0 = time.monotonic()
            first = last = None
            n = 0
            async for resp in g.stream(prompts[i], max_tokens=max_tokens, temperature=0.8, seed=i,
                                       ignore_eos=True, timeout=300):
                if resp.tokens:
                    last = time.monotonic()
                    first = first or last
                    n += len(resp.tokens)
                    nmsg[0] += 1
            ntok[0] += n
            ttft.append(first - t0)
            if n > 1:
                itl.append((last - first) / (n - 1))
        wall = await run_pool(one, len(prompts), conc)
    return ttft, itl, ntok[0], wall, nmsg[0]


async def frontend_pass(url: str, model: str, messages: list[list[dict]], conc: int,
                        max_tokens: int):
    ttft, itl, ntok, failed, wall = await chat_load(url, model, messages, conc, max_tokens)
    if failed:
        raise RuntimeError(f"{failed} requests through the front end failed")
    return ttft, itl, ntok, wall


def _client_job(job: tuple) -> tuple[tuple, float]:
    """One client process's share of a pass: (the pass's result, its CPU seconds)."""
    kind, target, items, conc, max_tokens = job
    t0 = time.process_time()
    if kind == "direct":
        r = asyncio.run(direct_pass(target[0], items, conc, max_tokens))
    else:
        r = asyncio.run(frontend_pass(target[0], target[1], items, conc, max_tokens))
    return r, time.process_time() - t0


def client_pass(pool, procs: int, kind: str, target: tuple, items: list, conc: int,
                max_tokens: int) -> tuple[tuple, float]:
    """A pass split over `procs` client processes (one Python process reads about 7k events/s, less
    than the front end can send): each gets conc/procs of the streams and as large a share of the
    requests. Returns the merged result (lists joined, counts summed, the longest wall time) and the
    client processes' CPU seconds."""
    p = max(1, min(procs, conc))
    jobs = [(kind, target, items[i::p], conc // p + (i < conc % p), max_tokens) for i in range(p)]
    parts = [_client_job(jobs[0])] if pool is None or p == 1 else pool.map(_client_job, jobs)
    results = [r for r, _ in parts]
    merged = []
    for i in range(len(results[0])):
        vals = [r[i] for r in results]
        if isinstance(vals[0], list):
            merged.append([x for v in vals for x in v])
        elif i == 3:  # wall seconds
            merged.append(max(vals))
        else:
            merged.append(sum(vals))
    return tuple(merged), sum(c for _, c in parts)


def run_levels(args, pool, procs: int, engine: str, engine_metrics: str, fe, url: str,
               tok: ModelTokenizer, workers: int, mode: str) -> list[tuple]:
    """Every level of --levels against one front end: a warm-up, then per level the direct pass and
    the pass through the front end. Returns the table's rows."""
    rows = []
    name = openai.OpenAI(base_url=url, api_key="none").models.list().data[0].id
    warm = [[{"role": "user", "content": "warm-up"}]] * 4 * workers
    asyncio.run(direct_pass(engine, [tok.encode_chat(m) for m in warm], 2, 8))
    asyncio.run(frontend_pass(url, name, warm, 2 * workers, 8))
    fe_addr = url[len("http://"):-len("/v1")]
    for conc in [int(x) for x in args.levels.split(",")]:
        n = max(conc * args.requests_per_stream, 32)
        msgs = [[{"role": "user", "content": f"Request {i}: tell me about experts."}]
                for i in range(n)]
        ids = [tok.encode_chat(m) for m in msgs]
        ed, wd = engine_clocks(engine_metrics)
        d, _ = client_pass(pool, procs, "direct", (engine,), ids, conc, args.max_tokens)
        # The same gap for the direct pass: a grpc.aio client's TTFT (sent -> first token read)
        # over the engine's own. What the engine's gRPC side and a Python gRPC reader add, which
        # the front end's engine call pays too; of it, the engine's first-token write (its token
        # handed to the call -> gRPC's write done) is measured by the engine.
        ed1, wd1 = engine_clocks(engine_metrics)
        direct_gap = statistics.fmean(d[0]) - mean_between(ed, ed1)
        direct_write = mean_between(wd, wd1)
        e0, w0 = engine_clocks(engine_metrics)
        s0 = hist_totals(fe_addr, "exl3_frontend_time_to_first_token_seconds")
        c0 = tree_cpu_seconds(fe.p.pid)
        f, client_cpu = client_pass(pool, procs, "frontend", (url, name), msgs, conc,
                                    args.max_tokens)
        c1 = tree_cpu_seconds(fe.p.pid)
        per_process = {p: c1[p] - c0.get(p, 0.0) for p in c1}
        cpu = sum(per_process.values())
        # Server side, same requests: the front end's TTFT (request in -> first token out)
        # against the engine's own (accepted -> first token), means over the pass.
        e1, w1 = engine_clocks(engine_metrics)
        added = mean_between(s0, hist_totals(fe_addr, "exl3_frontend_time_to_first_token_seconds")) - \
            mean_between(e0, e1)
        fe_write = mean_between(w0, w1)
        rows.append((workers, mode, conc, n, d, f, cpu, added, direct_gap, client_cpu, direct_write,
                     fe_write))
        shares = ", ".join(f"{per_process[p]:.2f}" for p in sorted(per_process) if p != fe.p.pid)
        print(f"workers={workers} {mode} c={conc:3d}: direct TTFT p50 {p50(d[0]) * 1e3:7.2f} ms, front end "
              f"{p50(f[0]) * 1e3:7.2f} ms; own TTFT over the engine's {added * 1e3:6.2f} ms (direct "
              f"client's {direct_gap * 1e3:6.2f} ms; engine's first-token write "
              f"{fe_write * 1e3:.2f} / {direct_write * 1e3:.2f} ms); front end "
              f"CPU {cpu / max(f[2], 1) * 1e6:6.1f} us/token"
              + (f" (workers' CPU s: {shares}; parent {per_process.get(fe.p.pid, 0.0):.2f})"
                 if shares else ""), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-dir", default="build", type=Path)
    ap.add_argument("--levels", default="1,8,32,64")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests-per-stream", type=int, default=2)
    ap.add_argument("--output", type=Path, help="also write the markdown table here")
    ap.add_argument("--engine-cpus", help="CPU list (taskset -c style) of exl3-router")
    ap.add_argument("--frontend-cpus", help="CPU list of exl3serve-openai")
    ap.add_argument("--client-cpus", help="CPU list of this process (the load clients)")
    ap.add_argument("--frontend-workers", default="1",
                    help="exl3serve-openai --workers counts, comma-separated: all levels for each")
    ap.add_argument("--engine-calls", default="stream",
                    help="exl3serve-openai --engine-calls modes, comma-separated (stream, "
                         "per-request): all levels of every worker count for each")
    ap.add_argument("--engine-args", default="",
                    help="more exl3-router flags, space-separated, given as "
                         "--engine-args='--a=1 --b=2' (after --engine-threads: a later flag wins)")
    ap.add_argument("--client-procs", type=int,
                    help="load client processes that share each pass's streams (default: as many "
                         "as --client-cpus names, at most 4; 1 without it)")
    args = ap.parse_args()
    procs = args.client_procs or (min(4, len(cpu_list(args.client_cpus))) if args.client_cpus else 1)
    build = args.build_dir.resolve()
    work = Path(tempfile.mkdtemp(prefix="exl3-fe-bench."))
    model = stack.make_model(build, work / "model")
    pin(args.engine_cpus)
    engine_args = ("--engine-threads", str(len(cpu_list(args.engine_cpus)))) if args.engine_cpus else ()
    engine_args += tuple(args.engine_args.split())
    router, engine, engine_metrics = stack.start_router(build, model, work / "logs", extra=engine_args)
    worker_counts = [int(x) for x in args.frontend_workers.split(",")]
    modes = [m for m in args.engine_calls.split(",") if m]
    for m in modes:
        if m not in ("stream", "per-request"):
            ap.error(f"--engine-calls: expected stream or per-request, got {m!r}")
    tok = ModelTokenizer(model)
    rows = []
    placement = ""
    # spawn: the children start clean of this process's gRPC and event-loop state.
    pool = None
    try:
        for workers in worker_counts:
            for mode in modes:
                pin(args.frontend_cpus)
                fe, url = stack.start_frontend(engine, model, work / "logs",
                                               extra=("--workers", str(workers)), engine_calls=mode)
                pin(args.client_cpus)
                try:
                    if pool is None and procs > 1:
                        pool = multiprocessing.get_context("spawn").Pool(procs)
                    placement = (f"CPUs: engine {affinity(router.p.pid)}, front end "
                                 f"{affinity(fe.p.pid)}, client {affinity(os.getpid())}")
                    placement += f", {procs} client process{'es' if procs > 1 else ''}"
                    print(f"front end with {workers} worker{'s' if workers > 1 else ''}, engine "
                          f"calls {mode}; {placement}", flush=True)
                    rows += run_levels(args, pool, procs, engine, engine_metrics, fe, url, tok,
                                       workers, mode)
                finally:
                    fe.stop()
    finally:
        if pool is not None:
            pool.terminate()
        router.stop()
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    lines = [f"machine: {platform.node()} ({os.cpu_count()} CPUs), commit {commit}, "
             f"{args.max_tokens} tokens per request, {args.requests_per_stream} requests per stream; "
             f"{placement}",
             "",
             "| front-end workers | engine calls | streams | requests | TTFT p50 direct ms | TTFT p50 via SDK ms | difference ms | "
             "front end's own TTFT over the engine's, mean ms | "
             "direct gRPC client's TTFT over the engine's, mean ms | "
             "engine's first-token write, mean ms (front end / direct) | "
             "ITL p50 direct ms | ITL p50 front end ms | tok/s direct | tok/s front end | "
             "front end CPU µs/token | client CPU µs/token | tokens per engine message (direct) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for workers, mode, conc, n, d, f, cpu, added, direct_gap, client_cpu, direct_write, fe_write in rows:
        lines.append(f"| {workers} | {mode} | {conc} | {n} | {p50(d[0]) * 1e3:.2f} | {p50(f[0]) * 1e3:.2f} | "
                     f"{(p50(f[0]) - p50(d[0])) * 1e3:.2f} | {added * 1e3:.2f} | {direct_gap * 1e3:.2f} | "
                     f"{fe_write * 1e3:.2f} / {direct_write * 1e3:.2f} | "
                     f"{p50(d[1]) * 1e3:.2f} | "
                     f"{p50(f[1]) * 1e3:.2f} | {d[2] / d[3]:.0f} | {f[2] / f[3]:.0f} | "
                     f"{cpu / max(f[2], 1) * 1e6:.1f} | {client_cpu / max(f[2], 1) * 1e6:.1f} | "
                     f"{d[2] / max(d[4], 1):.2f} |")
    table = "\n".join(lines)
    print(table)
    if args.output:
        args.output.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
