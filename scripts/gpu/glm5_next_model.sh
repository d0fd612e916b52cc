#!/usr/bin/env bash
# Writes the synthetic GLM-5.3-Flash EXL3 model the GPU benchmarks run, at the published shapes
# (`exl3-tool make-test-model --help` lists them: hidden 4096, 3 dense layers of 12288, 288
# experts of 2048, top 8, one shared; NoPE MLA with the k-pooled indexer on every fourth layer,
# KDA on the others; hyper-connections; experts K=2 MCG, attention K=4, head K=6), LAYERS deep,
# in the release config layout (what exllamav3 reads; the engine reads either alike:
# tests/engine/cpu/synthetic_model_test.cc), unless DIR holds one. Without a GPU,
# scripts/conformance/exllamav3_config_check.py DIR runs exllamav3's own config reader on it.
#   scripts/gpu/glm5_next_model.sh BIN DIR LAYERS LOG [TIMEOUT_S]
set -uo pipefail
BIN=$1 DIR=$2 LAYERS=$3 LOG=$4
[ -f "$DIR/config.json" ] && exit 0
timeout "${5:-600}" "$BIN"/exl3-tool make-test-model --arch glm5_next --synthetic --whole-model --release-layout \
  --output "$DIR" --hidden 4096 --layers "$LAYERS" --dense-layers 3 --dense-intermediate 12288 \
  --experts 288 --intermediate 2048 --top-k 8 --shared 1 --vocab 154880 --heads 64 --q-lora-rank 1536 \
  --kv-lora-rank 512 --qk-nope-head-dim 256 --v-head-dim 256 --index-heads 32 --index-head-dim 128 \
  --index-kpool 16 --index-topk 2048 --linear-heads 64 --linear-head-dim 128 --max-position 16384 \
  --bits 2 --codebook mcg --attention-bits 4 --head-bits 6 --quiet > "$LOG" 2>&1 ||
  { echo "model generation failed"; tail -5 "$LOG"; exit 1; }
