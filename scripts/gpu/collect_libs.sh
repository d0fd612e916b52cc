#!/usr/bin/env bash
# Copies into DEST_LIB_DIR every shared library the given binaries load that the GPU machine
# lacks (Debian's abseil, gRPC, protobuf, ...): everything but glibc, the C++ runtime and CUDA's
# own libraries, which the GPU machine's CUDA 13 image provides.
# Usage: scripts/gpu/collect_libs.sh DEST_LIB_DIR BINARY...
set -euo pipefail
dest=$1; shift
mkdir -p "$dest"
for bin in "$@"; do
  ldd "$bin" | awk '/=> \// {print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libgcc_s.so*|libstdc++.so*) ;;
      libcublas*|libcudart*|libcuda.so*) ;;
      *) cp -L -n "$lib" "$dest/" ;;
    esac
  done
done
