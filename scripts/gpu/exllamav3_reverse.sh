#!/usr/bin/env bash
# The reverse check on the GPU machine: exllamav3 1.6.5 loads the directories exl3-tool quantize
# wrote (tests/fixtures/engine/NAME) and its logits are compared with the fixtures' reference logits
# (scripts/conformance/exllamav3_reverse.py). Carry .exl3v3-a and .exl3v3-b
# (scripts/gpu/exllamav3_stage.sh); of tests/fixtures/engine only the directories named need to come.
#   bash scripts/gpu/exllamav3_reverse.sh [NAMES]   (comma-separated; default: every *_release_all
#   fixture whose reference.safetensors came along: the release models' settings and config.json
#   layout, where exllamav3 implements what the model does; the directories without it are named as
#   skipped; `python3 scripts/conformance/exllamav3_reverse.py --list` says why the other *_all
#   fixtures are left out)
# $OUT: reverse.json and reverse.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
. scripts/gpu/exllamav3_ready.sh
fixtures_to_check "${1:-}" '*_release_all' || exit 2
{
  [ -z "$SKIPPED" ] || echo "exllamav3_reverse: skipped (no reference.safetensors):$SKIPPED"
  echo "exllamav3_reverse: checking $NAMES"
  exllamav3_ready || exit 2
  TORCH_CUDA_ARCH_LIST=9.0 timeout ${REVERSE_TIMEOUT:-480} python3 scripts/conformance/exllamav3_reverse.py --fixtures tests/fixtures/engine \
    --names "$NAMES" --out "$OUT/reverse.json"
  echo "exllamav3_reverse exit $?"
} > "$OUT/reverse.log" 2>&1
grep -E "exllamav3_reverse" "$OUT/reverse.log"
