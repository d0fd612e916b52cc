#!/usr/bin/env bash
# Branch pending-26 in one device call: two micro-batches with remote experts for the latent, indexed
# (GLM-5.3-Flash) and QSA (Qwen3.8-Flash-Next) attention kinds, the gated connections' fewer launches,
# the device gate's register top-k and the MoE combine's block per (token, 128 values)
# (tests/engine/cuda/cuda_model_test.cc, qwen4exp_residual_test.cc, the latent / kpool / QSA kernel
# tests, the release MTP fixtures, `exl3-cuda-check --moe-prefill`, `exl3-bench moe`), then GLM-5.3-Flash and
# Qwen3.8-Flash-Next (6 layers) with one worker under MPS at one and two micro-batches, and
# Qwen3.8-Flash-Next's decode against main's build.
#   BASELINE_BUILD=<main's build> ONLY="engine_cuda_model_test engine_cuda_qwen4exp_residual_test
#     engine_cuda_latent_attention_test engine_cuda_kpool_test engine_cuda_qsa_test engine_cuda_mtp_test
#     exl3-engine-bench exl3-tool exl3-worker exl3-cuda-check exl3-bench" scripts/gpu/bundle.sh build
#   scripts/dev/fixtures_aside.sh out glm4_moe_all deepseek_v3_all deepseek_v3_experts glm_moe_dsa_all \
#     glm_moe_dsa_experts glm5_next_all glm5_next_experts qwen4_exp_all qwen4_exp_experts qwen3_next_all \
#     deepseek_v4_all deepseek_v4_experts glm5_next_release_mtp glm5_next_release_all \
#     glm_moe_dsa_release_mtp glm_moe_dsa_release_all           (about 30 MB besides the bundle)
#   bash scripts/gpu/microbatch_checks.sh      (carry .gpu-check; about 400 s)
# $OUT: the tests' logs.tar.xz, remote-*/ (engine_remote.sh's tables and logs), bench-*.json.
# Then, time allowing, GLM-5.3-Flash (6 layers) by kernel: $OUT/profile.tar.xz.
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
rm -rf .gpu-deps
. scripts/gpu/env.sh > /dev/null
MODELS_LOG=$(mktemp /tmp/microbatch-models.XXXXXX)
( bash scripts/gpu/glm5_next_model.sh "$BIN" /tmp/glm5-next-synthetic-6 6 "$MODELS_LOG" 300
  bash scripts/gpu/qwen4_exp_model.sh "$BIN" /tmp/qwen4-exp-synthetic-6 6 "$MODELS_LOG" 200 ) &
MODELS=$!
OUT=$OUT KEEP_DEPS=1 bash scripts/gpu/test_checks.sh --limit 200 \
  model=engine_cuda_model_test:'Families/CudaTwoMicroBatchesTest.*:CudaModelTest.*MicroBatch*:LatentFamilies/*:Glm5NextFamily/*:Qwen4ExpFamily/*:Dsv4Family/*:CudaKernelsTest.*:Fixtures/CudaVerifyGraphTest.*' \
  qwen4=engine_cuda_qwen4exp_residual_test latent=engine_cuda_latent_attention_test kpool=engine_cuda_kpool_test \
  qsa=engine_cuda_qsa_test kda=engine_cuda_kda_test deltanet=engine_cuda_deltanet_test mtp=engine_cuda_mtp_test:'*release_mtp*'
echo "tests exit $?"
timeout 120 "$BIN/exl3-cuda-check" --moe-prefill > "$OUT/moe-check.log" 2>&1
echo "exl3-cuda-check --moe-prefill exit $?"; tail -3 "$OUT/moe-check.log"
timeout 120 "$BIN/exl3-bench" moe --json "$OUT/bench-moe.json" > "$OUT/bench-moe.log" 2>&1
echo "exl3-bench moe exit $?"; grep -iE "glm-5|qwen3.8|T *= *1 " "$OUT/bench-moe.log" | head -12
wait $MODELS
for m in glm5-next qwen4-exp; do
  OUT=$OUT/remote-$m BENCH_TIMEOUT=100 timeout 200 bash scripts/gpu/engine_remote.sh --model /tmp/$m-synthetic-6 \
    --batches 1,8,32 --contexts 1024 --steps 16 --micro-batches 1,2 --mps --no-in-process > "$OUT/remote-$m.log" 2>&1
  echo "remote $m exit $?"
  grep -E "^decode|^=== |exit" "$OUT/remote-$m.log" | head -20
done
for b in exl3-engine-bench exl3-engine-bench-baseline exl3-engine-bench exl3-engine-bench-baseline; do
  echo "--- $b"
  timeout 60 "$BIN/$b" --model /tmp/qwen4-exp-synthetic-6 --context 1024 --batch 1,8 --steps 16 2>&1 | grep -E "^decode context"
done
# GLM-5.3-Flash's batch-1 decode step and a 1k prompt's prefill by kernel (one ncu run), if the
# call's time allows; packed into one file (a call returns only so many).
if [ "$SECONDS" -lt 420 ]; then
  mkdir -p /tmp/profile
  OUT=/tmp/profile MODEL=/tmp/glm5-next-synthetic-6 BATCH=1 PHASE="decode prefill" \
    timeout $((580 - SECONDS)) bash scripts/gpu/profile_step.sh > /tmp/profile/profile.log 2>&1
  echo "profile exit $? ($SECONDS s)"
  head -30 /tmp/profile/profile-B1-decode.txt; head -25 /tmp/profile/profile-B1-prefill.txt
  tar -C /tmp -cJf "$OUT/profile.tar.xz" --exclude='*.csv' profile
fi
echo "total $SECONDS s"
