#!/usr/bin/env bash
# On the GPU machine: the GPU engine with its routed experts in exl3-worker processes (issues 18
# and 21) beside the same run's in-process figures, in one go. Writes to $OUT (or ./gpu-out):
# engine-remote.txt (the tables), engine-remote.json (exl3-engine-bench --json) and every log.
#   1. the model: by default a synthetic one with GLM-4.5-Air's shapes (as scripts/gpu/engine.sh,
#      --layers N layers, default 6, the first dense); --model-args "ARGS" gives make-test-model's
#      arguments instead (without --output), --model DIR an existing model;
#   2. exl3-engine-bench with every expert on this process's GPU (in process);
#   3. one exl3-worker (--backend cuda) holding every routed expert and the shared expert, on GPU
#      --worker-gpu N (default 0: the engine's own; 1 for issue 21's attention on GPU 0 and experts
#      on GPU 1), then exl3-engine-bench --expert-map (the router core in the bench's process,
#      the shared-memory channel to the worker, --shm-mb MiB each way, default 256: a quarter of it
#      holds a 2048-token prefill chunk's 32 MB, so prefill goes through it too; the bench's log says
#      whether it attached) with --micro-batches 1,2; with --grpc also the same over gRPC only;
#   4. with --two-workers: two workers, experts split in halves over GPU 0 and GPU 1 (the first
#      also holding the shared expert), the engine on GPU 0, --micro-batches 1,2;
#   5. with --mps: step 3's shared-memory run again under an MPS daemon started for it (its pipe
#      and logs in a temporary directory, the logs copied to $OUT, the daemon quit at the end), so
#      the engine and a worker on the same GPU share one GPU context instead of being time-sliced
#      between two (the question of bench/results/engine-h200.md "Session 10": the engine's call at
#      batch 1 costs 2.7× the same call from a process without a GPU context).
# --bench-args "ARGS": more exl3-engine-bench arguments for every run (e.g. "--speculative-acceptance
#   0.7 --num-speculative-tokens 1,3": speculative decoding in process and with the experts on the
#   worker, issue 31).
# Every worker this script starts is stopped on exit (TERM, then KILL). A worker that does not
# serve within --worker-timeout-s (default 600) or exits ends the script with its log's tail and
# exit code 3; a failed benchmark gives exit code 1 at the end (the other runs still run).
# Binaries: $BIN from scripts/gpu/env.sh (the bundle of scripts/gpu/bundle.sh); EXL3_BIN overrides.
# Usage: scripts/gpu/engine_remote.sh [--model DIR | --model-args "ARGS" | --layers N]
#          [--worker-gpu N] [--two-workers] [--grpc] [--mps] [--no-in-process] [--batches 1,8,32,64]
#          [--contexts 1024,8192] [--steps 12] [--micro-batches 1,2] [--backend cuda|cpu]
#          [--shm-mb 256] [--worker-timeout-s S] [--bench-timeout-s S] [--bench-args "ARGS"]
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
LAYERS=${ENGINE_LAYERS:-6}
MODEL_DIR="" MODEL_ARGS="" WORKER_GPU=0 TWO_WORKERS=0 GRPC=0 MPS=0 MPS_ON=0 IN_PROCESS=1
BATCHES=${BATCHES:-1,8,32,64} CONTEXTS=${CONTEXTS:-1024,8192} STEPS=${STEPS:-12} MICRO_BATCHES=1,2
BACKEND=cuda WORKER_TIMEOUT_S=600 BENCH_TIMEOUT_S=${BENCH_TIMEOUT:-600} SHM_MB=256 EXTRA_BENCH_ARGS=
usage() { sed -n '2,/^set -uo/p' "$0" | grep '^#'; }
need() { if [ $# -lt 2 ] || [ -z "$2" ]; then echo "engine_remote.sh: $1 needs a value" >&2; exit 2; fi; }
number() { [[ "$2" =~ ^[0-9]+$ ]] || { echo "engine_remote.sh: $1 needs a number, not '$2'" >&2; exit 2; }; }
list() { [[ "$2" =~ ^[0-9]+(,[0-9]+)*$ ]] || { echo "engine_remote.sh: $1 needs a list like 1,8,32, not '$2'" >&2; exit 2; }; }
while [ $# -gt 0 ]; do
  case "$1" in
    --model) need "$@"; MODEL_DIR="$2"; shift ;;
    --model-args) need "$@"; MODEL_ARGS="$2"; shift ;;
    --layers) need "$@"; number "$1" "$2"; LAYERS="$2"; shift ;;
    --worker-gpu) need "$@"; number "$1" "$2"; WORKER_GPU="$2"; shift ;;
    --two-workers) TWO_WORKERS=1 ;;
    --grpc) GRPC=1 ;;
    --mps) MPS=1 ;;
    --no-in-process) IN_PROCESS=0 ;;
    --batches) need "$@"; list "$1" "$2"; BATCHES="$2"; shift ;;
    --contexts) need "$@"; list "$1" "$2"; CONTEXTS="$2"; shift ;;
    --steps) need "$@"; number "$1" "$2"; STEPS="$2"; shift ;;
    --micro-batches) need "$@"; list "$1" "$2"; MICRO_BATCHES="$2"; shift ;;
    --backend) need "$@"; [[ "$2" =~ ^(cuda|cpu)$ ]] || { echo "engine_remote.sh: --backend cuda or cpu" >&2; exit 2; }
               BACKEND="$2"; shift ;;
    --worker-timeout-s) need "$@"; number "$1" "$2"; WORKER_TIMEOUT_S="$2"; shift ;;
    --shm-mb) need "$@"; number "$1" "$2"; SHM_MB="$2"; shift ;;
    --bench-timeout-s) need "$@"; number "$1" "$2"; BENCH_TIMEOUT_S="$2"; shift ;;
    --bench-args) need "$@"; EXTRA_BENCH_ARGS="$2"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "engine_remote.sh: unknown argument $1 (--help lists them)" >&2; exit 2 ;;
  esac
  shift
