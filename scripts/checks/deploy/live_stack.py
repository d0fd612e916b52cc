#!/usr/bin/env python3
"""Runs the compose stack's processes on loopback and checks the observability config against it.

Usage: live_stack.py --build-dir BUILD_DIR --deploy deploy --doc docs/metrics.md
                     --frontend-venv VENV [--keep DIR]

What it starts (all on 127.0.0.1, free ports, CPU backend, in a temporary directory):
  - a generated EXL3 test model (`exl3-tool make-test-model`, or the router tests'
    `exl3-test-model` where the tool lacks that subcommand), of the shape the CPU compose run uses;
  - two workers and a router with the exact flags of deploy/compose/docker-compose.yml (paths and
    addresses rewritten to loopback) and the expert map of deploy/compose/expert-map.cpu.yml;
  - the front end (exl3serve-openai from --frontend-venv, a venv with the project's Python
    package: scripts/lib/frontend_venv.sh) with the compose file's flags, on a tokenizer made for
    the test model (exl3serve-make-tokenizer);
  - a real Prometheus (Debian's) with deploy/prometheus/prometheus.yml (targets rewritten,
    1 s scrape and rule evaluation) and the project's rule files;
  - load from `exl3-loadgen`, and HTTP completions through the front end.
What it checks:
  0. The real router accepts every example expert map of deploy/ (compose, k8s base and
     overlays) against a model with GLM-5.3-Flash's expert layout, and refuses one with a gap.
  1. deploy/docker/grpc-health-check.sh reports the workers and then the router SERVING.
  2. Every metric name used by a dashboard panel, template variable, recording rule or alert
     exists in the live /metrics of the router, the workers and the front end
     (check_metric_names.py --live).
  3. Prometheus scrapes all targets; its HTTP API returns non-empty per-layer latency series for
     every MoE layer (router and workers); every rule group evaluates without error and every
     recording rule returns data; every dashboard query runs and returns data.
  4. After `kill -9` of one worker, grpc-health-check reports the router NOT_SERVING, and the
     alerts Exl3WorkerDown and Exl3ExpertUnserved go pending.
Everything it started is stopped on exit. Exit status 1 on any failure.
"""
import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import promql  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", "..", ".."))
HEALTH = os.path.join(REPO, "deploy", "docker", "grpc-health-check.sh")
# Test model of the CPU compose run (deploy/compose/docker-compose.cpu.yml runs the same).
TEST_MODEL_EXPERTS = 16
COMPOSE_MODEL_ARGS = ["--arch", "glm4_moe", "--synthetic", "--whole-model", "--layers", "4",
                      "--experts", str(TEST_MODEL_EXPERTS)]

procs = []  # (name, Popen)
problems = []


def log(msg):
    print(f"live_stack: {msg}", flush=True)


def fail(msg):
    problems.append(msg)
    print(f"FAIL: {msg}", file=sys.stderr, flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(name, argv, logdir):
    out = open(os.path.join(logdir, f"{name}.log"), "w")
    p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    procs.append((name, p))
    return p


def stop_all():
    for name, p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.time() + 10
    for name, p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def tail(logdir, name, n=15):
    try:
        return "".join(open(os.path.join(logdir, f"{name}.log")).readlines()[-n:])
    except OSError:
        return ""


def wait_for(what, fn, timeout, logdir=None, name=None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if fn():
            return True
        if name:
            p = dict(procs)[name]
            if p.poll() is not None:
                fail(f"{what}: {name} exited with {p.returncode}:\n{tail(logdir, name)}")
                return False
        time.sleep(0.25)
    fail(f"{what}: not within {timeout} s" + (f"\n{tail(logdir, name)}" if name else ""))
    return False


def healthy(addr):
    return subprocess.run([HEALTH, addr], capture_output=True).returncode == 0


def http_get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def prom_query(base, expr):
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        d = json.loads(http_get(url))
    except urllib.error.HTTPError as e:
        return "error", e.read().decode()[:300]
    if d.get("status") != "success":
        return "error", d.get("error", "")
    return "ok", d["data"]["result"]


def compose_command(svc, subst):
    out = []
    for a in svc["command"]:
        a = re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*:-([^}]*)\}", r"\1", a)
        for k, v in subst.items():
            a = a.replace(k, v)
        out.append(a)
    return out


