#!/usr/bin/env bash
# exllamav3 1.6.5's own EXL3 kernels beside exl3-bench's, in one device call: exllamav3's GEMV/GEMM
# and MoE-layer kernels at bench/results/h200.md's cases on exl3-bench's random weights
# (scripts/gpu/exllamav3_kernels.py; bounded to KERNELS_BUDGET_S, about 2.5 minutes with the
# install), then `exl3-bench gemv|moe|gemm` on the same GPU when its bundle is carried, and one
# merged table (scripts/gpu/side_by_side_kernels.py).
#   bash scripts/gpu/exllamav3_kernels.sh
# Carry .exl3v3-a (scripts/gpu/exllamav3_stage.sh: exllamav3 and its prebuilt extension, installed
# into /tmp/site unless a warm machine already has them; .exl3v3-b is not needed, only the
# extension is imported) and, for exl3-bench's side, .gpu-check (scripts/gpu/bundle.sh;
# ONLY=exl3-bench is enough). The tracked tree must leave room for both (64 MiB a call):
# `scripts/dev/fixtures_aside.sh out` before the call, `in` after it.
# Environment: KERNEL_GROUPS (gemv,moe,gemm), ONLY (a regular expression on case names, e.g. 'm=1 |T=1$'),
# REPS (30), KERNELS_BUDGET_S (140), BENCHES (exl3-bench subcommands; default "gemv moe gemm" where
# the bundle is carried, "" runs exllamav3's side alone), BENCH_TIMEOUT (300 s each, and none past
# CALL_BUDGET_S = 560 s of the call: their run times at this commit are not measured).
# $OUT: exllamav3-kernels.json (JSON lines), exllamav3-kernels.md, exllamav3-kernels.log,
# install.log; with exl3-bench also bench-<name>.json and .log and kernels-side-by-side.md;
# kernels.log (this script's output).
set -uo pipefail
cd "$(dirname "$0")/../.."
export OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/kernels.log") 2>&1
SITE=${EXL3V3_SITE:-/tmp/site}
KERNEL_GROUPS=${KERNEL_GROUPS:-gemv,moe,gemm} REPS=${REPS:-30} BUDGET=${KERNELS_BUDGET_S:-140}
if [ -z "${BENCHES+set}" ]; then
  BENCHES=""
  { [ -d .gpu-deps ] || [ -f .gpu-check/gpu-deps.tar.xz ]; } && BENCHES="gemv moe gemm"
fi
say() { echo "exllamav3_kernels: [$SECONDS s] $*"; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader || true
git log -1 --format='commit %H' 2>/dev/null || true
# On a machine an earlier call left warm, exllamav3 is already in place (install.sh logs to $OUT).
[ -f "$SITE/exllamav3_ext.so" ] || EXL3V3_SITE=$SITE bash scripts/gpu/exllamav3_install.sh > /dev/null 2>&1 ||
  { say "install failed"; tail -5 "$OUT/install.log"; exit 2; }

say "exllamav3 (groups $KERNEL_GROUPS${ONLY:+, only $ONLY})"
PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 timeout $((${BUDGET%.*} + 60)) \
  python3 scripts/gpu/exllamav3_kernels.py --groups "$KERNEL_GROUPS" ${ONLY:+--only "$ONLY"} --reps "$REPS" \
  --budget-s "$BUDGET" --json "$OUT/exllamav3-kernels.json" --md "$OUT/exllamav3-kernels.md" \
  > "$OUT/exllamav3-kernels.log" 2>&1
say "exllamav3 exit $? (4: a path failed its check, see the table)"
grep -E "^exllamav3_kernels: .*(match|warning|capture failed|Error|no path passed|over their)" "$OUT/exllamav3-kernels.log" | head -20
[ -f "$OUT/exllamav3-kernels.md" ] && cat "$OUT/exllamav3-kernels.md" || tail -20 "$OUT/exllamav3-kernels.log"

if [ -n "$BENCHES" ]; then
  source scripts/gpu/env.sh
  for b in $BENCHES; do
    # exl3-bench writes its JSON at the end: one cut short leaves no rows, so none starts late.
    left=$(( ${CALL_BUDGET_S:-560} - SECONDS ))
    [ "$left" -lt 60 ] && { say "exl3-bench $b not run: ${left} s left of CALL_BUDGET_S"; continue; }
    limit=${BENCH_TIMEOUT:-300}; [ "$left" -lt "$limit" ] && limit=$left
    say "exl3-bench $b (at most $limit s)"
    timeout "$limit" "$BIN"/exl3-bench "$b" --json "$OUT/bench-$b.json" > "$OUT/bench-$b.log" 2>&1
    say "exl3-bench $b exit $?"
  done
  jsons=$(ls "$OUT"/bench-*.json 2>/dev/null)
  if [ -n "$jsons" ] && [ -f "$OUT/exllamav3-kernels.json" ]; then
    python3 scripts/gpu/side_by_side_kernels.py --exl3-bench $jsons --exllamav3 "$OUT/exllamav3-kernels.json" \
      --md "$OUT/kernels-side-by-side.md"
  fi
fi
say "done"
