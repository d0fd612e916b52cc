"""vLLM's metric names on the front end's /metrics (docs/frontend.md, "vLLM's names"), so that a
Grafana dashboard or alert written for vLLM works unchanged: the same names, types, labels
(`model_name`, the served model's name, and `engine`, always "0": one engine behind the front end)
and bucket edges as vLLM's own Prometheus logger.

Two sources:
- Per request (VllmRequest, one per engine request, i.e. per choice): the token timing as the front
  end receives the engine's messages (time to first token from the HTTP request's arrival, one
  inter-token observation per gap between messages, end to end), the token counts, the finish
  reason, and the engine's own phases from its last message (GenerateTimings: queue, prefill,
  decode). These are counters and histograms of this process; with several worker processes they
  live in prometheus_client's multiprocess files and a scrape sums them, which is right for counts.
  The per-message series go through frontend/metrics.py's pending values (PendingHistogram,
  PendingCount), as the front end's own per-token series do.
- The engine's state (EngineStatsCollector): running and waiting requests, KV cache usage,
  preemptions, prefix cache queries and hits, speculative decoding's counters. They are the
  engine's numbers, not this process's, so they are not kept in the multiprocess files at all
  (where a gauge would need a multiprocess_mode and a counter would be summed over the workers:
  N times the engine's): each scrape asks the engine (Generator.EngineStats) and shows its answer
  as is; whichever worker answers the scrape shows the same values. When the engine does not
  answer, these series are absent from that scrape (no stale value).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from exl3serve.v1 import exl3serve_pb2 as pb

# vLLM's bucket edges (vllm/v1/metrics/loggers.py, PrometheusStatLogger).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)
# vLLM's finish reasons (request_success_total's finished_reason).
FINISHED_REASONS = ("stop", "length", "abort", "error")
ENGINE_INDEX = "0"
LABELS = ("model_name", "engine")

_FINISHED_REASON_OF = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                       pb.FINISH_REASON_ABORT: "abort", pb.FINISH_REASON_ERROR: "error"}


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets, to max_model_len)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


@dataclass
class TokenTally:
    """Tokens this process handed through, for the stats line (stats_log.py): prompts (each once
    its request's first token came) and generated tokens."""
    prompt: int = 0
    generation: int = 0


class VllmSeries:
    """One model name's series (children looked up once; the per-message ones pending)."""

    def __init__(self, m: "VllmMetrics", model_name: str, pending_histogram: Callable,
                 pending_count: Callable) -> None:
        labels = (model_name, ENGINE_INDEX)
        self.ttft = m.ttft.labels(*labels)
        # vLLM's older name of the inter-token latency gets the same observations.
        self.itl = pending_histogram(m.itl.labels(*labels), m.tpot.labels(*labels))
        self.e2e = m.e2e.labels(*labels)
        self.queue = m.queue.labels(*labels)
        self.prefill = m.prefill.labels(*labels)
        self.decode = m.decode.labels(*labels)
        self.inference = m.inference.labels(*labels)
        self.prompt_tokens = m.prompt_tokens.labels(*labels)
        self.generation_tokens = pending_count(m.generation_tokens.labels(*labels))
        self.request_prompt_tokens = m.request_prompt_tokens.labels(*labels)
        self.request_generation_tokens = m.request_generation_tokens.labels(*labels)
        self.max_num_generation_tokens = m.max_num_generation_tokens.labels(*labels)
        self.params_max_tokens = m.params_max_tokens.labels(*labels)
        self.params_n = m.params_n.labels(*labels)
        self.success = {r: m.success.labels(*labels, r) for r in FINISHED_REASONS}


class VllmMetrics:
    """vLLM's request-level series, registered in `registry` (the process's, multiprocess-file
    backed when workers run). `max_model_len` bounds the token-count buckets (as vLLM's)."""

    def __init__(self, registry: CollectorRegistry, max_model_len: int,
                 pending_histogram: Callable, pending_count: Callable) -> None:
        r, L = registry, LABELS
        tokens = one_two_five_buckets(max(1, max_model_len))
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first "
                              "token in seconds (request received -> its first tokens received "
                              "from the engine).", L, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token "
                             "latency in seconds (one observation per gap between a request's "
                             "messages from the engine).", L, buckets=ITL_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Histogram of time per "
                              "output token in seconds (vLLM's older name of "
                              "vllm:inter_token_latency_seconds; the same observations).", L,
                              buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request "
                             "latency in seconds.", L, buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Histogram of time spent in "
                               "WAITING phase for request (the engine's).", L,
                               buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.prefill = Histogram("vllm:request_prefill_time_seconds", "Histogram of time spent in "
                                 "PREFILL phase for request (the engine's).", L,
                                 buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.decode = Histogram("vllm:request_decode_time_seconds", "Histogram of time spent in "
                                "DECODE phase for request (the engine's).", L,
                                buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.inference = Histogram("vllm:request_inference_time_seconds", "Histogram of time "
                                   "spent in RUNNING phase for request (the engine's prefill + "
                                   "decode).", L, buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                     L, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens "
                                         "processed.", L, registry=r)
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Number of prefill "
                                               "tokens processed.", L, buckets=tokens, registry=r)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens", "Number of "
                                                   "generation tokens processed.", L,
                                                   buckets=tokens, registry=r)
        self.max_num_generation_tokens = Histogram("vllm:request_max_num_generation_tokens",
                                                   "Histogram of maximum number of requested "
                                                   "generation tokens.", L, buckets=tokens,
                                                   registry=r)
        self.params_max_tokens = Histogram("vllm:request_params_max_tokens", "Histogram of the "
                                           "max_tokens request parameter.", L, buckets=tokens,
                                           registry=r)
        self.params_n = Histogram("vllm:request_params_n", "Histogram of the n request "
                                  "parameter.", L, buckets=N_BUCKETS, registry=r)
        self.success = Counter("vllm:request_success", "Count of successfully processed "
                               "requests.", (*L, "finished_reason"), registry=r)
        self._pending_histogram = pending_histogram
        self._pending_count = pending_count
        self._series: dict[str, VllmSeries] = {}
        self.tally = TokenTally()

    def series(self, model_name: str) -> VllmSeries:
        s = self._series.get(model_name)
        if s is None:
            s = self._series[model_name] = VllmSeries(self, model_name, self._pending_histogram,
                                                      self._pending_count)
        return s

    def request(self, model_name: str, started: float, request: pb.GenerateRequest,
                n: Optional[int]) -> "VllmRequest":
        """`n`: the prompt's `n` where this is its first choice (vllm:request_params_n counts it
        once), else None."""
        return VllmRequest(self.series(model_name), started, request, n, self.tally)


class VllmRequest:
    """One engine request in vLLM's series: message() per engine message as it is received (its
    tokens, and the request's finish: a stop string the front end found in its text, or the
    engine's finish reason), close() when its call ends (a request that had not finished by then:
    abort). Counted once."""

    def __init__(self, series: VllmSeries, started: float, request: pb.GenerateRequest,
                 n: Optional[int], tally: Optional[TokenTally] = None) -> None:
        self.s = series
        self.tally = tally if tally is not None else TokenTally()
        self.started = started
        self.prompt_len = len(request.prompt_token_ids)
        self.max_tokens = request.max_tokens
        self.n = n
        self.generated = 0
        self.last: Optional[float] = None  # when the previous tokens came
        self.done = False

    def message(self, resp: pb.GenerateResponse, k: int, stopped: bool = False) -> None:
        """`k`: the message's tokens (len(resp.tokens), which the caller has: each len of a
        protobuf repeated field costs); `stopped`: a stop string ended the request here (its
        engine call is cancelled)."""
        if k:
            now = time.monotonic()
            if self.last is None:
                self.s.ttft.observe(now - self.started)
                self.tally.prompt += self.prompt_len
            else:
                self.s.itl.observe(now - self.last)
            self.last = now
            self.generated += k
            self.tally.generation += k
            self.s.generation_tokens.inc(k)
        if resp.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            self._finish("stop" if stopped else
                         _FINISHED_REASON_OF.get(resp.finish_reason, "error"), resp)
        elif stopped:
            self._finish("stop", None)

    def close(self) -> None:
        self._finish("abort", None)

    def _finish(self, reason: str, last: Optional[pb.GenerateResponse]) -> None:
        if self.done:
            return
        self.done = True
        s = self.s
        s.success[reason].inc()
        s.e2e.observe(time.monotonic() - self.started)
        if self.last is not None:  # the prompt went through prefill
            prompt = last.usage.prompt_tokens if last is not None and last.usage.prompt_tokens \
                else self.prompt_len
            s.prompt_tokens.inc(prompt)
            s.request_prompt_tokens.observe(prompt)
        s.request_generation_tokens.observe(self.generated)
        s.max_num_generation_tokens.observe(self.generated)
        if self.max_tokens:
            s.params_max_tokens.observe(self.max_tokens)
        if self.n is not None:
            s.params_n.observe(self.n)
        if last is not None and last.HasField("timings"):
            t = last.timings
            s.queue.observe(t.queue_seconds)
            s.prefill.observe(t.prefill_seconds)
            decode = max(0.0, t.total_seconds - t.first_token_seconds)
            s.decode.observe(decode)
            s.inference.observe(t.prefill_seconds + decode)


class EngineStatsCollector:
    """The engine's state under vLLM's names, from the last Generator.EngineStats answer (set by
    the /metrics handler before it renders: update()); nothing while there is none."""

    def __init__(self) -> None:
        self.stats: Optional[pb.EngineStatsResponse] = None
        self.model_name = ""

    def update(self, stats: Optional[pb.EngineStatsResponse], model_name: str) -> None:
        self.stats = stats
        self.model_name = model_name

    def collect(self) -> list[Any]:
        s = self.stats
        if s is None:
            return []
        labels = [self.model_name, ENGINE_INDEX]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(labels, value)
            return c

        out = [
            gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                  s.num_requests_running),
            gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                  s.num_requests_waiting),
            gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                  s.kv_cache_usage),
            gauge("vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage "
                  "(vLLM's older name of vllm:kv_cache_usage_perc).", s.kv_cache_usage),
            counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                    s.num_preemptions),
            counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
                    "queried tokens.", s.prefix_cache_queried_tokens),
            counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                    "tokens.", s.prefix_cache_hit_tokens),
        ]
        if s.num_speculative_tokens > 0:
            out += [
                counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
                        s.spec_decode_num_drafts),
                counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                        s.spec_decode_num_draft_tokens),
                counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                        s.spec_decode_num_accepted_tokens),
            ]
            per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                          "Accepted tokens per draft position.",
                                          labels=(*LABELS, "position"))
            for pos, v in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
                per_pos.add_metric([*labels, str(pos)], v)
            out.append(per_pos)
        return out
