#!/usr/bin/env bash
# Installs the dependency wheels of .exl3v3-b/ (scripts/gpu/exllamav3_stage.sh) beside exllamav3 in
# $EXL3V3_SITE (default /tmp/site, where scripts/gpu/exllamav3_install.sh put it), one at a time: a
# wheel pip refuses does not hold back the others. Used by exllamav3_run.sh and exllamav3_bench.sh.
set -uo pipefail
SITE=${EXL3V3_SITE:-/tmp/site}
B=.exl3v3-b
[ -d "$B" ] || { echo "exllamav3_wheels: no $B: carry it (scripts/gpu/exllamav3_stage.sh)"; exit 2; }
echo "exllamav3_wheels: installing $(ls "$B" | tr '\n' ' ')"
for whl in "$B"/*.whl; do
  python3 -m pip install -q --no-index --no-deps --target "$SITE" "$whl" || echo "exllamav3_wheels: pip could not install $whl"
done
