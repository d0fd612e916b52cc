#!/usr/bin/env bash
# cuobjdump and nvdisasm on a machine whose CUDA toolkit has nvcc but not them (this project's
# CPU machines): NVIDIA's wheels from the package registry, unpacked under build/cuda-binutils.
# Prints the folder that holds them; then, for example, SASS of a kernel without a GPU:
#   PATH=$(scripts/dev/cuda_binutils.sh):$PATH python3 scripts/gpu/sass_count.py build/bin/exl3-bench
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=build/cuda-binutils
VERSION=13.5.37
if [ ! -x "$DIR/nvidia/cu13/bin/cuobjdump" ] || [ ! -x "$DIR/nvidia/cu13/bin/nvdisasm" ]; then
  mkdir -p "$DIR"
  python3 -m pip download -q --no-deps -d "$DIR" "nvidia-cuda-cuobjdump==$VERSION" "nvidia-cuda-nvdisasm==$VERSION" >&2
  for w in "$DIR"/*.whl; do python3 -m zipfile -e "$w" "$DIR"; done
  chmod +x "$DIR"/nvidia/cu13/bin/*
fi
echo "$PWD/$DIR/nvidia/cu13/bin"
