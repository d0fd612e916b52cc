"""A byte-level BPE tokenizer.json of a chosen size, trained on local text: the stand-in for a real
150k-token tokenizer (Qwen's, GLM's) where none can be downloaded, for exl3-constraint-bench
(bench/results/structured-output.md). Qwen2's pre-tokenizer split, GPT-2's byte alphabet.

    python bench/train_bpe_tokenizer.py --vocab-size 151643 --out /tmp/bpe151k/tokenizer.json \\
        /opt/venv/lib/python3.11/site-packages docs
"""
from __future__ import annotations

import argparse
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SUFFIXES = {".py", ".md", ".txt", ".rst", ".cc", ".h"}


def texts(roots: list[Path]):
    for root in roots:
        for f in sorted(root.rglob("*")) if root.is_dir() else [root]:
            if f.is_file() and f.suffix in SUFFIXES and f.stat().st_size < 2 << 20:
                yield f.read_text(encoding="utf-8", errors="ignore")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab-size", type=int, default=151643)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("roots", nargs="+", type=Path, help="folders (or files) of text to train on")
    args = ap.parse_args()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=args.vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts(args.roots), trainer=trainer)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out))
    print(f"{args.out}: {tok.get_vocab_size()} tokens")


if __name__ == "__main__":
    main()
