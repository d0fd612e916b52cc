"""A stock vLLM Grafana dashboard against the front end: a real Prometheus (Debian's
/usr/bin/prometheus, as scripts/checks/worker_prometheus.sh runs it) scrapes the live stack's front
end every second while requests run, and every query of vLLM's published dashboard
(vllm_dashboard_queries.json, with the dashboard's model variable resolved as Grafana resolves it)
returns data: at least one series, with a finite value."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import threading
import time
import urllib.parse
from pathlib import Path

import openai
import pytest

import stack

QUERIES = json.loads((Path(__file__).parent / "vllm_dashboard_queries.json").read_text())
RATE_INTERVAL = "15s"  # Grafana's $__rate_interval for a 1 s scrape (at least 4 scrapes)


@pytest.fixture(scope="module")
def prometheus(live, tmp_path_factory):
    exe = shutil.which("prometheus") or "/usr/bin/prometheus"
    if not Path(exe).exists():
        pytest.fail("prometheus not found (scripts/install-deps.sh installs it)")
    d = tmp_path_factory.mktemp("prometheus")
    port = stack.free_port()
    (d / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: exl3serve-openai\n    static_configs:\n"
        f"      - targets: [\"{urllib.parse.urlparse(live.base).netloc}\"]\n")
    log = open(d / "prometheus.log", "w")
    p = subprocess.Popen([exe, f"--config.file={d / 'prometheus.yml'}",
                          f"--storage.tsdb.path={d / 'tsdb'}",
                          f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    try:
        def ready():
            try:
                return stack.get(f"{base}/-/ready", timeout=1)[0] == 200
            except OSError:  # not listening yet
                return False
        assert stack.wait_until(ready, 30), (d / "prometheus.log").read_text()[-2000:]
        yield base
    finally:
        p.terminate()
        p.wait(timeout=10)
        log.close()


def api(base: str, path: str, **params) -> dict:
    status, text = stack.get(f"{base}/api/v1/{path}?{urllib.parse.urlencode(params)}")
    body = json.loads(text)
    assert status == 200 and body["status"] == "success", (path, params, text[:500])
    return body["data"]


def has_data(result: list) -> bool:
    return any(math.isfinite(float(s["value"][1])) for s in result)


def test_stock_vllm_dashboard_queries_return_data(live, prometheus):
    c = openai.OpenAI(base_url=live.url, api_key="none", max_retries=0, timeout=60)
    name = c.models.list().data[0].id
    stop = threading.Event()

    def traffic():  # a prompt repeated (the prefix cache hits), plain and streamed
        i = 0
        while not stop.is_set():
            c.completions.create(model=name, prompt="a dashboard prompt " * 6 + str(i % 3),
                                 max_tokens=6, temperature=0, stream=bool(i % 2))
            i += 1
    threads = [threading.Thread(target=traffic, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        # The dashboard's model variable: the model names of vLLM's series.
        assert stack.wait_until(
            lambda: name in api(prometheus, "label/model_name/values",
                                **{"match[]": '{__name__=~"vllm:.*"}'}), 30)
        queries = [(panel, q.replace("$model_name", name).replace("$__rate_interval",
                                                                   RATE_INTERVAL))
                   for panel, qs in QUERIES["panels"].items() for q in qs]
        missing = queries
        deadline = time.monotonic() + 60
        while missing and time.monotonic() < deadline:
            missing = [(p, q) for p, q in missing
                       if not has_data(api(prometheus, "query", query=q)["result"])]
            time.sleep(1)
        assert not missing, "queries of vLLM's dashboard without data:\n" + \
            "\n".join(f"{p}: {q}" for p, q in missing)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
