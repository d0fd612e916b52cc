#!/usr/bin/env python3
"""Checks deploy/compose without a Docker engine.

Usage: check_compose.py --check-jsonschema PATH deploy

1. Each compose file validates against the Compose Specification's JSON schema (the copy that
   check-jsonschema ships, offline).
2. The base file and each override are merged the way `docker compose -f a -f b` merges them
   (mappings merged, command/entrypoint replaced, volumes and ports merged by container path),
   and the result must have: the router (with --generate=true), worker-0 and worker-1, the front
   end, Prometheus and Grafana, the named volumes, bind mounts whose sources exist; host
   networking for every long-running service, each listening on 127.0.0.1 on ports of its own;
   worker names and addresses (127.0.0.1:PORT) that match the expert map, the front end's engine
   the router's address, Prometheus scrape targets that match the services' metrics ports,
   Grafana's datasource Prometheus' address; health checks on the right ports (grpc-health-check
   for gRPC, /health for the front end); build targets that exist in the Dockerfiles; the GPU
   override reserves an NVIDIA device for each worker; the CPU override builds Dockerfile.cpu and
   starts the workers only after the test model, and the front end only after its tokenizer, is
   written.
Prints one line per problem; exit status 1 if there is any.
"""
import argparse
import copy
import os
import re
import subprocess
import sys

import yaml

REQUIRED_SERVICES = ["router", "worker-0", "worker-1", "frontend", "prometheus", "grafana"]
# Services that stay up (the init services of the CPU override run once, without a network).
LONG_RUNNING = REQUIRED_SERVICES
REQUIRED_VOLUMES = ["prometheus-data", "grafana-data"]
WORKERS = ["worker-0", "worker-1"]


def load(path):
    with open(path) as f:
        doc = yaml.safe_load(f)
    return {k: v for k, v in doc.items() if not k.startswith("x-")}


def _mount_target(v):
    if isinstance(v, dict):
        return v.get("target")
    parts = interpolate(v).split(":")
    return parts[1] if len(parts) > 1 else parts[0]


def _port_target(p):
    return str(p).rsplit(":", 1)[-1] if not isinstance(p, dict) else str(p.get("target"))


def merge_service(base, over):
    out = copy.deepcopy(base)
    for k, v in over.items():
        if k in ("command", "entrypoint") or k not in out:
            out[k] = copy.deepcopy(v)
        elif k in ("volumes", "ports"):
            key = _mount_target if k == "volumes" else _port_target
            merged = {key(x): x for x in out[k]}
            merged.update({key(x): x for x in v})
            out[k] = list(merged.values())
        elif k == "depends_on":
            a = out[k] if isinstance(out[k], dict) else {s: {"condition": "service_started"} for s in out[k]}
            b = v if isinstance(v, dict) else {s: {"condition": "service_started"} for s in v}
            out[k] = {**a, **b}
        elif isinstance(v, dict) and isinstance(out[k], dict):
            out[k] = {**out[k], **copy.deepcopy(v)}
        else:
            out[k] = copy.deepcopy(v)
    return out


def merge(base, over):
    out = copy.deepcopy(base)
    for k, v in over.items():
        if k == "services":
            for name, svc in v.items():
                out["services"][name] = merge_service(out["services"].get(name, {}), svc)
        elif isinstance(v, dict):
            out[k] = {**(out.get(k) or {}), **v}
        else:
            out[k] = v
    return out


def interpolate(s):
    """${VAR:-default} -> default (what compose uses when VAR is unset)."""
    return re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*:-([^}]*)\}", r"\1", s)


def flag(cmd, name):
    for a in cmd or []:
        if a.startswith(name + "="):
            return interpolate(a.split("=", 1)[1])
    return None


def dockerfile_targets(path):
    return set(re.findall(r"^FROM\s+\S+\s+AS\s+(\S+)", open(path).read(), re.M | re.I))


