#!/usr/bin/env bash
# Constrained decoding on the GPU in one short device call (issue 30): the device sampler's tests
# (constraint masks applied where the logits are, against the CPU sampler, and the masked rows kept
# for a host redraw), then the engine's constrained step against its unconstrained one
# (scripts/gpu/engine.sh --only constraint) with the test tokenizer and, when carried, a
# 151k-token one (CONSTRAINT_TOKENIZER_XZ, default .gpu-check/bpe151k.json.xz: bench/train_bpe_tokenizer.py's
# output, xz-compressed). Needs the bundle of the binaries it runs (carry .gpu-check):
#   CUDA_ARCHITECTURES=90 ONLY="engine_cuda_sampling_test exl3-engine-bench exl3-tool" scripts/gpu/bundle.sh build
# No engine fixture is read.
#   bash scripts/gpu/constrained_sampling_checks.sh        (LIMIT: seconds it may take, default 240)
# Logs and the benchmarks' JSON in $OUT.
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
LIMIT=${LIMIT:-240}
. scripts/gpu/time_budget.sh
. scripts/gpu/env.sh
echo "=== device sampler with constraint masks ($(el) s)"
timeout "$(upto 90)" "$BIN"/engine_cuda_sampling_test --gtest_filter='DeviceSamplerTest.*' > "$OUT/sampling.log" 2>&1
echo "exit $?"; grep -E "device sampler, vocab|FAILED|PASSED|Failure" "$OUT/sampling.log" | head -20
echo "=== the constrained step through the engine, test tokenizer ($(el) s)"
OUT="$OUT/small" CONSTRAINT_TIMEOUT=$(upto 60) bash scripts/gpu/engine.sh --only constraint 2>&1 | grep -E "^\||exit"
XZ=${CONSTRAINT_TOKENIZER_XZ:-.gpu-check/bpe151k.json.xz}
if [ -f "$XZ" ] && [ "$(left)" -gt 40 ]; then
  echo "=== the same with a 151k-token byte-level BPE ($(el) s)"
  xz -dc "$XZ" > /tmp/bpe151k.json
  OUT="$OUT/bpe151k" CONSTRAINT_TOKENIZER=/tmp/bpe151k.json CONSTRAINT_TIMEOUT=$(upto 90) \
    bash scripts/gpu/engine.sh --only constraint 2>&1 | grep -E "^\||exit|vocab_size"
fi
echo "total $(el) s"
