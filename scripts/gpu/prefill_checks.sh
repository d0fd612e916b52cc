#!/usr/bin/env bash
# The prefill kernels of branch prefill-24 in one device call: the hyper-connection collapse's sums
# (MixSumsTiledKernel), totals (CollapseMixKernel a warp a token, CollapseFinishKernel four positions
# a thread) and expand (ExpandVecKernel); KDA's convolution (ConvRunKernel); the delta-rule
# recurrence (8 lanes a column); the MoE chain's MoeInputKernel (no zeros before the GEMM) and
# MoeMidKernel (no local copy of its tables). First, side by side: their tests against the CPU at
# T = 1, 7, 64, 1024 and tile edges (every line gives ‖out−ref‖/‖ref‖), compute-sanitizer memcheck
# and racecheck on them, and the GLM-5.3-Flash, Qwen3-Next and DeepSeek-V4 model tests that run
# them (engine_cuda_model_test); then the 6-layer synthetic GLM-5.3-Flash's time to first token at
# 1k and 8k (exl3-engine-bench; with a baseline build in the bundle, baseline and current
# alternately), then the 1k prompt's prefill by kernel under ncu (PHASE=prefill
# scripts/gpu/profile_step.sh).
# Needs the bundle (carry .gpu-check), with a baseline exl3-engine-bench (the branch's base commit's,
# built into BASELINE_BUILD/bin) where the A/B is wanted:
#   CUDA_ARCHITECTURES=90 ONLY="exl3-cuda-check exl3-engine-bench exl3-tool engine_cuda_glm5_residual_test \
#     engine_cuda_dsv4_test engine_cuda_kda_test engine_cuda_delta_rule_test engine_cuda_deltanet_test \
#     engine_cuda_model_test" BASELINE_BUILD=build-base scripts/gpu/bundle.sh build
# and these fixtures, the rest set aside to fit a call (scripts/dev/fixtures_aside.sh in restores them):
#   scripts/dev/fixtures_aside.sh out glm5_next_experts glm5_next_all deepseek_v4_experts deepseek_v4_all \
#     qwen3_next_experts qwen3_next_all qwen4_exp_experts
#   bash scripts/gpu/prefill_checks.sh        (LIMIT: seconds it may take, default 550)
# $OUT gets logs.tar.xz (every log, the benchmarks' JSON, ncu's rows) and prefill-profile.txt; the
# summary lines go to stdout.
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
LIMIT=${LIMIT:-550}
. scripts/gpu/time_budget.sh
. scripts/gpu/env.sh
LOGS=$(mktemp -d /tmp/prefill-checks.XXXXXX)
# A call brings back at most 8 files: every log in one archive, whatever happens below.
trap 'tar -C "$LOGS" -cJf "$OUT/logs.tar.xz" . 2>/dev/null' EXIT
MODEL=/tmp/glm5-next-synthetic-6
bash scripts/gpu/glm5_next_model.sh "$BIN" "$MODEL" 6 "$LOGS/glm5-model.log" "$LIMIT" &
MODEL_PID=$!
show() { grep -E "$2|FAILED|PASSED|Failure|ERROR SUMMARY|RACECHECK SUMMARY" "$LOGS/$1.log" | head -"${3:-20}"; }

# --- Tests, sanitizers and model tests at once (one GPU, many small processes; none is timed).
echo "=== tests, sanitizers, model tests side by side ($(el) s)"
PIDS=""
job() {  # name timeout command...: runs in the background into $LOGS/name.log, its exit in name.rc
  local name=$1 t; t=$(upto "$2"); shift 2
  ( timeout "$t" "$@" > "$LOGS/$name.log" 2>&1; echo $? > "$LOGS/$name.rc" ) &
  PIDS="$PIDS $!"
}
job hyper 150 "$BIN"/engine_cuda_glm5_residual_test
job dsv4 90 "$BIN"/engine_cuda_dsv4_test --gtest_filter='Dsv4KernelsTest.*'
job delta-rule 120 "$BIN"/engine_cuda_delta_rule_test
job kda 150 "$BIN"/engine_cuda_kda_test
job deltanet 150 "$BIN"/engine_cuda_deltanet_test
job moe 200 "$BIN"/exl3-cuda-check --moe-prefill
job model 250 "$BIN"/engine_cuda_model_test \
  --gtest_filter='Glm5NextFamily/*:RecurrentFamilies/*:Dsv4Family/*:HyperConnectedFamilies/*:Fixtures/CudaVerifyGraphTest.*'
