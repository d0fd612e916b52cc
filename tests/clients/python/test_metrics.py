"""The front end's metrics (frontend/metrics.py) without a live stack: the per-token series held in
the process (PendingCount, PendingHistogram) give the same exposition as observing directly, in
one process and in prometheus_client's multiprocess mode, where a worker's values reach another
worker's scrape through the timer alone. Each case runs in a fresh interpreter: prometheus_client
picks its mode from PROMETHEUS_MULTIPROC_DIR when it is imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from exl3serve_client.frontend.metrics import _ITL_BUCKETS

# Gaps on and around the bucket bounds, 0, and past the last one (+Inf).
GAPS = [0.0, 1e-9, 0.0005, 0.00050001, 0.001, 0.0042, 0.02, 0.02, 0.3, 2.5, 2.6, 100.0]

OBSERVE = r"""
import asyncio, json, os, sys
from prometheus_client import generate_latest
from exl3serve_client.frontend.metrics import FrontendMetrics

gaps, scrape, exit_at_once = json.loads(sys.argv[1]), sys.argv[2] == "scrape", sys.argv[3] == "exit"
m = FrontendMetrics()

async def run():
    for g in gaps:  # as the hot path does: inside the event loop
        m.itl_of["completions"].observe(g)
        m.generation_tokens.inc(2)
    if scrape:  # at once: this process's pending values go in first
        print(generate_latest(m.registry).decode())
    else:
        await asyncio.sleep(0.5)  # the timer's flush, then leave without atexit
    if exit_at_once:
        sys.stdout.flush()
        os._exit(0)

asyncio.run(run())
"""

SCRAPE = r"""
from prometheus_client import generate_latest
from exl3serve_client.frontend.metrics import FrontendMetrics
print(generate_latest(FrontendMetrics().registry).decode())
"""


def run(code: str, *args: str, multiproc_dir: Path | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    if multiproc_dir is not None:
        env["PROMETHEUS_MULTIPROC_DIR"] = str(multiproc_dir)
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True,
                          text=True, check=True, timeout=60).stdout


def itl_and_tokens(text: str) -> dict[str, float]:
    """The completions ITL series and the generation token counter, by sample."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        if ('inter_token_latency_seconds' in line and 'endpoint="completions"' in line
                and "_created" not in line) or line.startswith("exl3_frontend_generation_tokens_total"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def expected(n_processes: int) -> dict[str, float]:
    out = {}
    for b in list(_ITL_BUCKETS) + [float("inf")]:
        le = "+Inf" if b == float("inf") else repr(float(b))
        out[f'exl3_frontend_inter_token_latency_seconds_bucket{{endpoint="completions",le="{le}"}}'] = \
            float(sum(g <= b for g in GAPS) * n_processes)
    out['exl3_frontend_inter_token_latency_seconds_count{endpoint="completions"}'] = \
        float(len(GAPS) * n_processes)
    out['exl3_frontend_inter_token_latency_seconds_sum{endpoint="completions"}'] = sum(GAPS) * n_processes
    out["exl3_frontend_generation_tokens_total"] = 2.0 * len(GAPS) * n_processes
    return out


def assert_same(got: dict[str, float], want: dict[str, float]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-12, abs=1e-12), k


def test_one_process_scrape_is_exact():
    assert_same(itl_and_tokens(run(OBSERVE, json.dumps(GAPS), "scrape", "stay")), expected(1))


def test_multiprocess_scrape_sums_processes(tmp_path):
    # A first worker's values reach the files by the timer alone (it leaves without atexit), a
    # second one's by its own scrape, which sees both.
    run(OBSERVE, json.dumps(GAPS), "wait", "exit", multiproc_dir=tmp_path)
    assert_same(itl_and_tokens(run(SCRAPE, multiproc_dir=tmp_path)), expected(1))
    text = run(OBSERVE, json.dumps(GAPS), "scrape", "exit", multiproc_dir=tmp_path)
    assert_same(itl_and_tokens(text), expected(2))
