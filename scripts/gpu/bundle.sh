#!/usr/bin/env bash
# Builds the CUDA tools here (Debian 12, nvcc 13) and collects them with the shared libraries the
# GPU machine lacks (Debian's abseil etc.; not glibc, not CUDA) into .gpu-deps/ (git-ignored), for
# the device tool's `carry`, and packs them into .gpu-check/gpu-deps.tar.xz (git-ignored, ~6 MB: the
# unpacked binaries with sm_90 + sm_121 code are ~44 MB, too much beside the working tree for the
# 64 MiB a call carries; run_all.sh unpacks it). Usage: scripts/gpu/bundle.sh [BUILD_DIR]   (default build-cuda)
# Environment: ONLY (a subset of the binaries below), CUDA_ARCHITECTURES for a new BUILD_DIR
# (default "90;121"; "90" alone builds in about half the time when only an H100/H200 will run it).
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build-cuda}
if [ ! -f "$BUILD/build.ninja" ]; then
  cmake -S . -B "$BUILD" -G Ninja -DEXL3_WITH_CUDA=ON -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc \
    -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHITECTURES:-90;121}"
fi
# The kernels' tools, the GPU engine's tests and benchmark (scripts/gpu/engine.sh), exl3-tool
# (synthetic models; --backend cuda for scripts/conformance/moe_conformance.py), and exl3-worker
# with exl3-loadgen (scripts/gpu/unified_memory.sh; exl3-worker and exl3-engine-bench --expert-map
# for scripts/gpu/engine_remote.sh), and exl3-remote-moe-bench (one remote MoE layer call's cost,
# scripts/gpu/remote_call.sh, which runs worker_cuda_backend_test first). TOOLS land in BUILD/bin,
# TESTS in BUILD/tests.
TOOLS="exl3-bench exl3-decode-share-sweep exl3-cuda-check exl3-engine-bench exl3-tool exl3-worker exl3-loadgen"
TESTS="engine_cuda_model_test engine_cuda_sampling_test engine_cuda_latent_attention_test engine_cuda_deltanet_test
  engine_cuda_delta_rule_test engine_cuda_dense_gemv_test engine_cuda_kda_test engine_cuda_kpool_test engine_cuda_dsv4_test
  engine_cuda_glm5_residual_test engine_cuda_qwen4exp_residual_test engine_cuda_qsa_test engine_cuda_speculative_test
  engine_cuda_mtp_test engine_cuda_verify_chunk_states_test engine_cuda_verify_chunk_indexers_test
  engine_cuda_dsv4_verify_chunk_test engine_cuda_prompt_logprobs_test engine_cuda_finite_check_test exl3-remote-moe-bench
  worker_cuda_backend_test engine_cuda_dspark_test"
# ONLY (names from the two lists, space-separated): build and pack just those (a call that runs
# a few of them carries less; scripts/gpu/seed_model_checks.sh names its own).
selected=""
for name in $TOOLS $TESTS; do
  if [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $name "* ]]; then selected="$selected $name"; fi
done
known=" $(echo $TOOLS $TESTS) "  # one space between names, none at line ends
for name in ${ONLY:-}; do
  [[ "$known" == *" $name "* ]] || { echo "bundle.sh: ONLY names $name, which it does not bundle" >&2; exit 2; }
done
cmake --build "$BUILD" -j2 --target $selected
rm -rf .gpu-deps
mkdir -p .gpu-deps/bin .gpu-deps/lib
for name in $selected; do
  if [[ " $TOOLS " == *" $name "* ]]; then cp "$BUILD/bin/$name" .gpu-deps/bin/; else cp "$BUILD/tests/$name" .gpu-deps/bin/; fi
done
# BASELINE_BUILD: another build directory's exl3-engine-bench (an earlier commit's), which
# scripts/gpu/engine.sh --only bench runs beside this one's in the same call.
if [ -n "${BASELINE_BUILD:-}" ]; then
  cp "$BASELINE_BUILD"/bin/exl3-engine-bench .gpu-deps/bin/exl3-engine-bench-baseline
fi
scripts/gpu/collect_libs.sh .gpu-deps/lib .gpu-deps/bin/*
# Symbols and all: a call carries at most 64 MiB with the ~50 MB of tracked files, and the binaries
# are ~100 MB each way unstripped (xz -9e: ~11 MB for all of them, against 22 MB at the default).
strip --strip-all .gpu-deps/bin/* 2>/dev/null || true
mkdir -p .gpu-check
XZ_OPT=-9e tar -cJf .gpu-check/gpu-deps.tar.xz .gpu-deps
du -sh .gpu-deps .gpu-check/gpu-deps.tar.xz
