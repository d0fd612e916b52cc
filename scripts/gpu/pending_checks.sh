#!/usr/bin/env bash
# Main's pending GPU work (session 28) on the device; modes run in the order given, in one call
# (LIMIT 580 s shared), each of its own (issue a further call at once: an idle machine goes back
# after 30 s, and with it the models under /tmp).
#   tests: the release MTP fixtures (tests/engine/cuda/mtp_drafting_test.cc: Fixtures/.../3 and
#     /5, Qwen4Exp/.../1; gtest names parameters by index).
#   spec: the goodput draft length (step costs per shape, warm-ups, probes only where certain drafts
#     could pay: engine/speculative/step_cost_model.h, goodput_draft_choice.h) beside fixed k,
#     GLM-5.3-Flash 6 layers, k = 3, acceptance 0.7, batch 1-64, 48 decode steps (session 27:
#     goodput 0.67x plain at batch 64), and goodput again over 96.
#   ab: GLM-5.3-Flash's batch-1 and batch-8 step with PDL, the hyper-connection mix stream and
#     the shared q/k/v launches (kernels/cuda/linear.cu) each off, alternately with the default.
#   remote: the experts on one worker on the same GPU, without and under MPS, at one and two
#     micro-batches (batch 1, 8, 32), GLM-5.3-Flash then Qwen3.8-Flash-Next (6 layers).
#   mps: GLM-5.3-Flash in process, then with one worker under MPS (one micro-batch), one run.
#   spec-remote: goodput speculative decoding (k = 3, acceptance 0.7, batch 1 and 8) in process
#     and with the experts on one worker under MPS (issue 31's 2.5x with a worker).
# Next session: `tests mps spec-remote` (the relaxed MTP rule, the same-call MPS ratio, and this).
# Bundle and fixtures:
#   ONLY="engine_cuda_qsa_test engine_cuda_mtp_test exl3-engine-bench exl3-tool exl3-worker" \
#     scripts/gpu/bundle.sh build
#   scripts/dev/fixtures_aside.sh out qwen4_exp_experts glm5_next_release_mtp glm_moe_dsa_release_mtp \
#     qwen4_exp_release_mtp
#   bash scripts/gpu/pending_checks.sh MODE...      (carry .gpu-check)
# $OUT: logs.tar.xz (the tests' logs), bench.tar.xz (every benchmark's log and the remote runs).
set -uo pipefail
cd "$(dirname "$0")/../.."
[ $# -ge 1 ] || { sed -n '2,26p' "$0"; exit 2; }
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
LIMIT=580
. scripts/gpu/time_budget.sh
. scripts/gpu/env.sh > /dev/null
BENCH=$(mktemp -d /tmp/pending-bench.XXXXXX)
trap 'tar -C "$BENCH" -cJf "$OUT/bench.tar.xz" .' EXIT
( bash scripts/gpu/glm5_next_model.sh "$BIN" /tmp/glm5-next-synthetic-6 6 "$BENCH/models.log" 300
  bash scripts/gpu/qwen4_exp_model.sh "$BIN" /tmp/qwen4-exp-synthetic-6 6 "$BENCH/models.log" 200 ) &
MODELS=$!

for MODE in "$@"; do
  case $MODE in
  tests)
    OUT=$OUT KEEP_DEPS=1 bash scripts/gpu/test_checks.sh --limit 150 \
      mtp=engine_cuda_mtp_test:'Fixtures/CudaMtpTest.*/3:Fixtures/CudaMtpTest.*/5:Qwen4Exp/CudaMtpTest.*/1'
    echo "tests exit $? ($(el) s)" ;;
  spec)
    wait $MODELS
    for run in goodput:48 fixed:48 goodput:96; do
      policy=${run%:*} steps=${run#*:}
      [ "$(left)" -gt 60 ] || break
      timeout "$(upto 120)" "$BIN/exl3-engine-bench" --model /tmp/glm5-next-synthetic-6 --context 1024 \
        --batch 1,8,32,64 --steps $steps --speculative-acceptance 0.7 --num-speculative-tokens 3 \
        --speculative-draft-length $policy > "$BENCH/spec-$policy-$steps.log" 2>&1
      echo "spec bench ($policy, $steps steps) exit $? ($(el) s)"; grep -E "^\|" "$BENCH/spec-$policy-$steps.log" | tail -8
    done ;;
  ab)
    wait $MODELS
    for round in 1 2; do
      for setting in default EXL3_PDL=0 EXL3_HC_MIX_STREAM=0 EXL3_LINEAR_SHARED=0; do
        [ "$(left)" -gt 25 ] || break
        log="$BENCH/ab-${setting//=/-}-$round.log"
        env $([ $setting = default ] || echo $setting) timeout "$(upto 40)" "$BIN/exl3-engine-bench" \
          --model /tmp/glm5-next-synthetic-6 --context 1024 --batch 1,8 --steps 24 > "$log" 2>&1
        echo "--- $setting round $round: exit $?"; grep -E "^decode context" "$log" | head -2
      done
    done ;;
  remote)
    wait $MODELS
    for m in glm5-next qwen4-exp; do
      [ "$(left)" -gt 90 ] || break
      OUT=$BENCH/remote-$m BENCH_TIMEOUT=120 timeout "$(upto 290)" bash scripts/gpu/engine_remote.sh \
        --model /tmp/$m-synthetic-6 --batches 1,8,32 --contexts 1024 --steps 16 --micro-batches 1,2 --mps \
        --no-in-process > "$BENCH/remote-$m.log" 2>&1
      echo "remote $m exit $? ($(el) s)"
      grep -E "^decode|^=== |exit" "$BENCH/remote-$m.log" | head -24
    done ;;
  mps)
    wait $MODELS
    [ "$(left)" -gt 90 ] || break
    OUT=$BENCH/mps-glm5-next BENCH_TIMEOUT=120 timeout "$(upto 300)" bash scripts/gpu/engine_remote.sh \
      --model /tmp/glm5-next-synthetic-6 --batches 1,8,32 --contexts 1024 --steps 16 --micro-batches 1 --mps \
      > "$BENCH/mps-glm5-next.log" 2>&1
    echo "mps glm5-next exit $? ($(el) s)"
    grep -E "^decode \(|^decode context|^=== " "$BENCH/mps-glm5-next.log" | cut -c1-110 | head -24 ;;
  spec-remote)
    wait $MODELS
    [ "$(left)" -gt 90 ] || break
    OUT=$BENCH/spec-remote-glm5-next BENCH_TIMEOUT=150 timeout "$(upto 300)" bash scripts/gpu/engine_remote.sh \
      --model /tmp/glm5-next-synthetic-6 --batches 1,8 --contexts 1024 --steps 48 --micro-batches 1 --mps \
      --bench-args "--speculative-acceptance 0.7 --num-speculative-tokens 3 --speculative-draft-length goodput" \
      > "$BENCH/spec-remote-glm5-next.log" 2>&1
    echo "spec-remote glm5-next exit $? ($(el) s)"
    grep -E "^\||^=== " "$BENCH/spec-remote-glm5-next.log" | cut -c1-140 | head -30 ;;
  *) echo "pending_checks: unknown mode $MODE" >&2; exit 2 ;;
  esac
done
echo "total $(el) s"