def listen_flag(svc, name):
    """The HOST:PORT a compose service's command gives to --listen / --metrics-listen."""
    for a in svc["command"]:
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    raise KeyError(f"no {name} in {svc['command']}")


def make_model(build, model_dir, logdir):
    tool = os.path.join(build, "bin", "exl3-tool")
    helptext = subprocess.run([tool, "--help"], capture_output=True, text=True)
    if "make-test-model" in helptext.stdout + helptext.stderr:
        argv = [tool, "make-test-model"] + COMPOSE_MODEL_ARGS + ["--output", model_dir, "--quiet"]
    else:
        alt = os.path.join(build, "tests", "exl3-test-model")
        if not os.path.exists(alt):
            fail("no test model generator: exl3-tool has no make-test-model and "
                 f"{alt} does not exist")
            return False
        log("exl3-tool has no make-test-model yet; using the router tests' exl3-test-model")
        argv = [alt, model_dir, f"--experts={TEST_MODEL_EXPERTS}", "--top-k=4", "--layers=4"]
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"{' '.join(argv)} failed: {r.stderr.strip()}")
        return False
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    n = cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts")
    if n != TEST_MODEL_EXPERTS:
        fail(f"the test model has {n} routed experts; deploy/compose/expert-map.cpu.yml is written "
             f"for {TEST_MODEL_EXPERTS}")
        return False
    return True


def example_maps(deploy, kubectl):
    """(name, YAML text) of every expert map that deploy/ ships for GLM-5.3-Flash."""
    out = [("deploy/compose/expert-map.yml", open(os.path.join(deploy, "compose", "expert-map.yml")).read())]
    k8s = os.path.join(deploy, "k8s")
    for d in ["base"] + [os.path.join("overlays", o) for o in sorted(os.listdir(os.path.join(k8s, "overlays")))]:
        r = subprocess.run([kubectl, "kustomize", os.path.join(k8s, d)], capture_output=True, text=True)
        for doc in yaml.safe_load_all(r.stdout):
            if doc and doc["kind"] == "ConfigMap" and "expert-map.yaml" in doc.get("data", {}):
                out.append((f"deploy/k8s/{d}", doc["data"]["expert-map.yaml"]))
    return out


def check_example_maps(build, deploy, kubectl, tmp):
    """The real router accepts every example expert map against a model of GLM-5.3-Flash's expert
    layout (288 routed experts, top-8; small hidden size) and refuses one with a gap."""
    model = os.path.join(tmp, "glm-layout")
    r = subprocess.run([os.path.join(build, "bin", "exl3-tool"), "make-test-model", "--arch", "glm4_moe",
                        "--synthetic", "--layers", "4", "--experts", "288", "--top-k", "8",
                        "--hidden", "128", "--intermediate", "128", "--output", model, "--quiet"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"make-test-model (288 experts): {r.stderr.strip()}")
        return
    maps = example_maps(deploy, kubectl)
    gap = maps[0][1].replace("144-287", "144-286")
    for name, text in maps + [("a map with a gap", gap)]:
        path = os.path.join(tmp, "map-" + re.sub(r"\W", "_", name) + ".yaml")
        open(path, "w").write(text)
        mp = free_port()
        pname = "router-map-" + re.sub(r"\W", "_", name)
        p = start(pname, [os.path.join(build, "bin", "exl3-router"), f"--model={model}",
                          f"--expert-map={path}", "--listen=127.0.0.1:0",
                          f"--metrics-listen=127.0.0.1:{mp}"], tmp)

        def loaded():
            try:
                return re.search(r"^exl3_router_unserved_experts \S+", http_get(f"http://127.0.0.1:{mp}/metrics", 1), re.M)
            except OSError:
                return False
        if name == "a map with a gap":
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                fail("the router accepted an expert map with a gap")
                continue
            if p.returncode == 0 or "no worker holds" not in tail(tmp, pname):
                fail(f"router on a map with a gap: exit {p.returncode}, {tail(tmp, pname, 2)}")
            continue
        if wait_for(f"router started with the expert map of {name}", loaded, 20, tmp, pname):
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=30)
    log(f"the router accepts the {len(maps)} example expert maps (GLM-5.3-Flash layout) and refuses one with a gap")


