#!/usr/bin/env python3
"""Qwen4-Exp's hashed n-gram rows as transformers computes them, for engine/cpu/residual/ngram_hash.h's test.

    /opt/hfref/bin/python scripts/conformance/qwen4exp_ngram_fixture.py \
        --out tests/fixtures/engine/qwen4_exp_ngram_hash.json

For a few configurations (the released model's hashing fields: vocab 248320, ngram_size 3,
heads_per_ngram 8, ngram_vocab_size_base 2e7, seed 1234, PLE layers 0 and 1; and a smaller one
with 4-grams) it runs transformers' own Qwen4ExpTextNGramEmbedding over random token sequences
with many end-of-sequence tokens (no cache: the context before each sequence is eos) and records
the table row of every (position, n-gram head) it looks up. The embedding table itself is never
built: the module is made on the meta device and its lookup replaced by one that returns the row
indices (as float64, exact below 2^53).
"""

import argparse
import json

import torch
from torch import nn

from transformers import Qwen4ExpTextConfig
from transformers.models.qwen4_exp import modeling_qwen4_exp as q4

CASES = [
    dict(name="released", vocab_size=248320, ngram_size=3, heads_per_ngram=8,
         ngram_vocab_size_base=20_000_000, seed=1234, eos_token_id=248044, ple_indices=[0, 1],
         length=48, sequences=3),
    dict(name="four_grams", vocab_size=1000, ngram_size=4, heads_per_ngram=3,
         ngram_vocab_size_base=5000, seed=7, eos_token_id=3, ple_indices=[2], length=40,
         sequences=3),
]


class RowsOut(nn.Module):
    """Stands in for the n-gram nn.Embedding: returns the looked-up row indices."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)

    def forward(self, ids):
        return ids.unsqueeze(-1).to(torch.float64)


def rows_for(case, ple_index, tokens):
    heads = (case["ngram_size"] - 1) * case["heads_per_ngram"]
    cfg = Qwen4ExpTextConfig(
        vocab_size=case["vocab_size"], hidden_size=heads, ple_embed_dim=heads,
        num_hidden_layers=4, ple_layer_ids=[1], ngram_size=case["ngram_size"],
        heads_per_ngram=case["heads_per_ngram"], ngram_vocab_size_base=case["ngram_vocab_size_base"],
        seed=case["seed"], eos_token_id=case["eos_token_id"])
    with torch.device("meta"):
        m = q4.Qwen4ExpTextNGramEmbedding(cfg, heads, layer_idx=0, ple_layer_index=ple_index)
    m.layer_multipliers = q4._build_layer_multipliers(cfg.vocab_size, cfg.ngram_size, ple_index, cfg.seed)
    m.ngram_heads_vocab_sizes = torch.tensor(m.head_vocab_sizes, dtype=torch.long)
    m.ngram_heads_offsets = torch.tensor(m.head_offsets, dtype=torch.long)
    m.ngram_embedding = RowsOut()
    with torch.no_grad():
        out = m(tokens.unsqueeze(0), cache=None)[0]  # [T, heads]
    return m, out.to(torch.int64)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(20261206)
    cases = []
    for case in CASES:
        for ple_index in case["ple_indices"]:
            seqs = []
            for _ in range(case["sequences"]):
                tokens = torch.randint(0, case["vocab_size"], (case["length"],), generator=gen)
                eos = torch.rand(case["length"], generator=gen) < 0.15  # frequent ends of sequence
                tokens[eos] = case["eos_token_id"]
                m, rows = rows_for(case, ple_index, tokens)
                seqs.append({"tokens": tokens.tolist(), "rows": rows.tolist()})
            padded = -(-m.total_vocab_size // 128) * 128
            cases.append({"name": case["name"], "ple_index": ple_index,
                          "vocab_size": case["vocab_size"], "ngram_size": case["ngram_size"],
                          "heads_per_ngram": case["heads_per_ngram"],
                          "ngram_vocab_size_base": case["ngram_vocab_size_base"],
                          "seed": case["seed"], "eos_token_id": case["eos_token_id"],
                          "multipliers": m.layer_multipliers.tolist(),
                          "head_vocab_sizes": m.head_vocab_sizes, "table_rows": padded,
                          "sequences": seqs})
    import transformers
    with open(args.out, "w") as f:
        json.dump({"generated_with": {"transformers": transformers.__version__,
                                      "script": "scripts/conformance/qwen4exp_ngram_fixture.py"},
                   "cases": cases}, f)
        f.write("\n")


if __name__ == "__main__":
    main()
