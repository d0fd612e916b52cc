#!/usr/bin/env bash
# On the GPU machine: where a family's GPU forward pass first makes a NaN or an infinity.
#   1. engine_cuda_finite_check_test (CudaModelOptions::check_finite names a planted NaN's layer);
#   2. the family's whole-model fixture test REPEATS times (its first variant checks every block of
#      every layer: a failure names the first layer and block with a non-finite value), then again
#      with CUDA_LAUNCH_BLOCKING=1 (a difference points at ordering between launches or streams);
#   3. compute-sanitizer racecheck and synccheck on one run of it (SANITIZE_TIMEOUT seconds each).
# Logs go to $OUT (or ./gpu-out), five files. Binaries from the bundle (scripts/gpu/env.sh).
# Usage: scripts/gpu/finite_check.sh [GTEST_FILTER [SANITIZE_FILTER]]   (default: Qwen4-Exp's
# whole-model tests; the sanitizers on its all-EXL3 fixture)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
FILTER=${1:-'Qwen4ExpFamily/CudaModelFixtureTest.*'}
SANITIZE_FILTER=${2:-'Qwen4ExpFamily/CudaModelFixtureTest.*/1'}
REPEATS=${REPEATS:-4}
. scripts/gpu/env.sh

summarise() {  # LOG: the exit code and the lines that say what failed where
  grep -E "non-finite|Failure|FAILED|PASSED|GPU token|rows within|worst" "$1" | sort | uniq -c | sort -rn | head -40
}
echo "=== finite check test"
timeout 120 "$BIN"/engine_cuda_finite_check_test > "$OUT/finite-check-test.log" 2>&1; echo "exit $?"
summarise "$OUT/finite-check-test.log"
echo "=== $FILTER x $REPEATS"
timeout ${REPEAT_TIMEOUT:-100} "$BIN"/engine_cuda_model_test --gtest_filter="$FILTER" --gtest_repeat="$REPEATS" > "$OUT/repeats.log" 2>&1
echo "exit $?"
summarise "$OUT/repeats.log"
echo "=== $FILTER, CUDA_LAUNCH_BLOCKING=1"
CUDA_LAUNCH_BLOCKING=1 timeout ${BLOCKING_TIMEOUT:-50} "$BIN"/engine_cuda_model_test --gtest_filter="$FILTER" \
  > "$OUT/blocking.log" 2>&1
echo "exit $?"
summarise "$OUT/blocking.log"
for tool in racecheck synccheck; do
  echo "=== compute-sanitizer --tool $tool"
  timeout ${SANITIZE_TIMEOUT:-50} compute-sanitizer --tool $tool --print-limit 20 "$BIN"/engine_cuda_model_test \
    --gtest_filter="$SANITIZE_FILTER" > "$OUT/$tool.log" 2>&1
  echo "exit $?"
  grep -E "ERROR SUMMARY|hazard|Race|Barrier|Invalid|at 0x|by thread" "$OUT/$tool.log" | head -20
done
