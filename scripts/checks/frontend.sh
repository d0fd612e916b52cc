#!/usr/bin/env bash
# The Python package and the OpenAI-compatible front end: installs clients/python into
# BUILD_DIR/frontend-venv (scripts/lib/frontend_venv.sh, pinned versions from PyPI), then runs
# tests/clients/python with pytest: offline tests of tokenizers, chat templates, detokenization and
# stop strings (against transformers' recorded outputs in tests/fixtures/tokenizer), and a live
# stack (a generated test model with a tokenizer, exl3-router, the exl3serve-openai process)
# driven by the openai SDK and curl. Run by scripts/test.sh.
# Usage: scripts/checks/frontend.sh BUILD_DIR
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD_DIR=$(cd "${1:?usage: scripts/checks/frontend.sh BUILD_DIR}" && pwd)
for b in exl3-router exl3-tool; do
  [ -x "$BUILD_DIR/bin/$b" ] || { echo "frontend.sh: $BUILD_DIR/bin/$b not built" >&2; exit 1; }
done
command -v curl >/dev/null || { echo "frontend.sh: curl not found (scripts/install-deps.sh)" >&2; exit 1; }
echo "--- frontend: venv"
VENV=$(scripts/lib/frontend_venv.sh "$BUILD_DIR" | tail -1)
echo "--- frontend: pytest tests/clients/python"
EXL3_BUILD_DIR=$BUILD_DIR timeout 900 "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  -o console_output_style=classic tests/clients/python
