"""The front end's own cost per request, with a client that costs next to nothing
(bench/results/frontend.md): exl3serve-openai in front of the fake engine of
tests/clients/python/fake_engine.py (--engine fake: one step every --step-ms, no forward pass, in
this process) or of exl3-router on a generated test model (--engine router), and a load client of
raw HTTP/1.1 keep-alive connections (no SDK: a few µs of CPU per event, where the openai SDK
client of frontend_bench.py takes ~250 µs per token and, on a small machine, the front end's
core). Each round sends one streamed completion per connection at once, a burst as a benchmark's
lock-stepped streams make (every request of a wave finishes on the same engine step, so the next
wave starts together), and waits for every [DONE]. Reports the front end's CPU per request (utime
+ stime over the rounds / requests) and the time from a burst's start to each request's first
token event, p50 and p90; with --engine router also the front end's own TTFT over the engine's
(means over the same requests of its exl3_frontend_time_to_first_token_seconds and the engine's
exl3_engine_time_to_first_token_seconds, as frontend_bench.py reports it).

    BUILD_DIR/frontend-venv/bin/python bench/frontend_burst_bench.py [--engine fake|router]
        [--build-dir build] [--streams 64] [--rounds 40] [--max-tokens 1] [--engine-calls stream]
        [--frontend-cpu 1 --client-cpu 0 [--engine-cpu 0]]

The prompt is token ids (tokenization and the chat template are not in it: frontend_bench.py's
chat passes have them). The front end is the one the Python on PATH (or PYTHONPATH) imports, so
PYTHONPATH=OTHER_CHECKOUT/clients/python measures another tree's front end on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests/clients/python"))
sys.path.insert(0, str(ROOT / "bench"))
import stack  # noqa: E402
from fake_engine import RUN, FakeEngine, ThreadedServer  # noqa: E402
from frontend_bench import (cpu_list, cpu_seconds, engine_clocks, hist_totals,  # noqa: E402
                            mean_between, pin)

FRONTEND_TTFT = "exl3_frontend_time_to_first_token_seconds"


async def one_request(conn: tuple, request: bytes, t0: float, firsts: list[float]) -> None:
    reader, writer = conn
    writer.write(request)
    await writer.drain()
    seen, tail = False, b""
    while True:
        chunk = await reader.read(65536)
        if not chunk:
            raise ConnectionError("the front end closed the connection")
        if not seen and b"data: {" in chunk:
            firsts.append(time.perf_counter() - t0)
            seen = True
        tail = (tail + chunk)[-64:]
        if b"data: [DONE]" in tail:
            return


async def run(args: argparse.Namespace, host: str, port: int, fe_pid: int, model: str,
              engine_metrics: str | None) -> dict:
    body = json.dumps({"model": model, "prompt": [RUN, 100], "max_tokens": args.max_tokens,
                       "stream": True, "ignore_eos": True}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    conns = [await asyncio.open_connection(host, port) for _ in range(args.streams)]

    async def burst(firsts: list[float]) -> None:
        t0 = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(one_request(c, request, t0, firsts) for c in conns)),
                               timeout=60)

    for _ in range(5):  # warm-up
        await burst([])
    firsts: list[float] = []
    fe_addr = f"{host}:{port}"
    s0 = hist_totals(fe_addr, FRONTEND_TTFT)
    e0 = engine_clocks(engine_metrics)[0] if engine_metrics else None
    c0, w0 = cpu_seconds(fe_pid), time.perf_counter()
    for _ in range(args.rounds):
        await burst(firsts)
    c1, w1 = cpu_seconds(fe_pid), time.perf_counter()
    own = None
    if engine_metrics and e0 is not None:
        own = mean_between(s0, hist_totals(fe_addr, FRONTEND_TTFT)) - \
            mean_between(e0, engine_clocks(engine_metrics)[0])
    for _, w in conns:
        w.close()
    firsts.sort()
    n = args.rounds * args.streams
    return {"cpu_us_per_request": (c1 - c0) / n * 1e6, "cpu_share": (c1 - c0) / (w1 - w0),
            "first_p50_ms": firsts[len(firsts) // 2] * 1e3,
            "first_p90_ms": firsts[int(len(firsts) * 0.9)] * 1e3, "own_ttft": own}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="fake", choices=("fake", "router"),
                    help="fake: fake_engine.py in this process; router: exl3-router on a test model")
    ap.add_argument("--build-dir", default="build", type=Path, help="with --engine router")
    ap.add_argument("--streams", type=int, default=64, help="requests per burst (connections)")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=1, help="tokens per request, one per step")
    ap.add_argument("--step-ms", type=float, default=2.0, help="the fake engine's step")
    ap.add_argument("--engine-calls", default="stream", choices=("stream", "per-request"))
    ap.add_argument("--frontend-cpu", help="CPU list of exl3serve-openai (e.g. 1)")
    ap.add_argument("--client-cpu", help="CPU list of this process: client and fake engine (e.g. 0)")
    ap.add_argument("--engine-cpu", help="with --engine router: CPU list of exl3-router (e.g. 0); "
                    "it runs as many forward-pass threads")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="exl3-fe-burst."))
    stops = []
    try:
        model = work / "model"
        engine_metrics = None
        if args.engine == "fake":
            shutil.copytree(ROOT / "tests/fixtures/tokenizer/glm4_moe", model)
            pin(args.client_cpu)
            server = ThreadedServer(FakeEngine(step_s=args.step_ms / 1e3)).start()
            stops.append(server.close)
            engine, name = server.target, "fake"
        else:
            stack.make_model(args.build_dir.resolve(), model)
            pin(args.engine_cpu)
            threads = ("--engine-threads", str(len(cpu_list(args.engine_cpu)))) if args.engine_cpu else ()
            router, engine, engine_metrics = stack.start_router(args.build_dir.resolve(), model,
                                                                work / "logs", extra=threads)
            stops.append(router.stop)
            name = ""
        pin(args.frontend_cpu)
        fe, url = stack.start_frontend(engine, model, work / "logs", engine_calls=args.engine_calls)
        stops.append(fe.stop)
        pin(args.client_cpu)
        if not name:
            name = json.loads(stack.get(url + "/models")[1])["data"][0]["id"]
        host, port = url[len("http://"):-len("/v1")].rsplit(":", 1)
        r = asyncio.run(run(args, host, int(port), fe.p.pid, name, engine_metrics))
    finally:
        for stop in reversed(stops):
            stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"{platform.node()} ({os.cpu_count()} CPUs), {args.engine} engine, front end {args.engine_calls}, "
          f"{args.streams} streams x {args.rounds} rounds, {args.max_tokens} tokens each: front end CPU "
          f"{r['cpu_us_per_request']:.0f} us/request ({r['cpu_share'] * 100:.0f} % of a core), "
          f"first token after the burst's start p50 {r['first_p50_ms']:.2f} ms, "
          f"p90 {r['first_p90_ms']:.2f} ms"
          + ("" if r["own_ttft"] is None else
             f"; the front end's own TTFT over the engine's {r['own_ttft'] * 1e3:.2f} ms (mean)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
