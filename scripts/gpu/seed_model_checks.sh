#!/usr/bin/env bash
# The GPU checks the seed-models and speculative-decoding issues wait on, in one short device call:
# Qwen4-Exp's whole model, MTP drafting and speculative decoding on the GPU engine (after the PLE
# table fix), glm_moe_dsa_mtp's greedy generation with MTP (its log names plain decoding's top-2 gap
# where a token differs), and the kernel tests whose set-ups moved. Needs the bundle of the
# binaries it runs (carry .gpu-check):
#   CUDA_ARCHITECTURES=90 ONLY="engine_cuda_model_test engine_cuda_mtp_test engine_cuda_speculative_test \
#     engine_cuda_kpool_test engine_cuda_latent_attention_test engine_cuda_qsa_test" scripts/gpu/bundle.sh
# and these fixtures, the rest set aside to fit a call:
#   scripts/dev/fixtures_aside.sh out qwen4_exp_all qwen4_exp_experts qwen4_exp_mtp \
#     qwen4_exp_ngram_hash.json glm_moe_dsa_mtp qwen3_next_all glm5_next_all deepseek_v4_all
#   bash scripts/gpu/seed_model_checks.sh        (LIMIT: seconds it may take, default 220)
# Logs in $OUT.
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
LIMIT=${LIMIT:-220}
. scripts/gpu/time_budget.sh
. scripts/gpu/env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
show() { grep -E "non-finite|Failure|FAILED|PASSED|rows within|worst|Which is|K [0-9], prompt|gap|runner" "$1" | head -"$2"; }
echo "=== Qwen4-Exp whole model ($(el) s)"
timeout "$(upto 90)" "$BIN"/engine_cuda_model_test --gtest_filter='Qwen4ExpFamily/*' > "$OUT/qwen4.log" 2>&1
echo "exit $?"; show "$OUT/qwen4.log" 40
echo "=== Qwen4-Exp MTP drafting and speculative decoding ($(el) s)"
timeout "$(upto 60)" "$BIN"/engine_cuda_mtp_test --gtest_filter='Qwen4Exp/*' > "$OUT/qwen4-mtp.log" 2>&1
echo "exit $?"; show "$OUT/qwen4-mtp.log" 20
timeout "$(upto 70)" "$BIN"/engine_cuda_speculative_test \
  --gtest_filter='Qwen4Exp/*:*RecurrentFamiliesAndDeepSeekV4AreAccepted*' > "$OUT/qwen4-spec.log" 2>&1
echo "exit $?"; show "$OUT/qwen4-spec.log" 20
echo "=== glm_moe_dsa_mtp: greedy generation with MTP against plain decoding ($(el) s)"
if [ "$(left)" -gt 10 ]; then
  timeout "$(upto 40)" "$BIN"/engine_cuda_mtp_test \
    --gtest_filter='Fixtures/CudaMtpTest.GreedyGenerationWithMtpEqualsPlainDecoding/2' > "$OUT/dsa-mtp.log" 2>&1
  echo "exit $?"; show "$OUT/dsa-mtp.log" 12
fi
echo "=== kernel tests ($(el) s)"
for tf in "engine_cuda_kpool_test:-*Glm5NextExperts*" "engine_cuda_latent_attention_test:LatentKernelsTest.*" \
          "engine_cuda_qsa_test:*"; do
  t=${tf%%:*} f=${tf#*:}
  [ "$(left)" -gt 8 ] || break
  timeout "$(upto 30)" "$BIN"/"$t" --gtest_filter="$f" > "$OUT/$t.log" 2>&1
  echo "$t exit $?"; grep -E "PASSED|FAILED" "$OUT/$t.log" | head -4
done
echo "total $(el) s"
