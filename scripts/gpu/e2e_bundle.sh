#!/usr/bin/env bash
# Builds the service binaries with the CUDA backend here (Debian 12: gRPC, protobuf, abseil,
# prometheus-cpp from Debian's packages) and collects them, with every shared library the GPU
# machine lacks (it has CUDA but none of Debian's -dev packages), into .gpu-e2e/ (git-ignored) for
# the device tool's `carry`. Usage: scripts/gpu/e2e_bundle.sh [BUILD_DIR]   (default build-e2e)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build-e2e}
if [ ! -f "$BUILD/build.ninja" ]; then
  cmake -S . -B "$BUILD" -G Ninja -DEXL3_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DCMAKE_BUILD_TYPE=Release
fi
cmake --build "$BUILD" -j2 --target exl3-worker exl3-router exl3-loadgen exl3-tool
rm -rf .gpu-e2e
mkdir -p .gpu-e2e/bin .gpu-e2e/lib
for b in exl3-worker exl3-router exl3-loadgen exl3-tool; do cp "$BUILD/bin/$b" .gpu-e2e/bin/; done
scripts/gpu/collect_libs.sh .gpu-e2e/lib .gpu-e2e/bin/*
strip --strip-debug .gpu-e2e/bin/* .gpu-e2e/lib/* 2>/dev/null || true
du -sh .gpu-e2e
