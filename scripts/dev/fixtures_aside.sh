#!/usr/bin/env bash
# A device call carries at most 64 MiB (tracked tree + carried paths) and the fixtures are most of
# the tree: set aside every engine fixture a call does not need, then bring them back from git.
#   scripts/dev/fixtures_aside.sh out NAME...   delete tests/fixtures/engine/* except NAME...
#                                               (a directory or a file there), tests/fixtures/exllamav3
#                                               and tests/golden/*.safetensors (all tracked)
#   scripts/dev/fixtures_aside.sh in            restore every deleted tracked file under tests/
#                                               (only deleted ones: edits elsewhere are left alone)
# Prints the tracked tree's bytes present. Do not build while they are out: gtest_discover_tests
# lists the fixture-enumerated cases when a test binary links, and would list fewer.
set -euo pipefail
cd "$(dirname "$0")/../.."
case "${1:-}" in
  out)
    shift
    for d in tests/fixtures/engine/*; do
      n=$(basename "$d")
      [ "$n" = README.md ] && continue
      keep=0
      for k in "$@"; do [ "$n" = "$k" ] && keep=1; done
      [ $keep = 1 ] || rm -rf "$d"
    done
    rm -rf tests/fixtures/exllamav3
    rm -f tests/golden/*.safetensors ;;
  in)
    git ls-files -d -z -- tests/ | xargs -0 -r git checkout -- ;;
  *)
    echo "usage: fixtures_aside.sh out NAME... | in" >&2
    exit 2 ;;
esac
echo "fixtures_aside: tracked files present: $(git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s}') bytes"
