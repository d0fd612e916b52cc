#!/usr/bin/env bash
# Writes the synthetic GLM-4.5-Air-shaped EXL3 model the GPU benchmarks run (hidden 4096, 128
# experts of 1408, top 8, one shared; the first layer dense at 11008: 10944 rounded up to EXL3's
# multiple of 128; 96/8 heads of 128; experts K=2 MCG, attention K=4, head K=6) unless DIR holds one.
#   scripts/gpu/glm45_air_model.sh BIN DIR LAYERS LOG
set -uo pipefail
BIN=$1 DIR=$2 LAYERS=$3 LOG=$4
[ -f "$DIR/config.json" ] && exit 0
timeout 200 "$BIN"/exl3-tool make-test-model --arch glm4_moe --synthetic --whole-model --output "$DIR" \
  --hidden 4096 --experts 128 --top-k 8 --intermediate 1408 --shared 1 --layers "$LAYERS" \
  --dense-layers 1 --dense-intermediate 11008 --vocab 151552 --heads 96 --kv-heads 8 --head-dim 128 \
  --bits 2 --attention-bits 4 --head-bits 6 --codebook mcg --max-position 16384 --quiet > "$LOG" 2>&1 ||
  { echo "model generation failed"; tail -5 "$LOG"; exit 1; }
