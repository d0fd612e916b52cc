#!/usr/bin/env python3
"""Renders every kustomization under deploy/k8s and validates what comes out.

Usage: check_k8s.py --kubectl PATH [--promtool PATH] deploy/k8s

For deploy/k8s/base and each deploy/k8s/overlays/*:
  1. `kubectl kustomize` renders it (the real kustomize built into kubectl).
  2. Built-in kinds are validated against the Kubernetes OpenAPI schemas, strictly (unknown
     fields are errors), for the oldest version we support (1.27, the first with GA gRPC
     probes) and the newest the validator knows (kubernetes-validate, offline).
  3. ServiceMonitor, PodMonitor and PrometheusRule are validated against the schemas in
     crd_schemas.py, and the PrometheusRule's groups with `promtool check rules`.
  4. Consistency that no schema sees: the expert map in the ConfigMap names exactly the
     StatefulSet's pods, at their headless-Service addresses, and covers every expert; the
     workers pass their pod name as --worker; probes are native gRPC where they should be;
     the Services, PodMonitor, ServiceMonitor and PodDisruptionBudgets select the pods they
     are meant to; volumes name objects that exist; GPU limits; overlay-specific placement.
Prints one line per problem and exits 1 if there is any.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

import jsonschema
import kubernetes_validate
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import crd_schemas  # noqa: E402

K8S_VERSIONS = ["1.27.0", "1.37.0"]
# Experts per MoE layer of the model the example maps are written for (GLM-5.3-Flash).
EXAMPLE_NUM_EXPERTS = 288


def ranges(text, limit):
    out = set()
    text = str(text).strip()
    if text == "all":
        return set(range(limit))
    for part in text.split(","):
        part = part.strip()
        lo, _, hi = part.partition("-")
        lo, hi = int(lo), int(hi or lo)
        if not (0 <= lo <= hi < limit):
            raise ValueError(f"range {part} outside 0..{limit - 1}")
        out |= set(range(lo, hi + 1))
    return out


def by_kind(docs):
    out = {}
    for d in docs:
        out.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    return out


def selects(selector, labels):
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def pod_spec(obj):
    return obj["spec"]["template"]["spec"]


def container(obj, name):
    for c in pod_spec(obj)["containers"]:
        if c["name"] == name:
            return c
    return None


def arg_value(c, flag):
    for a in c.get("args", []):
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def consistency(name, docs, problems):
    def fail(msg):
        problems.append(f"{name}: {msg}")

    k = by_kind(docs)
    sts = k.get("StatefulSet", {}).get("exl3-worker")
    dep = k.get("Deployment", {}).get("exl3-router")
    if not sts or not dep:
        fail("needs StatefulSet exl3-worker and Deployment exl3-router")
        return
    worker, router = container(sts, "worker"), container(dep, "router")

    # Expert map <-> StatefulSet pods.
    cms = [c for n, c in k.get("ConfigMap", {}).items() if n.startswith("exl3-expert-map")]
    if len(cms) != 1:
        fail(f"expected one exl3-expert-map ConfigMap, found {len(cms)}")
        return
    cm = cms[0]
    emap = yaml.safe_load(cm["data"]["expert-map.yaml"])
    workers = emap["workers"]
    svc_name = sts["spec"]["serviceName"]
    replicas = sts["spec"]["replicas"]
    want = [f"{sts['metadata']['name']}-{i}" for i in range(replicas)]
    got = [w["name"] for w in workers]
    if sorted(got) != sorted(want):
        fail(f"expert map workers {got} are not the StatefulSet's pods {want}")
    grpc_port = next(p["containerPort"] for p in worker["ports"] if p["name"] == "grpc")
    by_name = {w["name"]: w for w in workers}
    for w in workers:
        if w["address"] != f"{w['name']}.{svc_name}:{grpc_port}":
            fail(f"worker {w['name']} address {w['address']} is not "
                 f"{w['name']}.{svc_name}:{grpc_port}")
    covered = set()
    for w in workers:
        if "replica_of" in w:
            if w["replica_of"] not in by_name or "replica_of" in by_name[w["replica_of"]]:
                fail(f"worker {w['name']}: replica_of must name a worker with its own experts")
            continue
        covered |= ranges(w["experts"], EXAMPLE_NUM_EXPERTS)
    missing = set(range(EXAMPLE_NUM_EXPERTS)) - covered
    if missing:
        fail(f"expert map leaves experts {sorted(missing)[:10]}... without a worker")

    # Volumes name objects that exist.
    for obj in (sts, dep):
        for v in pod_spec(obj).get("volumes", []):
            if "configMap" in v and v["configMap"]["name"] not in k.get("ConfigMap", {}):
                fail(f"{obj['metadata']['name']} mounts missing ConfigMap {v['configMap']['name']}")
            if "persistentVolumeClaim" in v and \
                    v["persistentVolumeClaim"]["claimName"] not in k.get("PersistentVolumeClaim", {}):
                fail(f"{obj['metadata']['name']} mounts missing claim "
                     f"{v['persistentVolumeClaim']['claimName']}")

    # The worker finds its share by pod name.
    if arg_value(worker, "--worker") != "$(POD_NAME)":
        fail("worker must run with --worker=$(POD_NAME)")
    env = {e["name"]: e for e in worker.get("env", [])}
    if env.get("POD_NAME", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") != "metadata.name":
        fail("worker needs env POD_NAME from metadata.name")
    for c, flag in ((worker, "--expert-map"), (router, "--expert-map")):
        path = arg_value(c, flag)
        mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
        if not path or os.path.dirname(path) not in mounts:
            fail(f"{c['name']}: {flag}={path} is not under a mounted volume")

    # Probes: native gRPC on the gRPC port for the worker's startup/readiness/liveness and the
    # router's readiness.
    for c, probes in ((worker, ["startupProbe", "readinessProbe", "livenessProbe"]),
                      (router, ["readinessProbe"])):
        port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
        for p in probes:
            if c.get(p, {}).get("grpc", {}).get("port") != port:
                fail(f"{c['name']}: {p} must be a gRPC probe on port {port}")
    for c in (worker, router):
        for p in ("startupProbe", "readinessProbe", "livenessProbe"):
            if p not in c:
                fail(f"{c['name']}: no {p}")
        if c.get("securityContext", {}).get("allowPrivilegeEscalation") is not False:
            fail(f"{c['name']}: allowPrivilegeEscalation must be false")
    for obj in (sts, dep):
        if pod_spec(obj).get("securityContext", {}).get("runAsNonRoot") is not True:
            fail(f"{obj['metadata']['name']}: must run as non-root")
    if str(worker["resources"].get("limits", {}).get("nvidia.com/gpu")) != "1":
        fail("worker must limit nvidia.com/gpu to 1")

    # Selection: Services, monitors and PDBs pick the right pods and ports.
    pods = {"exl3-worker": sts["spec"]["template"]["metadata"]["labels"],
            "exl3-router": dep["spec"]["template"]["metadata"]["labels"]}
    for n, svc in k.get("Service", {}).items():
        if n not in pods or not selects({"matchLabels": svc["spec"]["selector"]}, pods[n]):
            fail(f"Service {n} does not select its pods")
    wsvc = k.get("Service", {}).get(svc_name, {})
    if wsvc.get("spec", {}).get("clusterIP") != "None":
        fail(f"worker Service {svc_name} must be headless")
    if not wsvc.get("spec", {}).get("publishNotReadyAddresses"):
        fail(f"worker Service {svc_name} must publish not-ready addresses (router watches loading workers)")
    for n, pdb in k.get("PodDisruptionBudget", {}).items():
        if n not in pods or not selects(pdb["spec"]["selector"], pods[n]):
            fail(f"PodDisruptionBudget {n} does not select its pods")
    for n, pm in k.get("PodMonitor", {}).items():
        if not selects(pm["spec"]["selector"], pods["exl3-worker"]):
            fail(f"PodMonitor {n} does not select the worker pods")
        for ep in pm["spec"]["podMetricsEndpoints"]:
            if ep["port"] not in {p["name"] for p in worker["ports"]}:
                fail(f"PodMonitor {n}: no worker port named {ep['port']}")
        if pods["exl3-worker"].get(pm["spec"].get("jobLabel")) != "exl3-worker":
            fail(f"PodMonitor {n}: jobLabel must give job=exl3-worker (alerts use it)")
    for n, sm in k.get("ServiceMonitor", {}).items():
        svc = k.get("Service", {}).get("exl3-router", {})
        if not selects(sm["spec"]["selector"], svc.get("metadata", {}).get("labels", {})):
            fail(f"ServiceMonitor {n} does not select the router Service")
        for ep in sm["spec"]["endpoints"]:
            if ep["port"] not in {p["name"] for p in svc["spec"]["ports"]}:
                fail(f"ServiceMonitor {n}: router Service has no port {ep['port']}")
        if svc.get("metadata", {}).get("labels", {}).get(sm["spec"].get("jobLabel")) != "exl3-router":
            fail(f"ServiceMonitor {n}: jobLabel must give job=exl3-router (alerts use it)")
    if not k.get("PrometheusRule"):
        fail("no PrometheusRule")

    # Overlay specifics.
    spec = pod_spec(sts)
    if name.startswith("overlays/dgx-spark"):
        if spec.get("nodeSelector", {}).get("kubernetes.io/arch") != "arm64":
            fail("dgx-spark workers must select arm64 nodes")
        terms = spec.get("affinity", {}).get("podAntiAffinity", {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution", [])
        if not any(t["topologyKey"] == "kubernetes.io/hostname" and
                   selects(t["labelSelector"], pods["exl3-worker"]) for t in terms):
            fail("dgx-spark needs one worker per node (required pod anti-affinity on hostname)")
    if name.endswith("hostnet"):
        for obj in (sts, dep):
            ps = pod_spec(obj)
            if not ps.get("hostNetwork") or ps.get("dnsPolicy") != "ClusterFirstWithHostNet":
                fail(f"{obj['metadata']['name']}: hostNetwork with dnsPolicy ClusterFirstWithHostNet expected")
    if name == "overlays/datacenter":
        if spec.get("nodeSelector", {}).get("kubernetes.io/arch") != "amd64":
            fail("datacenter workers must select amd64 nodes")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kubectl", required=True)
    ap.add_argument("--promtool", default="promtool")
    ap.add_argument("k8s_dir")
    args = ap.parse_args()

    dirs = ["base"] + sorted(os.path.join("overlays", d) for d in
                             os.listdir(os.path.join(args.k8s_dir, "overlays")))
    problems = []
    for name in dirs:
        r = subprocess.run([args.kubectl, "kustomize", os.path.join(args.k8s_dir, name)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            problems.append(f"{name}: kubectl kustomize failed: {r.stderr.strip()}")
            continue
        docs = [d for d in yaml.safe_load_all(r.stdout) if d]
        counts = {}
        for d in docs:
            kind = d["kind"]
            counts[kind] = counts.get(kind, 0) + 1
            what = f"{name}: {kind}/{d['metadata']['name']}"
            if kind in crd_schemas.SCHEMAS:
                try:
                    jsonschema.validate(d, crd_schemas.SCHEMAS[kind])
                except jsonschema.ValidationError as e:
                    problems.append(f"{what}: {'.'.join(map(str, e.absolute_path))}: {e.message}")
                if kind == "PrometheusRule":
                    with tempfile.NamedTemporaryFile("w", suffix=".yml") as f:
                        yaml.safe_dump({"groups": d["spec"]["groups"]}, f)
                        f.flush()
                        pr = subprocess.run([args.promtool, "check", "rules", f.name],
                                            capture_output=True, text=True)
                        if pr.returncode != 0:
                            problems.append(f"{what}: promtool check rules: {pr.stdout}{pr.stderr}")
                continue
            for v in K8S_VERSIONS:
                try:
                    kubernetes_validate.validate(d, v, strict=True)
                except kubernetes_validate.ValidationError as e:
                    problems.append(f"{what}: Kubernetes {v}: "
                                    f"{'.'.join(map(str, e.path))}: {e.message}")
                except kubernetes_validate.SchemaNotFoundError:
                    problems.append(f"{what}: no schema for Kubernetes {v}")
        consistency(name, docs, problems)
        print(f"check_k8s: {name}: rendered " +
              ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    for p in problems:
        print("FAIL: " + p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
