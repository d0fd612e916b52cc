"""exllamav3's own generator timed on a model directory, for the side-by-side tables beside
exl3-engine-bench (scripts/gpu/exllamav3_bench.sh runs both on the same files and GPU).

    python3 exllamav3_bench.py --model DIR --context 1024,8192 --batch 1,8,32,64 --steps 16 --json FILE

What is timed, as a user of exllamav3 runs it: Generator (its paged cache, its batching, CUDA graphs
as it uses them by default) with ArgmaxSampler and no stop conditions.
- Time to first token: one job of a random prompt of each context length, from enqueue to the
  iterate() that returns its first token, after one untimed job of the same length.
- Decode: `batch` jobs, each a different random prompt of the context length; once every job has
  its first token, each iterate() in which every job gains exactly one token is one decode step,
  timed on the host between torch.cuda.synchronize() calls; the median of --steps such steps, then
  the jobs are cancelled. Prompts are ingested in full 2048-token chunks on every iteration
  (shared_chunk_size = max_chunk_size, prefill_cooldown 0): with exllamav3's defaults (half chunks,
  one pass in five while any job generates) the first jobs of a batch of 32 would finish before the
  last had its first token, and no iteration would advance them all. Each job may generate as many
  tokens as the prefill takes iterations, plus the warm-up and timed steps.
One JSON object per result is appended to --json, in the shape exl3-engine-bench writes
({"bench": "exllamav3_prefill", "context", "ttft_s"} and {"bench": "exllamav3_decode", "context",
"batch", "step_s", "tokens_per_s"}).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def log(msg: str) -> None:
    print(f"exllamav3_bench: {msg}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--context", default="1024,8192")
    ap.add_argument("--batch", default="1,8,32,64")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--seed", type=int, default=20261206)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    contexts = [int(c) for c in args.context.split(",")]
    batches = [int(b) for b in args.batch.split(",")]

    import torch
    from exllamav3 import Cache, Config, Generator, Job, Model, Tokenizer
    from exllamav3.generator.sampler import ArgmaxSampler
    try:
        from exllamav3.version import __version__ as version
    except Exception:
        version = "unknown"

    config = Config.from_directory(args.model)
    model = Model.from_config(config)
    warmup = 4
    chunk = 2048

    def new_tokens(ctx: int, batch: int) -> int:
        # Every job still generating once the last prompt is in: one iteration per prefill chunk.
        return -(-batch * ctx // chunk) + warmup + args.steps + 8

    # The cache holds the largest batch at the longest context, rounded up to its 256-token pages.
    need = max(batches) * (max(contexts) + new_tokens(max(contexts), max(batches)) + 256)
    # max_batch_size: the recurrent state slots of models with linear-attention layers (KDA, gated
    # DeltaNet); exllamav3's default of 16 caps the generator's batch there.
    cache = Cache(model, max_num_tokens=256 * (need // 256 + 1), max_batch_size=max(batches))
    t0 = time.perf_counter()
    model.load("cuda:0")
    log(f"loaded {args.model} ({config.architecture}) in {time.perf_counter() - t0:.1f} s; "
        f"exllamav3 {version}, torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    tokenizer = Tokenizer.from_config(config)
    generator = Generator(model=model, cache=cache, tokenizer=tokenizer, max_batch_size=max(batches),
                          max_chunk_size=chunk, shared_chunk_size=chunk, prefill_cooldown=0)
    vocab = config.vocab_size
    gen = torch.Generator().manual_seed(args.seed)

    # A vision model's image / video placeholders (Qwen3.8-Flash-Next's and GLM-5.3-Flash's lie
    # inside the vocabulary) are left out of the prompts: the engine refuses Qwen3.8-Flash-Next's in
    # a text prompt, and exl3-engine-bench leaves them out.
    with open(os.path.join(args.model, "config.json")) as f:
        top = json.load(f)
    placeholders = [top[k] for k in ("image_token_id", "video_token_id") if isinstance(top.get(k), int)]

    def prompt(length: int) -> torch.Tensor:
        # Ids above 1000 keep clear of the special tokens a tokenizer puts first.
        ids = torch.randint(1000, vocab, (1, length), generator=gen, dtype=torch.long)
        for p in placeholders:
            ids[ids == p] = 1000
        return ids

    def job(length: int, tokens: int, ident: int) -> Job:
        return Job(input_ids=prompt(length), max_new_tokens=tokens, min_new_tokens=tokens,
                   sampler=ArgmaxSampler(), stop_conditions=[], identifier=ident)

    def emit(obj: dict) -> None:
        obj.update({"exllamav3": version, "model": args.model,
                    "device": torch.cuda.get_device_name(0)})
        with open(args.json, "a") as f:
            f.write(json.dumps(obj) + "\n")

    for ctx in contexts:
        times = []
        for rep in range(2):  # the first is untimed warm-up
            generator.enqueue(job(ctx, 1, 0))
            torch.cuda.synchronize()
            start = time.perf_counter()
            first = None
            while generator.num_remaining_jobs():
                for r in generator.iterate():
                    if first is None and r.get("stage") == "streaming" and "token_ids" in r:
                        torch.cuda.synchronize()
                        first = time.perf_counter() - start
            if rep:
                times.append(first)
        log(f"time to first token, context {ctx}: {times[0] * 1e3:.2f} ms")
        emit({"bench": "exllamav3_prefill", "context": ctx, "ttft_s": times[0]})

    for ctx in contexts:
        for batch in batches:
            generator.enqueue([job(ctx, new_tokens(ctx, batch), i) for i in range(batch)])
            counts = [0] * batch
            step_ms = []
            seen_all = False
            while generator.num_remaining_jobs() and len(step_ms) < args.steps:
                torch.cuda.synchronize()
                start = time.perf_counter()
                results = generator.iterate()
                torch.cuda.synchronize()
                dt = time.perf_counter() - start
                gained = [0] * batch
                for r in results:
                    if r.get("stage") == "streaming" and "token_ids" in r:
                        gained[r["identifier"]] += r["token_ids"].numel()
                counts = [c + g for c, g in zip(counts, gained)]
                if seen_all and all(g == 1 for g in gained):
                    step_ms.append(dt * 1e3)
                seen_all = seen_all or min(counts) >= warmup
            generator.clear_queue()
            if len(step_ms) < 3:
                log(f"context {ctx}, batch {batch}: only {len(step_ms)} clean decode steps; skipped")
                continue
            med = statistics.median(step_ms)
            log(f"decode context {ctx} batch {batch}: {med:.3f} ms per step (median of {len(step_ms)}), "
                f"{batch / med * 1e3:.1f} tokens/s")
            emit({"bench": "exllamav3_decode", "context": ctx, "batch": batch, "step_s": med / 1e3,
                  "tokens_per_s": batch / med * 1e3, "steps": len(step_ms)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
