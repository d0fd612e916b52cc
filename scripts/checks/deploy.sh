#!/usr/bin/env bash
# Deployment and observability checks: Prometheus config and rules, Grafana dashboards,
# Kubernetes manifests, compose files, Dockerfiles, and a live stack (router, workers, load,
# a real Prometheus) whose /metrics and query results the rules and dashboards are checked
# against. Run by scripts/test.sh. Usage: scripts/checks/deploy.sh BUILD_DIR
# Tools come from Debian (promtool, prometheus, curl) and from PyPI into BUILD_DIR/deploy-venv
# (pinned in scripts/checks/deploy/requirements.txt). Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD_DIR=${1:?usage: scripts/checks/deploy.sh BUILD_DIR}
BUILD_DIR=$(cd "$BUILD_DIR" && pwd)
HERE=scripts/checks/deploy
failures=0

step() { printf -- '--- deploy: %s\n' "$1"; }
run() {  # run NAME CMD...: runs a check, counts a failure without stopping the others
  local name=$1; shift
  if "$@"; then echo "ok: $name"; else echo "FAILED: $name" >&2; failures=$((failures + 1)); fi
}

step "tools"
VENV=$(scripts/lib/deploy_venv.sh "$BUILD_DIR" | tail -1)
PY=$VENV/bin/python
for t in promtool prometheus curl; do
  command -v $t >/dev/null || { echo "deploy.sh: $t not found (scripts/install-deps.sh installs it)" >&2; exit 1; }
done
echo "promtool $(promtool --version 2>&1 | head -1 | awk '{print $3}'), kubectl $("$VENV/bin/kubectl" version --client 2>/dev/null | head -1 | awk '{print $3}'), hadolint $("$VENV/bin/hadolint" --version | awk '{print $NF}')"

step "tests of the checkers (each must catch a broken copy of deploy/)"
run "checker tests" "$PY" $HERE/test_checks.py --kubectl "$VENV/bin/kubectl" --check-jsonschema "$VENV/bin/check-jsonschema"

step "Prometheus: config, rules, rule unit tests"
run "promtool check config" promtool check config deploy/prometheus/prometheus.yml
run "promtool test rules" promtool test rules deploy/prometheus/tests/*.yml
run "PrometheusRule in sync with deploy/prometheus/rules" "$PY" deploy/prometheus/sync_k8s_rules.py --check
run "runbook for every alert" "$PY" $HERE/check_runbooks.py deploy docs/operations.md

step "Grafana dashboards"
run "dashboards generated from generate_dashboards.py" "$PY" deploy/grafana/generate_dashboards.py --check
run "dashboard structure" "$PY" $HERE/check_dashboards.py deploy
run "metric names against docs/metrics.md" "$PY" $HERE/check_metric_names.py --deploy deploy --doc docs/metrics.md

step "Kubernetes: kustomize render and schema validation"
run "kustomize base and overlays" "$PY" $HERE/check_k8s.py --kubectl "$VENV/bin/kubectl" deploy/k8s

step "compose"
run "compose files" "$PY" $HERE/check_compose.py --check-jsonschema "$VENV/bin/check-jsonschema" deploy

step "Dockerfiles"
run "hadolint" "$VENV/bin/hadolint" deploy/docker/Dockerfile deploy/docker/Dockerfile.cpu \
  deploy/docker/Dockerfile.frontend scripts/checks/containers/Dockerfile.prometheus
run "Dockerfile sources, targets and packages" "$PY" $HERE/check_dockerfiles.py --build-dir "$BUILD_DIR" .
run "grpc-health-check.sh syntax" bash -n deploy/docker/grpc-health-check.sh

step "live stack: router, workers, front end, load, Prometheus"
FRONTEND_VENV=$(scripts/lib/frontend_venv.sh "$BUILD_DIR" | tail -1)
run "live stack" "$PY" $HERE/live_stack.py --build-dir "$BUILD_DIR" --deploy deploy --doc docs/metrics.md \
  --kubectl "$VENV/bin/kubectl" --frontend-venv "$FRONTEND_VENV"

if [ "$failures" -ne 0 ]; then
  echo "deploy.sh: $failures check(s) failed" >&2
  exit 1
fi
echo "deploy.sh: all deployment checks passed"
