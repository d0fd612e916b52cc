#!/usr/bin/env bash
# Builds the CUDA tools here (Debian 12, nvcc 13) and collects them with the shared libraries the
# GPU machine lacks (Debian's abseil etc.; not glibc, not CUDA) into .gpu-deps/ (git-ignored), for
# the device tool's `carry`, and packs them into .gpu-check/gpu-deps.tar.xz (git-ignored, ~6 MB: the
# unpacked binaries with sm_90 + sm_121 code are ~44 MB, too much beside the working tree for the
# 64 MiB a call carries; run_all.sh unpacks it). Usage: scripts/gpu/bundle.sh [BUILD_DIR]   (default build-cuda)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build-cuda}
if [ ! -f "$BUILD/build.ninja" ]; then
  cmake -S . -B "$BUILD" -G Ninja -DEXL3_WITH_CUDA=ON -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc \
    -DCMAKE_CUDA_ARCHITECTURES="90;121"
fi
# The kernels' tools, the GPU engine's tests and benchmark (scripts/gpu/engine.sh), exl3-tool
# (synthetic models; --backend cuda for scripts/conformance/moe_conformance.py), and exl3-worker
# with exl3-loadgen (scripts/gpu/unified_memory.sh; exl3-worker and exl3-engine-bench --expert-map
# for scripts/gpu/engine_remote.sh), and exl3-remote-moe-bench (one remote MoE layer call's cost,
# scripts/gpu/remote_call.sh, which runs worker_cuda_backend_test first).
cmake --build "$BUILD" -j2 --target exl3-bench exl3-decode-share-sweep exl3-cuda-check exl3-engine-bench engine_cuda_model_test \
  engine_cuda_sampling_test engine_cuda_latent_attention_test engine_cuda_deltanet_test engine_cuda_delta_rule_test engine_cuda_dense_gemv_test engine_cuda_kda_test \
  engine_cuda_kpool_test engine_cuda_dsv4_test engine_cuda_glm5_residual_test engine_cuda_qwen4exp_residual_test \
  engine_cuda_qsa_test engine_cuda_speculative_test engine_cuda_mtp_test engine_cuda_verify_chunk_states_test engine_cuda_verify_chunk_indexers_test engine_cuda_dsv4_verify_chunk_test engine_cuda_prompt_logprobs_test engine_cuda_finite_check_test exl3-tool exl3-worker exl3-loadgen exl3-remote-moe-bench worker_cuda_backend_test
rm -rf .gpu-deps
mkdir -p .gpu-deps/bin .gpu-deps/lib
cp "$BUILD"/bin/exl3-bench "$BUILD"/bin/exl3-decode-share-sweep "$BUILD"/bin/exl3-cuda-check "$BUILD"/bin/exl3-engine-bench "$BUILD"/bin/exl3-tool \
  "$BUILD"/bin/exl3-worker "$BUILD"/bin/exl3-loadgen "$BUILD"/tests/engine_cuda_model_test \
  "$BUILD"/tests/engine_cuda_sampling_test "$BUILD"/tests/engine_cuda_latent_attention_test \
  "$BUILD"/tests/engine_cuda_deltanet_test "$BUILD"/tests/engine_cuda_delta_rule_test "$BUILD"/tests/engine_cuda_dense_gemv_test "$BUILD"/tests/engine_cuda_kda_test "$BUILD"/tests/engine_cuda_kpool_test "$BUILD"/tests/engine_cuda_dsv4_test \
  "$BUILD"/tests/engine_cuda_glm5_residual_test "$BUILD"/tests/engine_cuda_qwen4exp_residual_test \
  "$BUILD"/tests/engine_cuda_qsa_test "$BUILD"/tests/engine_cuda_speculative_test "$BUILD"/tests/engine_cuda_mtp_test "$BUILD"/tests/engine_cuda_verify_chunk_states_test "$BUILD"/tests/engine_cuda_verify_chunk_indexers_test "$BUILD"/tests/engine_cuda_dsv4_verify_chunk_test "$BUILD"/tests/engine_cuda_prompt_logprobs_test "$BUILD"/tests/engine_cuda_finite_check_test "$BUILD"/tests/exl3-remote-moe-bench \
  "$BUILD"/tests/worker_cuda_backend_test .gpu-deps/bin/
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
