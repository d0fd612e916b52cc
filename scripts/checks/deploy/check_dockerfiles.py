#!/usr/bin/env python3
"""Checks the Dockerfiles beyond hadolint (no Docker engine in CI, so nothing is built here).

Usage: check_dockerfiles.py --build-dir BUILD_DIR REPO_ROOT

- every COPY source outside --from exists in the repository (the build context), except in the
  stages that read a staged context instead (`prebuilt`, `wheels-context`: what
  scripts/checks/containers.sh stages, and builds for real);
- both Dockerfiles have the stages `router` and `worker`, each with a HEALTHCHECK that runs
  grpc-health-check, an ENTRYPOINT, and a non-root USER in force; Dockerfile.frontend's stage
  `frontend` has a HEALTHCHECK asking /health, a non-root USER and the package's
  `exl3serve-openai` script as ENTRYPOINT;
- the CMake targets they build are defined by the project (add_executable);
- the build stage installs exactly the -dev packages of scripts/install-deps.sh;
- the runtime-package step (ldd -> realpath -> dpkg -S) run here on the binaries of BUILD_DIR,
  built on Debian bookworm like Dockerfile.cpu's build stage, yields packages that apt knows.
"""
import argparse
import os
import re
import subprocess
import sys

DOCKERFILES = ["deploy/docker/Dockerfile", "deploy/docker/Dockerfile.cpu"]
FRONTEND_DOCKERFILE = "deploy/docker/Dockerfile.frontend"
# Stages whose COPY sources are a staging directory's, not the repository's (see the docstring).
STAGED_CONTEXT_STAGES = {"prebuilt", "wheels-context"}
BINARIES = ["exl3-router", "exl3-worker", "exl3-tool", "exl3-loadgen"]


def logical_lines(text):
    return re.sub(r"\\\n", " ", text).splitlines()


