#!/usr/bin/env bash
# Fuzzes the expert worker's request decoding (services/expert_worker/request.cc and the wire
# tensor conversion it uses) with libFuzzer + AddressSanitizer + UBSan for a bounded time:
# arbitrary bytes parsed as an ExpertRequest, then validated against a fixed model shape.
# Usage: scripts/checks/worker_fuzz.sh BUILD_DIR   (WORKER_FUZZ_SECONDS overrides 30 s)
# Needs the generated protobuf code in BUILD_DIR/proto (the main build makes it).
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD_DIR="${1:?usage: scripts/checks/worker_fuzz.sh BUILD_DIR}"
SECONDS_TO_RUN="${WORKER_FUZZ_SECONDS:-30}"
GEN="$BUILD_DIR/proto"
OUT="$BUILD_DIR/worker_fuzz"
mkdir -p "$OUT/corpus" "$OUT/artifacts"
CXX="$(command -v clang++ || true)"
[ -n "$CXX" ] || { echo "worker_fuzz: clang++ not found (scripts/install-deps.sh)" >&2; exit 1; }
[ -f "$GEN/exl3serve/v1/exl3serve.pb.cc" ] || { echo "worker_fuzz: $GEN/exl3serve/v1/exl3serve.pb.cc missing (build exl3_proto first)" >&2; exit 1; }

. scripts/checks/lib/absl_libs.sh
BIN="$OUT/request_fuzz"
echo "worker_fuzz: building $BIN"
"$CXX" -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -I. -I"$GEN" -w \
  tests/services/expert_worker/request_fuzz.cc services/expert_worker/request.cc \
  services/common/wire.cc "$GEN/exl3serve/v1/exl3serve.pb.cc" \
  $(pkg-config --libs protobuf) \
  $ABSL_LIBS \
  -o "$BIN"

# Seed corpus: valid and nearly valid requests, protobuf-encoded by hand.
python3 - "$OUT/corpus" <<'PY'
import os, struct, sys, random
out = sys.argv[1]
def varint(v):
    v &= (1 << 64) - 1
    b = b""
    while True:
        x = v & 0x7F; v >>= 7
        if v: b += bytes([x | 0x80])
        else: return b + bytes([x])
def key(f, t): return varint(f << 3 | t)
def ld(f, payload): return key(f, 2) + varint(len(payload)) + payload
def tensor(dtype, shape, data):
    return key(1, 0) + varint(dtype) + ld(2, b"".join(varint(d) for d in shape)) + ld(3, data)
rng = random.Random(1)
def request(i, layer, T, S, dtype=1, ids=None, out_dtype=0, timeout=0):
    H = 8
    n = T * H
    if dtype == 1: data = b"".join(struct.pack("<f", rng.uniform(-2, 2)) for _ in range(n))
    else: data = bytes(rng.randrange(256) for _ in range(2 * n))
    ids = ids if ids is not None else [rng.choice([-1, 0, 1, 2, 3]) for _ in range(T * S)]
    w = b"".join(struct.pack("<f", rng.uniform(0, 1)) for _ in range(T * S))
    m = key(1, 0) + varint(i) + key(2, 0) + varint(layer) + ld(3, tensor(dtype, [T, H], data))
    m += key(4, 0) + varint(S) + ld(5, b"".join(varint(x) for x in ids)) + ld(6, w)
    if out_dtype: m += key(7, 0) + varint(out_dtype)
    if timeout: m += key(8, 0) + varint(timeout)
    return m
seeds = [request(1, 1, 2, 3), request(2, 2, 1, 1, dtype=2), request(3, 1, 3, 2, dtype=3, out_dtype=3),
         request(4, 0, 1, 1), request(5, 1, 1, 2, ids=[5, 4]), request(6, 2, 2, 2, ids=[1, 1, 0, -1]),
         request(7, 1, 4, 4, timeout=1000)]
for k, s in enumerate(seeds):
    open(os.path.join(out, f"seed{k}"), "wb").write(s)
PY

echo "worker_fuzz: running for ${SECONDS_TO_RUN}s"
set +e
"$BIN" -max_total_time="$SECONDS_TO_RUN" -max_len=2048 -timeout=10 -rss_limit_mb=2048 \
  -artifact_prefix="$OUT/artifacts/" -print_final_stats=1 "$OUT/corpus" 2>&1 | tail -n 12
status=${PIPESTATUS[0]}
set -e
if [ "$status" -ne 0 ]; then
  echo "worker_fuzz: the fuzzer found a problem (exit $status); reproducer in $OUT/artifacts/" >&2
  exit 1
fi
echo "worker_fuzz: clean"
