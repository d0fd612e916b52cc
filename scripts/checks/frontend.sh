#!/usr/bin/env bash
# The Python package and the OpenAI-compatible front end: installs clients/python into
# BUILD_DIR/frontend-venv (scripts/lib/frontend_venv.sh, pinned versions from PyPI), then runs
# tests/clients/python with pytest: offline tests of tokenizers, chat templates, detokenization and
# stop strings (against transformers' recorded outputs in tests/fixtures/tokenizer), and a live
# stack (a generated test model with a tokenizer, exl3-router, the exl3serve-openai process)
# driven by the openai SDK and curl. Run by scripts/test.sh.
# Before the tests, the package is installed once more the way a user installs it: into a fresh venv,
# offline (pip --no-index) from a wheelhouse of the same pinned packages.
# Usage: scripts/checks/frontend.sh BUILD_DIR
set -euo pipefail
cd "$(dirname "$0")/../.."
SETUPTOOLS="setuptools==84.2.1"  # the package's build backend (clients/python/pyproject.toml), pinned
BUILD_DIR=$(cd "${1:?usage: scripts/checks/frontend.sh BUILD_DIR}" && pwd)
for b in exl3-router exl3-tool; do
  [ -x "$BUILD_DIR/bin/$b" ] || { echo "frontend.sh: $BUILD_DIR/bin/$b not built" >&2; exit 1; }
done
command -v curl >/dev/null || { echo "frontend.sh: curl not found (scripts/install-deps.sh)" >&2; exit 1; }
echo "--- frontend: venv"
VENV=$(scripts/lib/frontend_venv.sh "$BUILD_DIR" | tail -1)
# `pip install ./clients/python` as a user runs it, in a fresh venv and offline: from a wheelhouse
# of the pinned packages (and setuptools, the package's build backend), downloaded once per
# requirements file; pip may reach no index, so every dependency must come from what CI installs.
echo "--- frontend: pip install ./clients/python in a fresh venv, offline"
WHEELS=$BUILD_DIR/frontend-wheelhouse
req_hash=$( (cat scripts/checks/frontend/requirements.txt; echo "$SETUPTOOLS") | sha256sum | cut -c1-16)
if [ "$(cat "$WHEELS/.requirements" 2>/dev/null)" != "$req_hash" ]; then
  rm -rf "$WHEELS"
  "$VENV/bin/pip" download --quiet --disable-pip-version-check -d "$WHEELS" \
    -r scripts/checks/frontend/requirements.txt "$SETUPTOOLS"
  echo "$req_hash" > "$WHEELS/.requirements"
fi
FRESH=$(mktemp -d "${TMPDIR:-/tmp}/exl3-fresh-venv.XXXXXX")
trap 'rm -rf "$FRESH"' EXIT
python3 -m venv "$FRESH/venv"
rm -rf clients/python/build  # setuptools' in-tree build output: no stale module may ship
PIP_FIND_LINKS= "$FRESH/venv/bin/pip" install --quiet --disable-pip-version-check --no-index \
  --find-links "$WHEELS" ./clients/python
rm -rf clients/python/build
"$FRESH/venv/bin/pip" check --disable-pip-version-check
(cd "$FRESH" && venv/bin/python -c 'import exl3serve_client, exl3serve.v1.exl3serve_pb2_grpc
from exl3serve_client.frontend import app
from importlib.metadata import version
print("fresh venv: exl3serve", version("exl3serve"), "imports")')
"$FRESH/venv/bin/exl3serve-openai" --help >/dev/null
"$FRESH/venv/bin/exl3serve-make-tokenizer" --help >/dev/null
echo "--- frontend: pytest tests/clients/python"
EXL3_BUILD_DIR=$BUILD_DIR timeout 900 "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  -o console_output_style=classic tests/clients/python
