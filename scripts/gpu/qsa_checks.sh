#!/usr/bin/env bash
# Branch qsa-split-25 in one device call: the QSA split attention (engine/cuda/qsa_kernels.cu)
# against its double reference (engine_cuda_qsa_test), the GPU model, speculative, MTP, DSPARK and
# hyper-connection tests side by side (InputBlockScales), then Qwen3.8-Flash-Next's 6-layer
# synthetic model decoded by this build and the baseline (main's exl3-engine-bench) in turn.
#   BASELINE_BUILD=<main's build> ONLY="engine_cuda_qsa_test engine_cuda_model_test
#     engine_cuda_speculative_test engine_cuda_mtp_test engine_cuda_glm5_residual_test
#     engine_cuda_dspark_test exl3-engine-bench exl3-tool" scripts/gpu/bundle.sh build
#   scripts/dev/fixtures_aside.sh out glm4_moe_all qwen3_moe_all mixtral_all deepseek_v3_all \
#     glm_moe_dsa_all deepseek_v4_all qwen3_next_all glm5_next_all qwen4_exp_all qwen4_exp_experts \
#     glm4_moe_mtp deepseek_v3_mtp glm_moe_dsa_mtp glm5_next_mtp qwen4_exp_mtp deepseek_v4_release_mtp \
#     qwen4_exp_release_mtp                  (34 MB with the 16 MB bundle)
#   These leave out the other families' `_experts` and release fixtures (all would pass 64 MiB), so
#   those families' cases fail on "cannot read tests/fixtures/engine/..." (session 26's run);
#   scripts/gpu/test_checks.sh runs chosen cases with their fixtures instead.
#   bash scripts/gpu/qsa_checks.sh            (carry .gpu-check; about 300 s)
# $OUT: logs.tar.xz (every log, the benchmarks' JSON); summary lines on stdout.
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
rm -rf .gpu-deps
. scripts/gpu/env.sh
L=$(mktemp -d /tmp/qsa-checks.XXXXXX)
trap 'tar -C "$L" -cJf "$OUT/logs.tar.xz" .' EXIT
bash scripts/gpu/qwen4_exp_model.sh "$BIN" /tmp/qwen4-exp-synthetic-6 6 "$L/model-write.log" 200 &
MODEL_PID=$!
timeout 120 "$BIN"/engine_cuda_qsa_test > "$L/qsa.log" 2>&1
echo "qsa test exit $?"
grep -E "^qsa attention|FAILED|PASSED" "$L/qsa.log" | tail -60
run() { local name=$1 t=$2; shift 2; timeout "$t" "$@" > "$L/$name.log" 2>&1; echo "$name exit $?" >> "$L/exits"; }
run model 180 "$BIN"/engine_cuda_model_test &
( run speculative 150 "$BIN"/engine_cuda_speculative_test; run mtp 100 "$BIN"/engine_cuda_mtp_test;
  run dspark 60 "$BIN"/engine_cuda_dspark_test; run hyper 90 "$BIN"/engine_cuda_glm5_residual_test ) &
wait
cat "$L/exits"
for n in model speculative mtp dspark hyper; do grep -E "^\[  FAILED  \]|^\[  PASSED  \]" "$L/$n.log" | head -8 | sed "s/^/$n: /"; done
wait $MODEL_PID
for round in 1; do
  for b in exl3-engine-bench exl3-engine-bench-baseline; do
    echo "--- $b, round $round"
    timeout 90 "$BIN"/$b --model /tmp/qwen4-exp-synthetic-6 --context 1024,8192 --batch 1,8 --steps 16 \
      --json "$L/bench-$b-$round.json" 2>&1 | grep -E "^prefill|^decode"
  done
done