# The sanitizers on the kernels' tests, leaving out the 1024-token cases (too slow there; the
# multi-pass tiled sums need T >= 256 at H 4096, so memcheck runs the wide cases, racecheck not).
for tool in memcheck racecheck; do
  san="compute-sanitizer --tool $tool --error-exitcode 3"
  hc_filter='Glm5KernelsTest.HyperConnectionsMatchTheCpu'
  [ $tool = memcheck ] && hc_filter='Glm5KernelsTest.HyperConnections*'
  job san-hc-$tool 200 $san "$BIN"/engine_cuda_glm5_residual_test --gtest_filter="$hc_filter"
  job san-kda-$tool 200 $san "$BIN"/engine_cuda_kda_test --gtest_filter='KdaKernelsTest.*'
  job san-dr-$tool 200 $san "$BIN"/engine_cuda_delta_rule_test \
    --gtest_filter='DeltaRuleKernelTest.*:-DeltaRuleKernelTest.MatchesTheFormulaOverAPrefillChunk'
  job san-moe-$tool 200 $san "$BIN"/exl3-cuda-check --moe-prefill --small
done
for p in $PIDS; do wait "$p"; done
rc() { cat "$LOGS/$1.rc" 2>/dev/null || echo "?"; }
echo "--- hyper-connections (glm5_residual_test): exit $(rc hyper)"; show hyper "^glm5 hyper|mix on a side" 60
echo "--- DeepSeek-V4 kernels: exit $(rc dsv4)"; show dsv4 "hyper" 8
echo "--- delta rule: exit $(rc delta-rule)"; show delta-rule "^delta rule" 60
echo "--- KDA: exit $(rc kda)"; show kda "^kda conv|^kda delta rule|step 2 prefill-again \(" 40
echo "--- gated DeltaNet: exit $(rc deltanet)"; show deltanet "rel" 12
echo "--- MoE chain (exl3-cuda-check --moe-prefill): exit $(rc moe)"
grep -E "FAIL|T=1024|worst|^  moe" "$LOGS/moe.log" | head -30
echo "--- model tests: exit $(rc model)"; show model "^model |verify graphs" 40
for tool in memcheck racecheck; do
  for t in hc kda dr moe; do echo "--- $tool $t: exit $(rc san-$t-$tool)"; show san-$t-$tool "x^" 3; done
done

# --- Time to first token at 1k and 8k (and batch-1 decode beside it): this build, then with a
# baseline build in the bundle, baseline and current alternately.
echo "=== GLM-5.3-Flash synthetic, 6 layers ($(el) s)"
wait "$MODEL_PID" || { tail -5 "$LOGS/glm5-model.log"; exit 1; }
bench() {  # which round
  local b="$BIN"/exl3-engine-bench
  [ "$1" = baseline ] && b="$BIN"/exl3-engine-bench-baseline
  timeout "$(upto 75)" "$b" --model "$MODEL" --context 1024,8192 --batch 1 --steps 8 \
    --json "$LOGS/bench-$1-$2.json" > "$LOGS/bench-$1-$2.log" 2>&1
  echo "--- $1, round $2: exit $?"; grep -E "^prefill|floor|^decode context" "$LOGS/bench-$1-$2.log" | head -8
}
bench current 1
if [ -x "$BIN"/exl3-engine-bench-baseline ]; then
  for round in 1 2; do
    [ "$(left)" -gt 200 ] || break
    bench baseline "$round"
    [ "$(left)" -gt 180 ] || break
    bench current $((round + 1))
  done
fi

# --- The 1k prompt's prefill by kernel (this morning: 50.8 ms to the first token, 60.5 ms of kernels).
if [ "$(left)" -gt 60 ]; then
  echo "=== 1k prefill by kernel ($(el) s)"
  mkdir -p "$LOGS/prefill"
  OUT="$LOGS/prefill" MODEL="$MODEL" BATCH=1 CONTEXT=1024 PHASE=prefill timeout "$(upto 240)" \
    bash scripts/gpu/profile_step.sh > "$LOGS/prefill/profile.log" 2>&1
  echo "prefill profile exit $?"
  cp "$LOGS/prefill/profile-B1.txt" "$OUT/prefill-profile.txt" 2>/dev/null && head -40 "$OUT/prefill-profile.txt"
fi
echo "total $(el) s"
