#!/usr/bin/env bash
# Writes the synthetic Qwen3.8-Flash-Next EXL3 model the GPU benchmarks run, at the published shapes
# (transformers 5.25's Qwen4ExpTextConfig defaults; `exl3-tool make-test-model --help` lists them:
# hidden 2048, 512 experts of 512, top 10, one gated shared expert of 512, vocab 248320; gated
# DeltaNet (16 key heads / 32 value heads of 128) and QSA on every fourth layer (16 heads / 2 KV
# heads of 256); low-rank gated hyper-connections (4 streams, rank 320); ngram_size 3,
# heads_per_ngram 8) and, where transformers has no default, chosen here: the QSA indexer of 16
# heads of 128 choosing 4-position blocks (budget 2048), a PLE layer ahead of layer 0 with n-gram
# rows of 160 (ple_embed_dim 2560, what exllamav3 takes) and a table of 4M rows
# (ngram_vocab_size_base 250000, 1.2 GiB; the real one ~100 GB); experts K=2 MCG, attention K=4,
# head K=6, LAYERS deep, in the release config layout (full_attention: what exllamav3 reads;
# the engine reads either alike: tests/engine/cpu/synthetic_model_test.cc), unless DIR holds one.
# Without a GPU, scripts/conformance/exllamav3_config_check.py DIR runs exllamav3's own config
# reader on it. 2 layers write 3.6 GB in about 50 s on 2 cores; each more layer ~0.45 GB.
#   scripts/gpu/qwen4_exp_model.sh BIN DIR LAYERS LOG [TIMEOUT_S]
set -uo pipefail
BIN=$1 DIR=$2 LAYERS=$3 LOG=$4
[ -f "$DIR/config.json" ] && exit 0
timeout "${5:-600}" "$BIN"/exl3-tool make-test-model --arch qwen4_exp --synthetic --whole-model --release-layout \
  --output "$DIR" --hidden 2048 --layers "$LAYERS" --experts 512 --intermediate 512 --top-k 10 --shared 1 \
  --vocab 248320 --heads 16 --kv-heads 2 --head-dim 256 --linear-key-heads 16 --linear-value-heads 32 \
  --linear-key-head-dim 128 --linear-value-head-dim 128 --hc-mult 4 --hc-lowrank 320 --ple-layer-ids 1 \
  --ple-embed-dim 2560 --ngram-size 3 --heads-per-ngram 8 --ngram-vocab-size-base 250000 --index-heads 16 \
  --index-head-dim 128 --index-topk 2048 --index-kpool 4 --max-position 32768 \
  --bits 2 --codebook mcg --attention-bits 4 --head-bits 6 --quiet > "$LOG" 2>&1 ||
  { echo "model generation failed"; tail -5 "$LOG"; exit 1; }