def check_merged(name, doc, compose_dir, deploy_dir, problems):
    def fail(msg):
        problems.append(f"{name}: {msg}")

    services = doc.get("services", {})
    for s in REQUIRED_SERVICES:
        if s not in services:
            fail(f"missing service {s}")
    for v in REQUIRED_VOLUMES:
        if v not in (doc.get("volumes") or {}):
            fail(f"missing named volume {v}")
    if any(s not in services for s in REQUIRED_SERVICES):
        return
    named = set(doc.get("volumes") or {})

    # Mounts: named volumes declared, bind sources present (the model dir is the user's).
    maps = {}
    for sname, svc in services.items():
        for v in svc.get("volumes", []):
            src, tgt = (v["source"], v["target"]) if isinstance(v, dict) else interpolate(v).split(":")[:2]
            if src.startswith((".", "/")):
                path = os.path.normpath(os.path.join(compose_dir, src))
                if tgt == "/models/model":
                    continue
                if not os.path.exists(path):
                    fail(f"{sname}: bind mount source {src} does not exist")
                if tgt == "/etc/exl3/expert-map.yaml":
                    maps[sname] = path
            elif src not in named:
                fail(f"{sname}: volume {src} is not declared under volumes:")
        b = svc.get("build")
        if b:
            df = os.path.normpath(os.path.join(compose_dir, b["context"], b["dockerfile"]))
            if not os.path.exists(df):
                fail(f"{sname}: Dockerfile {df} does not exist")
            elif "target" in b and b["target"] not in dockerfile_targets(df):
                fail(f"{sname}: {os.path.basename(df)} has no target {b.get('target')}")

    # Host networking on loopback: every long-running service binds 127.0.0.1, on its own ports.
    listen_flags = {"router": ("--listen", "--metrics-listen"), "worker-0": ("--listen", "--metrics-listen"),
                    "worker-1": ("--listen", "--metrics-listen"), "frontend": ("--listen",),
                    "prometheus": ("--web.listen-address",)}
    taken = {}
    for sname in LONG_RUNNING:
        svc = services[sname]
        if svc.get("network_mode") != "host":
            fail(f"{sname}: network_mode must be host (the stack binds 127.0.0.1, no container network)")
        if svc.get("ports"):
            fail(f"{sname}: ports: has no meaning with host networking (and docker-compose 1.29 refuses it)")
        for f in listen_flags.get(sname, ()):
            addr = flag(svc.get("command"), f) or ""
            if not addr.startswith("127.0.0.1:"):
                fail(f"{sname}: {f}={addr or '(unset)'} must bind 127.0.0.1")
            port = addr.rsplit(":", 1)[-1]
            if port in taken:
                fail(f"{sname}: {f} port {port} is taken by {taken[port]} (host networking: one port each)")
            taken[port] = sname
    if services["grafana"].get("environment", {}).get("GF_SERVER_HTTP_ADDR") != "127.0.0.1":
        fail("grafana: GF_SERVER_HTTP_ADDR must be 127.0.0.1")

    # Workers and the expert map.
    if len(set(maps.values())) != 1:
        fail(f"router and workers must mount the same expert map, got {sorted(set(maps.values()))}")
    else:
        emap = yaml.safe_load(open(next(iter(maps.values()))))
        names = {w["name"]: w for w in emap["workers"]}
        for w in WORKERS:
            cmd = services[w].get("command")
            if flag(cmd, "--worker") != w:
                fail(f"{w}: must run with --worker={w} (its name in the expert map)")
            port = (flag(cmd, "--listen") or "").rsplit(":", 1)[-1]
            if w not in names:
                fail(f"expert map has no worker {w}")
            elif names[w]["address"] != f"127.0.0.1:{port}":
                fail(f"expert map address of {w} is {names[w]['address']}, service listens on 127.0.0.1:{port}")
            hc = services[w].get("healthcheck", {}).get("test", [])
            if hc[:2] != ["CMD", "grpc-health-check"] or hc[2:3] != [f"127.0.0.1:{port}"]:
                fail(f"{w}: healthcheck must run grpc-health-check 127.0.0.1:{port}")
    rport = (flag(services["router"].get("command"), "--listen") or "").rsplit(":", 1)[-1]
    if services["router"].get("healthcheck", {}).get("test", [])[2:3] != [f"127.0.0.1:{rport}"]:
        fail(f"router: healthcheck must run grpc-health-check 127.0.0.1:{rport}")
    if flag(services["router"].get("command"), "--generate") != "true":
        fail("router: must run --generate=true (the front end's engine)")

    # The front end talks to the router's Generator and is healthy when /health answers.
    fe = services["frontend"].get("command")
    if flag(fe, "--engine") != f"127.0.0.1:{rport}":
        fail(f"frontend: --engine={flag(fe, '--engine')}, the router listens on 127.0.0.1:{rport}")
    fport = (flag(fe, "--listen") or "").rsplit(":", 1)[-1]
    if f"http://127.0.0.1:{fport}/health" not in services["frontend"].get("healthcheck", {}).get("test", []):
        fail(f"frontend: healthcheck must ask http://127.0.0.1:{fport}/health")
    fmodel = {_mount_target(v): v for v in services["frontend"].get("volumes", [])}
    if flag(fe, "--model") not in fmodel:
        fail(f"frontend: --model={flag(fe, '--model')} is not a mounted volume")

    # Prometheus scrapes what the services expose.
    prom = services["prometheus"]
    mounts = {_mount_target(v): interpolate(v).split(":")[0] for v in prom.get("volumes", [])
              if isinstance(v, str)}
    cfg_dir = mounts.get("/etc/prometheus")
    if not cfg_dir or os.path.normpath(os.path.join(compose_dir, cfg_dir)) != os.path.join(deploy_dir, "prometheus"):
        fail("prometheus must mount deploy/prometheus at /etc/prometheus")
    cfg = yaml.safe_load(open(os.path.join(deploy_dir, "prometheus", "prometheus.yml")))
    jobs = {j["job_name"]: [t for sc in j.get("static_configs", []) for t in sc["targets"]]
            for j in cfg["scrape_configs"]}
    want = {"exl3-router": [flag(services["router"].get("command"), "--metrics-listen")],
            "exl3-worker": [flag(services[w].get("command"), "--metrics-listen") for w in WORKERS],
            "exl3serve-openai": [flag(fe, "--listen")],
            "prometheus": [flag(prom.get("command"), "--web.listen-address")]}
    for job, targets in want.items():
        if sorted(jobs.get(job, [])) != sorted(targets):
            fail(f"prometheus.yml job {job} scrapes {jobs.get(job)}, the services expose {targets}")

    # Grafana gets the provisioning and the dashboards where the provider looks.
    gmounts = {_mount_target(v): interpolate(v).split(":")[0] for v in services["grafana"].get("volumes", [])}
    prov = yaml.safe_load(open(os.path.join(deploy_dir, "grafana", "provisioning", "dashboards", "exl3.yml")))
    dash_path = prov["providers"][0]["options"]["path"]
    for tgt, src in (("/etc/grafana/provisioning/datasources", "grafana/provisioning/datasources"),
                     ("/etc/grafana/provisioning/dashboards", "grafana/provisioning/dashboards"),
                     (dash_path, "grafana/dashboards")):
        got = gmounts.get(tgt)
        if not got or os.path.normpath(os.path.join(compose_dir, got)) != os.path.join(deploy_dir, src):
            fail(f"grafana must mount deploy/{src} at {tgt}")
    ds = yaml.safe_load(open(os.path.join(deploy_dir, "grafana", "provisioning", "datasources", "prometheus.yml")))
    url = ds["datasources"][0]["url"]
    if url != f"http://{flag(prom.get('command'), '--web.listen-address')}":
        fail(f"grafana datasource {url} is not Prometheus' --web.listen-address")
    home = services["grafana"].get("environment", {}).get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    if home and not os.path.exists(os.path.join(deploy_dir, "grafana", "dashboards", os.path.basename(home))):
        fail(f"grafana home dashboard {home} does not exist")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check-jsonschema", required=True)
    ap.add_argument("deploy_dir")
    args = ap.parse_args()
    deploy_dir = os.path.abspath(args.deploy_dir)
    cdir = os.path.join(deploy_dir, "compose")
    files = sorted(f for f in os.listdir(cdir) if f.startswith("docker-compose") and f.endswith(".yml"))
    problems = []
    r = subprocess.run([args.check_jsonschema, "--builtin-schema", "vendor.compose-spec"] +
                       [os.path.join(cdir, f) for f in files], capture_output=True, text=True)
    if r.returncode != 0:
        problems.append("compose schema: " + (r.stdout + r.stderr).strip())

    base = load(os.path.join(cdir, "docker-compose.yml"))
    variants = {"docker-compose.yml": base}
    for f in files:
        if f != "docker-compose.yml":
            variants[f"docker-compose.yml + {f}"] = merge(base, load(os.path.join(cdir, f)))
    for name, doc in variants.items():
        check_merged(name, doc, cdir, deploy_dir, problems)
        services = doc["services"]
        if name.endswith("gpu.yml"):
            for w in WORKERS:
                devs = services[w].get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
                if not any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devs):
                    problems.append(f"{name}: {w} reserves no NVIDIA GPU")
                if flag(services[w].get("command"), "--backend") != "cuda":
                    problems.append(f"{name}: {w} must run --backend=cuda")
        if name.endswith("cpu.yml"):
            if "model-init" not in services:
                problems.append(f"{name}: no model-init service")
            for s in WORKERS + ["router"]:
                dep = services[s].get("depends_on", {})
                if not isinstance(dep, dict) or dep.get("model-init", {}).get("condition") != "service_completed_successfully":
                    problems.append(f"{name}: {s} must wait for model-init to complete")
            for s in WORKERS + ["router", "model-init"]:
                if services[s].get("build", {}).get("dockerfile") != "deploy/docker/Dockerfile.cpu":
                    problems.append(f"{name}: {s} must build deploy/docker/Dockerfile.cpu")
            if "make-test-model" not in " ".join(services["model-init"].get("command", [])):
                problems.append(f"{name}: model-init must run exl3-tool make-test-model")
            tok = services.get("tokenizer-init", {})
            if "exl3serve-make-tokenizer" not in " ".join(tok.get("command", [])):
                problems.append(f"{name}: tokenizer-init must run exl3serve-make-tokenizer")
            if tok.get("depends_on", {}).get("model-init", {}).get("condition") != "service_completed_successfully":
                problems.append(f"{name}: tokenizer-init must wait for model-init to complete")
            fdep = services["frontend"].get("depends_on", {})
            if not isinstance(fdep, dict) or fdep.get("tokenizer-init", {}).get("condition") != "service_completed_successfully":
                problems.append(f"{name}: frontend must wait for tokenizer-init to complete")
        print(f"check_compose: {name}: services " + ", ".join(sorted(services)))
    for p in problems:
        print("FAIL: " + p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
