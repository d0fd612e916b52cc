#!/usr/bin/env bash
# The images built and the compose stack run for real (Docker engine from Debian's docker.io,
# docker-compose 1.29 from Debian). Run by scripts/test.sh. Usage: scripts/checks/containers.sh BUILD_DIR
#
#  1. Installs docker.io, docker-compose and debootstrap where missing; starts dockerd
#     (--bridge=none --iptables=false: every container here uses host networking or none) where
#     no engine answers, and stops it again at the end.
#  2. Base image: debian:bookworm / debian:bookworm-slim where present or pullable; otherwise one
#     made here from the Debian mirror apt's own sources name for bookworm main
#     (scripts/checks/lib/debian_mirror.sh; none there: the check fails saying so) with
#     debootstrap --variant=minbase + docker import, passed to the Dockerfiles as BASE_IMAGE /
#     RUNTIME_BASE_IMAGE (cached between runs).
#  3. Builds from deploy/docker: router and worker (Dockerfile.cpu, BINARIES=prebuilt: the binaries
#     of BUILD_DIR, stripped, with the libraries no Debian package owns), the front end
#     (Dockerfile.frontend, WHEELS=context: clients/python and its pinned dependencies as wheels
#     made here from PyPI), and a Prometheus image from Debian's package
#     (scripts/checks/containers/Dockerfile.prometheus) in place of prom/prometheus.
#  4. Kubernetes: every image, port, probe, user and argument the rendered manifests use exists
#     in the built images, and the base's router and worker run as a pod would (read-only root,
#     no capabilities, the manifest's user and args) and pass their probes
#     (scripts/checks/containers/check_k8s_images.py).
#  5. The compose stack (deploy/compose/docker-compose.yml + docker-compose.cpu.yml +
#     scripts/checks/containers/docker-compose.check.yml): generated test model, three workers
#     (worker-2 a replica of worker-1), the router with --generate, the front end, Prometheus;
#     exl3-loadgen --verify, chat completions through the front end with the openai SDK, worker-1
#     killed under load and restarted, a crash restarted by the restart policy, health checks,
#     scrape targets, SIGTERM stop (drained, exit 0), everything removed
#     (scripts/checks/containers/stack.py).
# Every wait is bounded; the whole check is cut off after 20 minutes. It keeps the images (tagged
# :check, plus the base image) and the build cache for the next run; containers, volumes and
# networks it made are removed. EXL3_CONTAINERS_REMOVE_IMAGES=1 removes the images too.
# Skips (exit 0, with the reason) only where no Docker engine can run and CI is not set; in CI
# that is a failure.
# Last line: containers: images=N built, requests=R ok=R failed=0, worker kill failed=0, scrape targets up=U/U
set -euo pipefail
# Under a time limit, once: a hang anywhere still ends the check.
if [ -z "${EXL3_CONTAINERS_TIMED:-}" ]; then
  export EXL3_CONTAINERS_TIMED=1
  exec timeout --kill-after=30 1200 "$(realpath "$0")" "$@"
fi
BUILD_DIR=$(cd "${1:?usage: scripts/checks/containers.sh BUILD_DIR}" && pwd)
cd "$(dirname "$0")/../.."
HERE=scripts/checks/containers
WORK=$BUILD_DIR/containers
DOCKER=/usr/bin/docker          # Debian's client, the engine's version (BuildKit without buildx)
BINARIES=(exl3-router exl3-worker exl3-tool exl3-loadgen)
TAG=check
PROJECT=exl3serve-check
LOCAL_BASE=exl3serve-check/debian:bookworm-minbase
LABEL=org.exl3serve.check=containers
T_START=$(date +%s)

say() { printf -- '--- containers: %s\n' "$*"; }
skip_or_fail() {
  if [ "${CI:-}" = "true" ]; then
    echo "containers: FAILED: $* (CI must run this check)" >&2
    exit 1
  fi
  echo "containers: SKIPPED: $*"
  exit 0
}

for b in "${BINARIES[@]}"; do
  [ -x "$BUILD_DIR/bin/$b" ] || { echo "containers.sh: $BUILD_DIR/bin/$b not built" >&2; exit 1; }
done
mkdir -p "$WORK/logs"

