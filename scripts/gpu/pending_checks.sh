#!/usr/bin/env bash
# Branch pending-27 on the device, in two calls on one warm machine (issue the second at once: an
# idle machine goes back after 30 s, and with it the models under /tmp).
#   check: correctness. Two micro-batches with remote experts for the latent, indexed (GLM-5.3-Flash)
#     and QSA (Qwen3.8-Flash-Next) attention kinds, the gated connections' fewer launches, the
#     device gate's register top-k, the MoE combine's block per (token, 128 values), the recurrent,
#     QSA and PLE kernels under PDL, the EXL3 layers of one input in one DenseGemvKernel launch
#     (tests/engine/cuda/cuda_model_test.cc, qwen4exp_residual_test.cc, the latent / kpool / QSA /
#     KDA / DeltaNet kernel tests, the release MTP fixtures, `exl3-cuda-check --no-big` beside them,
#     then `--moe-prefill`); then GLM-5.3-Flash and Qwen3.8-Flash-Next (6 layers) against main's
#     build, alternately (decode batch 1 and 8, first token, 1k).
#   perf: GLM-5.3-Flash (6 layers) batch-1 decode step and 1k prefill by kernel (one ncu run), the
#     goodput draft length beside fixed and adaptive (k = 3, acceptance 0.7, batch 1-64), and the
#     experts on one worker under MPS at one and two micro-batches (batch 1, 8, 32).
# Bundle and fixtures (about 60 MB in all, under a call's 64 MiB):
#   BASELINE_BUILD=<main's build> ONLY="engine_cuda_model_test engine_cuda_qwen4exp_residual_test
#     engine_cuda_latent_attention_test engine_cuda_kpool_test engine_cuda_qsa_test engine_cuda_mtp_test
#     engine_cuda_kda_test engine_cuda_deltanet_test exl3-engine-bench exl3-tool exl3-worker exl3-cuda-check
#     exl3-bench" scripts/gpu/bundle.sh build
#   scripts/dev/fixtures_aside.sh out glm4_moe_all deepseek_v3_all deepseek_v3_experts glm_moe_dsa_all \
#     glm_moe_dsa_experts glm5_next_all glm5_next_experts qwen4_exp_all qwen4_exp_experts qwen3_next_all \
#     qwen3_next_experts deepseek_v4_all deepseek_v4_experts glm5_next_release_mtp glm5_next_release_all \
#     glm_moe_dsa_release_mtp glm_moe_dsa_release_all
#   bash scripts/gpu/pending_checks.sh check|perf      (carry .gpu-check; under 580 s each)
# $OUT: check: the tests' logs.tar.xz, cuda-check logs, ab-*.log; perf: profile.tar.xz, spec-*.log,
# remote-*/ (engine_remote.sh's tables and logs).
set -uo pipefail
cd "$(dirname "$0")/../.."
MODE=${1:?usage: pending_checks.sh check|perf}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
LIMIT=580
. scripts/gpu/time_budget.sh
. scripts/gpu/env.sh > /dev/null
MODELS_LOG=$(mktemp /tmp/pending-models.XXXXXX)
( bash scripts/gpu/glm5_next_model.sh "$BIN" /tmp/glm5-next-synthetic-6 6 "$MODELS_LOG" 300
  bash scripts/gpu/qwen4_exp_model.sh "$BIN" /tmp/qwen4-exp-synthetic-6 6 "$MODELS_LOG" 200 ) &
MODELS=$!

if [ "$MODE" = check ]; then
  timeout 200 "$BIN/exl3-cuda-check" --no-big > "$OUT/cuda-check.log" 2>&1 &
  CHECK=$!
  OUT=$OUT KEEP_DEPS=1 bash scripts/gpu/test_checks.sh --limit 220 \
    model=engine_cuda_model_test:'Families/CudaTwoMicroBatchesTest.*:CudaModelTest.*MicroBatch*:LatentFamilies/*:Glm5NextFamily/*:Qwen4ExpFamily/*:Dsv4Family/*:CudaKernelsTest.*:Fixtures/CudaVerifyGraphTest.*' \
    qwen4=engine_cuda_qwen4exp_residual_test latent=engine_cuda_latent_attention_test kpool=engine_cuda_kpool_test \
    qsa=engine_cuda_qsa_test kda=engine_cuda_kda_test deltanet=engine_cuda_deltanet_test \
    mtp=engine_cuda_mtp_test:'*release_mtp*'
  echo "tests exit $? ($(el) s)"
  wait $CHECK
  echo "exl3-cuda-check --no-big exit $? ($(el) s)"; tail -4 "$OUT/cuda-check.log"
  timeout "$(upto 100)" "$BIN/exl3-cuda-check" --moe-prefill > "$OUT/moe-check.log" 2>&1
  echo "exl3-cuda-check --moe-prefill exit $? ($(el) s)"; tail -3 "$OUT/moe-check.log"
  wait $MODELS
  # Before and after in one call: this build's bench and main's (bundle.sh BASELINE_BUILD), alternately.
  for m in glm5-next qwen4-exp; do
    for b in exl3-engine-bench exl3-engine-bench-baseline exl3-engine-bench exl3-engine-bench-baseline; do
      [ "$(left)" -gt 30 ] || break
      echo "--- $m $b ($(el) s)"
      timeout "$(upto 60)" "$BIN/$b" --model /tmp/$m-synthetic-6 --context 1024 --batch 1,8 --steps 16 \
        > "$OUT/ab-$m-$b.log" 2>&1
      grep -E "^decode context|first token" "$OUT/ab-$m-$b.log" | head -4
    done
  done
fi

if [ "$MODE" = perf ]; then
  wait $MODELS
  mkdir -p /tmp/profile
  OUT=/tmp/profile MODEL=/tmp/glm5-next-synthetic-6 BATCH=1 PHASE="decode prefill" \
    timeout "$(upto 150)" bash scripts/gpu/profile_step.sh > /tmp/profile/profile.log 2>&1
  echo "profile exit $? ($(el) s)"
  head -30 /tmp/profile/profile-B1-decode.txt; head -25 /tmp/profile/profile-B1-prefill.txt
  tar -C /tmp -cJf "$OUT/profile.tar.xz" --exclude='*.csv' profile
  for policy in fixed adaptive goodput; do
    [ "$(left)" -gt 60 ] || break
    timeout "$(upto 80)" "$BIN/exl3-engine-bench" --model /tmp/glm5-next-synthetic-6 --context 1024 \
      --batch 1,8,32,64 --steps 48 --speculative-acceptance 0.7 --num-speculative-tokens 3 \
      --speculative-draft-length $policy > "$OUT/spec-$policy.log" 2>&1
    echo "spec bench ($policy) exit $? ($(el) s)"; grep -iE "batch|tokens/s" "$OUT/spec-$policy.log" | tail -6
  done
  for m in glm5-next qwen4-exp; do
    [ "$(left)" -gt 90 ] || break
    OUT=$OUT/remote-$m BENCH_TIMEOUT=100 timeout "$(upto 200)" bash scripts/gpu/engine_remote.sh \
      --model /tmp/$m-synthetic-6 --batches 1,8,32 --contexts 1024 --steps 16 --micro-batches 1,2 --mps \
      --no-in-process > "$OUT/remote-$m.log" 2>&1
    echo "remote $m exit $? ($(el) s)"
    grep -E "^decode|^=== |exit" "$OUT/remote-$m.log" | head -20
  done
fi
echo "total $(el) s"
