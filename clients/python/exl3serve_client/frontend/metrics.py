"""Prometheus metrics of the front end, as its clients see the requests (docs/frontend.md lists them).

With several worker processes (`exl3serve-openai --workers N`, frontend/workers.py) the supervisor
sets PROMETHEUS_MULTIPROC_DIR for each worker: prometheus_client then keeps every value in a file
of that directory per process, and a scrape of any worker reads them all (its MultiProcessCollector),
so /metrics shows the sum over the workers, including workers that died and were restarted.

The per-token series (tokens received, inter-token latency) are counted in plain Python numbers and
added to their metrics at most FLUSH_INTERVAL_S later (PerTokenSeries), when a scrape of this
process begins and at exit: a prometheus_client value takes a lock to change, and in multiprocess
mode also getpid and a write into the file's mapping. For the two series of one token that was
3.7 µs in one process and 9.7 µs with the files, 0.8 µs held this way (measured here). A scrape of
one process is exact; another worker's per-token series may be up to FLUSH_INTERVAL_S behind.
"""

from __future__ import annotations

import asyncio
import atexit
import bisect
import os
import time
from typing import Any, Optional, Union

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.multiprocess import MultiProcessCollector

from .vllm_metrics import EngineStatsCollector, VllmMetrics

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
ENDPOINTS = ("completions", "chat_completions")


# prometheus_client's switch: set, values live in files of this directory (read when it is imported).
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
# How stale another worker's per-token series may be in a scrape (multiprocess mode).
FLUSH_INTERVAL_S = 0.1


class PendingCount:
    """A counter's increments held in the process until PerTokenSeries.flush adds them."""

    def __init__(self, counter: Counter, series: "PerTokenSeries") -> None:
        self._counter = counter
        self._series = series
        self._pending = 0.0

    def inc(self, amount: float = 1) -> None:
        self._pending += amount
        if not self._series.flush_scheduled:
            self._series.schedule_flush()

    def flush(self) -> None:
        if self._pending:
            self._counter.inc(self._pending)
            self._pending = 0.0


class PendingHistogram:
    """A histogram series' observations held in the process (a count per bucket and their sum)
    until PerTokenSeries.flush adds them to the series' values: bucket i counts the observations
    at most its bound and above the one before, as Histogram.observe counts them. `mirror`: a
    series of another histogram with the same buckets that gets the same observations (a metric
    under two names) for the cost of one."""

    def __init__(self, child: Any, series: "PerTokenSeries", mirror: Any = None) -> None:
        self._children = [child] if mirror is None else [child, mirror]
        self._series = series
        self._bounds = list(child._upper_bounds)  # the last is +Inf
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0

    def observe(self, amount: float) -> None:
        self._sum += amount
        self._counts[bisect.bisect_left(self._bounds, amount)] += 1
        if not self._series.flush_scheduled:
            self._series.schedule_flush()

    def flush(self) -> None:
        if any(self._counts):
            for child in self._children:
                child._sum.inc(self._sum)
                for bucket, n in zip(child._buckets, self._counts):
                    if n:
                        bucket.inc(n)
            self._counts = [0] * len(self._bounds)
            self._sum = 0.0


class PerTokenSeries:
    """The pending per-token series of this process, flushed together on a timer of the running
    event loop (at once where none runs), when a scrape of this process begins (collect(), as the
    first collector of the served registry) and at exit."""

    def __init__(self) -> None:
        self.items: list[Union[PendingCount, PendingHistogram]] = []
        self.flush_scheduled = False
        atexit.register(self.flush)

    def schedule_flush(self) -> None:
        try:
            loop: Optional[asyncio.AbstractEventLoop] = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None:
            self.flush()
            return
        self.flush_scheduled = True
        loop.call_later(FLUSH_INTERVAL_S, self.flush)

    def flush(self) -> None:
        self.flush_scheduled = False
        for item in self.items:
            item.flush()

    def collect(self) -> list:
        self.flush()
        return []


