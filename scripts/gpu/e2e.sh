#!/usr/bin/env bash
# On the GPU machine: workers serving from the H200 behind gRPC (issue "GPU end to end").
# Uses the binaries of scripts/gpu/e2e_bundle.sh (.gpu-e2e/). Writes logs to $OUT (or ./gpu-out).
#  1. a synthetic GLM-5.3-Flash-shaped model (hidden 4096, 288 experts, top-8, intermediate 2048,
#     1 shared, K=2 MCG, random trellis bits) with MOE_LAYERS MoE layers (default 12: the disk holds
#     about 60 GB, the full 42 layers are about 76 GB);
#  2. one exl3-worker --backend cuda holding every expert, exl3-router beside it (shared expert
#     off: protocol v1 runs it on the router's CPU, which at these shapes would dominate); the
#     router->worker hop in shared memory (same host: the default), then again on gRPC;
#  3. exl3-loadgen decode steps (every MoE layer in order) at 1, 8 and 32 streams, with the echo
#     transport floor measured in the same run, and the worker's own compute time from /metrics;
#  4. --verify on a small synthetic model: GPU answers against the in-process CPU reference.
#  5. the same verify with the weights left in registered host memory (--weights-residency host,
#     the unified-memory path of GB10, here read over PCIe), and with the shared expert computed
#     by the worker (--shared-expert worker:gpu0).
# Usage: scripts/gpu/e2e.sh [--moe-layers N] [--seconds S] [--verify-only]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
MOE_LAYERS=12
SECONDS_PER_RUN=8
VERIFY_ONLY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --moe-layers) MOE_LAYERS="$2"; shift ;;
    --seconds) SECONDS_PER_RUN="$2"; shift ;;
    --verify-only) VERIFY_ONLY=1 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "e2e.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
GPU_BUNDLE=.gpu-e2e . scripts/gpu/env.sh
W=/tmp/exl3-e2e
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
RP=$(free_port); RM=$(free_port)
declare -a WORKER_METRICS
rm -rf "$W"; mkdir -p "$W"
PIDS=()
trap 'kill -TERM "${PIDS[@]}" 2>/dev/null; sleep 1; kill -KILL "${PIDS[@]}" 2>/dev/null' EXIT
{ date -u; git rev-parse HEAD 2>/dev/null; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; } | tee "$OUT/e2e-machine.txt"

