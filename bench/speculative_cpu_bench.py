#!/usr/bin/env python3
"""Single-stream greedy decode on the CPU engine with and without n-gram speculative decoding
(exl3-router --speculative-method ngram), on a prompt built to repeat: a random prompt, the
model's own greedy continuation of it, then that continuation's first tokens again (so the
drafter finds what the model goes on to say earlier in the prompt, as far as the model repeats
itself). Per setting: decode tokens/s (first token to last), the spec_decode counters from
/metrics, and whether the tokens equal plain decoding's. Results as a Markdown table on stdout.

  bench/speculative_cpu_bench.py --build build --model DIR [--k 1,2,4] [--max-tokens 128]
                                 [--requests 3] [--engine-threads 2] [--ngram-min 1 --ngram-max 3]

Random weights rarely repeat themselves (no drafts accepted: the table then shows what verifying
costs); the engine fixtures' tiny models do (tests/fixtures/engine/glm5_next_all, with
--max-tokens 48 within its context of 128). A GLM-5.3-Flash-shaped model with random weights
(KDA, k-pooled MLA, hyper-connections):
  exl3-tool make-test-model --arch glm5_next --synthetic --whole-model --output DIR \\
      --hidden 1024 --layers 8 --experts 32 --top-k 4 --intermediate 256 --vocab 2048 \\
      --linear-heads 8 --linear-head-dim 64

Tokens/s against a chosen acceptance rate (a drafter that matches the target with probability p,
which random weights need) is build/bin/exl3-speculative-cpu-bench (docs/engine.md, "Benchmark
drafter"): it runs the engine in its own process, since exl3-router takes no such drafter."""

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import urllib.request

import grpc

from service_logs import wait_log




def scrape(metrics):
    time.sleep(0.6)  # the router refreshes its engine counters every 250 ms
    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5).read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S+) (\S+)$", text, re.M)}


def generate(pb, stub, prompt, max_tokens):
    """(tokens, seconds from the first token to the last) of one greedy request."""
    req = pb.GenerateRequest(prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True,
                             sampling=pb.SamplingParams(temperature=0))
    tokens, first, last = [], None, None
    for r in stub.Generate(req, timeout=600):
        if r.tokens:
            now = time.perf_counter()
            if first is None:
                first = now
            last = now
            tokens += [t.token_id for t in r.tokens]
    return tokens, last - first


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build")
    ap.add_argument("--model", required=True)
    ap.add_argument("--k", default="1,2,4")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--engine-threads", type=int, default=0)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--ngram-min", type=int, default=1)
    ap.add_argument("--ngram-max", type=int, default=3)
    a = ap.parse_args()
    sys.path.insert(0, os.path.join(a.build, "python"))
    from exl3serve.v1 import exl3serve_pb2 as pb, exl3serve_pb2_grpc as pbg

    with open(os.path.join(a.model, "config.json")) as f:
        config = json.load(f)
    vocab = config.get("text_config", config)["vocab_size"]
    work = tempfile.mkdtemp(prefix="exl3-spec-bench-")
    settings = [("off", 0)] + [("ngram", int(k)) for k in a.k.split(",")]
    rows, plain_tokens, prompt = [], None, None
    for method, k in settings:
        extra = [] if method == "off" else [
            "--speculative-method", "ngram", "--num-speculative-tokens", str(k),
            "--ngram-prompt-lookup-min", str(a.ngram_min), "--ngram-prompt-lookup-max", str(a.ngram_max)]
        log = os.path.join(work, f"router-{method}-{k}.log")
        proc = subprocess.Popen(
            [os.path.join(a.build, "bin", "exl3-router"), "--model", a.model, "--listen", "127.0.0.1:0",
             "--metrics-listen", "127.0.0.1:0", "--engine-threads", str(a.engine_threads), *extra],
            stdout=open(log, "w"), stderr=subprocess.STDOUT)
        try:
            m = wait_log(log, r"exl3-router listening on (\S+) .*metrics on (\S+),", timeout=180)
            address, metrics = m.group(1), m.group(2)
            stub = pbg.GeneratorStub(grpc.insecure_channel(address))
            if prompt is None:  # the repeating prompt, from plain decoding
                rng = random.Random(31)
                base = [rng.randrange(vocab) for _ in range(a.prompt_len)]
                cont, _ = generate(pb, stub, base, 48)
                prompt = base + cont + cont[:4]
            generate(pb, stub, prompt, 8)  # warm-up
            before = scrape(metrics)
            total_tokens, total_s = 0, 0.0
            for _ in range(a.requests):
                tokens, seconds = generate(pb, stub, prompt, a.max_tokens)
                total_tokens += len(tokens) - 1  # decode: after the first token
                total_s += seconds
            if plain_tokens is None:
                plain_tokens = tokens
            after = scrape(metrics)
            d = lambda name: after.get(name, 0.0) - before.get(name, 0.0)  # noqa: E731
            drafts = d("exl3_engine_spec_decode_num_draft_tokens_total")
            accepted = d("exl3_engine_spec_decode_num_accepted_tokens_total")
            rows.append((method, k, total_tokens / total_s, d("exl3_engine_spec_decode_num_drafts_total"),
                         drafts, accepted, tokens == plain_tokens))
        finally:
            proc.terminate()
            proc.wait()
    print(f"model {a.model}, prompt of {len(prompt)} tokens built to repeat, {a.requests} x "
          f"{a.max_tokens} greedy tokens, one stream, CPU engine, experts in process\n")
    print("| method | K | decode tokens/s | verify chunks | draft tokens | accepted | acceptance | same tokens as off |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    base = rows[0][2]
    for method, k, tps, chunks, drafts, accepted, same in rows:
        rate = f"{accepted / drafts:.2f}" if drafts else "-"
        print(f"| {method} | {k or '-'} | {tps:.1f} ({tps / base:.2f}x) | {chunks:.0f} | {drafts:.0f} | "
              f"{accepted:.0f} | {rate} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
