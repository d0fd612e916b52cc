"""`exl3serve-openai --workers N`: N front-end processes serving one address, and the parent process
that supervises them (docs/frontend.md, "Workers").

One front end is one asyncio event loop; at many concurrent streams a new request's first token
waits in that loop's queue behind the other streams' chunks. N workers are N loops (N processes,
each with its own gRPC channel to the engine). The parent makes one listening socket per worker,
all on the address with SO_REUSEPORT, and each worker inherits its own: the kernel spreads new
connections over the sockets by a hash of the connection's addresses. (One socket that every
worker accepts from, as uvicorn's and gunicorn's workers share, goes to whichever worker wakes
first, and an event loop accepts all that is queued when it wakes: a burst of 64 connections over 3
workers came out 31/23/10 here, against 21/23/20 for the hash.) The parent keeps every socket open,
so a worker's socket outlives the worker: connections that arrive while it restarts wait in its
backlog for the new one, none is refused.

The parent (Supervisor):
- starts the workers (`python -m exl3serve_client.frontend.server` with its socket's descriptor and
  a pipe on which a worker says it serves) with PROMETHEUS_MULTIPROC_DIR set to a directory it
  made, so that /metrics from any worker sums them all (frontend/metrics.py), and prints the
  listening line once every worker serves;
- restarts a worker that dies after it served (logged; after MAX_RESTARTS in RESTART_WINDOW_S it
  gives up, drains the others and exits 1: a worker that keeps dying is a bug to see, not to hide),
  and exits 1 if a worker dies before it ever served (a configuration error, the same in every
  worker: restarting would only repeat it);
- on SIGTERM or SIGINT sends SIGTERM to every worker (each drains as one front end does: no new
  connections, open streams finish within uvicorn's graceful-shutdown timeout), waits for them,
  kills any still there after the drain timeout, removes the metrics directory and exits 0.
Workers ask the kernel for SIGTERM when the parent dies (prctl PR_SET_PDEATHSIG), so none outlives
it even if it is killed with SIGKILL.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from prometheus_client.multiprocess import mark_process_dead

from .metrics import MULTIPROC_DIR_ENV

log = logging.getLogger("exl3serve.frontend.workers")

MAX_RESTARTS = 5           # restarts allowed within RESTART_WINDOW_S before the parent gives up
RESTART_WINDOW_S = 60.0
READY_MESSAGE = b"serving\n"  # what a worker writes on its ready pipe once it accepts connections


class WorkerState(enum.Enum):
    STARTING = "starting"    # started, has not said it serves yet
    SERVING = "serving"
    STOPPING = "stopping"    # sent SIGTERM by the parent


@dataclass
class Worker:
    index: int
    proc: subprocess.Popen
    ready_pipe: Optional[int]            # read end until the worker said it serves (or closed it)
    state: WorkerState = WorkerState.STARTING
    started: float = field(default_factory=time.monotonic)


# A worker's command line: (its listening socket's descriptor, its ready pipe's write end) -> argv.
WorkerArgv = Callable[[int, int], list[str]]


class Supervisor:
    def __init__(self, sockets: list[socket.socket], worker_argv: WorkerArgv,
                 on_serving: Callable[[], None], drain_timeout_s: float,
                 start_timeout_s: float = 120.0) -> None:
        self.sockets = sockets               # worker i listens on sockets[i]
        self.count = len(sockets)
        self.worker_argv = worker_argv
        self.on_serving = on_serving         # called once, when every worker first serves
        self.drain_timeout_s = drain_timeout_s
        self.start_timeout_s = start_timeout_s
        self.metrics_dir = ""
        self.workers: list[Worker] = []
        self.restarts: list[float] = []      # when workers were restarted (monotonic)
        self.stop_signal: Optional[int] = None
        self.sel = selectors.DefaultSelector()

    # ---- the parent's loop -----------------------------------------------------------------
    def run(self) -> int:
        """Supervises until a signal asks to stop (returns 0 once drained) or a worker fails to
        start or keeps dying (returns 1 once the others are drained)."""
        self.metrics_dir = tempfile.mkdtemp(prefix="exl3serve-openai-metrics.")
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        wake_w.setblocking(False)
        old_wakeup = signal.set_wakeup_fd(wake_w.fileno())
        old_handlers = {s: signal.signal(s, self._on_signal)
                        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD)}
        self.sel.register(wake_r, selectors.EVENT_READ, None)
        rc = 0
        try:
            for i in range(self.count):
                self._start(i)
            announced = False
            deadline = time.monotonic() + self.start_timeout_s
            while self.stop_signal is None:
                for key, _ in self.sel.select(timeout=1.0):
                    if key.data is None:
                        self._drain_wakeups(wake_r)
                    else:
                        self._read_ready(key.data)
                failed = self._reap()
                if failed:
                    rc = 1
                    break
                if not announced:
                    if all(w.state is WorkerState.SERVING for w in self.workers):
                        announced = True
                        self.on_serving()
                    elif time.monotonic() > deadline:
                        log.error("not every worker served within %.0f s", self.start_timeout_s)
                        rc = 1
                        break
        finally:
            self._drain()  # also when the loop failed (a worker that could not be started)
            signal.set_wakeup_fd(old_wakeup)
            for s, h in old_handlers.items():
                signal.signal(s, h)
            self.sel.close()
            wake_r.close()
            wake_w.close()
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
        return rc

    def _on_signal(self, signum: int, frame: object) -> None:
        # Runs between the loop's steps; the wakeup descriptor has already woken select().
        if signum in (signal.SIGTERM, signal.SIGINT) and self.stop_signal is None:
            self.stop_signal = signum

    @staticmethod
    def _drain_wakeups(wake_r: socket.socket) -> None:
        try:
            while wake_r.recv(256):
                pass
        except BlockingIOError:
            pass

    # ---- workers -----------------------------------------------------------------------------
    def _start(self, index: int) -> None:
        ready_r, ready_w = os.pipe()
        env = dict(os.environ)
        env[MULTIPROC_DIR_ENV] = self.metrics_dir
        fd = self.sockets[index].fileno()
        try:
            # In the parent's process group: a terminal's Ctrl-C reaches every worker at once
            # (each drains; the parent's SIGTERM after it changes nothing), and a second Ctrl-C
            # makes uvicorn cut the open streams, as with one process.
            proc = subprocess.Popen(self.worker_argv(fd, ready_w), env=env,
                                    pass_fds=(fd, ready_w), stdin=subprocess.DEVNULL)
        finally:
            os.close(ready_w)
        w = Worker(index=index, proc=proc, ready_pipe=ready_r)
        self.sel.register(ready_r, selectors.EVENT_READ, w)
        if index < len(self.workers):
            self.workers[index] = w
        else:
            self.workers.append(w)
        log.info("worker %d started (pid %d)", index, proc.pid)

    def _read_ready(self, w: Worker) -> None:
        assert w.ready_pipe is not None
        data = os.read(w.ready_pipe, 64)
        if data.startswith(READY_MESSAGE) and w.state is WorkerState.STARTING:
            w.state = WorkerState.SERVING
        self._close_ready_pipe(w)  # one message, or end of file: a worker that died

    def _close_ready_pipe(self, w: Worker) -> None:
        if w.ready_pipe is not None:
            self.sel.unregister(w.ready_pipe)
            os.close(w.ready_pipe)
            w.ready_pipe = None

    def _reap(self) -> bool:
        """Handles the workers that exited; True when the parent has to give up."""
        for w in list(self.workers):
            rc = w.proc.poll()
            if rc is None:
                continue
            self._close_ready_pipe(w)
            mark_process_dead(w.proc.pid, self.metrics_dir)  # its live gauges leave the sums
            how = f"was killed by signal {-rc}" if rc < 0 else f"exited with status {rc}"
            if w.state is WorkerState.STARTING:
                log.error("worker %d (pid %d) %s before it served; stopping", w.index,
                          w.proc.pid, how)
                return True
            now = time.monotonic()
            self.restarts = [t for t in self.restarts if now - t < RESTART_WINDOW_S] + [now]
            if len(self.restarts) > MAX_RESTARTS:
                log.error("worker %d (pid %d) %s; more than %d restarts in %.0f s: stopping",
                          w.index, w.proc.pid, how, MAX_RESTARTS, RESTART_WINDOW_S)
                return True
            log.warning("worker %d (pid %d) %s after %.1f s; restarting it", w.index, w.proc.pid,
                        how, now - w.started)
            self._start(w.index)
        return False

    def _drain(self) -> None:
        """SIGTERM to every worker, then waits for them (SIGKILL after the drain timeout)."""
        for w in self.workers:
            if w.proc.poll() is None:
                w.state = WorkerState.STOPPING
                w.proc.send_signal(signal.SIGTERM)
        # No new connection can wait in the backlog of a socket no worker accepts from any more.
        for sock in self.sockets:
            sock.close()
        deadline = time.monotonic() + self.drain_timeout_s
        for w in self.workers:
            try:
                w.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("worker %d (pid %d) still running %.0f s after SIGTERM: killing it",
                          w.index, w.proc.pid, self.drain_timeout_s)
                w.proc.kill()
                w.proc.wait()
            self._close_ready_pipe(w)


# ---- the worker's side -----------------------------------------------------------------------
def exit_with_parent(parent_pid: int) -> None:
    """Asks the kernel for SIGTERM when the parent process dies (Linux; elsewhere nothing), and
    exits at once if it is already gone (it died before the request was made)."""
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if os.getppid() != parent_pid:
        sys.exit(1)


def say_serving(ready_fd: int) -> None:
    """Tells the parent that this worker accepts connections."""
    try:
        os.write(ready_fd, READY_MESSAGE)
    finally:
        os.close(ready_fd)
