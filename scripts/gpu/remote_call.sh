#!/usr/bin/env bash
# On the GPU machine: what one MoE layer call on a remote CUDA worker costs beyond the worker's own
# compute, as the GPU engine makes it (tests/services/router/remote_moe_bench.cc: the router core in
# the caller's process, the caller's top-k, fp32 hidden states), over the shared-memory channel and
# over gRPC. The expert side is GLM-4.5-Air's MoE layer (hidden 4096, 128 experts of 1408, top 8,
# one shared expert, K = 2 MCG) in a 2-layer synthetic model; one exl3-worker --backend cuda on
# GPU 0 holds all of it. Per token count (TOKENS, default 1,8,32,64,1024) the bench prints the
# call's wall time, the router's and the worker's stages from their metrics, and call - worker
# compute. First the worker's CUDA backend against its CPU backend (worker_cuda_backend_test: the
# staging, a batch from another thread, a scheduler batch), into $OUT/remote-call-backend-test.txt.
# Writes $OUT/remote-call.txt and the logs. Binaries: the bundle (scripts/gpu/bundle.sh).
# Usage: [OUT=DIR] [TOKENS=1,8,32,64,1024] [ITERS=30] scripts/gpu/remote_call.sh
set -uo pipefail
case "${1:-}" in
  -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
  "") ;;
  *) echo "remote_call.sh: no arguments (environment: OUT, TOKENS, ITERS, CALL_TIMEOUT; --help)" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
. scripts/gpu/env.sh
W=$(mktemp -d /tmp/exl3-remote-call.XXXXXX)
WPID=""
trap '[ -n "$WPID" ] && kill -TERM $WPID 2>/dev/null; wait 2>/dev/null; rm -rf "$W"' EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
BACKEND_TEST="worker_cuda_backend_test: not in the bundle"
if [ -x "$BIN/worker_cuda_backend_test" ]; then
  "$BIN/worker_cuda_backend_test" > "$OUT/remote-call-backend-test.txt" 2>&1
  rc=$?
  BACKEND_TEST="worker_cuda_backend_test: rc $rc; $(grep -E '^\[  (PASSED|FAILED)  \]' \
    "$OUT/remote-call-backend-test.txt" | tr '\n' ' ')"
fi
MODEL=$W/model
"$BIN/exl3-tool" make-test-model --arch glm4_moe --synthetic --whole-model --hidden 4096 --experts 128 --top-k 8 \
  --intermediate 1408 --shared 1 --layers 2 --dense-layers 1 --dense-intermediate 11008 --vocab 4096 --heads 32 \
  --kv-heads 8 --head-dim 128 --bits 2 --codebook mcg --output "$MODEL" --quiet > "$OUT/remote-call-model.log" 2>&1 \
  || { echo "model generation failed"; tail -5 "$OUT/remote-call-model.log"; exit 1; }
PORT=$(free_port) MPORT=$(free_port)
printf 'workers:\n  - name: w0\n    address: 127.0.0.1:%d\n    experts: 0-127\n    shared_expert: true\n' "$PORT" > "$W/map.yaml"
"$BIN/exl3-worker" --model "$MODEL" --expert-map "$W/map.yaml" --worker w0 --backend cuda --device 0 \
  --listen 127.0.0.1:$PORT --metrics-listen 127.0.0.1:$MPORT --progress=false > "$OUT/remote-call-worker.log" 2>&1 &
WPID=$!
for _ in $(seq 1 240); do grep -q "serving on" "$OUT/remote-call-worker.log" && break; sleep 0.5; done
grep -q "serving on" "$OUT/remote-call-worker.log" || { echo "worker not serving"; tail -10 "$OUT/remote-call-worker.log"; exit 3; }
{ date -u; git rev-parse --short HEAD 2>/dev/null; nproc; echo "$BACKEND_TEST"; } | tee "$OUT/remote-call.txt"
for shm in 256 0; do
  echo "=== $([ $shm = 0 ] && echo gRPC || echo "shared memory ($shm MiB per direction)")" | tee -a "$OUT/remote-call.txt"
  timeout ${CALL_TIMEOUT:-200} "$BIN/exl3-remote-moe-bench" "$MODEL" "$W/map.yaml" --tokens ${TOKENS:-1,8,32,64,1024} \
    --iters ${ITERS:-30} --warmup 5 --shm-mb $shm --shared-expert worker:w0 --worker-metrics 127.0.0.1:$MPORT \
    2>&1 | tee -a "$OUT/remote-call.txt"
done
