#!/usr/bin/env bash
# A real Prometheus scrapes a real exl3-worker: the worker's per-layer series (docs/metrics.md)
# must be queryable through Prometheus's HTTP API, with counts from real traffic, and the worker
# must drain and exit 0 on SIGTERM. Usage: scripts/checks/worker_prometheus.sh BUILD_DIR
# Needs /usr/bin/prometheus, curl, python3 (scripts/install-deps.sh). About 15 s.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD_DIR=${1:?usage: scripts/checks/worker_prometheus.sh BUILD_DIR}
BIN=$BUILD_DIR/bin
for b in exl3-worker exl3-worker-probe exl3-tool; do
  [ -x "$BIN/$b" ] || { echo "worker_prometheus: $BIN/$b not built" >&2; exit 1; }
done
for t in prometheus curl python3; do
  command -v $t >/dev/null || { echo "worker_prometheus: $t not found (scripts/install-deps.sh)" >&2; exit 1; }
done

WORK=$(mktemp -d)
WORKER_PID=""; PROM_PID=""
cleanup() {
  [ -n "$WORKER_PID" ] && kill "$WORKER_PID" 2>/dev/null || true
  [ -n "$PROM_PID" ] && kill "$PROM_PID" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
say() { printf -- '--- worker_prometheus: %s\n' "$1"; }
fail() { echo "worker_prometheus: FAILED: $1" >&2; echo "--- worker log:" >&2; tail -20 "$WORK/worker.log" >&2 || true; exit 1; }

say "test model"
"$BIN/exl3-tool" make-test-model --arch glm4_moe --synthetic --output "$WORK/model" --layers 4 \
  --hidden 256 --experts 8 --top-k 2 --intermediate 128 --bits 3 --quiet

GP=$(free_port); MP=$(free_port); PP=$(free_port)
say "exl3-worker on 127.0.0.1:$GP, metrics on :$MP"
"$BIN/exl3-worker" --model "$WORK/model" --experts 0-5 --listen "127.0.0.1:$GP" \
  --metrics-listen "127.0.0.1:$MP" --threads 2 --progress=false > "$WORK/worker.log" 2>&1 &
WORKER_PID=$!
# The page is read whole before grep sees it: `curl | grep -q` under pipefail fails when grep
# exits at its first match and curl can no longer write (curl exit 23).
worker_ready() {
  local page
  page=$(curl -fsS "http://127.0.0.1:$MP/metrics" 2>/dev/null) || return 1
  grep -q '^exl3_worker_ready 1' <<<"$page"
}
for _ in $(seq 100); do
  worker_ready && break
  sleep 0.1
done
worker_ready || fail "worker not ready"

say "prometheus on :$PP"
cat > "$WORK/prometheus.yml" <<YAML
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: exl3-worker
    static_configs:
      - targets: ["127.0.0.1:$MP"]
        labels: {worker: w0}
YAML
prometheus --config.file="$WORK/prometheus.yml" --storage.tsdb.path="$WORK/tsdb" \
  --web.listen-address="127.0.0.1:$PP" --log.level=warn > "$WORK/prometheus.log" 2>&1 &
PROM_PID=$!
for _ in $(seq 100); do
  curl -fsS "http://127.0.0.1:$PP/-/ready" >/dev/null 2>&1 && break
  sleep 0.1
done
curl -fsS "http://127.0.0.1:$PP/-/ready" >/dev/null || { cat "$WORK/prometheus.log" >&2; fail "prometheus not ready"; }

say "traffic"
"$BIN/exl3-worker-probe" --target "127.0.0.1:$GP" --requests 300 --streams 6 --tokens 4 || fail "probe traffic"

# query EXPR: prints the result vector as "labels value" lines.
query() {
  curl -fsS "http://127.0.0.1:$PP/api/v1/query" --data-urlencode "query=$1" | python3 -c '
import json, sys
d = json.load(sys.stdin)
assert d["status"] == "success", d
for r in d["data"]["result"]:
    m = {k: v for k, v in r["metric"].items() if k not in ("instance", "job")}
    print(",".join(f"{k}={v}" for k, v in sorted(m.items())), r["value"][1])'
}

say "per-layer series through the Prometheus API"
MOE_LAYERS="1 2 3"  # --layers 4 with first_k_dense_replace 1
# Wait for a scrape taken after the traffic ended (an earlier one may hold partial counts).
total=""
for _ in $(seq 60); do
  total=$(query 'sum(exl3_worker_requests_total)' | awk '{print $NF}' || true)
  [ "${total%.*}" = 300 ] && break
  sleep 0.5
done
[ "${total%.*}" = 300 ] || fail "sum(exl3_worker_requests_total) = $total, expected 300"
out=$(query 'exl3_worker_layer_latency_seconds_count{stage="total"} > 0')
printf '%s\n' "$out"
[ "$(printf '%s\n' "$out" | grep -c 'layer=')" -ge 3 ] || fail "per-layer total latency counts not all > 0"
for L in $MOE_LAYERS; do
  for S in queue compute total; do
    query "exl3_worker_layer_latency_seconds_bucket{layer=\"$L\",stage=\"$S\",le=\"+Inf\"}" | grep -q . \
      || fail "no series for layer $L stage $S"
  done
  query "exl3_worker_batch_tokens_count{layer=\"$L\"}" | grep -q . || fail "no batch_tokens for layer $L"
done
p99=$(query 'histogram_quantile(0.99, sum by (le, layer) (exl3_worker_layer_latency_seconds_bucket{stage="compute"}))')
echo "compute p99 by layer since start (s):"; printf '%s\n' "$p99"
[ "$(printf '%s\n' "$p99" | grep 'layer=' | grep -vc NaN)" -ge 3 ] || fail "histogram_quantile by layer"
query 'exl3_worker_errors_total{code="INVALID_ARGUMENT"}' | grep -q . || fail "errors series missing at zero"

say "every worker metric of docs/metrics.md is in Prometheus"
names=$(python3 - docs/metrics.md <<'PY'
import re, sys
text = open(sys.argv[1]).read()
section = text.split("## Expert worker", 1)[1].split("\n## ", 1)[0]
print(" ".join(re.findall(r"^\| `(exl3_worker_[a-z_]+)`", section, re.M)))
PY
)
[ -n "$names" ] || fail "no worker metric names found in docs/metrics.md"
have=$(query 'count by (__name__) ({__name__=~"exl3_worker_.*"})' | sed 's/^__name__=\([^ ]*\) .*/\1/')
for n in $names; do
  printf '%s\n' "$have" | grep -Eq "^$n(_bucket|_count|_sum)?$" || fail "metric $n not scraped"
done
echo "all $(echo $names | wc -w) worker metrics present"

say "SIGTERM drains and exits 0"
kill -TERM "$WORKER_PID"
rc=0; wait "$WORKER_PID" || rc=$?
WORKER_PID=""
[ "$rc" = 0 ] || fail "worker exited $rc after SIGTERM"
grep -q "drained" "$WORK/worker.log" || fail "no drain in the log"
say "ok"
