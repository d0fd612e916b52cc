# Sourced by the scripts/gpu/*.sh runners on the GPU machine: unpacks the carried binaries
# (.gpu-check/gpu-deps.tar.xz, made by scripts/gpu/bundle.sh) once and puts their libraries and
# CUDA's (cuBLAS, wherever the machine keeps it) on LD_LIBRARY_PATH. Sets BIN.
CUDA_LIBS=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
         $(python3 -c 'import nvidia.cublas, os; print(os.path.join(nvidia.cublas.__path__[0], "lib"))' 2>/dev/null); do
  [ -e "$d/libcublas.so.13" ] && CUDA_LIBS="$CUDA_LIBS:$d"
done
export LD_LIBRARY_PATH="$PWD/.gpu-deps/lib$CUDA_LIBS:${LD_LIBRARY_PATH:-}"
BIN=.gpu-deps/bin
if [ ! -d "$BIN" ] && [ -f .gpu-check/gpu-deps.tar.xz ]; then
  python3 -c 'import tarfile; tarfile.open(".gpu-check/gpu-deps.tar.xz").extractall()'
fi