say "helpers"
tests/scripts/checks/lib/debian_mirror_test.sh > "$WORK/logs/debian_mirror_test.log" 2>&1 \
  || { cat "$WORK/logs/debian_mirror_test.log" >&2; exit 1; }
tail -1 "$WORK/logs/debian_mirror_test.log"

say "packages"
need=(docker.io docker-compose debootstrap curl)
missing=()
for p in "${need[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  [ "$(id -u)" -eq 0 ] || skip_or_fail "${missing[*]} not installed and not root to install them"
  echo "installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" \
    > "$WORK/logs/apt.log" 2>&1 || { tail -20 "$WORK/logs/apt.log" >&2; exit 1; }
fi

say "engine"
DOCKERD_PID=""
stop_dockerd() {
  [ -n "$DOCKERD_PID" ] || return 0
  kill -TERM "$DOCKERD_PID" 2>/dev/null || true
  for _ in $(seq 1 100); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.2; done
  kill -KILL "$DOCKERD_PID" 2>/dev/null || true
  DOCKERD_PID=""
}
if ! timeout 20 "$DOCKER" info >/dev/null 2>&1; then
  [ "$(id -u)" -eq 0 ] || skip_or_fail "no Docker engine answers and not root to start dockerd"
  # No bridge, no iptables: containers here use the host's network (bound to 127.0.0.1) or none.
  setsid dockerd --bridge=none --iptables=false > "$WORK/logs/dockerd.log" 2>&1 < /dev/null &
  DOCKERD_PID=$!
  for _ in $(seq 1 120); do
    timeout 5 "$DOCKER" info >/dev/null 2>&1 && break
    kill -0 "$DOCKERD_PID" 2>/dev/null || break
    sleep 0.5
  done
  if ! timeout 5 "$DOCKER" info >/dev/null 2>&1; then
    tail -15 "$WORK/logs/dockerd.log" >&2
    stop_dockerd
    skip_or_fail "dockerd does not start here (log above)"
  fi
  echo "started dockerd (pid $DOCKERD_PID, log $WORK/logs/dockerd.log); stopped again at the end"
fi
echo "engine $("$DOCKER" version -f '{{.Server.Version}}'), $("$DOCKER" info -f 'storage {{.Driver}}, cgroup v{{.CgroupVersion}}'), $(docker-compose version --short 2>/dev/null | sed 's/^/docker-compose /')"

cleanup() {
  local status=$?
  trap - EXIT
  # What an interrupted run leaves: the stack's containers and volumes, the Kubernetes check's.
  "$DOCKER" ps -aq --filter "label=com.docker.compose.project=$PROJECT" \
    | xargs -r "$DOCKER" rm -f >/dev/null 2>&1 || true
  "$DOCKER" ps -aq --filter "label=$LABEL" | xargs -r "$DOCKER" rm -f >/dev/null 2>&1 || true
  "$DOCKER" volume ls -q --filter "label=com.docker.compose.project=$PROJECT" \
    | xargs -r "$DOCKER" volume rm -f >/dev/null 2>&1 || true
  "$DOCKER" volume ls -q --filter "label=$LABEL" | xargs -r "$DOCKER" volume rm -f >/dev/null 2>&1 || true
  if [ "${EXL3_CONTAINERS_REMOVE_IMAGES:-0}" = 1 ]; then
    "$DOCKER" images -q --filter "label=$LABEL" | sort -u | xargs -r "$DOCKER" rmi -f >/dev/null 2>&1 || true
    "$DOCKER" rmi -f "$LOCAL_BASE" >/dev/null 2>&1 || true
  fi
  stop_dockerd
  exit $status
}
trap cleanup EXIT
trap 'exit 143' TERM INT

say "base image"
BASE_IMAGE=debian:bookworm
RUNTIME_BASE_IMAGE=debian:bookworm-slim
have_image() { "$DOCKER" image inspect "$1" >/dev/null 2>&1; }
pull() { have_image "$1" || timeout 120 "$DOCKER" pull -q "$1" >/dev/null 2>&1; }
if pull "$BASE_IMAGE" && pull "$RUNTIME_BASE_IMAGE"; then
  echo "using $BASE_IMAGE and $RUNTIME_BASE_IMAGE"
