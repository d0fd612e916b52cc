#!/usr/bin/env bash
# The project's test command: installs packages, configures, builds and runs every test.
# Exits non-zero on any failure. Usage: ./scripts/test.sh [--no-deps] [--build-dir DIR]
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=build
INSTALL_DEPS=1
while [ $# -gt 0 ]; do
  case "$1" in
    --no-deps) INSTALL_DEPS=0 ;;
    --build-dir) BUILD_DIR="$2"; shift ;;
    -h|--help) sed -n '2,4p' "$0"; exit 0 ;;
    *) echo "test.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done

step() { printf '\n=== %s (%s)\n' "$1" "$(date +%T)"; }

if [ "$INSTALL_DEPS" = 1 ]; then
  step "install dependencies"
  ./scripts/install-deps.sh
fi

# No two .h/.cc pairs anywhere in the tree include each other (a factory apart from the interface
# its kinds implement; scripts/checks/include_cycles.py, whole tree by default). Runs in well under
# a second, before the build.
step "include cycles"
python3 scripts/checks/include_cycles.py

step "configure"
# Line tables only (-g1): failures still backtrace to file and line, while the full debug info of
# RelWithDebInfo's -g made each C++ unit about 40 % slower to compile and 4x larger to link (on the
# CI machine's 2 cores the build is most of this command's time). demo.sh keeps whatever the build
# directory was configured with.
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DEXL3_WITH_FUZZ=ON \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG"

step "build"
cmake --build "$BUILD_DIR" -j "$(nproc)"

step "unit and integration tests (ctest)"
(cd "$BUILD_DIR" && ctest --output-on-failure -j "$(nproc)" --timeout 900)

# Further checks (fuzzing, deployment validation, demo) are added below as scripts/checks/*.sh;
# each runs with the build directory as its argument and must exit 0.
for check in scripts/checks/*.sh; do
  [ -e "$check" ] || continue
  step "check: $check"
  "$check" "$BUILD_DIR"
done

step "all tests passed"
