#!/usr/bin/env bash
# Run HERE (Debian 12): packs what scripts/gpu/frontend.sh needs to run bench/frontend_bench.py on
# the GPU machine (16 cores, no network, no Debian -dev packages) into ONE archive,
# .gpu-check/frontend.tar.xz (git-ignored), for the device tool's `carry`:
#   .gpu-front/bin/    exl3-router and exl3-tool, a CPU build (the benchmark's engine is the CPU
#                      engine on a small generated model)
#   .gpu-front/lib/    the shared libraries they load that the GPU machine lacks
#                      (scripts/gpu/collect_libs.sh)
#   .gpu-front/wheels/ an offline wheelhouse for CPython 3.12 manylinux x86_64: the clients/python
#                      package built as a wheel, and the pinned packages of
#                      scripts/checks/frontend/requirements.txt (the front end's dependencies and
#                      the openai SDK; not pytest or mypy) with everything they pull in, except IMAGE_HAS
#                      below
#   .gpu-front/IMAGE_HAS, .gpu-front/MANIFEST  the names left out; the files packed
# (.gpu-front/ is staged in the repository root, git-ignored, and removed once packed.)
# Size: a call carries at most 64 MiB with the working tree, which is ~41 MB of tracked files, so the
# archive has ~22 MB. The full wheelhouse is ~45 MB (numpy alone 17 MB), so the big binary packages
# that the GPU machine's python3 already has are left out (IMAGE_HAS; frontend.sh takes them from
# that python3 and prints their versions) and every wheel is re-zipped uncompressed (same files, same
# names) so that xz compresses across them: about 11 MB in all (~6 MB of it the wheels).
# Usage: scripts/gpu/frontend_bundle.sh [--no-build] [BUILD_DIR]   (default build-front)
#   --no-build: pack BUILD_DIR/bin's binaries as they are.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=build-front
NO_BUILD=0
while [ $# -gt 0 ]; do
  case "$1" in
    --no-build) NO_BUILD=1 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) BUILD=$1 ;;
  esac
  shift
done
# The GPU machine's python3 has these (with their own dependencies); the front end needs only
# numpy>=1.24, grpcio>=1.51, tokenizers>=0.15, uvloop>=0.17 (clients/python/pyproject.toml).
IMAGE_HAS="numpy grpcio tokenizers huggingface_hub hf_xet uvloop pyyaml"
PYTAGS=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64
        --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64)

if [ "$NO_BUILD" = 0 ]; then
  if [ ! -f "$BUILD/build.ninja" ]; then
    launcher=()
    command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
    cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DEXL3_WITH_CUDA=OFF "${launcher[@]}"
  fi
  cmake --build "$BUILD" -j2 --target exl3-router exl3-tool
fi
STAGE=.gpu-front
rm -rf "$STAGE"
mkdir -p "$STAGE/bin" "$STAGE/lib" "$STAGE/wheels"
cp "$BUILD/bin/exl3-router" "$BUILD/bin/exl3-tool" "$STAGE/bin/"
scripts/gpu/collect_libs.sh "$STAGE/lib" "$STAGE"/bin/*
strip --strip-all "$STAGE"/bin/* 2>/dev/null || true
strip --strip-unneeded "$STAGE"/lib/* 2>/dev/null || true

# Downloads, kept in BUILD/frontend-wheels until the requirements change.
DL=$BUILD/frontend-wheels
mkdir -p "$BUILD"
grep -v -e '^pytest==' -e '^mypy==' scripts/checks/frontend/requirements.txt > "$BUILD/frontend-bench-requirements.txt"
req_hash=$(sha256sum "$BUILD/frontend-bench-requirements.txt" | cut -c1-16)
if [ "$(cat "$DL/.requirements" 2>/dev/null)" != "$req_hash" ]; then
  rm -rf "$DL"
  python3 -m pip download --quiet --disable-pip-version-check "${PYTAGS[@]}" -d "$DL" \
    -r "$BUILD/frontend-bench-requirements.txt"
  echo "$req_hash" > "$DL/.requirements"
fi
rm -rf clients/python/build  # setuptools' in-tree build output: no stale module may ship
python3 -m pip wheel --quiet --disable-pip-version-check --no-deps -w "$DL/own" ./clients/python
rm -rf clients/python/build

# Re-zips each wheel uncompressed into the stage (entries and names unchanged), leaving out IMAGE_HAS.
python3 - "$DL" "$STAGE/wheels" "$IMAGE_HAS" <<'EOF'
import re, sys, zipfile
from pathlib import Path
src, dst, left_out = Path(sys.argv[1]), Path(sys.argv[2]), set(sys.argv[3].split())
for whl in sorted(list(src.glob("*.whl")) + list((src / "own").glob("*.whl"))):
    name = re.sub(r"[-_.]+", "_", whl.name.split("-")[0]).lower()
    if name in left_out:
        continue
    with zipfile.ZipFile(whl) as zin, zipfile.ZipFile(dst / whl.name, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            info.compress_type = zipfile.ZIP_STORED
            zout.writestr(info, data)
EOF
echo "$IMAGE_HAS" > "$STAGE/IMAGE_HAS"
(cd "$STAGE" && find . -type f | sort > MANIFEST)
mkdir -p .gpu-check
tar -cf - "$STAGE" | xz -6 -T2 > .gpu-check/frontend.tar.xz
unpacked=$(du -sh "$STAGE" | cut -f1)
nwheels=$(ls "$STAGE/wheels" | wc -l)
rm -rf "$STAGE"  # only the archive travels
tree_bytes=$(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s}')
archive_bytes=$(stat -c %s .gpu-check/frontend.tar.xz)
echo "$nwheels wheels, $unpacked unpacked; left out: $IMAGE_HAS"
echo "archive .gpu-check/frontend.tar.xz: $((archive_bytes / 1000000)) MB; with the tracked tree" \
  "($((tree_bytes / 1000000)) MB): $(((archive_bytes + tree_bytes) / 1048576)) MiB of the 64 MiB a call carries"
