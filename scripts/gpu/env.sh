# Sourced by the scripts/gpu/*.sh runners on the GPU machine: puts a carried bundle's libraries
# and CUDA's (cuBLAS, wherever the machine keeps it) on LD_LIBRARY_PATH and sets BIN to its
# binaries. GPU_BUNDLE names the bundle: .gpu-deps (default; unpacked once from
# .gpu-check/gpu-deps.tar.xz, made by scripts/gpu/bundle.sh) or .gpu-e2e (scripts/gpu/e2e_bundle.sh).
GPU_BUNDLE=${GPU_BUNDLE:-.gpu-deps}
CUDA_LIBS=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
         $(python3 -c 'import nvidia.cublas, os; print(os.path.join(nvidia.cublas.__path__[0], "lib"))' 2>/dev/null); do
  [ -e "$d/libcublas.so.13" ] && CUDA_LIBS="$CUDA_LIBS:$d"
done
export LD_LIBRARY_PATH="$PWD/$GPU_BUNDLE/lib$CUDA_LIBS:${LD_LIBRARY_PATH:-}"
BIN=$PWD/$GPU_BUNDLE/bin
if [ "$GPU_BUNDLE" = .gpu-deps ] && [ ! -d "$BIN" ] && [ -f .gpu-check/gpu-deps.tar.xz ]; then
  python3 -c 'import tarfile; tarfile.open(".gpu-check/gpu-deps.tar.xz").extractall()'
fi