else
  # The same suites as this machine (bookworm, -updates, -security): the runtime packages are
  # then the versions the binaries were built against.
  sources=$({ cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null || true; } | sha256sum | cut -c1-12)
  if [ "$("$DOCKER" image inspect -f '{{index .Config.Labels "org.exl3serve.sources"}}' "$LOCAL_BASE" 2>/dev/null)" != "$sources" ]; then
    t0=$(date +%s)
    mirror=$(scripts/checks/lib/debian_mirror.sh bookworm) || {
      echo "containers: $BASE_IMAGE cannot be pulled, and apt names no mirror to debootstrap" \
        "bookworm from (above)" >&2
      exit 1
    }
    rootfs=$WORK/rootfs
    rm -rf "$rootfs"
    debootstrap --variant=minbase bookworm "$rootfs" "$mirror" > "$WORK/logs/debootstrap.log" 2>&1 \
      || { tail -20 "$WORK/logs/debootstrap.log" >&2; exit 1; }
    rm -f "$rootfs/etc/apt/sources.list"
    cp /etc/apt/sources.list.d/*.sources "$rootfs/etc/apt/sources.list.d/" 2>/dev/null || true
    if [ -e /etc/apt/sources.list ]; then cp /etc/apt/sources.list "$rootfs/etc/apt/sources.list"; fi
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | "$DOCKER" import \
      -c "LABEL org.exl3serve.sources=$sources" -c 'CMD ["/bin/bash"]' - "$LOCAL_BASE" >/dev/null
    rm -rf "$rootfs"
    echo "made $LOCAL_BASE (debootstrap --variant=minbase bookworm from $mirror + docker import) in $(( $(date +%s) - t0 )) s"
  else
    echo "using $LOCAL_BASE (made earlier from this machine's package mirror)"
  fi
  BASE_IMAGE=$LOCAL_BASE
  RUNTIME_BASE_IMAGE=$LOCAL_BASE
fi
# A container runs here at all (a kernel or sandbox may refuse namespaces or cgroups).
if ! out=$(timeout 60 "$DOCKER" run --rm --network none --label "$LABEL" "$RUNTIME_BASE_IMAGE" true 2>&1); then
  skip_or_fail "the engine cannot run a container: $out"
fi

say "build context (prebuilt binaries of $BUILD_DIR, front end wheels)"
CTX=$WORK/context
rm -rf "$CTX"
mkdir -p "$CTX/prebuilt/bin" "$CTX/prebuilt/lib" "$CTX/deploy/docker" "$CTX/wheels"
cp deploy/docker/grpc-health-check.sh "$CTX/deploy/docker/"
for b in "${BINARIES[@]}"; do
  strip --strip-debug -o "$CTX/prebuilt/bin/$b" "$BUILD_DIR/bin/$b"
done
# The runtime-package step of Dockerfile.cpu's source stage, done here; a library no Debian
# package owns travels in prebuilt/lib.
owner() {  # owner FILE: the Debian package that owns FILE under any of its merged-/usr names
  local f real
  f=$1
  real=$(realpath "$f")
  for cand in "$f" "$real" "${real#/usr}" "/usr$f"; do
    dpkg -S "$cand" 2>/dev/null | head -1 | cut -d: -f1 && return 0
  done
  return 1
}
: > "$CTX/prebuilt/runtime-packages.txt"
for lib in $(ldd "$CTX"/prebuilt/bin/* | awk '/=> \//{print $3}' | sort -u); do
  if ! owner "$lib" >> "$CTX/prebuilt/runtime-packages.txt"; then
    cp -L "$lib" "$CTX/prebuilt/lib/"
  fi
done
sort -u -o "$CTX/prebuilt/runtime-packages.txt" "$CTX/prebuilt/runtime-packages.txt"
echo "runtime packages: $(wc -l < "$CTX/prebuilt/runtime-packages.txt"); libraries no package owns:" \
  "$(cd "$CTX/prebuilt/lib" && ls | tr '\n' ' ')($(du -sh "$CTX/prebuilt/lib" | cut -f1))"
VENV=$(scripts/lib/frontend_venv.sh "$BUILD_DIR" | tail -1)
mkdir -p "$CTX/clients" "$CTX/scripts/checks/frontend"
cp -r clients/python "$CTX/clients/python"
rm -rf "$CTX/clients/python/build"
cp scripts/checks/frontend/requirements.txt "$CTX/scripts/checks/frontend/"
"$VENV/bin/pip" wheel --quiet --disable-pip-version-check --wheel-dir "$CTX/wheels" \
  -c scripts/checks/frontend/requirements.txt "$CTX/clients/python" > "$WORK/logs/pip-wheel.log" 2>&1 \
  || { tail -20 "$WORK/logs/pip-wheel.log" >&2; exit 1; }
rm -rf "$CTX/clients/python/build"
echo "wheels: $(ls "$CTX/wheels" | wc -l) ($(du -sh "$CTX/wheels" | cut -f1))"
mkdir -p "$WORK/prometheus-context"

say "images"
IMAGES_TXT=$WORK/images.txt
: > "$IMAGES_TXT"
build() {  # build IMAGE DOCKERFILE CONTEXT [docker build args...]
  local image=$1 dockerfile=$2 context=$3 t0 size
  shift 3
  t0=$(date +%s)
  if ! DOCKER_BUILDKIT=1 timeout 600 "$DOCKER" build --network host --progress plain \
      --label "$LABEL" -f "$dockerfile" -t "$image" \
      --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg RUNTIME_BASE_IMAGE="$RUNTIME_BASE_IMAGE" \
      "$@" "$context" > "$WORK/logs/build-${image//[\/:]/_}.log" 2>&1; then
    tail -30 "$WORK/logs/build-${image//[\/:]/_}.log" >&2
    echo "containers: building $image from $dockerfile failed" >&2
    exit 1
  fi
  size=$("$DOCKER" image inspect -f '{{.Size}}' "$image")
  printf '%s\t%s\t%s\t%s\n' "$image" "$dockerfile" "$(( $(date +%s) - t0 ))" "$size" >> "$IMAGES_TXT"
  printf '  %-34s %-44s %4d s  %5d MB\n' "$image" "$dockerfile" "$(( $(date +%s) - t0 ))" "$(( size / 1000000 ))"
}
build "exl3serve/worker:$TAG-cpu" deploy/docker/Dockerfile.cpu "$CTX" --target worker --build-arg BINARIES=prebuilt
build "exl3serve/router:$TAG-cpu" deploy/docker/Dockerfile.cpu "$CTX" --target router --build-arg BINARIES=prebuilt
build "exl3serve/frontend:$TAG" deploy/docker/Dockerfile.frontend "$CTX" --build-arg WHEELS=context
build "exl3serve-check/prometheus:debian12" $HERE/Dockerfile.prometheus "$WORK/prometheus-context"
N_IMAGES=$(wc -l < "$IMAGES_TXT")
# Images of earlier runs whose tags moved to the new ones.
"$DOCKER" image prune -f --filter "label=$LABEL" >/dev/null 2>&1 || true

say "Kubernetes manifests against the images"
DEPLOY_VENV=$(scripts/lib/deploy_venv.sh "$BUILD_DIR" | tail -1)
"$DEPLOY_VENV/bin/python" $HERE/check_k8s_images.py --docker "$DOCKER" --kubectl "$DEPLOY_VENV/bin/kubectl" \
  --build-dir "$BUILD_DIR" --work "$WORK/k8s" --label "$LABEL" \
  --image exl3serve/router="exl3serve/router:$TAG-cpu" --image exl3serve/worker="exl3serve/worker:$TAG-cpu" \
  deploy/k8s

say "compose stack"
SUMMARY=$WORK/stack-summary.txt
rm -f "$SUMMARY"
EXL3_TAG=$TAG "$VENV/bin/python" $HERE/stack.py --docker "$DOCKER" --project "$PROJECT" \
  --compose-dir deploy/compose --check-file $HERE/docker-compose.check.yml --work "$WORK" \
  --summary "$SUMMARY"

kept="$(cut -f1 "$IMAGES_TXT" | tr '\n' ' ')$BASE_IMAGE"
[ "${EXL3_CONTAINERS_REMOVE_IMAGES:-0}" = 1 ] && kept="none (EXL3_CONTAINERS_REMOVE_IMAGES=1)"
echo "containers: done in $(( $(date +%s) - T_START )) s; containers, volumes and networks removed; images kept: $kept"
echo "containers: images=$N_IMAGES built, $(cat "$SUMMARY")"