metric_sum_count() {  # metric_sum_count URL NAME LABELMATCH -> "sum count" of a histogram
  curl -fsS "$1" | awk -v n="$2" -v m="$3" '
    index($0, n"_sum{") == 1 && index($0, m) { split($0, a, " "); s += a[2] }
    index($0, n"_count{") == 1 && index($0, m) { split($0, a, " "); c += a[2] }
    END { printf "%.9f %d", s, c }'
}
worker_stage_sums() {  # the summed "sum count" of one stage over every worker
  local s=0 c=0 i out
  for i in "${!WORKER_METRICS[@]}"; do
    out=$(metric_sum_count "http://127.0.0.1:${WORKER_METRICS[$i]}/metrics" \
      exl3_worker_layer_latency_seconds "stage=\"$1\"")
    s=$(awk -v a=$s -v b="${out% *}" 'BEGIN{print a+b}'); c=$((c + ${out#* }))
  done
  echo "$s $c"
}
mean_us() {  # mean_us "SUM0 COUNT0" "SUM1 COUNT1" -> mean of the difference in microseconds
  awk -v a="$1" -v b="$2" 'BEGIN{split(a,x," "); split(b,y," "); n=y[2]-x[2];
    if (n > 0) printf "%.1f", 1e6*(y[1]-x[1])/n; else printf "nan"}'
}
wait_ready() {  # wait_ready LOGFILE PATTERN PID
  for _ in $(seq 1 1500); do
    kill -0 "$3" 2>/dev/null || return 1
    grep -q "$2" "$1" 2>/dev/null && return 0
    sleep 0.2
  done
  return 1
}
# METRICS=0 runs without /metrics endpoints.
METRICS=${METRICS:-1}
metrics_flag() { [ "$METRICS" = 1 ] && echo "--metrics-listen=127.0.0.1:$1" || echo "--metrics-listen="; }

serve_and_load() {  # serve_and_load NAME MODEL NUM_WORKERS NUM_EXPERTS COMMAND...
  local name=$1 model=$2 nw=$3 ne=$4; shift 4
  echo "workers:" > "$W/map.yaml"
  WORKER_METRICS=()
  local wpids=() wports=()
  for ((i = 0; i < nw; ++i)); do  # the whole map first: each worker reads its share from it
    wports[$i]=$(free_port); WORKER_METRICS[$i]=$(free_port)
    printf '  - name: gpu%d\n    address: 127.0.0.1:%d\n    experts: %d-%d\n' $i ${wports[$i]} \
      $(( i * ne / nw )) $(( (i + 1) * ne / nw - 1 )) >> "$W/map.yaml"
    # SHARED_ON_WORKER=1: worker 0 also holds the shared expert and the router sends it there.
    [ "${SHARED_ON_WORKER:-0}" = 1 ] && [ $i = 0 ] && echo "    shared_expert: true" >> "$W/map.yaml"
  done
  local shared=none
  [ "${SHARED_ON_WORKER:-0}" = 1 ] && shared=worker:gpu0
  for ((i = 0; i < nw; ++i)); do
    "$BIN/exl3-worker" --model "$model" --expert-map "$W/map.yaml" --worker gpu$i --backend cuda \
      --device $i --listen 127.0.0.1:${wports[$i]} $(metrics_flag ${WORKER_METRICS[$i]}) \
      --progress=false ${WORKER_ARGS:-} > "$OUT/$name-worker$i.log" 2>&1 &
    wpids+=($!); PIDS+=($!)
  done
  for ((i = 0; i < nw; ++i)); do
    if ! wait_ready "$OUT/$name-worker$i.log" "serving on" ${wpids[$i]}; then
      echo "worker $i did not start"; tail -20 "$OUT/$name-worker$i.log"; return 1
    fi
    grep -iE "loaded" "$OUT/$name-worker$i.log" | tail -1
  done
  "$BIN/exl3-router" --model "$model" --expert-map "$W/map.yaml" --listen 127.0.0.1:$RP \
    $(metrics_flag $RM) --shared-expert $shared ${ROUTER_ARGS:-} > "$OUT/$name-router.log" 2>&1 &
  local rpid=$!; PIDS+=($rpid)
  wait_ready "$OUT/$name-router.log" "ready: every routed" $rpid || { tail -20 "$OUT/$name-router.log"; return 1; }
  "$@"
  kill -TERM $rpid "${wpids[@]}"; wait $rpid "${wpids[@]}" 2>/dev/null
}

large_runs() {  # large_runs MODEL STREAMS...
  local model=$1; shift
  for c in "$@"; do
    local c0 t0
    c0=$(worker_stage_sums compute); t0=$(worker_stage_sums total)
    echo "=== streams=$c"
    local extra=""
    [ "$c" = 1 ] && extra="--echo-baseline"
    "$BIN/exl3-loadgen" --target 127.0.0.1:$RP --model "$model" --concurrency $c --tokens 1 \
      --duration "$SECONDS_PER_RUN" --warmup 20 --shared=false $extra 2>&1 | tail -25
    echo "worker compute per sub-request batch, mean us: $(mean_us "$c0" "$(worker_stage_sums compute)")"
    echo "worker total (queue + compute) per sub-request, mean us: $(mean_us "$t0" "$(worker_stage_sums total)")"
  done
  curl -fsS http://127.0.0.1:${WORKER_METRICS[0]}/metrics | grep -E "^exl3_worker_(pinned_bytes|load_seconds)" | tee "$OUT/e2e-worker-memory.txt"
}

if [ "$VERIFY_ONLY" = 0 ]; then
echo "=== generating synthetic GLM-5.3-Flash-shaped model, $MOE_LAYERS MoE layers"
t0=$(date +%s)
"$BIN/exl3-tool" make-test-model --synthetic --arch glm4_moe --output "$W/glm" --hidden 4096 \
  --experts 288 --top-k 8 --intermediate 2048 --shared 1 --layers $((MOE_LAYERS + 3)) \
  --dense-layers 3 --routed-scaling-factor 2.5 --swiglu-limit 10 --bits 2 --codebook mcg --quiet \
  > "$OUT/e2e-gen.log" 2>&1 || { tail "$OUT/e2e-gen.log"; exit 1; }
echo "generated $(du -sh "$W/glm" | cut -f1) in $(( $(date +%s) - t0 )) s"
serve_and_load large "$W/glm" 1 288 large_runs "$W/glm" 1 8 32
echo "=== the same with the router->worker hop on gRPC instead of shared memory (--worker-shm-mb 0)"
ROUTER_ARGS="--worker-shm-mb 0" serve_and_load large-grpc "$W/glm" 1 288 large_runs "$W/glm" 1 8 32
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  echo "=== two workers, one GPU each, experts split in halves"
  serve_and_load large2 "$W/glm" 2 288 large_runs "$W/glm" 1 8 32
fi
rm -rf "$W/glm"
fi

echo "=== verify on a small synthetic model (GPU answers vs the CPU reference)"
"$BIN/exl3-tool" make-test-model --synthetic --arch glm4_moe --output "$W/small" --hidden 512 \
  --experts 32 --top-k 8 --intermediate 256 --shared 1 --layers 4 --dense-layers 1 \
  --swiglu-limit 10 --bits 2 --down-bits 4 --codebook mcg --quiet > /dev/null 2>&1
verify_run() {
  "$BIN/exl3-loadgen" --target 127.0.0.1:$RP --model "$W/small" --concurrency 8 --tokens 3 \
    --requests 600 --verify --shared="${SHARED_ON_WORKER:-0}" --tolerance 5e-3 2>&1 |
    tee "$OUT/e2e-verify${VERIFY_TAG:-}.txt" | tail -6
}
serve_and_load small "$W/small" 1 32 verify_run
echo "=== the same, weights in place in registered host memory (--weights-residency host)"
WORKER_ARGS="--weights-residency host" VERIFY_TAG=-host serve_and_load small-host "$W/small" 1 32 verify_run
grep -h "registered host memory" "$OUT/small-host-worker0.log"
echo "=== the same with the shared expert on the worker (router --shared-expert worker:gpu0)"
SHARED_ON_WORKER=1 VERIFY_TAG=-shared serve_and_load small-shared "$W/small" 1 32 verify_run
