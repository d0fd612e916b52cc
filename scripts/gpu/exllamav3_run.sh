#!/usr/bin/env bash
# Device call 2 of 2 (scripts/gpu/exllamav3_stage.sh prints both), on the machine call 1
# (exllamav3_install.sh) left warm: installs the wheels of .exl3v3-b/ beside exllamav3 in
# /tmp/site, builds the tiny Hugging Face models (transformers on the machine; the families it
# cannot build come prebuilt in .exl3v3-hf/, scripts/gpu/exllamav3_prebuild.sh), converts them with
# exllamav3's converter and records its greedy tokens and logits
# (scripts/conformance/exllamav3_fixtures.py). A fixture that fails is written down and the others
# go on; what was done comes back even when time runs out.
#
#   bash scripts/gpu/exllamav3_run.sh [FIXTURES]     (comma-separated names; default: the sweep)
#
# $OUT: exllamav3_results.tar.xz (results/: NAME.reference.json and NAME.log per fixture,
# status.json, import.log, models.log, run.log; hf-configs/: the models' config.json and
# prompts.json), exllamav3_models_N.tar.xz (results/NAME/: the directories exllamav3 wrote),
# status.json and run.log. Run again on the same warm machine (within 30 s), it goes on with the
# fixtures not yet ok: each family's model is built once, status.json keeps every fixture's outcome.
set -uo pipefail
START=$(date +%s)
BUDGET_S=${EXL3V3_BUDGET_S:-500}  # this script's own time limit; the call's is about 540-600 s
SITE=${EXL3V3_SITE:-/tmp/site}
OUT=${OUT:-/tmp/exl3v3-out}
W=${EXL3V3_WORK:-/tmp/exl3v3}
R="$W/results"
mkdir -p "$OUT" "$R"
exec > >(tee "$OUT/run.log") 2>&1
say() { echo "exllamav3_run: [$(( $(date +%s) - START )) s] $*"; }

pack() {
  # At most 8 files of 16 MiB come back: references, logs and configs in one tar.xz, the
  # converted model directories in as many more as it takes at 15 MiB each (trellis bits hardly
  # compress, so their size on disk is what they take).
  say "packing results"
  mkdir -p "$W/hf-configs"
  for d in "$W"/hf/*/; do
    [ -f "$d/config.json" ] && mkdir -p "$W/hf-configs/$(basename "$d")" && cp "$d/config.json" "$W/hf-configs/$(basename "$d")/"
  done
  [ -f "$W/hf/prompts.json" ] && cp "$W/hf/prompts.json" "$W/hf-configs/"
  cp "$OUT/run.log" "$R/run.log" 2>/dev/null
  (cd "$W" && find results -maxdepth 1 -type f | sort > "$W/small.list" && echo hf-configs >> "$W/small.list")
  tar -C "$W" -cf - -T "$W/small.list" | xz -6 -T0 > "$OUT/exllamav3_results.tar.xz"
  local part=1 size=0 limit=$((15 * 1024 * 1024))
  : > "$W/part1.list"
  for d in "$R"/*/; do
    [ -d "$d" ] || continue
    local s
    s=$(du -sb "$d" | cut -f1)
    if [ $size -gt 0 ] && [ $((size + s)) -gt $limit ]; then
      part=$((part + 1)); size=0; : > "$W/part$part.list"
    fi
    echo "results/$(basename "$d")" >> "$W/part$part.list"
    size=$((size + s))
  done
  for i in $(seq 1 $part); do
    [ -s "$W/part$i.list" ] && tar -C "$W" -cf - -T "$W/part$i.list" | xz -6 -T0 > "$OUT/exllamav3_models_$i.tar.xz"
  done
  [ -f "$R/status.json" ] && cp "$R/status.json" "$OUT/status.json"
  ls -la "$OUT"
}
trap pack EXIT

if [ ! -d "$SITE/exllamav3" ]; then
  say "$SITE has no exllamav3: run call 1 (scripts/gpu/exllamav3_install.sh) on this machine first"
  exit 2
fi
EXL3V3_SITE=$SITE bash scripts/gpu/exllamav3_wheels.sh || exit 2
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 TORCH_EXTENSIONS_DIR=$W/torch_ext
export PYTHONUNBUFFERED=1

say "importing exllamav3"
python3 -c "import exllamav3, exllamav3.conversion.convert_model; from exllamav3.version import __version__; print('exllamav3', __version__)" \
  > "$R/import.log" 2>&1
rc=$?
cat "$R/import.log"
[ $rc -eq 0 ] || { say "exllamav3 does not import (see above)"; exit 3; }

# The families this machine's transformers cannot build come prebuilt (exllamav3_prebuild.sh,
# carried as .exl3v3-hf/models.tar.xz); the others are built here. Families written by an earlier
# call on this machine are kept.
PREBUILT=""
if [ -f .exl3v3-hf/models.tar.xz ]; then
  rm -rf "$W/prebuilt"
  if tar -C "$W" -xJf .exl3v3-hf/models.tar.xz && [ -d "$W/prebuilt" ]; then
    PREBUILT="$W/prebuilt"
    say "prebuilt models: $(ls "$PREBUILT" | tr '\n' ' ')"
  else
    say "could not unpack .exl3v3-hf/models.tar.xz: building every family here"
  fi
fi
say "the Hugging Face models"
python3 scripts/conformance/exllamav3_fixtures.py models --out "$W/hf" ${1:+--fixtures "$1"} \
  ${PREBUILT:+--prebuilt "$PREBUILT"} >> "$R/models.log" 2>&1
rc=$?
tail -n 4 "$R/models.log"
[ $rc -eq 0 ] || say "building the models failed (exit $rc): the families that were written go on"

LEFT=$(( BUDGET_S - ($(date +%s) - START) - 30 ))
say "converting and recording (${LEFT} s left)"
python3 scripts/conformance/exllamav3_fixtures.py device --models "$W/hf" --work "$W/work" \
  --out "$R" --budget-s "$LEFT" ${1:+--fixtures "$1"}
say "done"
