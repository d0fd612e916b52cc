#!/usr/bin/env bash
# The fault drills end to end (tests/services/router/fault_drills.py): kill -9 of a
# replicated worker under exl3-loadgen load, kill -9 of the only holder of some experts and its
# restart, SIGSTOP of a worker over shared memory and over gRPC, SIGTERM drain of the router under
# load, corrupt models refused at load, model files truncated under a serving worker. Real
# exl3-router / exl3-worker / exl3-loadgen processes on loopback; needs only Debian's python3 with
# python3-grpcio, python3-protobuf and python3-numpy (scripts/install-deps.sh). Every wait is
# bounded; the whole check is cut off after 240 s. About 20-40 s on a 2-core machine.
# Last line: fault-drills: N drills, N passed, 0 failed (...key figures...).
# Usage: scripts/checks/fault_drills.sh BUILD_DIR [DRILL...]
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD_DIR=$(realpath "${1:?usage: scripts/checks/fault_drills.sh BUILD_DIR [DRILL...]}")
shift
for b in bin/exl3-router bin/exl3-worker bin/exl3-loadgen tests/exl3-test-model python/exl3serve/v1/exl3serve_pb2.py; do
  [ -e "$BUILD_DIR/$b" ] || { echo "fault_drills: $BUILD_DIR/$b not built" >&2; exit 1; }
done
PY=/usr/bin/python3
"$PY" -c 'import grpc, numpy, google.protobuf' 2>/dev/null \
  || { echo "fault_drills: $PY lacks grpcio, numpy or protobuf (scripts/install-deps.sh)" >&2; exit 1; }
export EXL3_BUILD_DIR="$BUILD_DIR"
export PYTHONPATH="$BUILD_DIR/python:$PWD/clients/python"
# --kill-after: a drill that hangs despite its own bounds still ends the check.
exec timeout --kill-after=10 240 "$PY" tests/services/router/fault_drills.py "$@"
