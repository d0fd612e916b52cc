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
SKIPPED=
if [ -n "${1:-}" ]; then
  NAMES=$1
else
  # A directory can come without its files (a call that carried only some of them).
  NAMES=
  for d in tests/fixtures/engine/*_release_all; do
    [ -d "$d" ] || continue
    if [ -f "$d/reference.safetensors" ]; then NAMES=${NAMES:+$NAMES,}${d##*/}; else SKIPPED="$SKIPPED ${d##*/}"; fi
  done
  [ -n "$NAMES" ] || { echo "exllamav3_reverse: no *_release_all fixture with reference.safetensors"; exit 2; }
fi
{
  [ -z "$SKIPPED" ] || echo "exllamav3_reverse: skipped (no reference.safetensors):$SKIPPED"
  echo "exllamav3_reverse: checking $NAMES"
  # On a machine an earlier call left warm, exllamav3 and its wheels are already in place.
  [ -d "${EXL3V3_SITE:-/tmp/site}/exllamav3" ] && [ -d "${EXL3V3_SITE:-/tmp/site}/pydantic" ] ||
    { bash scripts/gpu/exllamav3_install.sh > "$OUT/install.log" 2>&1 &&
      bash scripts/gpu/exllamav3_wheels.sh > "$OUT/wheels.log" 2>&1; } || { echo "install failed"; tail -5 "$OUT/install.log"; exit 2; }
  PYTHONPATH="${EXL3V3_SITE:-/tmp/site}${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 \
    timeout ${REVERSE_TIMEOUT:-480} python3 scripts/conformance/exllamav3_reverse.py --fixtures tests/fixtures/engine \
    --names "$NAMES" --out "$OUT/reverse.json"
  echo "exllamav3_reverse exit $?"
} > "$OUT/reverse.log" 2>&1
grep -E "exllamav3_reverse" "$OUT/reverse.log"
