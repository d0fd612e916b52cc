#!/usr/bin/env bash
# Main's pending GPU work (session 28) on the device, in two calls on one warm machine (issue the
# second at once: an idle machine goes back after 30 s, and with it the models under /tmp).
#   spec: the QSA mixer test whose stale assertion session 27 fixed and the release MTP fixtures
#     (tests/engine/cuda/mtp_drafting_test.cc: Fixtures/.../3 and /5, Qwen4Exp/.../1, never run:
#     gtest names parameters by index); the goodput draft length with the step cost kept apart for
#     plain decode steps (CUDA graphs) and mixed ones (engine/speculative/step_cost_model.h)
#     beside fixed k (GLM-5.3-Flash 6 layers, k = 3, acceptance 0.7, batch 1-64; session 27:
#     goodput 0.67x plain at batch 64); GLM-5.3-Flash's batch-1 and batch-8 step with PDL, the
#     hyper-connection mix stream and the shared q/k/v launches each off, alternately with the
#     default (session 27: 2-3 % slower at batch 8 than before those landed).
#   remote: the experts on one worker on the same GPU, without and under MPS, at one and two
#     micro-batches (batch 1, 8, 32), GLM-5.3-Flash then Qwen3.8-Flash-Next (6 layers).
# Bundle and fixtures:
#   ONLY="engine_cuda_qsa_test engine_cuda_mtp_test exl3-engine-bench exl3-tool exl3-worker" \
#     scripts/gpu/bundle.sh build
#   scripts/dev/fixtures_aside.sh out glm5_next_all glm5_next_release_mtp glm_moe_dsa_release_mtp \
#     qwen4_exp_release_mtp qwen4_exp_all qwen4_exp_experts
#   bash scripts/gpu/pending_checks.sh spec|remote      (carry .gpu-check; under 580 s each)
# $OUT: spec: logs.tar.xz (the tests), spec-*.log, ab-*.log; remote: remote-*/ and remote-*.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
MODE=${1:?usage: pending_checks.sh spec|remote}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
LIMIT=580
. scripts/gpu/time_budget.sh
. scripts/gpu/env.sh > /dev/null
MODELS_LOG=$(mktemp /tmp/pending-models.XXXXXX)
( bash scripts/gpu/glm5_next_model.sh "$BIN" /tmp/glm5-next-synthetic-6 6 "$MODELS_LOG" 300
  bash scripts/gpu/qwen4_exp_model.sh "$BIN" /tmp/qwen4-exp-synthetic-6 6 "$MODELS_LOG" 200 ) &
MODELS=$!

if [ "$MODE" = spec ]; then
  OUT=$OUT KEEP_DEPS=1 bash scripts/gpu/test_checks.sh --limit 150 qsa=engine_cuda_qsa_test \
    mtp=engine_cuda_mtp_test:'Fixtures/CudaMtpTest.*/3:Fixtures/CudaMtpTest.*/5:Qwen4Exp/CudaMtpTest.*/1'
  echo "tests exit $? ($(el) s)"
  wait $MODELS
  for policy in goodput fixed; do
    [ "$(left)" -gt 60 ] || break
    timeout "$(upto 120)" "$BIN/exl3-engine-bench" --model /tmp/glm5-next-synthetic-6 --context 1024 \
      --batch 1,8,32,64 --steps 48 --speculative-acceptance 0.7 --num-speculative-tokens 3 \
      --speculative-draft-length $policy > "$OUT/spec-$policy.log" 2>&1
    echo "spec bench ($policy) exit $? ($(el) s)"; grep -E "^\|" "$OUT/spec-$policy.log" | tail -8
  done
  # Each setting twice, alternately: the default, and with each of PDL, the hyper-connection mix
  # stream and the shared q/k/v launches (kernels/cuda/linear.cu) off.
  for round in 1 2; do
    for setting in default EXL3_PDL=0 EXL3_HC_MIX_STREAM=0 EXL3_LINEAR_SHARED=0; do
      [ "$(left)" -gt 25 ] || break
      log="$OUT/ab-${setting//=/-}-$round.log"
      env $([ $setting = default ] || echo $setting) timeout "$(upto 40)" "$BIN/exl3-engine-bench" \
        --model /tmp/glm5-next-synthetic-6 --context 1024 --batch 1,8 --steps 24 > "$log" 2>&1
      echo "--- $setting round $round: exit $?"; grep -E "^decode context" "$log" | head -2
    done
  done
fi

if [ "$MODE" = remote ]; then
  wait $MODELS
  for m in glm5-next qwen4-exp; do
    [ "$(left)" -gt 90 ] || break
    OUT=$OUT/remote-$m BENCH_TIMEOUT=120 timeout "$(upto 290)" bash scripts/gpu/engine_remote.sh \
      --model /tmp/$m-synthetic-6 --batches 1,8,32 --contexts 1024 --steps 16 --micro-batches 1,2 --mps \
      --no-in-process > "$OUT/remote-$m.log" 2>&1
    echo "remote $m exit $? ($(el) s)"
    grep -E "^decode|^=== |exit" "$OUT/remote-$m.log" | head -24
  done
fi
echo "total $(el) s"