done
if [ -n "$MODEL_DIR" ] && [ -n "$MODEL_ARGS" ]; then
  echo "engine_remote.sh: --model and --model-args exclude each other" >&2; exit 2
fi

. scripts/gpu/env.sh
BIN=${EXL3_BIN:-$BIN}
for b in exl3-engine-bench exl3-worker exl3-tool; do
  if [ ! -x "$BIN/$b" ] || ldd "$BIN/$b" 2>/dev/null | grep -q "not found"; then
    echo "$BIN/$b is missing or lacks libraries here (scripts/gpu/bundle.sh bundles it)"
    ldd "$BIN/$b" 2>&1 | grep "not found"; exit 1
  fi
done
W=$(mktemp -d /tmp/exl3-engine-remote.XXXXXX)
SUMMARY="$OUT/engine-remote.txt"
JSON="$OUT/engine-remote.json"
: > "$SUMMARY"
PIDS=()
stop_workers() {  # TERM, up to 10 s for a drain, then KILL
  [ ${#PIDS[@]} -gt 0 ] || return 0
  kill -TERM "${PIDS[@]}" 2>/dev/null
  for _ in $(seq 1 50); do
    local alive=0
    for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.2
  done
  kill -KILL "${PIDS[@]}" 2>/dev/null
  wait "${PIDS[@]}" 2>/dev/null
  PIDS=()
}
stop_mps() {  # quits the MPS daemon of --mps, if it runs, and keeps its logs
  [ $MPS_ON = 1 ] || return 0
  echo quit | nvidia-cuda-mps-control >/dev/null 2>&1
  cp -r "$W/mps-log" "$OUT/engine-remote-mps-log" 2>/dev/null
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  MPS_ON=0
}
trap 'stop_workers; stop_mps; rm -rf "$W"' EXIT
trap 'exit 130' INT TERM
say() { echo "$*" | tee -a "$SUMMARY"; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
FAIL=0

{ date -u; git rev-parse HEAD 2>/dev/null; nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader 2>/dev/null; nproc; } | tee -a "$SUMMARY"

# 1. The model.
if [ -z "$MODEL_DIR" ]; then
  MODEL_DIR=${ENGINE_MODEL_DIR:-/tmp/glm45-air-synthetic-$LAYERS}
  if [ -n "$MODEL_ARGS" ]; then
    MODEL_DIR=$W/model
    # shellcheck disable=SC2086  # the arguments are meant to split
    set -- $MODEL_ARGS
  else
    set -- --arch glm4_moe --synthetic --whole-model --hidden 4096 --experts 128 --top-k 8 --intermediate 1408 \
      --shared 1 --layers "$LAYERS" --dense-layers 1 --dense-intermediate 11008 --vocab 151552 --heads 96 \
      --kv-heads 8 --head-dim 128 --bits 2 --attention-bits 4 --head-bits 6 --codebook mcg --max-position 16384
  fi
  if [ ! -f "$MODEL_DIR/config.json" ]; then
    say "=== model: make-test-model $* --output $MODEL_DIR"
    if ! timeout ${MODEL_TIMEOUT:-900} "$BIN/exl3-tool" make-test-model "$@" --output "$MODEL_DIR" --quiet \
        > "$OUT/engine-remote-model.log" 2>&1; then
      say "model generation failed:"; tail -5 "$OUT/engine-remote-model.log" | tee -a "$SUMMARY"; exit 1
    fi
  fi
fi
[ -f "$MODEL_DIR/config.json" ] || { say "no model at $MODEL_DIR (config.json missing)"; exit 1; }
NUM_EXPERTS=$(python3 -c 'import json,sys; c=json.load(open(sys.argv[1]+"/config.json")); c=c.get("text_config", c); print(c.get("n_routed_experts") or c.get("num_experts") or c.get("num_local_experts") or 0)' "$MODEL_DIR")
[ "$NUM_EXPERTS" -gt 0 ] 2>/dev/null || { say "$MODEL_DIR: no routed experts in config.json"; exit 1; }
say "model $MODEL_DIR: $NUM_EXPERTS routed experts"

BENCH_ARGS=(--model "$MODEL_DIR" --context "$CONTEXTS" --batch "$BATCHES" --steps "$STEPS" --json "$JSON")
# shellcheck disable=SC2206  # the arguments are meant to split
BENCH_ARGS+=($EXTRA_BENCH_ARGS)
run_bench() {  # run_bench NAME [ARGS...]: one exl3-engine-bench run, its tables into the summary
  local name=$1; shift
  say "=== $name"
  timeout "$BENCH_TIMEOUT_S" "$BIN/exl3-engine-bench" "${BENCH_ARGS[@]}" "$@" > "$OUT/engine-remote-$name.log" 2>&1
  local rc=$?
  grep -E "^(===|copy bandwidth|remote experts|model |weights|prefill|decode|    |\\|)|shared-memory channel attached|shared memory not used|no shared-memory channel" "$OUT/engine-remote-$name.log" \
    | tee -a "$SUMMARY"
  if [ $rc != 0 ]; then
    say "exl3-engine-bench ($name) exit $rc$([ $rc = 124 ] && echo " (over --bench-timeout-s $BENCH_TIMEOUT_S)"):"
    tail -5 "$OUT/engine-remote-$name.log" | tee -a "$SUMMARY"
    FAIL=1
  fi
}

# start_workers NAME SHARED_ON_FIRST GPU...: one worker per GPU listed, the experts split evenly in
# that order, all in $W/NAME.yaml; waits until each serves (bounded) or fails the script.
start_workers() {
  local name=$1 shared_first=$2; shift 2
  local gpus=("$@") n=$# map="$W/$name.yaml" ports=() i
  echo "workers:" > "$map"
  for ((i = 0; i < n; ++i)); do
    ports[$i]=$(free_port)
    printf '  - name: w%d\n    address: 127.0.0.1:%d\n    experts: %d-%d\n' $i ${ports[$i]} \
      $(( i * NUM_EXPERTS / n )) $(( (i + 1) * NUM_EXPERTS / n - 1 )) >> "$map"
    [ "$shared_first" = 1 ] && [ $i = 0 ] && echo "    shared_expert: true" >> "$map"
  done
  local wpids=()
  for ((i = 0; i < n; ++i)); do
    CUDA_VISIBLE_DEVICES=${gpus[$i]} "$BIN/exl3-worker" --model "$MODEL_DIR" --expert-map "$map" --worker w$i \
      --backend "$BACKEND" --device 0 --listen 127.0.0.1:${ports[$i]} --metrics-listen 127.0.0.1:0 \
      --progress=false ${WORKER_ARGS:-} > "$OUT/engine-remote-$name-w$i.log" 2>&1 &
    wpids+=($!); PIDS+=($!)
  done
  local deadline=$(( $(date +%s) + WORKER_TIMEOUT_S ))
  for ((i = 0; i < n; ++i)); do
    local log="$OUT/engine-remote-$name-w$i.log"
    while ! grep -q "serving on" "$log" 2>/dev/null; do
      if ! kill -0 "${wpids[$i]}" 2>/dev/null; then
        say "worker w$i ($name, GPU ${gpus[$i]}) exited before serving:"; tail -15 "$log" | tee -a "$SUMMARY"; exit 3
      fi
      if [ "$(date +%s)" -ge $deadline ]; then
        say "worker w$i ($name, GPU ${gpus[$i]}) not serving after $WORKER_TIMEOUT_S s (--worker-timeout-s):"
        tail -15 "$log" | tee -a "$SUMMARY"; exit 3
      fi
      sleep 0.5
    done
    say "worker w$i on GPU ${gpus[$i]}: $(grep -m1 -iE "loaded" "$log" | cut -c1-200)"
  done
  MAP=$map
}

# 2. Every expert in the engine's process.
[ $IN_PROCESS = 1 ] && run_bench in-process

# 3. One worker with every expert (and the shared expert) on --worker-gpu.
start_workers one 1 "$WORKER_GPU"
run_bench one-worker-shm --expert-map "$MAP" --shared-expert worker:w0 --micro-batches "$MICRO_BATCHES" \
  --worker-shm-mb "$SHM_MB"
[ $GRPC = 1 ] && run_bench one-worker-grpc --expert-map "$MAP" --shared-expert worker:w0 \
  --micro-batches "$MICRO_BATCHES" --worker-shm-mb 0
stop_workers

# 4. Two workers, the experts split over GPU 0 and GPU 1.
if [ $TWO_WORKERS = 1 ]; then
  start_workers two 1 0 1
  run_bench two-workers-shm --expert-map "$MAP" --shared-expert worker:w0 --micro-batches "$MICRO_BATCHES" \
    --worker-shm-mb "$SHM_MB"
  stop_workers
fi

# 5. Step 3's shared-memory run under MPS: one GPU context for the engine and the worker.
if [ $MPS = 1 ]; then
  if ! command -v nvidia-cuda-mps-control >/dev/null; then
    say "=== --mps: nvidia-cuda-mps-control is not here; the MPS run is skipped"; FAIL=1
  else
    export CUDA_MPS_PIPE_DIRECTORY=$W/mps-pipe CUDA_MPS_LOG_DIRECTORY=$W/mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if nvidia-cuda-mps-control -d; then
      MPS_ON=1
      say "=== MPS daemon started (pipe $CUDA_MPS_PIPE_DIRECTORY)"
      start_workers one-mps 1 "$WORKER_GPU"
      run_bench one-worker-shm-mps --expert-map "$MAP" --shared-expert worker:w0 \
        --micro-batches "$MICRO_BATCHES" --worker-shm-mb "$SHM_MB"
      stop_workers
      stop_mps
    else
      say "=== --mps: nvidia-cuda-mps-control -d failed; the MPS run is skipped"; FAIL=1
      unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    fi
  fi
fi

say "=== done: tables in $SUMMARY, JSON lines in $JSON$([ $FAIL = 1 ] && echo "; a benchmark FAILED")"
exit $FAIL
