#!/usr/bin/env bash
# On the GPU machine (run from the repository root; its 16 cores, not its GPU): the front end's
# benchmark, bench/frontend_bench.py, with the engine, the front end and the load clients on
# separate cores, for bench/results/frontend.md. Offline: everything comes from the archive that
# scripts/gpu/frontend_bundle.sh makes here (.gpu-check/frontend.tar.xz, carried with the call).
#  1. unpacks it into WORK (default /tmp/exl3-frontbench);
#  2. makes a Python environment from its wheelhouse alone (pip --no-index): a venv that also sees
#     python3's own packages (the archive leaves out the big ones that python3 has: its IMAGE_HAS),
#     or `pip install --no-deps --target WORK/site` with PYTHONPATH where python3 is itself a venv
#     (the GPU machine's is /opt/torch/.venv: a venv made from it would not see its packages) or
#     `python3 -m venv` is missing (FRONT_PY_MODE=venv|target forces one);
#  3. runs the benchmark (it generates the test model with the archive's exl3-tool) at 1, 8, 32
#     and 64 streams, once with a one-process front end and once with N/4 - 1 workers
#     (exl3serve-openai --workers, 3 on the GPU machine; frontend_bench.py --frontend-workers 1,3),
#     both in one table. Cores, of the N this process may use (16 on the GPU machine):
#       engine (exl3-router)          the first 3N/8 (0-5): the CPU engine's forward pass, with as
#                                     many threads, plus its gRPC threads; the baseline both paths share
#       front end (exl3serve-openai)  the next N/4 (6-9): one asyncio event loop per worker (Python
#                                     holds one core each) plus gRPC's and uvicorn's native threads
#                                     beside them: N/4 - 1 workers leave them a core
#       client (the benchmark itself) the rest (10-15): the 64-stream openai SDK client and the
#                                     direct grpc.aio pass, Python too, split over one process per
#                                     core (at most 4: frontend_bench.py --client-procs; one
#                                     Python SDK process reads fewer tokens/s than the front end
#                                     sends); given as many cores as the engine so that reading
#                                     chunks never queues behind the others
#     so the TTFT the front end adds is its own, not time waiting for a core shared with the
#     engine or the client (the 2-core measurement's problem, bench/results/frontend.md).
# Writes to $OUT (default ./gpu-out): frontend-table.md (the table), frontend-bench.log,
# frontend-env.txt (machine, Python, package versions), frontend-logs.txt (the processes' logs).
# Usage: scripts/gpu/frontend.sh [LEVELS [WORKER_COUNTS]]   (default 1,8,32,64 and 1,N/4-1)
# Env: PYTHON (default python3), FRONT_ARCHIVE, FRONT_PY_MODE, WORK, ENGINE_ARGS (more exl3-router
# flags, e.g. ENGINE_ARGS=--engine-threads=5 to leave one of the engine's cores to its gRPC threads;
# frontend_bench.py --engine-args), ENGINE_CALLS (the front end's --engine-calls modes, default
# stream; ENGINE_CALLS=stream,per-request runs every worker count in both, an A/B in one table,
# twice the time: give fewer WORKER_COUNTS or LEVELS to stay within the run's limit).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LEVELS=${1:-1,8,32,64}
WORKER_COUNTS=${2:-}
PY=${PYTHON:-python3}
ARCHIVE=${FRONT_ARCHIVE:-.gpu-check/frontend.tar.xz}
MODE=${FRONT_PY_MODE:-auto}
WORK=${WORK:-/tmp/exl3-frontbench}
die() { echo "frontend.sh: $*" | tee -a "$OUT/frontend-bench.log" >&2; exit 1; }
: > "$OUT/frontend-bench.log"
[ -f "$ARCHIVE" ] || die "no $ARCHIVE (make it with scripts/gpu/frontend_bundle.sh and carry it)"

echo "=== unpacking $ARCHIVE into $WORK"
rm -rf "$WORK"
mkdir -p "$WORK"
"$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$ARCHIVE" "$WORK" ||
  die "could not unpack $ARCHIVE"
B=$WORK/.gpu-front
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
missing=$(ldd "$B/bin/exl3-router" "$B/bin/exl3-tool" | grep "not found" | sort -u)
[ -z "$missing" ] || die "libraries missing: $missing"

echo "=== Python environment from $B/wheels ($(ls "$B/wheels" | wc -l) wheels; python3's own: $(cat "$B/IMAGE_HAS"))"
PYBIN=""
if [ "$MODE" = auto ] && "$PY" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
  echo "$PY is a venv ($("$PY" -c 'import sys; print(sys.prefix)')): pip --target"
  MODE=target
