#!/usr/bin/env bash
# On the GPU machine: runs test binaries of the bundle (scripts/gpu/bundle.sh; carry .gpu-check), each
# under a time limit, prints each one's exit code and its failed and passed lines, and packs every
# log into $OUT/logs.tar.xz (one file: a device call returns only so many).
#   bash scripts/gpu/test_checks.sh [--limit S] NAME=BINARY[:GTEST_FILTER] ...
# e.g. bash scripts/gpu/test_checks.sh qsa=engine_cuda_qsa_test model=engine_cuda_model_test:'Qwen4ExpFamily/*'
# A test reading a fixture the call left out fails with "cannot read tests/fixtures/engine/...":
# scripts/dev/fixtures_aside.sh keeps the ones named. Exit code: 1 if any binary failed.
# The bundle is unpacked afresh (a warm machine keeps the last call's .gpu-deps) unless KEEP_DEPS=1
# (a caller that unpacked it already and runs its binaries meanwhile).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}
LIMIT=180
if [ "${1:-}" = --limit ]; then LIMIT=$2; shift 2; fi
if [ $# -eq 0 ] || [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then sed -n '2,10p' "$0"; exit 2; fi
for spec in "$@"; do
  if [[ ! "$spec" =~ ^[A-Za-z0-9_.-]+=[A-Za-z0-9_.-]+(:.*)?$ ]]; then
    echo "test_checks: '$spec' is not NAME=BINARY[:FILTER]" >&2
    exit 2
  fi
done
mkdir -p "$OUT"
[ "${KEEP_DEPS:-0}" = 1 ] || rm -rf .gpu-deps
. scripts/gpu/env.sh > /dev/null
LOGS=$(mktemp -d /tmp/test-checks.XXXXXX)
trap 'tar -C "$LOGS" -cJf "$OUT/logs.tar.xz" .' EXIT
FAILED=0
for spec in "$@"; do
  name=${spec%%=*} rest=${spec#*=}
  binary=${rest%%:*} filter=
  [ "$binary" != "$rest" ] && filter=${rest#*:}
  args=()
  [ -n "$filter" ] && args+=("--gtest_filter=$filter")
  timeout "$LIMIT" "$BIN/$binary" "${args[@]}" > "$LOGS/$name.log" 2>&1
  rc=$?
  echo "$name ($binary${filter:+ $filter}): exit $rc"
  [ $rc = 0 ] || FAILED=1
  # A parameterized test's line names its parameter after a comma.
  grep -E "^\[  FAILED  \] [^ ]+( \(|, where)|^\[  PASSED  \]" "$LOGS/$name.log" | sed "s/^/  /" | head -40
  [ $rc = 0 ] || grep -m 3 -A 8 -E "Failure|terminate|Segmentation|Aborted" "$LOGS/$name.log" | sed "s/^/  | /" | head -40
done
exit $FAILED