class FrontendMetrics:
    """The front end's own series (exl3_frontend_*) and vLLM's (vllm, frontend/vllm_metrics.py;
    `max_model_len` bounds their token-count buckets)."""

    def __init__(self, max_model_len: int = 4096) -> None:
        r = CollectorRegistry()  # this process's metrics
        multiproc_dir = os.environ.get(MULTIPROC_DIR_ENV)
        # What /metrics serves: this process's metrics, or every worker's (summed) from the files.
        self.per_token = PerTokenSeries()
        r.register(self.per_token)  # first: a scrape adds this process's pending values first
        self.registry = r
        if multiproc_dir:
            self.registry = CollectorRegistry()
            self.registry.register(self.per_token)
            MultiProcessCollector(self.registry, path=multiproc_dir)
        # The engine's state under vLLM's names: straight from the engine at each scrape, never in
        # the multiprocess files (frontend/vllm_metrics.py says why).
        self.engine_stats = EngineStatsCollector()
        self.registry.register(self.engine_stats)
        self.requests = Counter("exl3_frontend_requests", "HTTP generation requests answered, by "
                                "endpoint and HTTP status (499: the client went away)",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("exl3_frontend_time_to_first_token_seconds",
                              "request received -> first token's text sent", ["endpoint"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("exl3_frontend_inter_token_latency_seconds",
                             "time between tokens as sent to the client (a message of k tokens "
                             "counts k times, gap / k)", ["endpoint"], buckets=_ITL_BUCKETS,
                             registry=r)
        self.e2e = Histogram("exl3_frontend_e2e_request_latency_seconds",
                             "request received -> last byte of the answer", ["endpoint"],
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("exl3_frontend_prompt_tokens", "prompt tokens of requests "
                                     "sent to the engine", registry=r)
        generation_tokens = Counter("exl3_frontend_generation_tokens",
                                    "tokens received from the engine", registry=r)
        # Across workers (ignored in one process): open requests summed over the live workers; the
        # engine's state as the worker that last talked to it saw it.
        self.running = Gauge("exl3_frontend_requests_running", "generation requests open",
                             registry=r, multiprocess_mode="livesum")
        self.engine_up = Gauge("exl3_frontend_engine_up", "1 while the engine answered the last "
                               "DescribeModel or request, 0 after it was unreachable", registry=r,
                               multiprocess_mode="livemostrecent")
        # The series of each endpoint, looked up once (labels() per token costs a lock and a
        # dict lookup); they exist at zero from the start.
        self.ttft_of = {ep: self.ttft.labels(ep) for ep in ENDPOINTS}
        self.e2e_of = {ep: self.e2e.labels(ep) for ep in ENDPOINTS}
        for ep in ENDPOINTS:
            for status in ("200", "400", "404", "429", "499", "500", "503", "504"):
                self.requests.labels(ep, status)
        # The per-token series, held in the process (PerTokenSeries): same inc / observe.
        self.generation_tokens = PendingCount(generation_tokens, self.per_token)
        self.itl_of = {ep: PendingHistogram(self.itl.labels(ep), self.per_token) for ep in ENDPOINTS}
        self.per_token.items = [self.generation_tokens, *self.itl_of.values()]
        self.vllm = VllmMetrics(r, max_model_len, self._pending_histogram, self._pending_count)

    def _pending_histogram(self, child: Any, mirror: Any = None) -> PendingHistogram:
        h = PendingHistogram(child, self.per_token, mirror)
        self.per_token.items.append(h)
        return h

    def _pending_count(self, child: Any) -> PendingCount:
        c = PendingCount(child, self.per_token)
        self.per_token.items.append(c)
        return c


class TokenClock:
    """One request's token timing as its client sees it: TTFT at the first token handed to the
    client, then inter-token gaps (n tokens handed over at once: n gaps of 1/n of the time since
    the previous ones; the first n: TTFT and n - 1 gaps of 0)."""

    def __init__(self, metrics: FrontendMetrics, endpoint: str, started: float) -> None:
        self.ttft = metrics.ttft_of[endpoint]
        self.itl = metrics.itl_of[endpoint]
        self.started = started
        self.last: Optional[float] = None

    def handed(self, n: int) -> None:
        """n tokens' text has just been handed to the client."""
        if n <= 0:
            return
        now = time.monotonic()
        if self.last is None:
            self.ttft.observe(now - self.started)
            for _ in range(n - 1):
                self.itl.observe(0.0)
        else:
            gap = (now - self.last) / n
            for _ in range(n):
                self.itl.observe(gap)
        self.last = now
