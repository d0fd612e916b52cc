#!/usr/bin/env bash
# Prints the Debian archive (a URI, no trailing slash) that apt's own sources name for SUITE's
# main component: deb822 .sources and one-line .list files alike, as apt itself reads them
# (`apt-get indextargets`, which honours APT_CONFIG), the first one where several do. Fails with a
# message saying where apt looked when none does: no address is assumed.
# Usage: scripts/checks/lib/debian_mirror.sh SUITE
set -euo pipefail
suite=${1:?usage: debian_mirror.sh SUITE}
targets=$(apt-get indextargets --no-release-info --format '$(REPO_URI)' \
  "Target-Of: deb" "Release: $suite" "Component: main" "Identifier: Packages") || {
  echo "debian_mirror.sh: apt-get indextargets failed (above)" >&2
  exit 1
}
mirror=$(printf '%s\n' "$targets" | sed -n '/./{s:/*$::;p;q}')
if [ -z "$mirror" ]; then
  eval "$(apt-config shell list Dir::Etc::sourcelist/f parts Dir::Etc::sourceparts/d)"
  echo "debian_mirror.sh: apt's sources name no Debian archive for '$suite' main (binary" \
    "packages) in ${list:-?} or ${parts:-?}*.list / *.sources; add one there (e.g." \
    "'deb http://MIRROR/debian $suite main')" >&2
  exit 1
fi
echo "$mirror"
