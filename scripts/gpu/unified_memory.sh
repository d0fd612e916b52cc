#!/usr/bin/env bash
# On the GPU machine: --weights-residency host (the unified-memory path of a GB10; on an H200 the
# GPU reads the registered host memory over PCIe) on a model whose expert tensors are 8- but not
# 16-byte aligned in its files, as Python's safetensors leaves them (issue 16, "unified memory
# without a second copy"; services/expert_worker/host_resident_weights.h). Writes to $OUT (or
# ./gpu-out): unified-memory.txt (the summary) and the logs.
#  1. a synthetic Qwen3-MoE-shaped model (hidden 2048, 128 experts, top-8, intermediate 768, K=4
#     3INST, UM_LAYERS MoE layers, default 40: about 12 GB of experts) written with
#     make-test-model --misaligned-data; exl3-tool inspect must find no expert tensor 16-byte
#     aligned;
#  2. a baseline worker holding expert 0 of every layer: what the process holds besides the
#     weights (CUDA context, gRPC), in host and device memory;
#  3. exl3-worker --backend cuda --weights-residency host holding every expert; its answers
#     checked against the CPU reference (exl3-loadgen --in-process-router --verify);
#  4. peak resident memory (VmHWM), resident memory after the load (anonymous, file pages),
#     registered bytes (worker log, exl3_worker_pinned_bytes) and device memory (nvidia-smi),
#     each against the share's bytes.
# Exits non-zero when the peak resident memory is over 1.1x the share, when a second copy exists
# (file pages resident beside the realigned copy: RssFile over the baseline's by more than 5% of
# the share; device memory over the baseline's by more than 5% of the share; the worker logging
# tensors copied to device memory), when the answers do not verify, or when the model is not
# misaligned. Binaries come from .gpu-deps/ or .gpu-check/gpu-deps.tar.xz (scripts/gpu/bundle.sh;
# GPU_BUNDLE=.gpu-e2e takes scripts/gpu/e2e_bundle.sh's instead). About 2 minutes.
# Usage: scripts/gpu/unified_memory.sh [--layers N]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
LAYERS=${UM_LAYERS:-40}
while [ $# -gt 0 ]; do
  case "$1" in
    --layers) LAYERS="$2"; shift ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "unified_memory.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
. scripts/gpu/env.sh
for b in exl3-worker exl3-loadgen exl3-tool; do
  if [ ! -x "$BIN/$b" ] || ldd "$BIN/$b" | grep -q "not found"; then
    echo "$BIN/$b is missing or lacks libraries here (scripts/gpu/bundle.sh bundles it)"; ldd "$BIN/$b" 2>&1 | grep "not found"; exit 1
  fi