def stages(lines):
    out, cur = {}, None
    for line in lines:
        m = re.match(r"\s*FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line, re.I)
        if m:
            cur = m.group(2) or m.group(1)
            base = out.get(m.group(1), {"user": None, "health": None, "entry": None})
            out[cur] = dict(base)
            continue
        if cur is None:
            continue
        m = re.match(r"\s*(USER|HEALTHCHECK|ENTRYPOINT)\s+(.*)", line, re.I)
        if m:
            out[cur][{"USER": "user", "HEALTHCHECK": "health", "ENTRYPOINT": "entry"}[m.group(1).upper()]] = m.group(2)
    return out


def copy_problems(df, lines, root):
    out, stage = [], None
    for line in lines:
        m = re.match(r"\s*FROM\s+\S+(?:\s+AS\s+(\S+))?", line, re.I)
        if m:
            stage = m.group(1)
            continue
        m = re.match(r"\s*COPY\s+(.*)", line, re.I)
        if m and "--from" not in m.group(1) and stage not in STAGED_CONTEXT_STAGES:
            for src in m.group(1).split()[:-1]:
                if not os.path.exists(os.path.join(root, src)):
                    out.append(f"{df}: COPY source {src} does not exist")
    return out


def frontend_problems(root):
    df = FRONTEND_DOCKERFILE
    lines = logical_lines(open(os.path.join(root, df)).read())
    out = copy_problems(df, lines, root)
    s = stages(lines).get("frontend")
    if not s:
        return out + [f"{df}: no stage frontend"]
    if not s["user"] or s["user"].split(":")[0] in ("root", "0"):
        out.append(f"{df}: stage frontend runs as root")
    if not s["health"] or "/health" not in s["health"]:
        out.append(f"{df}: stage frontend has no HEALTHCHECK asking /health")
    scripts = re.findall(r"^([\w-]+)\s*=", open(os.path.join(root, "clients/python/pyproject.toml")).read().split(
        "[project.scripts]", 1)[-1].split("[", 1)[0], re.M)
    if not s["entry"] or "exl3serve-openai" not in s["entry"] or "exl3serve-openai" not in scripts:
        out.append(f"{df}: ENTRYPOINT {s['entry']} is not the package's exl3serve-openai script ({scripts})")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build-dir", required=True)
    ap.add_argument("root")
    args = ap.parse_args()
    root = args.root
    problems = []
    deps = open(os.path.join(root, "scripts/install-deps.sh")).read()
    dev_pkgs = set(re.findall(r"\b(lib[\w+.-]*-dev|protobuf-compiler(?:-grpc)?|nlohmann-json3-dev|prometheus-cpp-dev)\b", deps))
    dev_pkgs -= {"libclang-rt-14-dev"}  # fuzzing runtime: tests only, not needed in images
    cmake_targets = set()
    for d, _, files in os.walk(root):
        if "/build" in d or "/.git" in d:
            continue
        if "CMakeLists.txt" in files:
            cmake_targets |= set(re.findall(r"add_executable\(\s*([\w-]+)", open(os.path.join(d, "CMakeLists.txt")).read()))

    for df in DOCKERFILES:
        text = open(os.path.join(root, df)).read()
        lines = logical_lines(text)
        problems += copy_problems(df, lines, root)
        st = stages(lines)
        for target in ("router", "worker"):
            s = st.get(target)
            if not s:
                problems.append(f"{df}: no stage {target}")
                continue
            if not s["user"] or s["user"].split(":")[0] in ("root", "0"):
                problems.append(f"{df}: stage {target} runs as root")
            if not s["health"] or "grpc-health-check" not in s["health"]:
                problems.append(f"{df}: stage {target} has no HEALTHCHECK with grpc-health-check")
            if not s["entry"]:
                problems.append(f"{df}: stage {target} has no ENTRYPOINT")
        m = re.search(r"--target\s+((?:exl3-[\w-]+\s*)+)", " ".join(lines))
        built = m.group(1).split() if m else []
        for t in built:
            if t not in cmake_targets:
                problems.append(f"{df}: builds {t}, which no CMakeLists.txt defines")
        if sorted(built) != sorted(BINARIES):
            problems.append(f"{df}: builds {built}, expected {BINARIES}")
        installed = set()
        for line in lines:
            if "apt-get install" in line and "xargs" not in line:
                installed |= set(re.findall(r"\b(lib[\w+.-]*-dev|protobuf-compiler(?:-grpc)?|nlohmann-json3-dev|prometheus-cpp-dev)\b", line))
        if installed != dev_pkgs:
            problems.append(f"{df}: build packages differ from scripts/install-deps.sh: "
                            f"missing {sorted(dev_pkgs - installed)}, extra {sorted(installed - dev_pkgs)}")

    problems += frontend_problems(root)

    # The runtime-package step, on this machine's binaries.
    bins = [os.path.join(args.build_dir, "bin", b) for b in BINARIES]
    present = [b for b in bins if os.path.exists(b)]
    if len(present) != len(bins):
        problems.append("binaries missing in the build directory: " +
                        ", ".join(os.path.basename(b) for b in bins if b not in present))
    if present:
        r = subprocess.run("ldd " + " ".join(present) + " | awk '/=> \\//{print $3}' | sort -u | "
                           "xargs -r realpath | xargs -r dpkg -S | cut -d: -f1 | sort -u",
                           shell=True, capture_output=True, text=True)
        pkgs = r.stdout.split()
        if r.returncode != 0 or not any(p.startswith("libgrpc++") for p in pkgs):
            problems.append(f"runtime package step found {pkgs} ({r.stderr.strip()})")
        else:
            known = subprocess.run(["apt-cache", "policy"] + pkgs, capture_output=True, text=True).stdout
            for p in pkgs:
                if not re.search(rf"^{re.escape(p)}:", known, re.M):
                    problems.append(f"runtime package {p} unknown to apt")
            print("check_dockerfiles: runtime packages for the CPU image: " + " ".join(pkgs))
    print(f"check_dockerfiles: {len(DOCKERFILES) + 1} Dockerfiles")
    for p in problems:
        print("FAIL: " + p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
