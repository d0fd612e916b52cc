#!/usr/bin/env bash
# The MTP judge on the GPU machine (issue 31): exllamav3 1.6.5 drafts with the MTP head of each
# tests/fixtures/engine/*_mtp fixture and its drafts are compared with the fixture's reference drafts
# (scripts/conformance/exllamav3_mtp_drafts.py; DeepSeek-V4's deepseek_v4_release_mtp: its DSPARK block
# drafter's drafts, lengths and logits at every position, docs/dspark.md). Carry .exl3v3-a and .exl3v3-b
# (scripts/gpu/exllamav3_stage.sh); of tests/fixtures/engine only the directories named need to come.
#   bash scripts/gpu/exllamav3_mtp.sh [NAMES]   (comma-separated; default: every *_mtp fixture whose
#   reference.safetensors came along; the families exllamav3 has no MTP head for are refused by name:
#   `python3 scripts/conformance/exllamav3_mtp_drafts.py --list`)
# $OUT: mtp_drafts.json and mtp_drafts.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
. scripts/gpu/exllamav3_ready.sh
fixtures_to_check "${1:-}" '*_mtp' || exit 2
{
  [ -z "$SKIPPED" ] || echo "exllamav3_mtp: skipped (no reference.safetensors):$SKIPPED"
  echo "exllamav3_mtp: checking $NAMES"
  exllamav3_ready || exit 2
  TORCH_CUDA_ARCH_LIST=9.0 timeout ${MTP_TIMEOUT:-480} python3 scripts/conformance/exllamav3_mtp_drafts.py --fixtures tests/fixtures/engine \
    --names "$NAMES" --out "$OUT/mtp_drafts.json"
  echo "exllamav3_mtp exit $?"
  # What exllamav3's loader makes of each fixture's MTP tensors, from the headers (no GPU needed).
  for n in ${NAMES//,/ }; do
    python3 scripts/conformance/exllamav3_config_check.py "tests/fixtures/engine/$n" --component text,mtp
  done
} > "$OUT/mtp_drafts.log" 2>&1
grep -E "exllamav3_mtp|exllamav3_config_check: .*(accepted|refused|problems|component)" "$OUT/mtp_drafts.log"
