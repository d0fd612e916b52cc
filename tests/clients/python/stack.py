"""A live stack on loopback for the front end's tests: a generated test model with a tokenizer, a
real exl3-router (the engine, experts in its process) and the real exl3serve-openai process."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Optional


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_model(build_dir: Path, out: Path, arch: str = "glm4_moe") -> Path:
    """exl3-tool make-test-model (3 layers, 8 experts, top-2, vocab 512) + exl3serve-make-tokenizer."""
    subprocess.run([str(build_dir / "bin" / "exl3-tool"), "make-test-model", "--arch", arch,
                    "--output", str(out), "--layers", "3", "--experts", "8", "--top-k", "2",
                    "--quiet"], check=True, timeout=300)
    subprocess.run([_script("exl3serve-make-tokenizer"), "--model", str(out)], check=True,
                   timeout=120, stdout=subprocess.DEVNULL)
    return out


def _script(name: str) -> str:
    """A console script of the package, next to this interpreter (the venv's bin)."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else (shutil.which(name) or name)


class Proc:
    def __init__(self, name: str, argv: list[str], log: Path,
                 env: Optional[dict[str, str]] = None) -> None:
        self.name = name
        self.log = log
        self._f = open(log, "ab")
        self.p = subprocess.Popen(argv, stdout=self._f, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True,
                                  env=None if env is None else {**os.environ, **env})

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 120.0) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.text())
            if m:
                return m
            if self.p.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.p.returncode}):\n{self.text()[-3000:]}")
            time.sleep(0.05)
        raise TimeoutError(f"{self.name}: no {pattern!r} within {timeout} s:\n{self.text()[-3000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        if self.p.poll() is None:
            self.p.send_signal(sig)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(10)
        self._f.close()


def start_router(build_dir: Path, model: Path, logs: Path, port: int = 0,
                 extra: tuple[str, ...] = ()) -> tuple[Proc, str, str]:
    """exl3-router serving Generator; returns it, its gRPC address and its metrics address."""
    argv = [str(build_dir / "bin" / "exl3-router"), "--model", str(model),
            "--listen", f"127.0.0.1:{port}", "--metrics-listen", "127.0.0.1:0",
            "--kv-cache-tokens", "8192", *extra]
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"router-{time.monotonic_ns()}.log"
    r = Proc("exl3-router", argv, log)
    m = r.wait_for(r"metrics on (127\.0\.0\.1:\d+)")
    addr = r.wait_for(r"(?m)^listening on (127\.0\.0\.1:\d+)$").group(1)
    return r, addr, m.group(1)


def start_frontend(engine: str, model: Path, logs: Path, port: int = 0,
                   extra: tuple[str, ...] = (), engine_calls: Optional[str] = None,
                   env: Optional[dict[str, str]] = None) -> tuple[Proc, str]:
    """exl3serve-openai; returns it and its base URL (http://HOST:PORT/v1). engine_calls is its
    --engine-calls (default: $EXL3_ENGINE_CALLS, else the front end's own default, stream); env:
    variables set in its environment beside this process's."""
    engine_calls = engine_calls or os.environ.get(ENV_ENGINE_CALLS)
    argv = [_script("exl3serve-openai"), "--engine", engine, "--model", str(model),
            "--listen", f"127.0.0.1:{port}", *extra]
    if engine_calls and "--engine-calls" not in extra:
        argv += ["--engine-calls", engine_calls]
    logs.mkdir(parents=True, exist_ok=True)
    f = Proc("exl3serve-openai", argv, logs / f"frontend-{time.monotonic_ns()}.log", env)
    url = f.wait_for(r"listening on (http://127\.0\.0\.1:\d+/v1)", timeout=60).group(1)
    return f, url


def get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metric(metrics_addr: str, name: str) -> Optional[float]:
    """The value of an unlabelled series (or the first series whose line starts with name)."""
    _, text = get(f"http://{metrics_addr}/metrics")
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def wait_until(cond, timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return cond()


ENV_BUILD_DIR = "EXL3_BUILD_DIR"
ENV_ENGINE_CALLS = "EXL3_ENGINE_CALLS"  # stream | per-request: the live front ends' --engine-calls


def build_dir() -> Path:
    return Path(os.environ.get(ENV_BUILD_DIR, "build")).resolve()
