#!/usr/bin/env bash
# scripts/checks/lib/debian_mirror.sh against apt configurations made here (APT_CONFIG: a sources
# list and a sources.list.d of this test's own): the archive of the suite's main component from a
# deb822 .sources file and from a one-line .list, the suite's own entry where an entry for another
# suite (security) comes first, and a clear failure, not an assumed address, where apt's sources
# name none. Run by scripts/checks/containers.sh. Usage: tests/scripts/checks/lib/debian_mirror_test.sh
set -euo pipefail
cd "$(dirname "$0")/../../../.."
MIRROR=scripts/checks/lib/debian_mirror.sh
tmp=$(mktemp -d "${TMPDIR:-/tmp}/debian-mirror-test.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
failures=0

# sources FILE_NAME CONTENT: an apt configuration whose only sources are CONTENT in FILE_NAME
# (nothing at all with an empty FILE_NAME); prints the configuration file for APT_CONFIG.
sources() {
  local d
  d=$(mktemp -d "$tmp/apt.XXXXXX")
  mkdir -p "$d/sources.list.d"
  [ -z "$1" ] || printf '%s\n' "$2" > "$d/sources.list.d/$1"
  printf 'Dir::Etc::sourcelist "%s/sources.list";\nDir::Etc::sourceparts "%s/sources.list.d";\n' \
    "$d" "$d" > "$d/apt.conf"
  echo "$d/apt.conf"
}

expect_mirror() {  # expect_mirror NAME WANT APT_CONF
  local got
  if got=$(APT_CONFIG=$3 "$MIRROR" bookworm 2>"$tmp/err") && [ "$got" = "$2" ]; then
    echo "ok: $1"
  else
    echo "FAILED: $1: got '$got', want '$2' ($(cat "$tmp/err"))" >&2
    failures=$((failures + 1))
  fi
}

expect_failure() {  # expect_failure NAME APT_CONF: exits 1 and says which suite it found none for
  local got status=0
  got=$(APT_CONFIG=$2 "$MIRROR" bookworm 2>"$tmp/err") || status=$?
  if [ "$status" = 1 ] && [ -z "$got" ] && grep -q "no Debian archive for 'bookworm' main" "$tmp/err"; then
    echo "ok: $1 ($(cat "$tmp/err"))"
  else
    echo "FAILED: $1: exit $status, printed '$got', said '$(cat "$tmp/err")'" >&2
    failures=$((failures + 1))
  fi
}

expect_mirror "deb822 .sources" http://mirror.example/debian "$(sources debian.sources \
'Types: deb
URIs: http://mirror.example/debian
Suites: bookworm bookworm-updates
Components: main contrib')"
expect_mirror "one-line .list, options and a trailing slash" https://mirror2.example/debian "$(sources mirror.list \
'deb [arch=amd64 signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] https://mirror2.example/debian/ bookworm main')"
expect_mirror "the suite's entry, not the first entry (security)" http://main.example/debian "$(sources debian.sources \
'Types: deb
URIs: http://security.example/debian-security
Suites: bookworm-security
Components: main

Types: deb
URIs: http://main.example/debian
Suites: bookworm
Components: main')"
expect_failure "no sources at all" "$(sources "" "")"
expect_failure "security only" "$(sources security.list \
'deb http://security.example/debian-security bookworm-security main')"
expect_failure "source packages only" "$(sources src.list 'deb-src http://mirror.example/debian bookworm main')"
expect_failure "another suite" "$(sources trixie.list 'deb http://mirror.example/debian trixie main')"
expect_failure "bookworm without main" "$(sources contrib.list 'deb http://mirror.example/debian bookworm contrib')"

[ "$failures" = 0 ] || { echo "debian_mirror_test: $failures failed" >&2; exit 1; }
echo "debian_mirror_test: passed"
