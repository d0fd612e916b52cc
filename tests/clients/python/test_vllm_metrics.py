"""vLLM's metric names on the front end's /metrics (frontend/vllm_metrics.py): one request's series
from scripted engine messages (no stack), then against the live stack (exl3-router + the front
end): each request counted once under vLLM's names with the engine's own token counts, and the
engine's state (running, KV usage, prefix cache) equal to what the engine itself exports.
test_workers.py runs the live cases again against a two-worker front end, where the engine's
gauges must not be summed over the workers."""

from __future__ import annotations

import http.client
import json
import time
from urllib.parse import urlparse

import openai
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import stack
from exl3serve.v1 import exl3serve_pb2 as pb
from exl3serve_client.frontend.metrics import FrontendMetrics, PendingHistogram, PerTokenSeries
from exl3serve_client.frontend.vllm_metrics import (ITL_BUCKETS, EngineStatsCollector,
                                                    VllmMetrics, one_two_five_buckets)


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value of an exposition."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(text_or_samples, name: str, **labels) -> float:
    """The sum of the samples named `name` whose labels include `labels` (0 when none)."""
    got = samples(text_or_samples) if isinstance(text_or_samples, str) else text_or_samples
    want = set(labels.items())
    return sum(v for (n, ls), v in got.items() if n == name and want <= set(ls))


# ---- one request, scripted ----------------------------------------------------------------------

