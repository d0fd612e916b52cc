#!/usr/bin/env bash
# On the GPU machine: the GPU engine (engine/cuda/) in one go. Writes logs to $OUT (or ./gpu-out;
# packed into logs.tar.xz at the end):
#   1. engine_cuda_model_test, engine_cuda_latent_attention_test, engine_cuda_deltanet_test,
#      engine_cuda_delta_rule_test (the recurrence both linear-attention kinds share),
#      engine_cuda_dense_gemv_test (decode-sized dense linears),
#      engine_cuda_kda_test (GLM-5.3-Flash's KDA layer), engine_cuda_kpool_test (its indexed
#      attention), engine_cuda_glm5_residual_test (its hyper-connections, mean head, clamped SwiGLU),
#      engine_cuda_qwen4exp_residual_test and engine_cuda_qsa_test (Qwen4-Exp's gated residual
#      stream and QSA attention) and engine_cuda_dsv4_test: the kernels against the CPU references and whole models
#      (tests/fixtures/engine) against the CPU engine and transformers; Qwen3-Next's state through
#      the engine (preemption, a failed step); engine_cuda_speculative_test (n-gram drafts verified
#      on the GPU, the recurrent families too), engine_cuda_mtp_test (the MTP head's drafts on the GPU
#      against the CPU engine's, greedy generation with mtp against plain decoding) and
#      engine_cuda_prompt_logprobs_test (prompt logprobs on the GPU), through the Engine; engine_cuda_verify_chunk_states_test and
#      engine_cuda_verify_chunk_indexers_test (a verify chunk's kept recurrent states, bit for bit,
#      and rejected drafts leaving no trace in the k-pooled and QSA indexers);
#      engine_cuda_dsv4_verify_chunk_test (DeepSeek-V4's compressed caches after rejected drafts,
#      bit for bit, through the kept accumulators);
#   2. compute-sanitizer: memcheck on a GQA, a GLM-MoE-DSA and a Qwen3-Next fixture's generation,
#      racecheck on the kernel tests (the DeltaNet's, KDA's and the k-pooled indexer's too) and one
#      short generation, memcheck on KDA's and the indexed attention's layer tests, DeepSeek-V4's
#      kernels, resume and kept accumulators (verify chunks), Qwen4-Exp's residual, PLE and QSA
#      kernels, its QSA layer and generation;
#   3. a synthetic model with GLM-4.5-Air's shapes (dense intermediate 11008: 10944 rounded up to EXL3's
#      multiple of 128; ENGINE_LAYERS layers, default 6: the first
#      dense) and exl3-engine-bench on it: time to first token, decode tokens/s at batch 1..64
#      against the floor measured in the same run;
#   4. exl3-engine-bench --attention-only: the attention kernels alone (GLM-4.5-Air's 96/8 heads of
#      128; decode at batch 1/8/64 x context 1k/8k, prefill of 1k/8k prompts in chunks of 2048)
#      against the KV-read and FLOP floors;
#   5. engine_cuda_sampling_test (the device sampler against the CPU sampler; fixture models through
#      the engine sampling on the device, on the host and on the CPU engine), compute-sanitizer
#      memcheck and racecheck on its random-logits cases, and exl3-engine-bench --sampling-only
#      (rows 1/8/64 x vocab 151552: device sampling beside the old logits-to-host path).
#   6. (--only dsa, not by default) a synthetic GLM-MoE-DSA model: GLM-5.3-Flash's MoE shapes
#      (EXL3_FORMAT.md) and the attention of transformers' GlmMoeDsaConfig defaults (64 heads,
#      q_lora_rank 2048, kv_lora_rank 512, nope 192 + rope 64, v 256; indexer 32 x 128, top 2048),
#      DSA_LAYERS layers (default 6, the first 3 dense), through exl3-engine-bench.
#   7. (--only glm5, not by default) a synthetic GLM-5.3-Flash (Glm5NextForConditionalGeneration)
#      at its published shapes as its origin runs it (experts K=2 MCG, attention K=4, head K=6),
#      GLM5_LAYERS layers (default 8: the 3 dense and 5 MoE; KDA and indexed layers three to one),
#      through exl3-engine-bench at contexts 1024 and 8192, batches 1, 8, 32, 64 ($OUT/glm5-L<layers>.json);
#      GLM5_DEPTHS "6,10" instead: both depths, then the 45 layers of the published model (too
#      large for an H100) extrapolated per layer ($OUT/glm5-extrapolated.md,
#      scripts/gpu/depth_extrapolation.py).
#   8. (--only spec, not by default) speculative decoding through the engine on the GLM-4.5-Air-shaped
#      model of 3 (or SPEC_MODEL_DIR): exl3-engine-bench --speculative-acceptance (a drafter that
#      matches the target with probability p: tokens/s against p and against k at batch 1, 8, 32,
#      requests whose greedy tokens differ from the plain run's counted), fixed K, adaptive K and the
#      goodput draft length (SPEC_POLICIES to choose).
#   9. (--only constraint, not by default) constrained decoding's cost per step (issue 30: <= 10 % of
#      the inter-token latency at batch 1 and 64) through the engine on the model of 3 (or
#      CONSTRAINT_MODEL_DIR): exl3-engine-bench --constrained-tokenizer, each batch decoding first
#      unconstrained (sampled on the device), then every sequence constrained by exl3-constraint-bench's
#      JSON schema (its rows sampled on the host); step ms, tokens/s and the difference as a share of
#      the unconstrained step. CONSTRAINT_TOKENIZER: default the test models' tokenizer
#      (tests/fixtures/tokenizer/glm4_moe, 512 ids in the model's 151552: few tokens left undecided,
#      so it understates the masks' cost); if time allows, a 151k-token one trained by
#      bench/train_bpe_tokenizer.py (needs `tokenizers`: train it on the development machine, not on
#      the GPU machine, which has no network to install it; carry the file) is the fairer measure.
#      ENGINE_LAYERS=46 (28 GB) gives GLM-4.5-Air's whole step; the default 6 layers' step is far
#      shorter, so there the difference in ms is what carries over, not the share.
# Binaries come from .gpu-deps/ or its packed copy .gpu-check/gpu-deps.tar.xz (scripts/gpu/bundle.sh;
# carry one of the two). Usage: scripts/gpu/engine.sh [--only test|sanitize|bench|attention|sampling|dsa|glm5|spec|constraint]...
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
# A device call brings back at most 8 files of $OUT: at the end every log goes into one
# logs.tar.xz (unpack it where the call's files arrive).
pack_logs() {
  (cd "$OUT" && ls ./*.log > /dev/null 2>&1 && tar -cJf logs.tar.xz ./*.log && rm -f ./*.log)
}
trap pack_logs EXIT
ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --only) ONLY="$ONLY $2"; shift ;;
    -h|--help) sed -n '2,64p' "$0"; exit 0 ;;
    *) echo "engine.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
want() { [ -z "$ONLY" ] || [[ " $ONLY " == *" $1 "* ]]; }

. scripts/gpu/env.sh
"$BIN"/exl3-engine-bench --help > /dev/null || { echo "binaries do not run here: ldd follows"; ldd "$BIN"/exl3-engine-bench; exit 1; }

# run_test BINARY LOG PATTERN LINES: one test binary, its exit code and the lines of its log that match.
run_test() {
  echo "=== $1"
  timeout ${TEST_TIMEOUT:-300} "$BIN"/$1 > "$OUT/$2" 2>&1
  echo "test exit $?"
  grep -E "$3|FAILED|Failure|error|PASSED" "$OUT/$2" | head -$4
}
if want test; then
  run_test engine_cuda_model_test engine-test.log "^(attention|gate|rope|add\+rmsnorm|model) " 400
  run_test engine_cuda_latent_attention_test latent-test.log "^(latent|indexer|layer) |chose different" 300
  run_test engine_cuda_deltanet_test deltanet-test.log "^(deltanet|model) " 100
  run_test engine_cuda_delta_rule_test delta-rule-test.log "^delta rule " 100
  run_test engine_cuda_dense_gemv_test dense-gemv-test.log "^dense gemv " 60
  run_test engine_cuda_kda_test kda-test.log "^kda " 300
  run_test engine_cuda_kpool_test kpool-test.log "^kpool " 300
  run_test engine_cuda_dsv4_test dsv4-test.log "^dsv4 " 200
  run_test engine_cuda_glm5_residual_test glm5-residual-test.log "^glm5 " 100
  run_test engine_cuda_qwen4exp_residual_test qwen4-residual-test.log "^qwen4 " 200
  run_test engine_cuda_qsa_test qsa-test.log "^qsa " 100
  run_test engine_cuda_speculative_test speculative-test.log " GPU K=| repeating prompt " 60
  run_test engine_cuda_mtp_test mtp-test.log "draft proposals compared| GPU mtp K=| repeating prompt " 60
  run_test engine_cuda_verify_chunk_states_test verify-states-test.log "^verify states " 80
  run_test engine_cuda_verify_chunk_indexers_test verify-indexers-test.log "^verify indexers " 40
  run_test engine_cuda_dsv4_verify_chunk_test dsv4-verify-test.log "^dsv4 verify " 40
  run_test engine_cuda_prompt_logprobs_test prompt-logprobs-test.log "worst prompt logprob" 40
fi
if want sanitize && command -v compute-sanitizer > /dev/null; then
  echo "=== compute-sanitizer"
  # memcheck: a GQA fixture's generation, then GLM-MoE-DSA's (latent attention, the indexer and its
  # top-k). racecheck (far slower): the kernel tests and one short generation (12 steps of two
  # sequences through glm4_moe_all), then the latent and indexer kernels. Then DeepSeek-V4's.
  sanitize() {  # sanitize TOOL NAME BINARY FILTER
    local log="$OUT/engine-sanitizer-$1-$2.log"
    timeout ${SANITIZE_TIMEOUT:-240} compute-sanitizer --tool $1 --error-exitcode 3 "$BIN"/$3 \
      --gtest_filter="$4" > "$log" 2>&1
    local rc=$?
    echo "$2 $1 exit $rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)"
    [ "$rc" = 0 ] || grep -E "error|Error|ERROR|FAIL|Invalid" "$log" | grep -v SUMMARY | head -8
  }
  sanitize memcheck gqa-generation engine_cuda_model_test 'GqaFamilies/CudaModelFixtureTest.MatchesCpuModelAndTransformers/1'
  sanitize memcheck dsa-generation engine_cuda_model_test 'LatentFamilies/CudaModelFixtureTest.MatchesCpuModelAndTransformers/3'
  sanitize racecheck kernels-and-generation engine_cuda_model_test 'CudaKernelsTest.*:CudaModelTest.ExpertsThroughAnExecutorMatchTheCpuModel'
  sanitize racecheck latent-kernels engine_cuda_latent_attention_test 'LatentKernelsTest.*'
  sanitize memcheck qwen3-next-generation engine_cuda_model_test 'RecurrentFamilies/CudaModelFixtureTest.MatchesCpuModelAndTransformers/1'
  sanitize racecheck deltanet-kernels engine_cuda_deltanet_test 'DeltaNetKernelsTest.*'
  sanitize racecheck kda-kernels engine_cuda_kda_test 'KdaKernelsTest.*'
  sanitize racecheck delta-rule engine_cuda_delta_rule_test 'DeltaRuleKernelTest.*'
  # A verify chunk's kept states (every recurrent block) and the indexers after rejected drafts.
  sanitize memcheck verify-states engine_cuda_verify_chunk_states_test '*'
  sanitize memcheck verify-indexers engine_cuda_verify_chunk_indexers_test '*'
  # DeepSeek-V4's kept accumulators: restores, kept rows around the restored one, a failed step.
  sanitize memcheck dsv4-verify engine_cuda_dsv4_verify_chunk_test 'CudaDsv4VerifyChunkTest.Consecutive*:CudaDsv4VerifyChunkTest.Plain*'
  sanitize memcheck delta-rule engine_cuda_delta_rule_test 'DeltaRuleKernelTest.*'
  sanitize memcheck kda-layer engine_cuda_kda_test 'Fixtures/KdaLayerTest.*/glm5_next_experts_lower_bound'
  sanitize racecheck kpool-kernels engine_cuda_kpool_test 'KpoolKernelsTest.*'
  sanitize memcheck kpool-layer engine_cuda_kpool_test 'KpoolLayerTest.Glm5NextExpertsLayersMatchCpu'
  # DeepSeek-V4: its kernels' tests (the compressors' fold, the indexer, attention, hyper-connections)
  # under memcheck and racecheck, and the resume through CudaModel under memcheck.
  sanitize memcheck dsv4-kernels engine_cuda_dsv4_test 'Dsv4KernelsTest.*'
  sanitize racecheck dsv4-kernels engine_cuda_dsv4_test 'Dsv4KernelsTest.*'
  sanitize memcheck dsv4-resume engine_cuda_model_test 'Dsv4Family/CudaDsv4ResumeTest.*/1'
  sanitize racecheck glm5-residual-kernels engine_cuda_glm5_residual_test 'Glm5KernelsTest.*'
  # Qwen4-Exp: the gated residual's and QSA's kernels, and the QSA layer through its kind.
  sanitize memcheck qwen4-residual engine_cuda_qwen4exp_residual_test 'Qwen4ExpResidualTest.*'
  sanitize racecheck qsa-kernels engine_cuda_qsa_test 'QsaKernelsTest.*'
  sanitize memcheck qsa-layer engine_cuda_qsa_test 'QsaMixerTest.*'
  sanitize memcheck qwen4-generation engine_cuda_model_test 'Qwen4ExpFamily/CudaModelFixtureTest.MatchesCpuModelAndTransformers/0'
fi
if want bench; then
  echo "=== exl3-engine-bench (GLM-4.5-Air shapes, ${ENGINE_LAYERS:-6} layers)"
  MODEL=${ENGINE_MODEL_DIR:-/tmp/glm45-air-synthetic-${ENGINE_LAYERS:-6}}
  bash scripts/gpu/glm45_air_model.sh "$BIN" "$MODEL" ${ENGINE_LAYERS:-6} "$OUT/engine-model.log"
  timeout ${BENCH_TIMEOUT:-200} "$BIN"/exl3-engine-bench --model "$MODEL" --context ${CONTEXTS:-1024,8192} \
    --batch ${BATCHES:-1,8,32,64} --steps ${STEPS:-12} --json "$OUT/engine-bench.json" > "$OUT/engine-bench.log" 2>&1
  echo "bench exit $?"
  cat "$OUT/engine-bench.log"
  # Before and after a change, in the same call: a baseline build's bench (bundle.sh BASELINE_BUILD)
  # and this one's, alternately, twice each.
  if [ -x "$BIN"/exl3-engine-bench-baseline ]; then
    for round in 1 2; do
      for which in baseline current; do
        bench="$BIN"/exl3-engine-bench; [ $which = baseline ] && bench="$BIN"/exl3-engine-bench-baseline
        echo "--- $which, round $round"
        timeout ${BENCH_TIMEOUT:-200} "$bench" --model "$MODEL" --context ${CONTEXTS:-1024,8192} \
          --batch ${BATCHES:-1,8,32,64} --steps ${STEPS:-12} > "$OUT/engine-bench-$which-$round.log" 2>&1
        echo "$which bench exit $?"
        cat "$OUT/engine-bench-$which-$round.log"
      done
    done
  fi
  echo "--- the same decode steps launched eagerly (no CUDA graphs)"
  timeout ${EAGER_TIMEOUT:-60} "$BIN"/exl3-engine-bench --model "$MODEL" --context 1024 --batch 1,8,64 --steps 8 \
    --no-graphs --json "$OUT/engine-bench.json" > "$OUT/engine-bench-eager.log" 2>&1
  echo "eager bench exit $?"
  grep -E "^decode|GPU time" "$OUT/engine-bench-eager.log"
fi
if [[ " $ONLY " == *" dsa "* ]]; then
  echo "=== exl3-engine-bench (GLM-MoE-DSA: GLM-5.3-Flash MoE shapes, GlmMoeDsaConfig attention, ${DSA_LAYERS:-6} layers)"
  MODEL=${DSA_MODEL_DIR:-/tmp/glm-dsa-synthetic-${DSA_LAYERS:-6}}
  if [ ! -f "$MODEL/config.json" ]; then
    timeout 300 "$BIN"/exl3-tool make-test-model --arch glm_moe_dsa --synthetic --whole-model --output "$MODEL" \
      --hidden 4096 --experts 288 --top-k 8 --intermediate 2048 --shared 1 --layers ${DSA_LAYERS:-6} \
      --dense-layers 3 --dense-intermediate 12288 --vocab 154880 --heads 64 --kv-heads 64 \
      --q-lora-rank 2048 --kv-lora-rank 512 --qk-nope-head-dim 192 --qk-rope-head-dim 64 --v-head-dim 256 \
      --index-heads 32 --index-head-dim 128 --index-topk 2048 \
      --bits 2 --attention-bits 4 --head-bits 6 --codebook mcg --max-position 16384 --quiet > "$OUT/dsa-model.log" 2>&1 || { echo "model generation failed"; tail -5 "$OUT/dsa-model.log"; }
  fi
  timeout ${BENCH_TIMEOUT:-300} "$BIN"/exl3-engine-bench --model "$MODEL" --context ${CONTEXTS:-1024,8192} \
    --batch ${DSA_BATCHES:-1,8,32} --steps ${STEPS:-12} --json "$OUT/engine-bench.json" > "$OUT/dsa-bench.log" 2>&1
  echo "dsa bench exit $?"
  cat "$OUT/dsa-bench.log"
fi
if [[ " $ONLY " == *" glm5 "* ]]; then
  # GLM5_DEPTHS "6,10": both depths, then the 45-layer model extrapolated per layer
  # (scripts/gpu/depth_extrapolation.py; the whole model does not fit an H100's memory).
  DEPTHS=${GLM5_DEPTHS:-${GLM5_LAYERS:-8}}
  for l in ${DEPTHS//,/ }; do
    echo "=== exl3-engine-bench (GLM-5.3-Flash, synthetic at the published shapes, $l layers)"
    MODEL=/tmp/glm5-next-synthetic-$l
    [ -z "${GLM5_DEPTHS:-}" ] && MODEL=${GLM5_MODEL_DIR:-$MODEL}
    bash scripts/gpu/glm5_next_model.sh "$BIN" "$MODEL" $l "$OUT/glm5-model-L$l.log" ${GLM5_MODEL_TIMEOUT:-600}
    timeout ${BENCH_TIMEOUT:-300} "$BIN"/exl3-engine-bench --model "$MODEL" --context ${CONTEXTS:-1024,8192} \
      --batch ${GLM5_BATCHES:-1,8,32,64} --steps ${STEPS:-12} --json "$OUT/glm5-L$l.json" > "$OUT/glm5-bench-L$l.log" 2>&1
    echo "glm5 bench ($l layers) exit $?"
    cat "$OUT/glm5-bench-L$l.log"
    [ -z "${GLM5_DEPTHS:-}" ] || rm -rf "$MODEL"  # room on the disk for the next depth
  done
  if [ -n "${GLM5_DEPTHS:-}" ]; then
    set -- ${GLM5_DEPTHS//,/ }
    python3 scripts/gpu/depth_extrapolation.py --layers ${GLM5_FULL_LAYERS:-45} "$1:$OUT/glm5-L$1.json" \
      "$2:$OUT/glm5-L$2.json" | tee "$OUT/glm5-extrapolated.md"
  fi
fi
if [[ " $ONLY " == *" spec "* ]]; then
  echo "=== exl3-engine-bench --speculative-acceptance (speculative decoding through the engine)"
  MODEL=${SPEC_MODEL_DIR:-${ENGINE_MODEL_DIR:-/tmp/glm45-air-synthetic-${ENGINE_LAYERS:-6}}}
  [ -n "${SPEC_MODEL_DIR:-}" ] || bash scripts/gpu/glm45_air_model.sh "$BIN" "$MODEL" ${ENGINE_LAYERS:-6} "$OUT/engine-model.log"
  for policy in ${SPEC_POLICIES:-fixed adaptive goodput}; do
    timeout ${SPEC_TIMEOUT:-400} "$BIN"/exl3-engine-bench --model "$MODEL" --context ${SPEC_CONTEXT:-1024} \
      --batch ${SPEC_BATCHES:-1,8,32} --steps ${SPEC_STEPS:-64} --speculative-acceptance ${SPEC_ACCEPTANCE:-0,0.5,0.7,0.9,1} \
      --num-speculative-tokens ${SPEC_KS:-1,2,3,4} --speculative-draft-length $policy \
      --json "$OUT/engine-bench.json" > "$OUT/spec-bench-$policy.log" 2>&1
    echo "spec bench ($policy) exit $?"
    cat "$OUT/spec-bench-$policy.log"
  done
fi
if [[ " $ONLY " == *" constraint "* ]]; then
  echo "=== exl3-engine-bench --constrained-tokenizer (constrained decoding's step through the engine)"
  MODEL=${CONSTRAINT_MODEL_DIR:-${ENGINE_MODEL_DIR:-/tmp/glm45-air-synthetic-${ENGINE_LAYERS:-6}}}
  [ -n "${CONSTRAINT_MODEL_DIR:-}" ] || bash scripts/gpu/glm45_air_model.sh "$BIN" "$MODEL" ${ENGINE_LAYERS:-6} "$OUT/engine-model.log"
  timeout ${CONSTRAINT_TIMEOUT:-400} "$BIN"/exl3-engine-bench --model "$MODEL" \
    --constrained-tokenizer ${CONSTRAINT_TOKENIZER:-tests/fixtures/tokenizer/glm4_moe/tokenizer.json} \
    --context ${CONSTRAINT_CONTEXT:-1024} --batch ${CONSTRAINT_BATCHES:-1,64} --steps ${CONSTRAINT_STEPS:-32} \
    --json "$OUT/engine-bench.json" > "$OUT/constraint-bench.log" 2>&1
  echo "constraint bench exit $?"
  cat "$OUT/constraint-bench.log"
fi
if want attention; then
  echo "=== exl3-engine-bench --attention-only (GLM-4.5-Air's attention shape)"
  timeout ${ATTENTION_TIMEOUT:-150} "$BIN"/exl3-engine-bench --attention-only --json "$OUT/engine-bench.json" \
    > "$OUT/attention-bench.log" 2>&1
  echo "attention bench exit $?"
  cat "$OUT/attention-bench.log"
fi
if want sampling; then
  echo "=== engine_cuda_sampling_test"
  timeout ${SAMPLING_TEST_TIMEOUT:-300} "$BIN"/engine_cuda_sampling_test > "$OUT/sampling-test.log" 2>&1
  echo "sampling test exit $?"
  grep -E "^(device sampler|model) |FAIL|diverged|Failure|error|PASSED" "$OUT/sampling-test.log" | head -200
  if command -v compute-sanitizer > /dev/null; then
    for tool in memcheck racecheck; do
      timeout ${SANITIZE_TIMEOUT:-120} compute-sanitizer --tool $tool --error-exitcode 3 "$BIN"/engine_cuda_sampling_test \
        --gtest_filter='DeviceSamplerTest.EveryPathOnce:DeviceSamplerTest.SameSeed*' > "$OUT/sampling-sanitizer-$tool.log" 2>&1
      rc=$?
      echo "$tool exit $rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sampling-sanitizer-$tool.log" | tail -1)"
      [ "$rc" = 0 ] || grep -E "error|Error|ERROR|FAIL|Invalid" "$OUT/sampling-sanitizer-$tool.log" | grep -v SUMMARY | head -8
    done
  fi
  echo "=== exl3-engine-bench --sampling-only"
  timeout ${SAMPLING_BENCH_TIMEOUT:-150} "$BIN"/exl3-engine-bench --sampling-only --json "$OUT/engine-bench.json" \
    > "$OUT/sampling-bench.log" 2>&1
  echo "sampling bench exit $?"
  cat "$OUT/sampling-bench.log"
fi
