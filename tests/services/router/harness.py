"""Process harness for the router's system tests: a generated test model, exl3-worker and
exl3-router processes on loopback ports, certificates made with openssl, and helpers to wait for
readiness. Everything is started as subprocesses of the test and ended by PID."""

import json
import os
import re
import signal
import socket
import struct
import subprocess
import tempfile
import time
import unittest

BUILD = os.environ.get("EXL3_BUILD_DIR", os.path.join(os.path.dirname(__file__), "../../../build"))
BIN = os.path.join(BUILD, "bin")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProcessExited(AssertionError):
    """A process the test waits on has died: waiting longer cannot help."""


def wait_for(pred, timeout, what, interval=0.05):
    end = time.time() + timeout
    last = None
    while time.time() < end:
        try:
            v = pred()
            if v:
                return v
        except ProcessExited:
            raise
        except Exception as e:  # noqa: BLE001 - retried until the timeout
            last = e
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last error: {last})")


def workers_up(client):
    """{worker name: up} as the router's Describe reports it."""
    return {w.name: w.up for w in client.describe(timeout=2).workers}


def wait_until_workers_up(client, transport=None, timeout=20):
    """Until every worker is up and, with `transport` ("shm" or "grpc"), reached through it: a
    same-host worker is up on gRPC first and moves to shared memory once its offer is answered."""
    def ready():
        ws = client.describe(timeout=2).workers
        return all(w.up for w in ws) and (transport is None or {w.transport for w in ws} == {transport})
    wait_for(ready, timeout, f"all workers up{'' if transport is None else ' on ' + transport}")


