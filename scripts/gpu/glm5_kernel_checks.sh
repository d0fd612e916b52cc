#!/usr/bin/env bash
# GLM-5.3-Flash's batch-1 kernels in one device call (issue 29): the decode-sized dense GEMV
# (split over a cluster, narrow rows) and the hyper-connections' collapse / expand against the CPU,
# racecheck and memcheck on both, the layers and whole models that use them, then the 6-layer
# synthetic model's decode (exl3-engine-bench) and, where time is left, its batch-1 step by kernel
# under ncu (scripts/gpu/profile_step.sh), then a 1k prompt's prefill by kernel. With a baseline
# build in the bundle (BASELINE_BUILD) its bench and this one's alternate; GLM5_DEEPER=10 adds that
# depth and the 45-layer extrapolation.
# Needs the bundle (carry .gpu-check):
#   CUDA_ARCHITECTURES=90 ONLY="engine_cuda_dense_gemv_test engine_cuda_glm5_residual_test engine_cuda_dsv4_test \
#     engine_cuda_kda_test engine_cuda_kpool_test engine_cuda_model_test exl3-engine-bench exl3-tool" scripts/gpu/bundle.sh build
# and these fixtures, the rest set aside to fit a call:
#   scripts/dev/fixtures_aside.sh out glm4_moe_all glm4_moe_experts deepseek_v4_all deepseek_v4_experts \
#     glm5_next_all glm5_next_experts qwen4_exp_experts qwen4_exp_all deepseek_v3_all qwen3_next_all
#   bash scripts/gpu/glm5_kernel_checks.sh        (LIMIT: seconds it may take, default 400)
# Logs and the benchmark's JSON in $OUT.
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
LIMIT=${LIMIT:-400}
. scripts/gpu/time_budget.sh
. scripts/gpu/env.sh
# The models are written while the tests run (over 90 s at 10 layers).
MODEL=/tmp/glm5-next-synthetic-6
bash scripts/gpu/glm5_next_model.sh "$BIN" "$MODEL" 6 "$OUT/glm5-model.log" "$LIMIT" &
MODEL_PID=$!
if [ -n "${GLM5_DEEPER:-}" ]; then
  DEEP=/tmp/glm5-next-synthetic-$GLM5_DEEPER
  bash scripts/gpu/glm5_next_model.sh "$BIN" "$DEEP" "$GLM5_DEEPER" "$OUT/glm5-model-deep.log" "$LIMIT" &
  DEEP_PID=$!
fi
show() { grep -E "$2|FAILED|PASSED|Failure|ERROR SUMMARY|RACECHECK SUMMARY" "$1" | head -"${3:-20}"; }
echo "=== dense GEMV ($(el) s)"
timeout "$(upto 60)" "$BIN"/engine_cuda_dense_gemv_test > "$OUT/dense-gemv.log" 2>&1
echo "exit $?"; show "$OUT/dense-gemv.log" "^dense gemv" 30
echo "=== hyper-connection kernels ($(el) s)"
timeout "$(upto 60)" "$BIN"/engine_cuda_glm5_residual_test > "$OUT/glm5-residual.log" 2>&1
echo "exit $?"; show "$OUT/glm5-residual.log" "^glm5 hyper" 20
timeout "$(upto 60)" "$BIN"/engine_cuda_dsv4_test --gtest_filter='Dsv4KernelsTest.*' > "$OUT/dsv4.log" 2>&1
echo "dsv4 kernels exit $?"; show "$OUT/dsv4.log" "hyper" 8
echo "=== compute-sanitizer ($(el) s)"
for tool in racecheck memcheck; do
  timeout "$(upto 60)" compute-sanitizer --tool $tool --error-exitcode 3 "$BIN"/engine_cuda_dense_gemv_test \
    > "$OUT/sanitize-gemv-$tool.log" 2>&1
  echo "gemv $tool exit $?"; show "$OUT/sanitize-gemv-$tool.log" "x" 3
  timeout "$(upto 60)" compute-sanitizer --tool $tool --error-exitcode 3 "$BIN"/engine_cuda_glm5_residual_test \
    --gtest_filter='Glm5KernelsTest.HyperConnections*' > "$OUT/sanitize-hc-$tool.log" 2>&1
  echo "hyper-connections $tool exit $?"; show "$OUT/sanitize-hc-$tool.log" "x" 3
done
echo "=== KDA and k-pooled layers ($(el) s)"
timeout "$(upto 60)" "$BIN"/engine_cuda_kda_test > "$OUT/kda.log" 2>&1; echo "kda exit $?"; show "$OUT/kda.log" "x" 4
timeout "$(upto 60)" "$BIN"/engine_cuda_kpool_test > "$OUT/kpool.log" 2>&1; echo "kpool exit $?"; show "$OUT/kpool.log" "x" 4
echo "=== whole models ($(el) s)"
timeout "$(upto 150)" "$BIN"/engine_cuda_model_test \
  --gtest_filter='Dsv4Family/*:Glm5NextFamily/*:HyperConnectedFamilies/*:Fixtures/CudaVerifyGraphTest.*:CudaKernelsTest.*' \
  > "$OUT/model.log" 2>&1
