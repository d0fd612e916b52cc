"""The front end's own cost per request, apart from any engine (bench/results/frontend.md): exl3serve-openai
against the fake engine of tests/clients/python/fake_engine.py (one step every --step-ms, no
forward pass, in this process), and a load client of raw HTTP/1.1 keep-alive connections (no SDK,
next to nothing of CPU per event). Each round sends one streamed completion per connection at
once, a burst as a benchmark's lock-stepped streams make (every request of a wave finishes on the
same engine step, so the next wave starts together), and waits for every [DONE]. Reports the front
end's CPU per request (utime + stime over the rounds / requests; the rounds are back to back, so
idle polling is a small part) and, over all rounds, the time from a burst's start to each
request's first token event, p50 and p90: with the fake engine's step at most a step of it is the
engine, the rest the front end working through the burst one request after another.

    BUILD_DIR/frontend-venv/bin/python bench/frontend_burst_bench.py [--streams 64] [--rounds 40]
        [--max-tokens 1] [--engine-calls stream] [--frontend-cpu 1 --client-cpu 0]

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
import stack  # noqa: E402
from fake_engine import RUN, FakeEngine, ThreadedServer  # noqa: E402

CLK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


def pin(cpus: str | None) -> None:
    if cpus is not None:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})


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


async def run(args: argparse.Namespace, host: str, port: int, fe_pid: int) -> dict:
    body = json.dumps({"model": "fake", "prompt": [RUN, 100], "max_tokens": args.max_tokens,
                       "stream": True}).encode()
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
    c0, w0 = cpu_seconds(fe_pid), time.perf_counter()
    for _ in range(args.rounds):
        await burst(firsts)
    c1, w1 = cpu_seconds(fe_pid), time.perf_counter()
    for _, w in conns:
        w.close()
    firsts.sort()
    n = args.rounds * args.streams
    return {"cpu_us_per_request": (c1 - c0) / n * 1e6, "cpu_share": (c1 - c0) / (w1 - w0),
            "first_p50_ms": firsts[len(firsts) // 2] * 1e3,
            "first_p90_ms": firsts[int(len(firsts) * 0.9)] * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=64, help="requests per burst (connections)")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=1, help="tokens per request, one per step")
    ap.add_argument("--step-ms", type=float, default=2.0, help="the fake engine's step")
    ap.add_argument("--engine-calls", default="stream", choices=("stream", "per-request"))
    ap.add_argument("--frontend-cpu", help="CPU list of exl3serve-openai (e.g. 1)")
    ap.add_argument("--client-cpu", help="CPU list of this process: client and fake engine (e.g. 0)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="exl3-fe-burst."))
    try:
        model = work / "model"
        shutil.copytree(ROOT / "tests/fixtures/tokenizer/glm4_moe", model)
        pin(args.client_cpu)
        server = ThreadedServer(FakeEngine(step_s=args.step_ms / 1e3)).start()
        try:
            pin(args.frontend_cpu)
            fe, url = stack.start_frontend(server.target, model, work / "logs",
                                           engine_calls=args.engine_calls)
            pin(args.client_cpu)
            try:
                host, port = url[len("http://"):-len("/v1")].rsplit(":", 1)
                r = asyncio.run(run(args, host, int(port), fe.p.pid))
            finally:
                fe.stop()
        finally:
            server.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{platform.node()} ({os.cpu_count()} CPUs), front end {args.engine_calls}, "
          f"{args.streams} streams x {args.rounds} rounds, {args.max_tokens} tokens each: front end CPU "
          f"{r['cpu_us_per_request']:.0f} us/request ({r['cpu_share'] * 100:.0f} % of a core), "
          f"first token after the burst's start p50 {r['first_p50_ms']:.2f} ms, "
          f"p90 {r['first_p90_ms']:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