fi
if [ "$MODE" != target ] && "$PY" -m venv --system-site-packages "$WORK/venv" > "$WORK/venv.log" 2>&1 &&
   "$WORK/venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-index \
     --find-links "$B/wheels" "$B"/wheels/*.whl >> "$WORK/venv.log" 2>&1; then
  PYBIN=$WORK/venv/bin/python
  echo "venv $WORK/venv"
elif [ "$MODE" != venv ]; then
  [ "$MODE" = target ] || { echo "no venv ($(tail -1 "$WORK/venv.log")): pip --target instead"; }
  "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --no-compile \
    --target "$WORK/site" "$B"/wheels/*.whl > "$WORK/target.log" 2>&1 ||
    { tail -20 "$WORK/target.log"; die "pip install --target failed"; }
  export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$WORK/site/bin:$PATH"
  PYBIN=$(command -v "$PY")
  echo "pip --target $WORK/site (PYTHONPATH)"
else
  tail -20 "$WORK/venv.log"; die "venv failed"
fi
{
  date -u
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  echo "nproc: $(nproc); $(grep -m1 'model name' /proc/cpuinfo)"
  echo "python: $("$PYBIN" -c 'import sys; print(sys.version.split()[0], sys.executable)')"
  "$PYBIN" - <<'EOF'
from importlib import metadata
for name in ["exl3serve", "openai", "fastapi", "starlette", "pydantic", "uvicorn", "httptools", "uvloop",
             "grpcio", "protobuf", "numpy", "tokenizers", "jinja2", "httpx"]:
    try:
        dist = metadata.distribution(name)
        print(f"{name}=={dist.version}  {dist.locate_file('')}")
    except metadata.PackageNotFoundError:
        print(f"{name}: MISSING")
EOF
} 2>&1 | tee "$OUT/frontend-env.txt"
"$PYBIN" -c 'import exl3serve_client.frontend.server, openai, grpc, numpy, tokenizers, uvloop, httptools' ||
  die "the front end's packages do not import (see $OUT/frontend-env.txt)"
command -v exl3serve-openai > /dev/null || [ -x "$(dirname "$PYBIN")/exl3serve-openai" ] ||
  die "no exl3serve-openai script"

# The cores this process may use, in order, split 3/8 : 1/4 : rest (see the header).
read -r -a CPUS <<< "$("$PY" -c 'import os; print(*sorted(os.sched_getaffinity(0)))')"
N=${#CPUS[@]}
PIN=()
nf=$((N / 4))
[ -n "$WORKER_COUNTS" ] || WORKER_COUNTS=1,$((nf > 2 ? nf - 1 : 2))
if [ "$N" -ge 8 ]; then
  ne=$((3 * N / 8))
  join() { local IFS=,; echo "$*"; }
  PIN=(--engine-cpus "$(join "${CPUS[@]:0:ne}")" --frontend-cpus "$(join "${CPUS[@]:ne:nf}")"
       --client-cpus "$(join "${CPUS[@]:ne+nf}")")
else
  echo "only $N cores: the three processes share them (no pinning)"
fi
ENGINE_CALLS=${ENGINE_CALLS:-stream}
echo "=== bench/frontend_bench.py --levels $LEVELS --frontend-workers $WORKER_COUNTS --engine-calls $ENGINE_CALLS ${PIN[*]} --engine-args '${ENGINE_ARGS:-}'"
mkdir -p "$WORK/tmp"
TMPDIR=$WORK/tmp timeout 480 "$PYBIN" bench/frontend_bench.py --build-dir "$B" --levels "$LEVELS" \
  --frontend-workers "$WORKER_COUNTS" --engine-calls "$ENGINE_CALLS" "${PIN[@]}" \
  --engine-args="${ENGINE_ARGS:-}" \
  --output "$OUT/frontend-table.md" 2>&1 |
  tee -a "$OUT/frontend-bench.log"
rc=${PIPESTATUS[0]}
for f in "$WORK"/tmp/exl3-fe-bench.*/logs/*.log; do
  [ -f "$f" ] && { echo "--- $(basename "$f") (last 40 lines)"; tail -40 "$f"; }
done > "$OUT/frontend-logs.txt" 2>&1
[ "$rc" = 0 ] || die "frontend_bench.py exited $rc (logs: $OUT/frontend-logs.txt)"
echo "=== $OUT/frontend-table.md"
cat "$OUT/frontend-table.md"
