#!/usr/bin/env bash
# The README's main job in its short mode: the whole stack on loopback, verified answers, and no
# process left behind afterwards.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD_DIR=${1:-build}
before=$(pgrep -c -f 'exl3-(worker|router)|exl3serve-openai|prometheus --config.file=.*exl3-demo' || true)
./scripts/demo.sh --short --no-deps --no-build --build-dir "$BUILD_DIR"
sleep 1
after=$(pgrep -c -f 'exl3-(worker|router)|exl3serve-openai|prometheus --config.file=.*exl3-demo' || true)
if [ "${after:-0}" -gt "${before:-0}" ]; then
  echo "demo left processes running:" >&2
  pgrep -af 'exl3-(worker|router)|exl3serve-openai|prometheus --config.file=.*exl3-demo' >&2
  exit 1
fi
echo "demo check passed"