echo "exit $?"; show "$OUT/model.log" "tokens|rel" 40
# No benchmark runs beside the deeper model's generation.
DEEP_OK=0
[ -n "${DEEP_PID:-}" ] && wait "$DEEP_PID" && DEEP_OK=1
echo "=== GLM-5.3-Flash synthetic, 6 layers ($(el) s)"
wait "$MODEL_PID" || { tail -5 "$OUT/glm5-model.log"; exit 1; }
timeout "$(upto 90)" "$BIN"/exl3-engine-bench --model "$MODEL" --context 1024,8192 --batch 1,8,32,64 --steps 12 \
  --json "$OUT/glm5-bench.json" > "$OUT/glm5-bench.log" 2>&1
echo "bench exit $?"; grep -E "decode context|prefill|floor" "$OUT/glm5-bench.log" | head -20
# GLM5_DEEPER (e.g. 10): that depth too, then the 45 layers extrapolated per layer.
if [ "$DEEP_OK" = 1 ] && [ "$(left)" -gt 60 ]; then
  # The 10-layer model loads and prefills 8k prompts for longer than the 6-layer one (90 s were too few).
  timeout "$(upto 240)" "$BIN"/exl3-engine-bench --model "$DEEP" --context 1024,8192 --batch 1,8,32,64 --steps 12 \
      --json "$OUT/glm5-bench-deep.json" > "$OUT/glm5-bench-deep.log" 2>&1
  echo "deeper bench exit $?"; grep -E "decode context" "$OUT/glm5-bench-deep.log" | head -8
  python3 scripts/gpu/depth_extrapolation.py --layers 45 "6:$OUT/glm5-bench.json" \
    "$GLM5_DEEPER:$OUT/glm5-bench-deep.json" > "$OUT/glm5-extrapolated.md" && cat "$OUT/glm5-extrapolated.md"
fi
if [ "$(left)" -gt 60 ]; then
  echo "=== batch-1 step by kernel ($(el) s)"
  OUT="$OUT" MODEL="$MODEL" BATCH=1 timeout "$(upto 120)" bash scripts/gpu/profile_step.sh > "$OUT/profile.log" 2>&1
  echo "profile exit $?"; head -40 "$OUT/profile-B1.txt" 2>/dev/null
fi
# The 1024-token prompt's prefill by kernel (first token: 8.5 ms a layer, far above its floor).
if [ "$(left)" -gt 60 ]; then
  echo "=== 1k prefill by kernel ($(el) s)"
  mkdir -p "$OUT/prefill"
  OUT="$OUT/prefill" MODEL="$MODEL" BATCH=1 PHASE=prefill timeout "$(upto 150)" bash scripts/gpu/profile_step.sh \
    > "$OUT/prefill/profile.log" 2>&1
  echo "prefill profile exit $?"; head -40 "$OUT/prefill/profile-B1.txt" 2>/dev/null
fi
# The same decode with the collapses' post / comb on the model's stream (no side stream): what
# HyperMixStream gains (engine/cuda/hyper_residual.h).
if [ "$(left)" -gt 60 ]; then
  EXL3_HC_MIX_STREAM=0 timeout "$(upto 60)" "$BIN"/exl3-engine-bench --model "$MODEL" --context 1024 --batch 1,8 \
    --steps 12 --json "$OUT/glm5-bench-one-stream.json" > "$OUT/glm5-bench-one-stream.log" 2>&1
  echo "bench, mix on the model's stream: exit $?"; grep -E "decode context" "$OUT/glm5-bench-one-stream.log" | head -4
fi
# Before and after, in the same call: a baseline build's bench (bundle.sh BASELINE_BUILD) and this
# one's, alternately, twice each (GLM5_COMPARE=0: not, when the baseline is there for another script).
if [ -x "$BIN"/exl3-engine-bench-baseline ] && [ "${GLM5_COMPARE:-1}" = 1 ]; then
  for round in 1 2; do
    for which in baseline current; do
      [ "$(left)" -gt 40 ] || break
      bench="$BIN"/exl3-engine-bench; [ $which = baseline ] && bench="$BIN"/exl3-engine-bench-baseline
      timeout "$(upto 40)" "$bench" --model "$MODEL" --context 1024 --batch 1,8,32,64 --steps 12 \
        > "$OUT/glm5-bench-$which-$round.log" 2>&1
      echo "--- $which, round $round: exit $?"; grep -E "^decode context" "$OUT/glm5-bench-$which-$round.log"
    done
  done
fi
echo "total $(el) s"
