#!/usr/bin/env bash
# Every binary given answers --version with "<its name> <project version>" (exit 0) and --help with
# a usage text naming it (exit 0, or 1 where absl's flags parse the command line: absl's --help
# exits 1), never "No flags matched" (base/command_line.h).
# usage: help_and_version_test.sh VERSION BINARY...
set -u
version=$1; shift
failed=0
for bin in "$@"; do
  name=$(basename "$bin")
  out=$("$bin" --version 2>&1); rc=$?
  if [[ $rc -ne 0 || "$out" != "$name $version"* ]]; then
    echo "FAIL $name --version: rc $rc, printed: $out"; failed=1
  fi
  out=$("$bin" --help 2>&1); rc=$?
  if [[ $rc -gt 1 || "$out" != *"$name"* || "$out" == *"No flags matched"* ]]; then
    echo "FAIL $name --help: rc $rc, printed: ${out:0:300}"; failed=1
  fi
done
[[ $failed -eq 0 ]] && echo "$# binaries answer --help and --version"
exit $failed
