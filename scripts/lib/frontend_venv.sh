#!/usr/bin/env bash
# Makes BUILD_DIR/frontend-venv: the pinned packages of scripts/checks/frontend/requirements.txt
# from PyPI (made again when that file changes), then the project's Python package
# (clients/python) installed as a user installs it, and `pip check` that its dependencies hold.
# Prints the venv's path on its last line. Usage: scripts/lib/frontend_venv.sh BUILD_DIR
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=$(scripts/lib/pinned_venv.sh "${1:?usage: frontend_venv.sh BUILD_DIR}" frontend-venv \
  scripts/checks/frontend/requirements.txt | tail -1)
rm -rf clients/python/build  # setuptools' in-tree build output: no stale module may ship
"$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps --force-reinstall ./clients/python >&2
"$VENV/bin/pip" check --disable-pip-version-check >&2
echo "$VENV"