def check_tls_health(build, model, tmp):
    """grpc-health-check's TLS and mutual-TLS modes against a worker serving with TLS."""
    d = os.path.join(tmp, "tls")
    os.makedirs(d)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    cmds = [["req", "-x509"] + ec + ["-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=exl3 test CA"]]
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1"), ("client", "extendedKeyUsage=clientAuth")):
        open(os.path.join(d, f"{name}.ext"), "w").write(ext + "\n")
        cmds += [["req"] + ec + ["-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}"],
                 ["x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                  "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext"]]
    for c in cmds:
        r = subprocess.run(["openssl"] + c, cwd=d, capture_output=True, text=True)
        if r.returncode != 0:
            fail(f"openssl {' '.join(c)}: {r.stderr.strip()}")
            return
    gp = free_port()
    start("worker-tls", [os.path.join(build, "bin", "exl3-worker"), f"--model={model}", "--experts=all",
                         f"--listen=127.0.0.1:{gp}", "--metrics-listen=", "--backend=cpu",
                         "--threads=1", "--progress=false", f"--tls-cert={d}/server.pem",
                         f"--tls-key={d}/server.key", f"--tls-ca={d}/ca.pem",
                         "--tls-require-client-cert"], tmp)
    env_mtls = dict(os.environ, GRPC_HEALTH_CA=f"{d}/ca.pem", GRPC_HEALTH_CERT=f"{d}/client.pem",
                    GRPC_HEALTH_KEY=f"{d}/client.key")

    def ok(env):
        return subprocess.run([HEALTH, f"127.0.0.1:{gp}"], env=env, capture_output=True).returncode == 0
    if not wait_for("TLS worker SERVING (grpc-health-check with GRPC_HEALTH_CA/CERT/KEY)",
                    lambda: ok(env_mtls), 30, tmp, "worker-tls"):
        return
    no_cert = dict(os.environ, GRPC_HEALTH_CA=f"{d}/ca.pem")
    if ok(no_cert):
        fail("grpc-health-check without a client certificate passed against a mutual-TLS worker")
    if ok(dict(os.environ)):
        fail("grpc-health-check in plaintext passed against a TLS worker")
    p = dict(procs)["worker-tls"]
    os.killpg(p.pid, signal.SIGTERM)
    p.wait(timeout=30)
    log("grpc-health-check: SERVING over mutual TLS; refused without a client certificate and in plaintext")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build-dir", required=True)
    ap.add_argument("--deploy", required=True)
    ap.add_argument("--doc", required=True)
    ap.add_argument("--load-seconds", type=float, default=12)
    ap.add_argument("--keep", help="keep logs and files in this directory")
    ap.add_argument("--kubectl", required=True, help="kubectl with kustomize (renders the k8s maps)")
    ap.add_argument("--frontend-venv", required=True,
                    help="a venv with the project's Python package (scripts/lib/frontend_venv.sh)")
    args = ap.parse_args()
    build = os.path.abspath(args.build_dir)
    deploy = os.path.abspath(args.deploy)
    for b in ("exl3-worker", "exl3-router", "exl3-loadgen", "exl3-tool"):
        if not os.path.exists(os.path.join(build, "bin", b)):
            fail(f"{build}/bin/{b} is missing: build the whole tree first")
    for s in ("exl3serve-openai", "exl3serve-make-tokenizer"):
        if not os.path.exists(os.path.join(args.frontend_venv, "bin", s)):
            fail(f"{args.frontend_venv}/bin/{s} is missing: scripts/lib/frontend_venv.sh makes it")
    if problems:
        return 1
    tmp = args.keep or tempfile.mkdtemp(prefix="exl3-deploy-")
    os.makedirs(tmp, exist_ok=True)
    t0 = time.time()
    try:
        run(args, build, deploy, tmp)
    finally:
        stop_all()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    log(f"done in {time.time() - t0:.1f} s, {len(problems)} problem(s)")
    return 1 if problems else 0


def start_frontend(venv, compose, model, engine, tmp):
    """The front end as deploy/compose/docker-compose.yml runs it (engine and listen address on
    loopback ports), on a tokenizer made for the test model; returns its address, or None."""
    r = subprocess.run([os.path.join(venv, "bin", "exl3serve-make-tokenizer"), "--model", model],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        fail(f"exl3serve-make-tokenizer failed: {r.stderr.strip()[-1000:]}")
        return None
    addr = f"127.0.0.1:{free_port()}"
    svc = compose["services"]["frontend"]
    argv = [os.path.join(venv, "bin", "exl3serve-openai")] + compose_command(
        svc, {listen_flag(svc, "--engine"): engine, "/models/model": model,
              listen_flag(svc, "--listen"): addr})
    start("frontend", argv, tmp)

    def serving():
        try:
            return "ok" in http_get(f"http://{addr}/health", timeout=1)
        except OSError:
            return False
    if not wait_for("front end healthy (/health)", serving, 60, tmp, "frontend"):
        return None
    log(f"front end serving on {addr}")
    return addr


class HttpLoad:
    """Completions through the front end on a thread of its own until stop() (streamed and not,
    one at a time), so its series have data."""

    def __init__(self, addr):
        import threading
        self.url, self.done, self.errors = f"http://{addr}/v1/completions", 0, []
        self.model = json.loads(http_get(f"http://{addr}/v1/models"))["data"][0]["id"]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        i = 0
        while not self._stop.is_set():
            body = json.dumps({"model": self.model, "prompt": f"load {i % 4}", "max_tokens": 4,
                               "stream": bool(i % 2)}).encode()
            req = urllib.request.Request(self.url, body, {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    r.read()
                self.done += 1
            except OSError as e:
                self.errors.append(str(e))
                time.sleep(0.2)
            i += 1

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=40)


def run(args, build, deploy, tmp):
    check_example_maps(build, deploy, args.kubectl, tmp)
    model = os.path.join(tmp, "model")
    if not make_model(build, model, tmp):
        return

    compose = yaml.safe_load(open(os.path.join(deploy, "compose", "docker-compose.yml")))
    emap = yaml.safe_load(open(os.path.join(deploy, "compose", "expert-map.cpu.yml")))
    ports = {}
    for w in emap["workers"]:
        ports[w["name"]] = (free_port(), free_port())
        w["address"] = f"127.0.0.1:{ports[w['name']][0]}"
    map_path = os.path.join(tmp, "expert-map.yaml")
    yaml.safe_dump(emap, open(map_path, "w"))

    base_subst = {"/models/model": model, "/etc/exl3/expert-map.yaml": map_path,
                  "--backend=auto": "--backend=cpu"}
    for name, (gp, mp) in ports.items():
        svc = compose["services"][name]
        argv = [os.path.join(build, "bin", "exl3-worker")] + compose_command(
            svc, dict(base_subst, **{listen_flag(svc, "--listen"): f"127.0.0.1:{gp}",
                                     listen_flag(svc, "--metrics-listen"): f"127.0.0.1:{mp}"}))
        argv += ["--threads=1", "--progress=false"]
        start(name, argv, tmp)
    for name, (gp, _) in ports.items():
        if not wait_for(f"{name} SERVING (grpc-health-check)", lambda: healthy(f"127.0.0.1:{gp}"),
                        60, tmp, name):
            return
    rgp, rmp = free_port(), free_port()
    svc = compose["services"]["router"]
    argv = [os.path.join(build, "bin", "exl3-router")] + compose_command(
        svc, dict(base_subst, **{listen_flag(svc, "--listen"): f"127.0.0.1:{rgp}",
                                 listen_flag(svc, "--metrics-listen"): f"127.0.0.1:{rmp}"}))
    start("router", argv, tmp)
    if not wait_for("router SERVING (grpc-health-check)", lambda: healthy(f"127.0.0.1:{rgp}"),
                    60, tmp, "router"):
        return
    log("workers and router SERVING (checked with deploy/docker/grpc-health-check.sh)")
    check_tls_health(build, model, tmp)
    fe_addr = start_frontend(args.frontend_venv, compose, model, f"127.0.0.1:{rgp}", tmp)
    if fe_addr is None:
        return

    # Prometheus with the project's config, targets on loopback.
    cfg = yaml.safe_load(open(os.path.join(deploy, "prometheus", "prometheus.yml")))
    cfg["global"]["scrape_interval"] = "1s"
    cfg["global"]["evaluation_interval"] = "1s"
    cfg["rule_files"] = [os.path.join(deploy, "prometheus", r) for r in cfg["rule_files"]]
    pport = free_port()
    for job in cfg["scrape_configs"]:
        if job["job_name"] == "exl3serve-openai":
            job["static_configs"] = [{"targets": [fe_addr]}]
        elif job["job_name"] == "exl3-router":
            job["static_configs"] = [{"targets": [f"127.0.0.1:{rmp}"]}]
        elif job["job_name"] == "exl3-worker":
            job["static_configs"] = [{"targets": [f"127.0.0.1:{ports[n][1]}" for n in ports]}]
        elif job["job_name"] == "prometheus":
            job["static_configs"] = [{"targets": [f"127.0.0.1:{pport}"]}]
    pcfg = os.path.join(tmp, "prometheus.yml")
    yaml.safe_dump(cfg, open(pcfg, "w"))
    start("prometheus", ["prometheus", f"--config.file={pcfg}", f"--storage.tsdb.path={tmp}/tsdb",
                         f"--web.listen-address=127.0.0.1:{pport}"], tmp)
    base = f"http://127.0.0.1:{pport}"

    def prom_ready():
        try:
            return "Ready" in http_get(f"{base}/-/ready", timeout=1)
        except OSError:
            return False
    if not wait_for("Prometheus ready", prom_ready, 30, tmp, "prometheus"):
        return

    # Load.
    lg = start("loadgen", [os.path.join(build, "bin", "exl3-loadgen"), f"--target=127.0.0.1:{rgp}",
                           f"--model={model}", "--concurrency=2", "--tokens=4",
                           f"--duration={args.load_seconds}"], tmp)
    http_load = HttpLoad(fe_addr)
    time.sleep(args.load_seconds / 2)
    # 2. Names against the live /metrics, fetched under load.
    live = []
    scraped = [("router", f"127.0.0.1:{rmp}"), ("frontend", fe_addr)] + \
        [(n, f"127.0.0.1:{ports[n][1]}") for n in ports]
    for name, addr in scraped:
        path = os.path.join(tmp, f"{name}.metrics.txt")
        open(path, "w").write(http_get(f"http://{addr}/metrics"))
        live.append(path)
    r = subprocess.run([sys.executable, os.path.join(HERE, "check_metric_names.py"), "--deploy", deploy,
                        "--doc", args.doc, "--live"] + live, capture_output=True, text=True)
    sys.stdout.write(r.stdout)
    if r.returncode != 0:
        fail("metric names against the live /metrics:\n" + r.stderr.strip())
    try:
        lg.wait(timeout=args.load_seconds + 60)
    except subprocess.TimeoutExpired:
        fail("exl3-loadgen did not finish")
        return
    # Generation through the engine, so the engine's series carry data too.
    gen = subprocess.run(["/usr/bin/python3", os.path.join(HERE, "generate_load.py"),
                          f"--target=127.0.0.1:{rgp}"], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=os.path.join(build, "python")))
    log("generate load: " + (gen.stdout.strip() or gen.stderr.strip()[-400:]))
    if gen.returncode != 0:
        fail(f"generate load failed:\n{gen.stderr[-2000:]}")
    summary = [l for l in tail(tmp, "loadgen", 40).splitlines() if l.startswith("requests=")]
    log("exl3-loadgen: " + (summary[-1] if summary else "(no summary line)"))
    if lg.returncode != 0:
        fail(f"exl3-loadgen exited with {lg.returncode}:\n{tail(tmp, 'loadgen')}")
    http_load.stop()
    log(f"HTTP completions through the front end: {http_load.done} answered, "
        f"{len(http_load.errors)} failed")
    if http_load.errors or not http_load.done:
        fail("HTTP completions through the front end failed: " + "; ".join(http_load.errors[:3]))
    time.sleep(3)  # a few more scrapes and rule evaluations after the load

    # 3. Prometheus: targets, per-layer series, rules, dashboard queries.
    targets = json.loads(http_get(f"{base}/api/v1/targets"))["data"]["activeTargets"]
    down = [t["scrapeUrl"] + ": " + t.get("lastError", "") for t in targets if t["health"] != "up"]
    if down:
        fail("targets not up: " + "; ".join(down))
    model_cfg = json.load(open(os.path.join(model, "config.json")))
    first_dense = model_cfg.get("first_k_dense_replace", 0)
    moe_layers = {str(i) for i in range(first_dense, model_cfg["num_hidden_layers"])}
    for metric in ("exl3_router_layer_latency_seconds", "exl3_worker_layer_latency_seconds"):
        st, res = prom_query(base, f'sum by (layer) (increase({metric}_count{{stage="total"}}[1m])) > 0')
        layers = {s["metric"].get("layer") for s in res} if st == "ok" else set()
        if layers != moe_layers:
            fail(f"{metric}: layers with samples {sorted(layers)}, MoE layers {sorted(moe_layers)} ({res if st != 'ok' else ''})")
        else:
            log(f"{metric}: per-layer series with samples for layers {','.join(sorted(layers, key=int))}")

    rules = json.loads(http_get(f"{base}/api/v1/rules"))["data"]["groups"]
    n_rules = 0
    for g in rules:
        for rule in g["rules"]:
            n_rules += 1
            if rule.get("health") != "ok" or rule.get("lastError"):
                fail(f"rule {rule['name']}: health {rule.get('health')} {rule.get('lastError', '')}")
            if rule["type"] == "recording":
                st, res = prom_query(base, rule["name"])
                if st != "ok" or not res:
                    fail(f"recording rule {rule['name']} has no data ({res if st != 'ok' else 'empty'})")
    recorded, _ = promql.rule_exprs(deploy)
    if n_rules == 0 or not recorded:
        fail("Prometheus loaded no rules")
    log(f"{n_rules} rules loaded and evaluated, {len(recorded)} recording rules return data")

    n_q, empty = 0, []
    for e in promql.dashboard_exprs(deploy):
        q = promql.grafana_to_promql(e.text)
        st, res = prom_query(base, q)
        n_q += 1
        if st != "ok":
            fail(f"{e.where}: query fails: {res}")
        elif not res:
            empty.append(e.where)
    for w in empty:
        fail(f"{w}: returns no data under load")
    log(f"{n_q} dashboard queries run against Prometheus, {n_q - len(empty)} return data")

    firing = [a for a in json.loads(http_get(f"{base}/api/v1/alerts"))["data"]["alerts"]
              if a["state"] == "firing"]
    if firing:
        fail("alerts firing on a healthy stack: " + ", ".join(a["labels"]["alertname"] for a in firing))

    # 4. A worker dies: the router and the alerts see it.
    victim = list(ports)[-1]
    p = dict(procs)[victim]
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()

    def alerts_pending():
        alerts = json.loads(http_get(f"{base}/api/v1/alerts"))["data"]["alerts"]
        names = {a["labels"]["alertname"] for a in alerts if a["state"] in ("pending", "firing")
                 and a["labels"].get("worker", victim) == victim}
        return {"Exl3WorkerDown", "Exl3ExpertUnserved"} <= names
    def router_not_serving():
        r = subprocess.run([HEALTH, f"127.0.0.1:{rgp}"], capture_output=True, text=True)
        return r.returncode == 1 and "NOT_SERVING" in r.stderr
    if wait_for(f"grpc-health-check reports the router NOT_SERVING after kill -9 of {victim}",
                router_not_serving, 20):
        log(f"after kill -9 of {victim}: grpc-health-check reports the router NOT_SERVING")
    if wait_for(f"Exl3WorkerDown and Exl3ExpertUnserved pending after kill -9 of {victim}",
                alerts_pending, 20):
        st, res = prom_query(base, "exl3_router_unserved_experts")
        log(f"after kill -9 of {victim}: alerts Exl3WorkerDown and Exl3ExpertUnserved pending, "
            f"unserved experts = {res[0]['value'][1] if st == 'ok' and res else '?'}")


if __name__ == "__main__":
    sys.exit(main())
