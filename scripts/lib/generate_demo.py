"""The generation half of scripts/demo.sh, run with BUILD_DIR/frontend-venv's Python: chat
completions through the OpenAI-compatible front end with the official openai SDK (one streaming,
printed as it arrives), greedy token ids through the front end checked against a direct Generate
call, greedy token ids of the transformers fixture (tests/fixtures/engine/README.md) through a
second router serving that model, a short concurrent streaming load, and the summary line

    generate: requests=R ok=R failed=0 reference_match=M/M ttft_p50_ms=X itl_p50_ms=Y tok_s=Z

written to --summary (demo.sh prints it last). Exits non-zero if a request failed or a reference
did not match. Every loop is bounded by a request count and a timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import struct
import sys
import time
from pathlib import Path

import openai

from exl3serve_client import GenerateClient
from exl3serve_client.frontend.text import ModelTokenizer

PROMPTS = ["Tell me about mixtures of experts.", "What does the router do?",
           "Write a haiku about GPUs.", "Count to five.", "Why split attention from experts?",
           "Say something in French."]


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def stream_one(client: openai.OpenAI, model: str, max_tokens: int) -> int:
    msg = [{"role": "system", "content": "You are a test model with random weights."},
           {"role": "user", "content": "Hello! Please introduce yourself."}]
    print(f"  user: {msg[1]['content']}")
    print("  assistant (streamed): ", end="", flush=True)
    n = 0
    for chunk in client.chat.completions.create(model=model, messages=msg, max_tokens=max_tokens,
                                                temperature=0.7, seed=1, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage:
            n = chunk.usage.completion_tokens
    print(f"\n  ({n} tokens)")
    return n


def reference(client: openai.OpenAI, model: str, engine: str, tok: ModelTokenizer,
              prompts: list[str], max_tokens: int) -> tuple[int, int]:
    """Greedy ids of each chat prompt through the front end (HTTP, chat template, tokenizer, the
    full stack) against a direct Generate call with temperature 0 on the same rendered ids."""
    matched = 0
    with GenerateClient(engine) as g:
        for p in prompts:
            messages = [{"role": "user", "content": p}]
            r = client.chat.completions.create(model=model, messages=messages,
                                               max_tokens=max_tokens, temperature=0,
                                               logprobs=True,
                                               extra_body={"return_tokens_as_token_ids": True})
            via_http = [int(e.token.split(":", 1)[1]) for e in r.choices[0].logprobs.content]
            direct = g.generate(tok.encode_chat(messages), max_tokens=max_tokens,
                                temperature=0, timeout=120).token_ids
            ok = via_http == direct
            matched += ok
            print(f"  {'match' if ok else 'MISMATCH'}  {p!r}: {len(direct)} tokens "
                  f"{direct[:8]}{'…' if len(direct) > 8 else ''}")
            if not ok:
                print(f"    front end: {via_http}\n    direct:    {direct}")
    return matched, len(prompts)


def read_int_tensors(path: Path) -> dict[str, list[int]]:
    """The int32 tensors of a safetensors file (8-byte little-endian header size, JSON header,
    then the data)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    out = {}
    for name, t in header.items():
        if name != "__metadata__" and t["dtype"] == "I32":
            b, e = t["data_offsets"]
            out[name] = list(struct.unpack(f"<{(e - b) // 4}i", data[b:e]))
    return out


def transformers_reference(engine: str, fixture: Path) -> tuple[int, int]:
    """Greedy ids through a router serving the fixture's model against transformers' own."""
    ref = read_int_tensors(fixture / "reference.safetensors")
    matched, total = 0, 0
    with GenerateClient(engine) as g:
        g.wait_ready(timeout=60)  # the router listens once its model is loaded
        while f"prompt.{total}" in ref:
            prompt, want = ref[f"prompt.{total}"], ref[f"greedy.{total}"]
            got = g.generate(prompt, max_tokens=len(want), temperature=0, ignore_eos=True,
                             timeout=120).token_ids
            ok = got == want
            matched += ok
            print(f"  {'match' if ok else 'MISMATCH'}  prompt of {len(prompt)} tokens: "
                  f"{len(want)} greedy tokens{'' if ok else f': {got} vs transformers {want}'}")
            total += 1
    return matched, total


