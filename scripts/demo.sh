#!/usr/bin/env bash
# The main job in one command: builds the project, generates a small GLM-style EXL3 MoE model with
# a tokenizer, starts two expert workers splitting its experts plus a replica of the hottest ones,
# the router (which also runs the rest of the model: the Generator service), the OpenAI-compatible
# front end and a Prometheus server (all on loopback, CPU backend; CUDA where a GPU is present);
# drives decode steps through the router with `exl3-loadgen --verify` (per-layer latency), then
# chat completions through the front end with the openai SDK (one streamed, greedy ids checked
# against a direct Generate call, a short concurrent load: TTFT, inter-token latency, tokens/s).
# Python parts run in BUILD_DIR/frontend-venv (scripts/lib/frontend_venv.sh, pinned, from PyPI).
#
# usage: ./scripts/demo.sh [--short] [--keep-running] [--model DIR] [--requests N]
#                          [--concurrency N] [--build-dir DIR] [--no-deps] [--no-build]
#   --short         fewer requests (used by ./scripts/test.sh)
#   --keep-running  leave the stack up after the load, print `openai: http://HOST:PORT/v1` (Ctrl-C stops it)
#   --model DIR     serve a real EXL3 model (with its tokenizer.json) instead of generating one
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

BUILD_DIR=build
SHORT=0
KEEP=0
MODEL=""
REQUESTS=""
CONCURRENCY=4
DEPS=1
BUILD=1
while [ $# -gt 0 ]; do
  case "$1" in
    --short) SHORT=1 ;;
    --keep-running) KEEP=1 ;;
    --model) MODEL="$2"; shift ;;
    --requests) REQUESTS="$2"; shift ;;
    --concurrency) CONCURRENCY="$2"; shift ;;
    --build-dir) BUILD_DIR="$2"; shift ;;
    --no-deps) DEPS=0 ;;
    --no-build) BUILD=0 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "demo.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$REQUESTS" ] || REQUESTS=$([ "$SHORT" = 1 ] && echo 240 || echo 2400)
GEN_REQUESTS=$([ "$SHORT" = 1 ] && echo 12 || echo 48)
GEN_CONCURRENCY=$([ "$SHORT" = 1 ] && echo 4 || echo 8)

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

if [ "$DEPS" = 1 ]; then
  say "installing dependencies"
  ./scripts/install-deps.sh