class Proc:
    """A started binary with its log file; stop() ends it by PID."""

    def __init__(self, name, args, log_dir):
        self.name = name
        self.args = args
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.log = open(self.log_path, "ab")
        self.p = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL)

    @property
    def pid(self):
        return self.p.pid

    def alive(self):
        return self.p.poll() is None

    def signal(self, sig):
        if self.alive():
            os.kill(self.p.pid, sig)

    def freeze(self, timeout=10):
        """SIGSTOP, then waits until every thread has stopped: the signal is asynchronous, and a
        thread still running could answer a request sent right after."""
        self.signal(signal.SIGSTOP)

        def all_stopped():
            task = f"/proc/{self.p.pid}/task"
            for t in os.listdir(task):
                try:
                    with open(os.path.join(task, t, "stat")) as f:
                        if f.read().rsplit(")", 1)[1].split()[0] != "T":
                            return False
                except FileNotFoundError:
                    pass  # the thread ended
            return True

        wait_for(all_stopped, timeout, f"{self.name} stopped")

    def kill9(self):
        self.signal(signal.SIGKILL)
        self.p.wait(timeout=10)

    def stop(self, timeout=10):
        if self.alive():
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                self.p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill9()
        self.log.close()

    def text(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def wait_for_log(self, pattern, timeout=30):
        """Waits for `pattern` (a regex) in the log and returns its match; fails at once, with
        the log, if the process exits first."""
        rx = re.compile(pattern)

        def seen():
            m = rx.search(self.text())
            if m is None and not self.alive():
                raise ProcessExited(f"{self.name} exited ({self.p.returncode}) before "
                                    f"logging /{pattern}/:\n{self.text()}")
            return m

        return wait_for(seen, timeout, f"/{pattern}/ in the log of {self.name}")


# An expert map of two workers with no replica: a holds experts 0-3, b 4-7 (format with a=, b=).
TWO_WORKER_MAP = """workers:
  - name: a
    address: 127.0.0.1:{a}
    experts: 0-3
  - name: b
    address: 127.0.0.1:{b}
    experts: 4-7
"""


def greedy_generate(stub, prompt, max_tokens, pb):
    """(token ids, usage) of one greedy Generate request (pb: the exl3serve.v1 messages module)."""
    req = pb.GenerateRequest(prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True,
                             sampling=pb.SamplingParams(temperature=0))
    tokens, usage = [], None
    for r in stub.Generate(req, timeout=120):
        tokens += [t.token_id for t in r.tokens]
        if r.finish_reason:
            usage = r.usage
    return tokens, usage


def int32_tensors(path, prefix):
    """The int32 tensors named prefix + "0", prefix + "1", ... of a safetensors file (an engine
    fixture's reference.safetensors: prompt.i, greedy.i), as lists; no torch here."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = []
    while f"{prefix}{len(out)}" in header:
        t = header[f"{prefix}{len(out)}"]
        if t["dtype"] != "I32":
            raise ValueError(f"{path}: {prefix}{len(out)} is {t['dtype']}, not I32")
        b, e = t["data_offsets"]
        out.append(list(struct.unpack(f"<{(e - b) // 4}i", data[b:e])))
    return out


class FixtureGenerateTest(unittest.TestCase):
    """Generate through exl3-router on an engine fixture (tests/fixtures/engine/<FIXTURE>): its
    prompts and transformers' greedy tokens, a fresh cluster per case with TWO_WORKER_MAP."""

    FIXTURE = None  # the fixture directory; set by the subclass

    @classmethod
    def setUpClass(cls):
        ref = os.path.join(cls.FIXTURE, "reference.safetensors")
        cls.prompts = int32_tensors(ref, "prompt.")
        cls.greedy = int32_tensors(ref, "greedy.")

    def setUp(self):
        self.c = Cluster(model=self.FIXTURE)
        self.addCleanup(self.c.stop)
        self.c.write_map(TWO_WORKER_MAP)

    def wait_for_workers(self, stub, pb):
        """Until the router says its experts are on workers and answers a one-token request."""
        wait_for(lambda: stub.DescribeModel(pb.DescribeModelRequest(), timeout=2).experts == "workers"
                 and greedy_generate(stub, [1], 1, pb)[0], 30, "router with workers ready")


def make_test_model(path, whole_model=False):
    """Writes a test model directory at `path`. whole_model: a complete glm4_moe model (attention,
    embeddings, head; 8 experts) from exl3-tool make-test-model, so a router runs the engine
    (seconds of CPU: quantized at generation); else MoE layers only (exl3-test-model, instant)."""
    if whole_model:
        subprocess.run([os.path.join(BIN, "exl3-tool"), "make-test-model", "--arch", "glm4_moe",
                        "--output", path, "--layers", "3", "--experts", "8", "--top-k", "2",
                        "--quiet"], check=True)
    else:
        subprocess.run([os.path.join(BUILD, "tests", "exl3-test-model"), path], check=True)


class Cluster:
    """Test model + expert map + workers + router. Workers: a (experts 0-3, alone),
    b (4-7) and b2 (replica_of b)."""

    MAP = """workers:
  - name: a
    address: 127.0.0.1:{a}
    experts: 0-3
  - name: b
    address: 127.0.0.1:{b}
    experts: 4-7
  - name: b2
    address: 127.0.0.1:{b2}
    replica_of: b
"""

    def __init__(self, worker_tls=None, whole_model=False, model=None):
        """A new test model (make_test_model, whole_model as there), or `model`: an existing
        model directory that the cluster serves and leaves as it is (several clusters may share
        one made once)."""
        self.dir = tempfile.mkdtemp(prefix="exl3-router-test-")
        if model is not None:
            self.model = model
        else:
            self.model = os.path.join(self.dir, "model")
            make_test_model(self.model, whole_model)
        self.ports = {n: free_port() for n in ("a", "b", "b2")}
        self.map_path = os.path.join(self.dir, "map.yaml")
        self.write_map(self.MAP)
        self.worker_tls = worker_tls or []
        self.workers = {}
        self.routers = []

    def write_map(self, template):
        self.map_template = template
        with open(self.map_path, "w") as f:
            f.write(template.format(**self.ports))

    def _spawn_worker(self, name, extra, model, attempt):
        args = [os.path.join(BIN, "exl3-worker"), "--model", model or self.model, "--expert-map",
                self.map_path, "--worker", name, "--listen", f"127.0.0.1:{self.ports[name]}",
                "--metrics-listen", "127.0.0.1:0", "--progress=false", "--mlock=false",
                "--threads", "1", *self.worker_tls, *extra]
        w = Proc(f"worker-{name}-{len(self.workers)}-{attempt}-{time.time():.0f}", args, self.dir)
        self.workers[name] = w
        return w

    def _listening(self, name, w):
        """Waits until worker process `w` listens; False when its port was taken meanwhile by
        another process and may be replaced (no router has read the map yet): the caller
        retries on a fresh port."""
        try:
            w.wait_for_log(r"serving on ")
            return True
        except ProcessExited:
            if "address in use" not in w.text() or self.routers:
                raise
            w.stop()
            self.ports[name] = free_port()
            self.write_map(self.map_template)
            return False

    def start_worker(self, name, extra=(), model=None):
        """Starts worker `name` on its port from the map and waits until it listens (model: a
        model directory other than the cluster's, e.g. a copy of it). Before any router has
        read the map, a port another process took meanwhile is replaced by a fresh one
        (free_port() cannot reserve it)."""
        for attempt in range(5):
            w = self._spawn_worker(name, extra, model, attempt)
            if self._listening(name, w):
                return w
        raise AssertionError(f"worker {name}: no free port after 5 attempts")

    def start_workers(self, names=("a", "b", "b2")):
        """start_worker for several workers at once: all are started before the first is
        waited for, so their model loads overlap."""
        started = {n: self._spawn_worker(n, (), None, 0) for n in names}
        for n, w in started.items():
            if not self._listening(n, w):
                self.start_worker(n)

    def start_router(self, extra=(), tls=(), with_map=True):
        """Starts a router on ports the kernel picks and waits until it listens; .address and
        .metrics are what it logged. with_map False: the experts are held by the router."""
        args = [os.path.join(BIN, "exl3-router"), "--model", self.model,
                *(["--expert-map", self.map_path] if with_map else []),
                "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                "--reconnect-backoff-max-ms", "300", *tls, *extra]
        r = Proc(f"router-{len(self.routers)}", args, self.dir)
        self.routers.append(r)
        m = r.wait_for_log(r"exl3-router listening on (\S+) .*metrics on (\S+),")
        r.address, r.metrics = m.group(1), m.group(2)
        return r

    def stop(self):
        # Signal everything first, then wait: the processes drain in parallel.
        procs = self.routers + list(self.workers.values())
        for p in procs:
            if p.alive():
                p.signal(signal.SIGCONT)
                p.signal(signal.SIGTERM)
        for p in procs:
            p.stop()


def make_certs(d):
    """CA, server cert for 127.0.0.1/localhost, a client cert from the CA, and a client cert from
    another (untrusted) CA. Returns a dict of paths."""

    def run(*a):
        subprocess.run(a, check=True, cwd=d, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    for ca in ("ca", "rogue-ca"):
        run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-subj", f"/CN=exl3 test {ca}", "-keyout", f"{ca}.key", "-out", f"{ca}.pem")
    with open(os.path.join(d, "san.ext"), "w") as f:
        f.write("subjectAltName=DNS:localhost,IP:127.0.0.1\n")

    def leaf(name, ca, ext=True):
        run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
            "-keyout", f"{name}.key", "-out", f"{name}.csr")
        args = ["openssl", "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem",
                "-CAkey", f"{ca}.key", "-CAcreateserial", "-days", "2", "-out", f"{name}.pem"]
        if ext:
            args += ["-extfile", "san.ext"]
        run(*args)

    leaf("server", "ca")
    leaf("client", "ca")
    leaf("rogue", "rogue-ca")
    return {k: os.path.join(d, v) for k, v in {
        "ca": "ca.pem", "server_cert": "server.pem", "server_key": "server.key",
        "client_cert": "client.pem", "client_key": "client.key",
        "rogue_cert": "rogue.pem", "rogue_key": "rogue.key"}.items()}
