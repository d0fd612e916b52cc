#!/usr/bin/env bash
# The README's main job in its short mode: the whole stack on loopback, verified answers, and no
# process left behind afterwards.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD_DIR=${1:-build}
before=$(pgrep -c -f 'exl3-(worker|router)|exl3serve-openai|prometheus --config.file=.*exl3-demo' || true)
out=$(mktemp "${TMPDIR:-/tmp}/exl3-demo-check.XXXXXX")
trap 'rm -f "$out"' EXIT
./scripts/demo.sh --short --no-deps --no-build --build-dir "$BUILD_DIR" 2>&1 | tee "$out"
# The run ends with the generation summary (README): every request answered, every reference
# matched; and the load generator's summary line is there too.
last=$(grep -v '^[[:space:]]*$' "$out" | tail -1)
if ! [[ "$last" =~ ^generate:\ requests=([0-9]+)\ ok=([0-9]+)\ failed=0\ reference_match=([0-9]+)/([0-9]+)\ ttft_p50_ms=[0-9.]+\ itl_p50_ms=[0-9.]+\ tok_s=[0-9.]+$ ]] ||
   [ "${BASH_REMATCH[1]}" != "${BASH_REMATCH[2]}" ] || [ "${BASH_REMATCH[3]}" != "${BASH_REMATCH[4]}" ] ||
   [ "${BASH_REMATCH[4]}" -eq 0 ]; then
  echo "demo's last line is not a passing generate: summary: $last" >&2
  exit 1
fi
grep -q '^requests=' "$out" || { echo "demo printed no exl3-loadgen summary line" >&2; exit 1; }
sleep 1
after=$(pgrep -c -f 'exl3-(worker|router)|exl3serve-openai|prometheus --config.file=.*exl3-demo' || true)
if [ "${after:-0}" -gt "${before:-0}" ]; then
  echo "demo left processes running:" >&2
  pgrep -af 'exl3-(worker|router)|exl3serve-openai|prometheus --config.file=.*exl3-demo' >&2
  exit 1
fi
echo "demo check passed"
