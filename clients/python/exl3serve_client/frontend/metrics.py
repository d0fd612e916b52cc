"""Prometheus metrics of the front end, as its clients see the requests (docs/frontend.md lists them).

With several worker processes (`exl3serve-openai --workers N`, frontend/workers.py) the supervisor
sets PROMETHEUS_MULTIPROC_DIR for each worker: prometheus_client then keeps every value in a file
of that directory per process, and a scrape of any worker reads them all (its MultiProcessCollector),
so /metrics shows the sum over the workers, including workers that died and were restarted.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.multiprocess import MultiProcessCollector

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
ENDPOINTS = ("completions", "chat_completions")


# prometheus_client's switch: set, values live in files of this directory (read when it is imported).
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


class FrontendMetrics:
    def __init__(self) -> None:
        r = CollectorRegistry()  # this process's metrics
        multiproc_dir = os.environ.get(MULTIPROC_DIR_ENV)
        # What /metrics serves: this process's metrics, or every worker's (summed) from the files.
        self.registry = r
        if multiproc_dir:
            self.registry = CollectorRegistry()
            MultiProcessCollector(self.registry, path=multiproc_dir)
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
        self.generation_tokens = Counter("exl3_frontend_generation_tokens",
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
        self.itl_of = {ep: self.itl.labels(ep) for ep in ENDPOINTS}
        self.e2e_of = {ep: self.e2e.labels(ep) for ep in ENDPOINTS}
        for ep in ENDPOINTS:
            for status in ("200", "400", "404", "429", "499", "500", "503", "504"):
                self.requests.labels(ep, status)
