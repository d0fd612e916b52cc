#!/usr/bin/env python3
"""Checks deploy/k8s against the images that were built (run by scripts/checks/containers.sh).
No cluster runs here; this is what a cluster would find out on first start, found out before.

Usage: check_k8s_images.py --docker DOCKER --kubectl KUBECTL --build-dir BUILD_DIR --work DIR
                           --label KEY=VALUE --image REPO=LOCAL_IMAGE... deploy/k8s

For every container of every workload that `kubectl kustomize` renders for the base and each
overlay:
  - its image (repository, tag aside) is one that was built (REPO=LOCAL_IMAGE);
  - its command, or the image's entrypoint, exists in the image, and every `--flag` of its args is
    a flag of that binary (from `--helpfull` run in the image);
  - its containerPorts are ports the image EXPOSEs and exactly the ports of its --listen and
    --metrics-listen args;
  - each probe names one of those ports (by number or name): a gRPC probe the --listen port, an
    HTTP probe the --metrics-listen port; an exec probe's command exists in the image;
  - the pod's runAsUser:runAsGroup is the image's user.
Then the base's router and worker run as one pod would (one network namespace of their own, no
network beyond it): the manifest's args, environment (POD_NAME), user, read-only root file system
with /tmp writable, capabilities dropped, no privilege escalation, the model and an expert map
for a generated test model mounted where the manifests mount them; every probe of both is run
inside the containers until it passes (startup probes within the manifests' own budget, bounded
here at 120 s); SIGTERM stops both with exit 0 within terminationGracePeriodSeconds. The images
built here are the CPU variants: overlays passing --backend=cuda are checked for flags, ports and
probes but not run. Exit status 1 on any problem.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

import yaml

WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job")
MODEL_ARGS = ["--arch", "glm4_moe", "--synthetic", "--whole-model", "--layers", "4", "--experts", "16"]
problems = []


def fail(msg):
    problems.append(msg)
    print(f"FAIL: {msg}", file=sys.stderr, flush=True)


def log(msg):
    print(f"check_k8s_images: {msg}", flush=True)


class Docker:
    def __init__(self, docker, label):
        self.docker = docker
        self.label = label
        self._flags = {}
        self._inspect = {}
        self._exists = {}

    def run(self, *argv, timeout=120):
        return subprocess.run([self.docker] + list(argv), capture_output=True, text=True, timeout=timeout)

    def inspect(self, image):
        if image not in self._inspect:
            r = self.run("image", "inspect", image)
            self._inspect[image] = json.loads(r.stdout)[0]["Config"] if r.returncode == 0 else None
        return self._inspect[image]

    def exists(self, image, program):
        key = (image, program)
        if key not in self._exists:
            r = self.run("run", "--rm", "--network", "none", "--label", self.label, "--entrypoint", "/bin/sh",
                         image, "-c", f'command -v "{program}"')
            self._exists[key] = r.returncode == 0
        return self._exists[key]

    def flags(self, image, program):
        """Flag names of an absl binary (dashes and underscores alike), from --helpfull."""
        key = (image, program)
        if key not in self._flags:
            r = self.run("run", "--rm", "--network", "none", "--label", self.label, "--entrypoint", program,
                         image, "--helpfull")
            names = set(re.findall(r"^\s+--([A-Za-z0-9_]+) \(", r.stdout + r.stderr, re.M))
            self._flags[key] = {n.replace("-", "_") for n in names}
        return self._flags[key]


def render(kubectl, k8s_dir):
    names = ["base"] + sorted(os.path.join("overlays", d) for d in os.listdir(os.path.join(k8s_dir, "overlays")))
    out = []
    for name in names:
        r = subprocess.run([kubectl, "kustomize", os.path.join(k8s_dir, name)], capture_output=True, text=True)
        if r.returncode != 0:
            fail(f"{name}: kubectl kustomize: {r.stderr.strip()}")
            continue
        out.append((name, [d for d in yaml.safe_load_all(r.stdout) if d]))
    return out


def flag_value(args, name):
    for a in args:
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
    return None


def port_of(hostport):
    return int(hostport.rsplit(":", 1)[1]) if hostport and ":" in hostport else None


def probe_port(probe, c):
    for kind in ("grpc", "httpGet", "tcpSocket"):
        if kind in probe:
            p = probe[kind].get("port")
            if isinstance(p, str) and not p.isdigit():
                named = {x.get("name"): x["containerPort"] for x in c.get("ports", [])}
                return kind, named.get(p)
            return kind, int(p)
    return ("exec", None) if "exec" in probe else (None, None)


def check_container(d, where, obj, c, images):
    spec = obj["spec"]["template"]["spec"]
    repo = re.sub(r"(@sha256:.*|:[^/:]+)$", "", c["image"])
    image = images.get(repo)
    if not image:
        fail(f"{where}: image {c['image']} is none of the images built ({', '.join(sorted(images))})")
        return None
    cfg = d.inspect(image)
    if cfg is None:
        fail(f"{where}: image {image} not found")
        return None
    entry = c.get("command") or cfg.get("Entrypoint") or []
    if not entry or not d.exists(image, entry[0]):
        fail(f"{where}: command {entry[:1]} is not in {image}")
        return None
    # Kubernetes: `command` replaces the entrypoint and drops the image's CMD; `args` replaces CMD.
    if "command" in c or "args" in c:
        args = c.get("args", [])
    else:
        args = cfg.get("Cmd") or []
    flags = d.flags(image, entry[0])
    if not flags:
        fail(f"{where}: {entry[0]} --helpfull in {image} lists no flags")
    for a in args:
        if a.startswith("--"):
            name = a[2:].split("=", 1)[0].replace("-", "_")
            if name not in flags and not (name.startswith("no") and name[2:] in flags):
                fail(f"{where}: {entry[0]} in {image} has no flag --{a[2:].split('=', 1)[0]}")
    declared = {p["containerPort"] for p in c.get("ports", [])}
    exposed = {int(p.split("/")[0]) for p in (cfg.get("ExposedPorts") or {})}
    if declared - exposed:
        fail(f"{where}: containerPorts {sorted(declared - exposed)} are not EXPOSEd by {image} ({sorted(exposed)})")
    grpc_port = port_of(flag_value(args, "listen"))
    metrics_port = port_of(flag_value(args, "metrics-listen") or flag_value(args, "metrics_listen"))
    listening = {p for p in (grpc_port, metrics_port) if p}
    if declared != listening:
        fail(f"{where}: containerPorts {sorted(declared)}, but the args listen on {sorted(listening)}")
    for pname in ("startupProbe", "readinessProbe", "livenessProbe"):
        if pname not in c:
            continue
        kind, port = probe_port(c[pname], c)
        if kind == "grpc" and port != grpc_port:
            fail(f"{where}: {pname} is a gRPC probe on {port}, the gRPC server listens on {grpc_port}")
        elif kind == "httpGet" and (port != metrics_port or c[pname]["httpGet"].get("path") != "/metrics"):
            fail(f"{where}: {pname} is an HTTP probe of {c[pname]['httpGet'].get('path')} on {port}; "
                 f"/metrics is served on {metrics_port}")
        elif kind == "tcpSocket" and port not in listening:
            fail(f"{where}: {pname} is a TCP probe on {port}, nothing listens there")
        elif kind == "exec" and not d.exists(image, c[pname]["exec"]["command"][0]):
            fail(f"{where}: {pname} runs {c[pname]['exec']['command'][0]}, which {image} lacks")
        elif kind is None:
            fail(f"{where}: {pname} has no handler")
    sc = spec.get("securityContext", {})
    user = cfg.get("User") or "0"
    want = f"{sc.get('runAsUser')}:{sc.get('runAsGroup')}" if "runAsGroup" in sc else str(sc.get("runAsUser"))
    if "runAsUser" in sc and want != user:
        fail(f"{where}: the pod runs as {want}, the image {image} as {user}")
    return {"image": image, "entry": entry, "args": args, "grpc": grpc_port, "metrics": metrics_port}


def expand(args, env):
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in args]


def run_probe(d, name, c, probe_name, ports):
    kind, port = probe_port(c[probe_name], c)
    if kind == "grpc":
        argv = ["grpc-health-check", f"127.0.0.1:{port}"]
    elif kind == "httpGet":
        argv = ["curl", "-fsS", "-o", "/dev/null", f"http://127.0.0.1:{port}{c[probe_name]['httpGet'].get('path', '/')}"]
    elif kind == "tcpSocket":
        argv = ["bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{port}"]
    else:
        argv = c[probe_name]["exec"]["command"]
    return d.run("exec", name, *argv, timeout=30).returncode == 0


def run_pod(d, docs, images, build_dir, work, label):
    """The base's worker and router in one network namespace, as a pod would run them."""
    by = {(o["kind"], o["metadata"]["name"]): o for o in docs}
    sts, dep = by.get(("StatefulSet", "exl3-worker")), by.get(("Deployment", "exl3-router"))
    if not sts or not dep:
        fail("base: no StatefulSet exl3-worker or Deployment exl3-router to run")
        return
    shutil.rmtree(work, ignore_errors=True)
    models, mapdir = os.path.join(work, "models"), os.path.join(work, "expert-map")
    os.makedirs(mapdir)
    r = subprocess.run([os.path.join(build_dir, "bin", "exl3-tool"), "make-test-model", *MODEL_ARGS,
                        "--output", os.path.join(models, "model"), "--quiet"], capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"make-test-model: {r.stderr.strip()}")
        return
    pod = sts["metadata"]["name"] + "-0"
    wc = sts["spec"]["template"]["spec"]["containers"][0]
    grpc = port_of(flag_value(wc.get("args", []), "listen"))
    with open(os.path.join(mapdir, "expert-map.yaml"), "w") as f:
        yaml.safe_dump({"workers": [{"name": pod, "address": f"127.0.0.1:{grpc}", "experts": "0-15"}]}, f)
    for root, dirs, files in os.walk(work):
        for x in dirs + files:
            os.chmod(os.path.join(root, x), 0o755 if x in dirs else 0o644)
    os.chmod(work, 0o755)

    def docker_run(obj, c, name, network):
        spec = obj["spec"]["template"]["spec"]
        sc, csc = spec.get("securityContext", {}), c.get("securityContext", {})
        env = {}
        argv = ["run", "-d", "--name", name, "--label", label, "--network", network]
        for e in c.get("env", []):
            if e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
                env[e["name"]] = pod if obj is sts else obj["metadata"]["name"] + "-pod"
            elif "value" in e:
                env[e["name"]] = e["value"]
        for k, v in env.items():
            argv += ["-e", f"{k}={v}"]
        if "runAsUser" in sc:
            argv += ["--user", f"{sc['runAsUser']}:{sc.get('runAsGroup', sc['runAsUser'])}"]
        if csc.get("readOnlyRootFilesystem"):
            argv.append("--read-only")
        if csc.get("allowPrivilegeEscalation") is False:
            argv += ["--security-opt", "no-new-privileges"]
        for cap in csc.get("capabilities", {}).get("drop", []):
            argv += ["--cap-drop", cap]
        vols = {v["name"]: v for v in spec.get("volumes", [])}
        for m in c.get("volumeMounts", []):
            v = vols.get(m["name"], {})
            if "emptyDir" in v:
                argv += ["--tmpfs", f"{m['mountPath']}:rw,mode=1777"]
            elif "configMap" in v:
                argv += ["-v", f"{mapdir}:{m['mountPath']}:ro"]
            else:  # the model volume (a claim, or hostPath in some overlays)
                argv += ["-v", f"{models}:{m['mountPath']}:ro"]
        argv += [images[re.sub(r"(@sha256:.*|:[^/:]+)$", "", c["image"])]] + expand(c.get("args", []), env)
        r = d.run(*argv)
        if r.returncode != 0:
            fail(f"docker run {name}: {r.stderr.strip()}")
            return False
        return True

    wname, rname = "exl3serve-check-k8s-worker", "exl3serve-check-k8s-router"
    rc = dep["spec"]["template"]["spec"]["containers"][0]
    try:
        if not docker_run(sts, wc, wname, "none") or not docker_run(dep, rc, rname, f"container:{wname}"):
            return
        t0 = time.time()
        for name, obj, c in ((wname, sts, wc), (rname, dep, rc)):
            order = [p for p in ("startupProbe", "readinessProbe", "livenessProbe") if p in c]
            for p in order:
                deadline = time.time() + 120
                while time.time() < deadline:
                    if run_probe(d, name, c, p, None):
                        break
                    st = json.loads(d.run("inspect", name).stdout)[0]["State"]
                    if st["Status"] != "running":
                        logs = d.run("logs", "--tail", "15", name)
                        fail(f"{name} exited {st['ExitCode']} before its {p} passed:\n{logs.stdout}{logs.stderr}")
                        return
                    time.sleep(1)
                else:
                    fail(f"{name}: {p} did not pass within 120 s")
                    return
            log(f"{name}: {', '.join(order)} pass ({time.time() - t0:.0f} s after start)")
        for name, obj in ((rname, dep), (wname, sts)):
            grace = obj["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
            t0 = time.time()
            d.run("stop", "-t", str(grace), name, timeout=grace + 30)
            st = json.loads(d.run("inspect", name).stdout)[0]["State"]
            if st["ExitCode"] != 0 or time.time() - t0 >= grace:
                fail(f"{name}: SIGTERM gave exit {st['ExitCode']} after {time.time() - t0:.0f} s (grace {grace} s)")
        log("base pod (worker + router, read-only root, capabilities dropped, the manifests' users, args "
            "and mounts): every probe passed, SIGTERM exit 0 within the grace period")
    finally:
        for name in (rname, wname):
            d.run("rm", "-f", name)
        shutil.rmtree(work, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docker", required=True)
    ap.add_argument("--kubectl", required=True)
    ap.add_argument("--build-dir", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--label", required=True)
    ap.add_argument("--image", action="append", required=True, help="REPO=LOCAL_IMAGE")
    ap.add_argument("k8s_dir")
    args = ap.parse_args()
    images = dict(i.split("=", 1) for i in args.image)
    d = Docker(args.docker, args.label)
    rendered = render(args.kubectl, args.k8s_dir)
    n = 0
    for name, docs in rendered:
        for obj in docs:
            if obj["kind"] not in WORKLOADS:
                continue
            spec = obj["spec"]["template"]["spec"]
            for c in spec.get("initContainers", []) + spec.get("containers", []):
                n += 1
                check_container(d, f"{name}: {obj['kind']}/{obj['metadata']['name']}/{c['name']}", obj, c, images)
    log(f"{n} containers in {len(rendered)} renderings: images, commands, flags, ports, probes and users "
        f"match the images {', '.join(sorted(set(images.values())))}")
    base = dict(rendered).get("base")
    if base is not None:
        run_pod(d, base, images, os.path.abspath(args.build_dir), os.path.abspath(args.work), args.label)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
