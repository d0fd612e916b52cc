#!/usr/bin/env bash
# On the GPU machine: runs everything in one go and writes logs to $OUT (or ./gpu-out):
# device facts, the correctness sweep (exl3-cuda-check), compute-sanitizer memcheck + racecheck on
# a small sweep, SASS instruction counts of the decode loop, and the benchmarks with --json.
# Binaries come from .gpu-deps/ or its packed copy .gpu-check/gpu-deps.tar.xz (scripts/gpu/bundle.sh;
# carry one of the two); with --build they are built here instead.
# Usage: scripts/gpu/run_all.sh [--build] [--quick] [--only check|bench|sanitize|sass|ncu]...
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
BUILD=0; QUICK=0; ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD=1 ;;
    --quick) QUICK=1 ;;
    --only) ONLY="$ONLY $2"; shift ;;
    -h|--help) sed -n '2,7p' "$0"; exit 0 ;;
    *) echo "run_all.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
want() { [ -z "$ONLY" ] || [[ " $ONLY " == *" $1 "* ]]; }

. scripts/gpu/env.sh
if [ "$BUILD" = 1 ]; then
  # The GPU machine reaches no network: without xgrammar's fetch (structured output), which the
  # benchmarks and the check do not use.
  cmake -S . -B build-gpu -G Ninja -DEXL3_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DEXL3_WITH_STRUCTURED_OUTPUT=OFF > "$OUT/build.log" 2>&1 &&
    cmake --build build-gpu -j16 --target exl3-bench exl3-cuda-check >> "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
  BIN=build-gpu/bin
fi

{ date -u; git rev-parse HEAD 2>/dev/null; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv; } > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"
"$BIN"/exl3-bench --help > /dev/null || { echo "binaries do not run here: ldd follows"; ldd "$BIN"/exl3-bench; exit 1; }

if want sass && command -v cuobjdump > /dev/null; then
  python3 scripts/gpu/sass_count.py "$BIN"/exl3-bench > "$OUT/sass.txt" 2>&1
  cat "$OUT/sass.txt"
fi
if want check; then
  echo "=== exl3-cuda-check"
  ARGS=""; [ "$QUICK" = 1 ] && ARGS="--no-big"
  timeout ${CHECK_TIMEOUT:-480} "$BIN"/exl3-cuda-check $ARGS > "$OUT/check.log" 2>&1; echo "check exit $?" | tee -a "$OUT/check.log"
  grep -E "FAIL|error" "$OUT/check.log" | head -20
  sed -n '/worst/,$p' "$OUT/check.log"
fi
if want sanitize && command -v compute-sanitizer > /dev/null; then
  echo "=== compute-sanitizer"
  for tool in memcheck racecheck; do
    timeout 100 compute-sanitizer --tool $tool --error-exitcode 3 "$BIN"/exl3-cuda-check --small > "$OUT/sanitizer-$tool.log" 2>&1
    rc=$?
    echo "$tool exit $rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer-$tool.log" | tail -1)"
    [ "$rc" = 0 ] || grep -E "error|Error|ERROR|FAIL" "$OUT/sanitizer-$tool.log" | grep -v "SUMMARY" | head -8
  done
fi
if [[ " $ONLY " == *" ncu "* ]] && command -v ncu > /dev/null; then
  # Hardware counters for one GEMV launch (m=1 4096x14336 K=2 mcg) and one decode-ceiling launch.
  NCU="ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis"
  EXL3_BENCH_FIRST_ONLY=1 timeout 150 $NCU -k regex:GroupedGemv --launch-skip 40 --launch-count 1 "$BIN"/exl3-bench gemv > "$OUT/ncu-gemv.txt" 2>&1
  timeout 100 $NCU -k regex:DecodeCeiling --launch-skip 3 --launch-count 1 "$BIN"/exl3-bench ceiling > "$OUT/ncu-ceiling.txt" 2>&1
  grep -E "Duration|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|No Eligible|Stall|Compute \(SM\) Throughput|Memory Throughput|Executed Ipc|One or More Eligible" "$OUT/ncu-gemv.txt" "$OUT/ncu-ceiling.txt" | head -60
fi
if want bench; then
  echo "=== exl3-bench"
  for b in ${BENCHES:-ceiling gemv moe gemm}; do
    [ "$QUICK" = 1 ] && [ "$b" = gemm ] && continue
    extra=""; [ "$b" = moe ] && extra="--stack ${STACK:-0}"  # STACK=42: the GLM-5.3-Flash layer stack
    timeout 300 "$BIN"/exl3-bench $b --json "$OUT/bench-$b.json" $extra > "$OUT/bench-$b.log" 2>&1; echo "$b exit $?"
    cat "$OUT/bench-$b.log"
  done
fi