done
W=${UM_DIR:-/tmp/exl3-unified-memory}
rm -rf "$W"; mkdir -p "$W"
SUMMARY="$OUT/unified-memory.txt"
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
FAIL=0
fail() { say "FAIL: $*"; FAIL=1; }
PIDS=()
trap 'kill -TERM "${PIDS[@]}" 2>/dev/null; sleep 1; kill -KILL "${PIDS[@]}" 2>/dev/null; rm -rf "$W"' EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
status_bytes() { awk -v f="$2:" '$1 == f { print $2 * 1024 }' "/proc/$1/status"; }   # status_bytes PID FIELD
gpu_used_bytes() {  # device 0's used memory (0 without nvidia-smi)
  local v
  v=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0 2>/dev/null | awk '{ printf "%.0f", $1 * 1048576 }')
  echo "${v:-0}"
}
gb() { awk -v b="$1" 'BEGIN { printf "%.3f GB", b / 1e9 }'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", (b > 0 ? a / b : 0) }'; }
wait_ready() {  # wait_ready LOGFILE PID
  for _ in $(seq 1 900); do
    kill -0 "$2" 2>/dev/null || return 1
    grep -q "serving on" "$1" 2>/dev/null && return 0
    sleep 0.2
  done
  return 1
}
metrics_pinned() {  # exl3_worker_pinned_bytes from a metrics port
  python3 -c '
import sys, urllib.request
for line in urllib.request.urlopen("http://127.0.0.1:%s/metrics" % sys.argv[1], timeout=5).read().decode().splitlines():
    if line.startswith("exl3_worker_pinned_bytes"): print(int(float(line.split()[-1])))' "$1" 2>/dev/null
}

{ date -u; git rev-parse HEAD 2>/dev/null; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g | head -2; } | tee -a "$SUMMARY"

say "=== 1. model: Qwen3-MoE shapes, $LAYERS MoE layers, every tensor 8 bytes past a 16-byte boundary"
t0=$(date +%s)
"$BIN/exl3-tool" make-test-model --synthetic --misaligned-data --arch qwen3_moe --output "$W/model" \
  --hidden 2048 --experts 128 --top-k 8 --intermediate 768 --layers "$LAYERS" --bits 4 --codebook 3inst \
  --quiet > "$OUT/um-gen.log" 2>&1 || { tail -5 "$OUT/um-gen.log"; exit 1; }
"$BIN/exl3-tool" inspect --model "$W/model" > "$OUT/um-inspect.txt" 2>&1 || { tail -5 "$OUT/um-inspect.txt"; exit 1; }
SHARE=$(awk '/^bytes, total:/ { print $3 }' "$OUT/um-inspect.txt")
say "generated in $(( $(date +%s) - t0 )) s; share (every routed expert): $SHARE bytes ($(gb "$SHARE"))"
ALIGN=$(grep '^alignment:' "$OUT/um-inspect.txt")
say "$ALIGN"
[[ "$ALIGN" =~ alignment:\ +0\ of ]] || fail "the model's expert tensors are not all misaligned"

printf 'workers:\n  - name: w0\n    address: 127.0.0.1:%s\n    experts: 0-127\n' "$(free_port)" > "$W/map.yaml"
PORT=$(awk '/address:/ { split($2, a, ":"); print a[2] }' "$W/map.yaml")

start_worker() {  # start_worker NAME EXPERTS METRICS_PORT -> sets WPID
  "$BIN/exl3-worker" --model "$W/model" --experts "$2" --backend ${UM_BACKEND:-cuda} --weights-residency host \
    --listen 127.0.0.1:$PORT --metrics-listen 127.0.0.1:$3 --load-threads 16 --progress=false \
    > "$OUT/um-$1-worker.log" 2>&1 &
  WPID=$!; PIDS+=($WPID)
  if ! wait_ready "$OUT/um-$1-worker.log" $WPID; then
    echo "worker $1 did not start"; tail -20 "$OUT/um-$1-worker.log"; exit 1
  fi
}
stop_worker() { kill -TERM "$WPID"; wait "$WPID" 2>/dev/null; }

GPU_IDLE=$(gpu_used_bytes)
say "=== 2. baseline: a worker holding expert 0 of every layer"
M0=$(free_port)
start_worker baseline 0 $M0
BASE_HWM=$(status_bytes $WPID VmHWM); BASE_FILE=$(status_bytes $WPID RssFile)
BASE_GPU=$(( $(gpu_used_bytes) - GPU_IDLE ))
BASE_SHARE=$(grep -o 'loaded [0-9]* experts over [0-9]* layers: [0-9.]* MB' "$OUT/um-baseline-worker.log" | awk '{ printf "%.0f", $7 * 1e6 }')
say "baseline: VmHWM $(gb "$BASE_HWM") (of which its own share $(gb "$BASE_SHARE")), RssFile $(gb "$BASE_FILE"), device $(gb "$BASE_GPU")"
stop_worker

say "=== 3. every expert, --weights-residency host"
M1=$(free_port)
t0=$(date +%s.%N)
start_worker host all $M1
LOAD_S=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
HWM=$(status_bytes $WPID VmHWM); RSS=$(status_bytes $WPID VmRSS)
ANON=$(status_bytes $WPID RssAnon); FILE=$(status_bytes $WPID RssFile)
GPU=$(( $(gpu_used_bytes) - GPU_IDLE ))
PINNED=$(metrics_pinned $M1)
grep -h "weights used in place\|loaded .* experts\|copied to device" "$OUT/um-host-worker.log" | tee -a "$SUMMARY"
REGISTERED=$(grep -o 'in place from [0-9.]* MB of registered' "$OUT/um-host-worker.log" | awk '{ printf "%.0f", $4 * 1e6 }')
REALIGNED=$(grep -o 'in one realigned copy of [0-9.]* MB' "$OUT/um-host-worker.log" | awk '{ printf "%.0f", $6 * 1e6 }')
say "worker up in $LOAD_S s"
OWN=$(awk -v h="$HWM" -v b="$BASE_HWM" -v s="$BASE_SHARE" 'BEGIN { printf "%.0f", h - (b - s) }')
say "peak resident (VmHWM): $(gb "$HWM") = $(ratio "$HWM" "$SHARE") x share; less what the baseline holds besides its share: $(ratio "$OWN" "$SHARE") x share"
say "resident after load: $(gb "$RSS") (anonymous $(gb "$ANON"), file pages $(gb "$FILE"); baseline's file pages $(gb "$BASE_FILE"))"
say "registered host memory: $(gb "${REGISTERED:-0}") = $(ratio "${REGISTERED:-0}" "$SHARE") x share (realigned copy $(gb "${REALIGNED:-0}")); exl3_worker_pinned_bytes $(gb "${PINNED:-0}")"
say "device memory: $(gb "$GPU") (baseline's $(gb "$BASE_GPU")): $(ratio "$((GPU - BASE_GPU))" "$SHARE") x share over the baseline"

say "=== 4. answers against the CPU reference"
"$BIN/exl3-loadgen" --in-process-router --expert-map "$W/map.yaml" --model "$W/model" --concurrency 4 \
  --tokens 2 --requests ${UM_REQUESTS:-48} --verify --shared=false --tolerance 5e-3 > "$OUT/um-verify.txt" 2>&1
VRC=$?
grep -E "^(verify|summary|requests)" "$OUT/um-verify.txt" | tee -a "$SUMMARY"
[ $VRC = 0 ] || fail "exl3-loadgen --verify exit $VRC"
HWM_AFTER=$(status_bytes $WPID VmHWM)
say "peak resident after serving: $(gb "$HWM_AFTER") = $(ratio "$HWM_AFTER" "$SHARE") x share"
stop_worker

awk -v h="$HWM_AFTER" -v s="$SHARE" 'BEGIN { exit !(h <= 1.1 * s) }' || fail "peak resident memory over 1.1x the share"
awk -v f="$FILE" -v b="$BASE_FILE" -v s="$SHARE" 'BEGIN { exit !(f - b <= 0.05 * s) }' ||
  fail "file pages resident beside the realigned copy (a second copy in host memory)"
awk -v g="$GPU" -v b="$BASE_GPU" -v s="$SHARE" 'BEGIN { exit !(g - b <= 0.05 * s) }' ||
  fail "device memory holds a copy of the weights"
grep -q "copied to device" "$OUT/um-host-worker.log" && fail "the worker copied tensors to device memory"
awk -v r="${REALIGNED:-0}" -v s="$SHARE" 'BEGIN { exit !(r >= 0.99 * s) }' || fail "the realigned copy does not hold the share"
[ "$FAIL" = 0 ] && say "PASS: weights held once, in registered host memory the GPU reads in place"
exit $FAIL
