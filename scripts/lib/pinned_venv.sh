#!/usr/bin/env bash
# Makes BUILD_DIR/NAME: a venv holding the pinned packages of REQUIREMENTS (a requirements file)
# from PyPI, made again when that file changes. Prints the venv's path on its last line.
# Usage: scripts/lib/pinned_venv.sh BUILD_DIR NAME REQUIREMENTS
set -euo pipefail
BUILD_DIR=$(cd "${1:?usage: pinned_venv.sh BUILD_DIR NAME REQUIREMENTS}" && pwd)
VENV=$BUILD_DIR/${2:?venv name}
REQ=${3:?requirements file}
req_hash=$(sha256sum "$REQ" | cut -c1-16)
if [ "$(cat "$VENV/.requirements" 2>/dev/null)" != "$req_hash" ]; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check -r "$REQ" >&2
  echo "$req_hash" > "$VENV/.requirements"
fi
echo "$VENV"
