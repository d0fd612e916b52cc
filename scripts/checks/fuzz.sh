#!/usr/bin/env bash
# Fuzzes the safetensors header parser (model/safetensors.cc) with libFuzzer + AddressSanitizer
# for a bounded time. Compiles with clang directly (the main build may use gcc).
# Usage: scripts/checks/fuzz.sh [BUILD_DIR]   (FUZZ_SECONDS overrides the default 60 s)
# Exits non-zero on any crash, sanitizer report, leak or build failure.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD_DIR="${1:-build}"
SECONDS_TO_RUN="${FUZZ_SECONDS:-60}"
OUT="$BUILD_DIR/fuzz"
mkdir -p "$OUT/corpus" "$OUT/artifacts"

CXX="$(command -v clang++ || true)"
if [ -z "$CXX" ]; then
  echo "fuzz.sh: clang++ not found (scripts/install-deps.sh installs clang)" >&2
  exit 1
fi

. scripts/checks/lib/absl_libs.sh
BIN="$OUT/safetensors_header_fuzz"
echo "fuzz.sh: building $BIN"
"$CXX" -std=c++20 -O1 -g -fsanitize=fuzzer,address -I. \
  tools/fuzz/safetensors_header_fuzz.cc model/safetensors.cc model/weight_digest.cc \
  model/owned_pages.cc model/checkpoint_naming.cc \
  $ABSL_LIBS \
  -o "$BIN"

# Seed corpus: the golden files' headers (with a little data, so offsets are partly valid) and a
# few small valid files.
python3 - "$OUT/corpus" <<'PY'
import json, struct, sys, os
out = sys.argv[1]
for name in os.listdir("tests/golden"):
    if not name.endswith(".safetensors"):
        continue
    b = open(os.path.join("tests/golden", name), "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    open(os.path.join(out, name + ".head"), "wb").write(b[: 8 + n + 64])
def make(path, tensors, meta=None):
    hdr, data, off = {}, b"", 0
    for tname, dtype, shape, size in tensors:
        hdr[tname] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + size]}
        data += bytes((i * 7) & 0xFF for i in range(size))
        off += size
    if meta:
        hdr["__metadata__"] = meta
    h = json.dumps(hdr).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    open(os.path.join(out, path), "wb").write(struct.pack("<Q", len(h)) + h + data)
make("small1", [("a.trellis", "I16", [1, 1, 32], 64), ("a.suh", "F16", [16], 32)])
make("small2", [("x", "F32", [2, 3], 24), ("flag", "I32", [], 4), ("e", "BF16", [0], 0)], {"k": "v"})
make("small3", [("b", "U8", [5], 5), ("c", "F64", [1], 8), ("d", "F8_E4M3", [3], 3)])
PY

echo "fuzz.sh: running for ${SECONDS_TO_RUN}s"
set +e
"$BIN" -max_total_time="$SECONDS_TO_RUN" -max_len=4096 -timeout=10 -rss_limit_mb=2048 \
  -artifact_prefix="$OUT/artifacts/" -print_final_stats=1 "$OUT/corpus" 2>&1 | tail -n 25
status=${PIPESTATUS[0]}
set -e
if [ "$status" -ne 0 ]; then
  echo "fuzz.sh: the fuzzer found a problem (exit $status); reproducer in $OUT/artifacts/" >&2
  exit 1
fi
echo "fuzz.sh: clean"