fi
if [ "$BUILD" = 1 ]; then
  say "building (first build takes several minutes)"
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build "$BUILD_DIR" -j "$(nproc)" --target exl3-tool exl3-worker exl3-router exl3-loadgen
fi
BIN="$ROOT/$BUILD_DIR/bin"
[ -d "$BUILD_DIR" ] && BIN="$(cd "$BUILD_DIR" && pwd)/bin"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/exl3-demo.XXXXXX")
mkdir -p "$WORK/logs"
PIDS=()
cleanup() {
  local status=$?
  trap - EXIT INT TERM
  [ -z "${KEEP_SLEEP:-}" ] || kill "$KEEP_SLEEP" 2>/dev/null || true
  if [ ${#PIDS[@]} -gt 0 ]; then
    say "shutting down (SIGTERM, drain)"
    kill -TERM "${PIDS[@]}" 2>/dev/null || true
    for _ in $(seq 1 100); do
      local alive=0
      for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
      [ "$alive" = 0 ] && break
      sleep 0.1
    done
    kill -KILL "${PIDS[@]}" 2>/dev/null || true
    wait 2>/dev/null || true
  fi
  echo "logs: $WORK/logs"
  # The run's last line: the generation summary (scripts/lib/generate_demo.py).
  [ -s "$WORK/generate-summary.txt" ] && cat "$WORK/generate-summary.txt"
  exit $status
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# Waits until a /metrics endpoint reports `<gauge> 1` (the process is loaded and serving).
wait_ready() {
  local name=$1 url=$2 gauge=$3 pid=$4
  for _ in $(seq 1 600); do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "$name exited during start-up; its log:" >&2
      tail -20 "$WORK/logs/$name.log" >&2
      return 1
    fi
    curl -fsS "$url" 2>/dev/null | grep -Eq "^$gauge(\{[^}]*\})? 1(\.0+)?$" && return 0
    sleep 0.2
  done
  echo "$name did not become ready within 120 s" >&2
  return 1
}

GENERATED=0
if [ -z "$MODEL" ]; then
  GENERATED=1
  say "generating a GLM-style EXL3 MoE test model (gate/up K=2 MCG, down K=4)"
  MODEL="$WORK/model"
  "$BIN/exl3-tool" make-test-model --arch glm4_moe --output "$MODEL" --layers 3 --hidden 256 \
    --experts 16 --top-k 4 --intermediate 128 --shared 1 --bits 2 --down-bits 4 --codebook mcg \
    --routed-scaling-factor 2.5 --seed 11 --quiet
fi

say "Python package and front end (venv $BUILD_DIR/frontend-venv)"
VENV=$(scripts/lib/frontend_venv.sh "$BUILD_DIR" | tail -1)
if [ "$GENERATED" = 1 ]; then  # a real model directory is used as it comes
  "$VENV/bin/exl3serve-make-tokenizer" --model "$MODEL"
elif [ ! -e "$MODEL/tokenizer.json" ]; then
  echo "demo.sh: $MODEL has no tokenizer.json (the front end needs one)" >&2
  exit 2
fi

say "model"
"$BIN/exl3-tool" inspect --model "$MODEL"

NUM_EXPERTS=$(python3 -c 'import json,sys; c=json.load(open(sys.argv[1])); print(c.get("n_routed_experts") or c.get("num_experts") or c["num_local_experts"])' "$MODEL/config.json")
HALF=$((NUM_EXPERTS / 2))
HOT=$(python3 scripts/lib/hot_experts.py "$BIN/exl3-tool" "$MODEL" "$WORK" 4)

WA=$(free_port); WB=$(free_port); WH=$(free_port); RP=$(free_port); OP=$(free_port)
MA=$(free_port); MB=$(free_port); MH=$(free_port); MR=$(free_port); PP=$(free_port)
cat > "$WORK/expert-map.yaml" <<YAML
workers:
  - name: worker-a
    address: 127.0.0.1:$WA
    experts: 0-$((HALF - 1))
  - name: worker-b
    address: 127.0.0.1:$WB
    experts: $HALF-$((NUM_EXPERTS - 1))
  - name: worker-hot
    address: 127.0.0.1:$WH
    experts: "$HOT"
YAML

say "where the experts live (expert map: $WORK/expert-map.yaml)"
printf '  %-11s %-17s %s\n' worker address experts
printf '  %-11s %-17s %s\n' worker-a "127.0.0.1:$WA" "0-$((HALF - 1)) (every MoE layer)"
printf '  %-11s %-17s %s\n' worker-b "127.0.0.1:$WB" "$HALF-$((NUM_EXPERTS - 1)) (every MoE layer)"
printf '  %-11s %-17s %s\n' worker-hot "127.0.0.1:$WH" "$HOT (replicas of the most-routed experts)"

say "starting workers, router (with the Generator service), front end and Prometheus"
THREADS=$(( $(nproc) / 4 > 0 ? $(nproc) / 4 : 1 ))  # three workers share the machine
start_worker() {
  local name=$1 port=$2 mport=$3
  "$BIN/exl3-worker" --model "$MODEL" --expert-map "$WORK/expert-map.yaml" --worker "$name" \
    --listen "127.0.0.1:$port" --metrics-listen "127.0.0.1:$mport" --backend auto \
    --threads "$THREADS" --progress=false >"$WORK/logs/$name.log" 2>&1 &
  PIDS+=($!)
  wait_ready "$name" "http://127.0.0.1:$mport/metrics" exl3_worker_ready $!
  echo "  $name ready (gRPC 127.0.0.1:$port, metrics 127.0.0.1:$mport)"
}
start_worker worker-a "$WA" "$MA"
start_worker worker-b "$WB" "$MB"
start_worker worker-hot "$WH" "$MH"
"$BIN/exl3-router" --model "$MODEL" --expert-map "$WORK/expert-map.yaml" \
  --listen "127.0.0.1:$RP" --metrics-listen "127.0.0.1:$MR" --kv-cache-tokens 16384 \
  >"$WORK/logs/router.log" 2>&1 &
PIDS+=($!)
wait_ready router "http://127.0.0.1:$MR/metrics" exl3_router_ready $!
echo "  router ready (gRPC 127.0.0.1:$RP: MoeRouter and Generator, metrics 127.0.0.1:$MR)"
# A second router, experts in process, serving a transformers fixture's model: its greedy tokens
# are checked against transformers' own.
FIXTURE="$ROOT/tests/fixtures/engine/glm4_moe_all"
FP=$(free_port); FM=$(free_port)
"$BIN/exl3-router" --model "$FIXTURE" --listen "127.0.0.1:$FP" --metrics-listen "127.0.0.1:$FM" \
  --kv-cache-tokens 2048 >"$WORK/logs/router-fixture.log" 2>&1 &
PIDS+=($!)
echo "  router on the transformers fixture $FIXTURE (127.0.0.1:$FP)"
"$VENV/bin/exl3serve-openai" --engine "127.0.0.1:$RP" --model "$MODEL" --listen "127.0.0.1:$OP" \
  >"$WORK/logs/frontend.log" 2>&1 &
PIDS+=($!)
OPENAI_URL="http://127.0.0.1:$OP/v1"
for _ in $(seq 1 300); do
  curl -fsS "http://127.0.0.1:$OP/health" >/dev/null 2>&1 && break
  kill -0 "${PIDS[-1]}" 2>/dev/null || { echo "front end exited; its log:" >&2; tail -20 "$WORK/logs/frontend.log" >&2; exit 1; }
  sleep 0.2
done
curl -fsS "http://127.0.0.1:$OP/health" >/dev/null || { echo "front end not healthy within 60 s" >&2; exit 1; }
echo "  front end ready ($OPENAI_URL, metrics http://127.0.0.1:$OP/metrics)"

PROM_URL=""
if command -v prometheus >/dev/null; then
  mkdir -p "$WORK/prometheus"
  cat > "$WORK/prometheus/prometheus.yml" <<YAML
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: exl3-router
    static_configs: [{targets: ["127.0.0.1:$MR"]}]
  - job_name: exl3-worker
    static_configs: [{targets: ["127.0.0.1:$MA", "127.0.0.1:$MB", "127.0.0.1:$MH"]}]
  - job_name: exl3serve-openai
    static_configs: [{targets: ["127.0.0.1:$OP"]}]
rule_files: ["$ROOT/deploy/prometheus/rules/*.yml"]
YAML
  prometheus --config.file="$WORK/prometheus/prometheus.yml" \
    --storage.tsdb.path="$WORK/prometheus/data" --web.listen-address="127.0.0.1:$PP" \
    >"$WORK/logs/prometheus.log" 2>&1 &
  PIDS+=($!)
  PROM_URL="http://127.0.0.1:$PP"
  echo "  prometheus at $PROM_URL"
fi

say "decode load: $REQUESTS layer requests over $CONCURRENCY streams, every MoE layer in order, verified against the CPU reference"
set +e
"$BIN/exl3-loadgen" --target "127.0.0.1:$RP" --model "$MODEL" --concurrency "$CONCURRENCY" \
  --tokens 1 --requests "$REQUESTS" --warmup 2 --verify
LOAD_STATUS=$?
set -e

if [ -n "$PROM_URL" ]; then
  sleep 3  # two scrapes after the load
  QUERY='histogram_quantile(0.99, sum by (layer, le) (exl3_router_layer_latency_seconds_bucket{stage="total"}))'
  say "Prometheus: $PROM_URL"
  echo "  example query (router p99 per layer since start; dashboards use rate() over a window):"
  echo "    $QUERY"
  curl -fsS --get "$PROM_URL/api/v1/query" --data-urlencode "query=$QUERY" 2>/dev/null |
    python3 -c 'import json,sys
r=json.load(sys.stdin)["data"]["result"]
for s in sorted(r, key=lambda s: int(s["metric"].get("layer","0"))):
    print("    layer %-3s p99 = %s s" % (s["metric"].get("layer"), s["value"][1]))' || true
fi

if [ "$LOAD_STATUS" -ne 0 ]; then
  say "FAILED: exl3-loadgen exited with $LOAD_STATUS"
  exit "$LOAD_STATUS"
fi
say "layer verification passed"

set +e
"$VENV/bin/python" scripts/lib/generate_demo.py --url "$OPENAI_URL" --engine "127.0.0.1:$RP" \
  --model-dir "$MODEL" --requests "$GEN_REQUESTS" --concurrency "$GEN_CONCURRENCY" \
  --max-tokens 32 --summary "$WORK/generate-summary.txt" \
  --fixture "$FIXTURE" --fixture-engine "127.0.0.1:$FP"
GEN_STATUS=$?
set -e
if [ "$GEN_STATUS" -ne 0 ]; then
  say "FAILED: generation through the front end (exit $GEN_STATUS)"
  exit "$GEN_STATUS"
fi
say "generation passed"
if [ "$KEEP" = 1 ]; then
  echo "openai: $OPENAI_URL"
  echo "  curl $OPENAI_URL/chat/completions -H 'Content-Type: application/json' \\"
  echo "    -d '{\"model\": \"$(basename "$MODEL")\", \"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}]}'"
  echo "stack left running (router 127.0.0.1:$RP${PROM_URL:+, Prometheus $PROM_URL}); Ctrl-C stops it"
  # Waiting in the builtin `wait`: Ctrl-C interrupts it and runs the INT trap at once. (Behind a
  # foreground `sleep`, bash acts on SIGINT only if the sleep dies of it; one that reached the
  # forked child before its exec left the loop starting the next sleep, and the stack down.)
  while true; do
    sleep 3600 &
    KEEP_SLEEP=$!
    wait "$KEEP_SLEEP"
  done
fi