async def run_pool(one, n: int, concurrency: int, timeout: float = 600.0) -> float:
    """Runs one(0..n-1) with `concurrency` at a time; returns the wall time."""
    todo = list(range(n))

    async def worker() -> None:
        while todo:
            await one(todo.pop())
    t0 = time.monotonic()
    await asyncio.wait_for(asyncio.gather(*[worker() for _ in range(concurrency)]), timeout)
    return time.monotonic() - t0


async def chat_load(url: str, model: str, messages: list[list[dict]], concurrency: int,
                    max_tokens: int):
    """Streamed chat completions through the openai SDK. TTFT: request sent -> first text; ITL:
    (last text - first text) / (tokens - 1), the request's mean gap between tokens (chunks may carry
    several). Returns (ttft list, itl list, tokens, failed, wall seconds)."""
    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
    ttft, itl, tokens, failed = [], [], [0], [0]

    async def one(i: int) -> None:
        t0 = time.monotonic()
        first = last = None
        n = 0
        try:
            stream = await client.chat.completions.create(
                model=model, messages=messages[i], max_tokens=max_tokens, temperature=0.8,
                seed=i, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    last = time.monotonic()
                    first = first or last
                if chunk.usage:
                    n = chunk.usage.completion_tokens
        except openai.OpenAIError as e:
            failed[0] += 1
            print(f"  request {i} failed: {e}", file=sys.stderr)
            return
        tokens[0] += n
        if first is not None:
            ttft.append(first - t0)
            if n > 1:
                itl.append((last - first) / (n - 1))

    wall = await run_pool(one, len(messages), concurrency)
    await client.close()
    return ttft, itl, tokens[0], failed[0], wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="front end base URL, http://HOST:PORT/v1")
    ap.add_argument("--engine", required=True, help="HOST:PORT of the Generator (exl3-router)")
    ap.add_argument("--model-dir", required=True, type=Path)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--reference-prompts", type=int, default=3)
    ap.add_argument("--summary", type=Path, required=True, help="file for the summary line")
    ap.add_argument("--fixture", type=Path, help="a transformers fixture's model directory")
    ap.add_argument("--fixture-engine", help="HOST:PORT of a router serving --fixture")
    args = ap.parse_args()

    client = openai.OpenAI(base_url=args.url, api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    tok = ModelTokenizer(args.model_dir)

    print(f"\n\033[1m== chat through the OpenAI API ({args.url}, model {model!r}; a generated "
          "test model has random weights: its text is noise)\033[0m")
    stream_one(client, model, 48)
    sent = 1

    print(f"\n\033[1m== reference: greedy token ids through the front end vs a direct Generate "
          f"call (temperature 0, same prompt ids)\033[0m")
    matched, total = reference(client, model, args.engine, tok,
                               PROMPTS[:args.reference_prompts], args.max_tokens)
    sent += total
    if args.fixture and args.fixture_engine:
        print(f"\n\033[1m== reference: greedy token ids of {args.fixture} against transformers' "
              "own (recorded by scripts/conformance/engine_fixtures.py)\033[0m")
        m, t = transformers_reference(args.fixture_engine, args.fixture)
        matched, total, sent = matched + m, total + t, sent + t

    print(f"\n\033[1m== load: {args.requests} streamed chat completions, {args.concurrency} at once, "
          f"{args.max_tokens} tokens each (openai.AsyncOpenAI)\033[0m")
    messages = [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
                for i in range(args.requests)]
    ttft, itl, ntok, failed, wall = asyncio.run(chat_load(args.url, model, messages,
                                                          args.concurrency, args.max_tokens))
    sent += args.requests
    tok_s = ntok / wall if wall > 0 else 0.0
    print(f"  {'':14} {'p50':>9} {'p90':>9} {'p99':>9}")
    for name, xs in (("TTFT ms", ttft), ("ITL ms", itl)):
        print(f"  {name:14} {pct(xs, .5) * 1e3:9.2f} {pct(xs, .9) * 1e3:9.2f} {pct(xs, .99) * 1e3:9.2f}")
    print(f"  {ntok} tokens in {wall:.2f} s: {tok_s:.1f} tokens/s")

    ok = sent - failed
    line = (f"generate: requests={sent} ok={ok} failed={failed} reference_match={matched}/{total} "
            f"ttft_p50_ms={pct(ttft, .5) * 1e3:.2f} itl_p50_ms={pct(itl, .5) * 1e3:.2f} "
            f"tok_s={tok_s:.1f}")
    args.summary.write_text(line + "\n")
    return 0 if failed == 0 and matched == total else 1


if __name__ == "__main__":
    sys.exit(main())