class Scripted:
    """VllmMetrics in a registry of its own (pending series flushed at each render)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.per_token = PerTokenSeries()
        self.registry.register(self.per_token)

        def pending(child, mirror=None):
            h = PendingHistogram(child, self.per_token, mirror)
            self.per_token.items.append(h)
            return h
        self.m = VllmMetrics(self.registry, 4096, pending, pending_count=self._count)

    def _count(self, child):
        from exl3serve_client.frontend.metrics import PendingCount
        c = PendingCount(child, self.per_token)
        self.per_token.items.append(c)
        return c

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def msg(tokens: int, finish=pb.FINISH_REASON_UNSPECIFIED, **kw) -> pb.GenerateResponse:
    return pb.GenerateResponse(tokens=[pb.GeneratedToken(token_id=7)] * tokens,
                               finish_reason=finish, **kw)


def test_one_request_counts_once_with_a_gap_per_message():
    s = Scripted()
    req = pb.GenerateRequest(prompt_token_ids=[1, 2, 3], max_tokens=8)
    r = s.m.request("m", time.monotonic(), req, n=1)
    r.message(msg(1), 1)       # first token: TTFT
    r.message(msg(2), 2)       # a gap (two tokens in one message: one gap, as vLLM's per step)
    r.message(msg(0), 0)       # nothing: no gap
    r.message(msg(1, pb.FINISH_REASON_LENGTH,
                  usage=pb.Usage(prompt_tokens=3, completion_tokens=4),
                  timings=pb.GenerateTimings(queue_seconds=0.5, prefill_seconds=0.25,
                                             first_token_seconds=0.75, total_seconds=2.0)), 1)
    r.close()                  # already finished: nothing more
    t = s.text()
    lab = {"model_name": "m", "engine": "0"}
    assert value(t, "vllm:time_to_first_token_seconds_count", **lab) == 1
    assert value(t, "vllm:inter_token_latency_seconds_count", **lab) == 2
    assert value(t, "vllm:time_per_output_token_seconds_count", **lab) == 2
    assert value(t, "vllm:e2e_request_latency_seconds_count", **lab) == 1
    assert value(t, "vllm:request_success_total", finished_reason="length", **lab) == 1
    assert value(t, "vllm:request_success_total", **lab) == 1
    assert value(t, "vllm:prompt_tokens_total", **lab) == 3
    assert value(t, "vllm:generation_tokens_total", **lab) == 4
    assert value(t, "vllm:request_queue_time_seconds_sum", **lab) == 0.5
    assert value(t, "vllm:request_prefill_time_seconds_sum", **lab) == 0.25
    assert value(t, "vllm:request_decode_time_seconds_sum", **lab) == 1.25  # total - first token
    assert value(t, "vllm:request_inference_time_seconds_sum", **lab) == 1.5
    assert value(t, "vllm:request_generation_tokens_sum", **lab) == 4
    assert value(t, "vllm:request_params_max_tokens_sum", **lab) == 8
    assert value(t, "vllm:request_params_n_sum", **lab) == 1
    # Every finish reason's series exists from the first request on.
    for reason in ("stop", "length", "abort", "error"):
        assert ("vllm:request_success_total",
                tuple(sorted({**lab, "finished_reason": reason}.items()))) in samples(t)


def test_a_stop_string_is_stop_and_a_closed_call_abort():
    s = Scripted()
    req = pb.GenerateRequest(prompt_token_ids=[1, 2], max_tokens=8)
    stopped = s.m.request("m", time.monotonic(), req, n=2)  # a prompt's first choice
    stopped.message(msg(1), 1)
    stopped.message(msg(1), 1, stopped=True)  # the front end found a stop string
    gone = s.m.request("m", time.monotonic(), req, n=None)  # its second choice
    gone.message(msg(1), 1)
    gone.close()                           # the client went away
    never = s.m.request("m", time.monotonic(), req, n=3)
    never.close()                          # no token: no prefill counted
    t = s.text()
    assert value(t, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(t, "vllm:request_success_total", finished_reason="abort") == 2
    assert value(t, "vllm:prompt_tokens_total") == 4  # two requests with tokens, 2 each
    assert value(t, "vllm:generation_tokens_total") == 3
    assert value(t, "vllm:request_queue_time_seconds_count") == 0  # the engine reported none
    assert value(t, "vllm:request_params_n_count") == 2  # once per prompt
    assert value(t, "vllm:request_params_n_sum") == 5


def test_buckets_are_vllms():
    assert one_two_five_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert one_two_five_buckets(4096)[-1] == 2000
    t = Scripted().text()
    assert "vllm:inter_token_latency_seconds" in t  # registered, no series yet
    assert ITL_BUCKETS[0] == 0.01 and ITL_BUCKETS[-1] == 80.0


def test_engine_series_from_the_engines_answer_only():
    c = EngineStatsCollector()
    r = CollectorRegistry()
    r.register(c)
    assert "vllm:" not in generate_latest(r).decode()  # no answer yet: no stale value
    c.update(pb.EngineStatsResponse(num_requests_running=3, num_requests_waiting=1,
                                    kv_cache_usage=0.25, num_preemptions=2,
                                    prefix_cache_queried_tokens=100, prefix_cache_hit_tokens=40),
             "m")
    t = generate_latest(r).decode()
    lab = {"model_name": "m", "engine": "0"}
    assert value(t, "vllm:num_requests_running", **lab) == 3
    assert value(t, "vllm:num_requests_waiting", **lab) == 1
    assert value(t, "vllm:kv_cache_usage_perc", **lab) == 0.25
    assert value(t, "vllm:gpu_cache_usage_perc", **lab) == 0.25
    assert value(t, "vllm:num_preemptions_total", **lab) == 2
    assert value(t, "vllm:prefix_cache_queries_total", **lab) == 100
    assert value(t, "vllm:prefix_cache_hits_total", **lab) == 40
    assert "spec_decode" not in t  # no speculative method: no series
    c.update(pb.EngineStatsResponse(num_speculative_tokens=2, spec_decode_num_drafts=5,
                                    spec_decode_num_draft_tokens=10,
                                    spec_decode_num_accepted_tokens=7,
                                    spec_decode_num_accepted_tokens_per_pos=[4, 3]), "m")
    t = generate_latest(r).decode()
    assert value(t, "vllm:spec_decode_num_drafts_total") == 5
    assert value(t, "vllm:spec_decode_num_draft_tokens_total") == 10
    assert value(t, "vllm:spec_decode_num_accepted_tokens_total") == 7
    assert value(t, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 3
    c.update(None, "m")  # the engine did not answer this scrape
    assert "vllm:" not in generate_latest(r).decode()


def test_frontend_metrics_carry_both():
    m = FrontendMetrics(max_model_len=100)
    m.engine_stats.update(pb.EngineStatsResponse(num_requests_running=1), "x")
    t = generate_latest(m.registry).decode()
    assert 'vllm:num_requests_running{engine="0",model_name="x"} 1.0' in t
    assert 'vllm:request_prompt_tokens' in t


# ---- against the live stack ---------------------------------------------------------------------

def scrape(live) -> dict:
    return samples(stack.get(f"{live.base}/metrics")[1])


def engine_value(live, name: str) -> float:
    return stack.metric(live.engine_metrics, name) or 0.0


def test_vllm_request_series_follow_the_requests(live):
    c = openai.OpenAI(base_url=live.url, api_key="none", max_retries=0, timeout=60)
    name = c.models.list().data[0].id
    before = scrape(live)
    usages = []
    for i in range(3):
        r = c.completions.create(model=name, prompt=f"v{i}", max_tokens=5, temperature=0)
        usages.append(r.usage)
    for chunk in c.chat.completions.create(model=name, messages=[{"role": "user", "content": "v"}],
                                           max_tokens=4, temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.usage:
            usages.append(chunk.usage)
    assert len(usages) == 4
    prompt = sum(u.prompt_tokens for u in usages)
    generated = sum(u.completion_tokens for u in usages)
    lab = {"model_name": name, "engine": "0"}

    def delta(after, n, **kw):
        return value(after, n, **{**lab, **kw}) - value(before, n, **{**lab, **kw})

    # With several workers a scrape reads the other workers' per-message series up to 0.1 s late.
    def settled():
        after = scrape(live)
        return delta(after, "vllm:generation_tokens_total") == generated and \
            delta(after, "vllm:request_success_total") == 4
    assert stack.wait_until(settled, 5), "vLLM's series did not count the four requests"
    after = scrape(live)
    for n in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
              "vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
              "vllm:request_decode_time_seconds_count", "vllm:request_prompt_tokens_count",
              "vllm:request_generation_tokens_count"):
        assert delta(after, n) == 4, n
    assert delta(after, "vllm:prompt_tokens_total") == prompt
    # One observation per gap between a request's messages: at most one per token after the first.
    gaps = delta(after, "vllm:inter_token_latency_seconds_count")
    assert 1 <= gaps <= generated - 4, (gaps, generated)
    assert delta(after, "vllm:time_per_output_token_seconds_count") == gaps
    reasons = {r: delta(after, "vllm:request_success_total", finished_reason=r)
               for r in ("stop", "length", "abort", "error")}
    assert sum(reasons.values()) == 4 and reasons["abort"] == reasons["error"] == 0, reasons


def test_vllm_engine_series_are_the_engines(live):
    c = openai.OpenAI(base_url=live.url, api_key="none", max_retries=0, timeout=60)
    name = c.models.list().data[0].id
    lab = {"model_name": name, "engine": "0"}
    # A prompt sent twice: the prefix cache is queried (and hit, when a block fills).
    prompt = "the same long prompt " * 8
    for _ in range(2):
        c.completions.create(model=name, prompt=prompt, max_tokens=1, temperature=0)

    def same(vllm_name, engine_name):
        return value(scrape(live), vllm_name, **lab) == engine_value(live, engine_name)
    assert stack.wait_until(lambda: same("vllm:prefix_cache_queries_total",
                                         "exl3_engine_prefix_cache_queries_total"), 5)
    assert stack.wait_until(lambda: same("vllm:prefix_cache_hits_total",
                                         "exl3_engine_prefix_cache_hits_total"), 5)
    assert value(scrape(live), "vllm:prefix_cache_queries_total", **lab) > 0
    assert stack.wait_until(lambda: same("vllm:num_preemptions_total",
                                         "exl3_engine_num_preemptions_total"), 5)
    assert stack.wait_until(lambda: value(scrape(live), "vllm:num_requests_running", **lab) == 0, 5)
    # One request held open: the engine runs one sequence, whichever worker answers the scrape
    # (a gauge summed over two workers would read 2).
    u = urlparse(live.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", "/v1/completions",
                 json.dumps({"model": name, "prompt": "open", "max_tokens": 4000, "stream": True,
                             "ignore_eos": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    try:
        assert resp.status == 200
        resp.fp.readline()  # the first event: the request runs
        for _ in range(6):
            s = scrape(live)
            assert value(s, "vllm:num_requests_running", **lab) == 1
            assert 0 < value(s, "vllm:kv_cache_usage_perc", **lab) <= 1
            assert value(s, "vllm:kv_cache_usage_perc", **lab) == \
                value(s, "vllm:gpu_cache_usage_perc", **lab)
    finally:
        conn.close()
    assert stack.wait_until(lambda: value(scrape(live), "vllm:num_requests_running", **lab) == 0, 10)
    assert stack.wait_until(
        lambda: value(scrape(live), "vllm:request_success_total", finished_reason="abort",
                      **lab) >= 1, 5)
