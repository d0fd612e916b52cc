#!/usr/bin/env bash
# Speculative decoding on the GPU engine in one short device call, after verify rows moved to the
# device sampler (Scheduler::SamplingRows gives each its drafts as history): the n-gram and MTP
# generation tests (greedy tokens = plain decoding's through the Engine, every family with a
# fixture here), then GLM-5.3-Flash's synthetic model (6 layers, scripts/gpu/glm5_next_model.sh)
# through exl3-engine-bench --speculative-acceptance with and without --verify-graphs, and the
# CUDA-graph replay test of verify steps. Needs the bundle of the binaries it runs (carry
# .gpu-check):
#   CUDA_ARCHITECTURES=90 ONLY="engine_cuda_model_test engine_cuda_mtp_test engine_cuda_speculative_test \
#     exl3-engine-bench exl3-tool" scripts/gpu/bundle.sh
# and these fixtures, the rest set aside to fit a call:
#   scripts/dev/fixtures_aside.sh out glm4_moe_all qwen3_moe_all mixtral_all deepseek_v3_all glm_moe_dsa_all \
#     qwen3_next_all glm5_next_all qwen4_exp_all deepseek_v4_all deepseek_v3_mtp glm4_moe_mtp glm_moe_dsa_mtp \
#     glm5_next_mtp qwen4_exp_mtp
#   bash scripts/gpu/speculative_checks.sh        (LIMIT: seconds it may take, default 400)
# Logs and the benchmarks' JSON in $OUT.
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
LIMIT=${LIMIT:-400}
. scripts/gpu/time_budget.sh
. scripts/gpu/env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
show() { grep -E "Failure|FAILED|PASSED|GPU K=|mtp K=|differs|indexer choice|Which is|gap" "$1" | head -"$2"; }
echo "=== n-gram speculative decoding through the Engine ($(el) s)"
timeout "$(upto 150)" "$BIN"/engine_cuda_speculative_test \
  --gtest_filter='StatelessAttention/*:RecurrentFamilies/*:Qwen4Exp/*' > "$OUT/spec.log" 2>&1
echo "exit $?"; show "$OUT/spec.log" 40
echo "=== MTP drafting and generation ($(el) s)"
timeout "$(upto 100)" "$BIN"/engine_cuda_mtp_test > "$OUT/mtp.log" 2>&1
echo "exit $?"; show "$OUT/mtp.log" 30
echo "=== verify steps in CUDA graphs ($(el) s)"
timeout "$(upto 60)" "$BIN"/engine_cuda_model_test --gtest_filter='Fixtures/CudaVerifyGraphTest.*' \
  > "$OUT/verify-graph.log" 2>&1
echo "exit $?"; grep -E "verify graphs|FAILED|PASSED" "$OUT/verify-graph.log" | head -8
echo "=== GLM-5.3-Flash synthetic, 6 layers: speculative decoding against plain ($(el) s)"
MODEL=/tmp/glm5-next-synthetic-6
bash scripts/gpu/glm5_next_model.sh "$BIN" "$MODEL" 6 "$OUT/glm5-model.log" "$(upto 120)" || exit 1
for graphs in "" --verify-graphs; do
  [ "$(left)" -gt 20 ] || break
  timeout "$(upto 90)" "$BIN"/exl3-engine-bench --model "$MODEL" --context 1024 --batch 1,8 --steps 48 \
    --speculative-acceptance 0.7,0.9 --num-speculative-tokens 1,3 --speculative-draft-length fixed $graphs \
    --json "$OUT/spec-bench${graphs}.json" > "$OUT/spec-bench${graphs}.log" 2>&1
  echo "spec bench ${graphs:-(eager verify steps)} exit $?"
  grep -E "^\|" "$OUT/spec-bench${graphs}.log"
done
echo "total $(el) s"
