"""`exl3serve-openai --workers 2` (frontend/workers.py): the important live tests of test_live.py
again against a two-worker front end on the same engine, then what only several workers have:
/metrics summing every worker (a killed one's counts kept, its open-request gauge gone; vLLM's
names: the request counts summed, the engine's gauges not), a dead
worker restarted on the same address, the same /v1/models from every worker, SIGTERM draining an
open stream and leaving no process behind, and no worker outliving a parent killed by SIGKILL."""

from __future__ import annotations

import copy
import http.client
import json
import os
import shutil
import signal
import time
from pathlib import Path
from urllib.parse import urlparse

import openai
import pytest

import stack
# Collected here again: they run against this module's `live` (the two-worker front end).
from test_live import (client, test_bad_bodies, test_bad_chat_requests,  # noqa: F401
                       test_chat_streaming_equals_not_streaming, test_curl,
                       test_disconnect_cancels_engine_request, test_health_and_metrics,
                       test_models, tok)
from test_vllm_metrics import (test_vllm_engine_series_are_the_engines,  # noqa: F401
                               test_vllm_request_series_follow_the_requests)

WORKERS = ("--workers", "2")


@pytest.fixture(scope="module")
def live(live, tmp_path_factory):
    """The session's stack with a two-worker front end in place of its one-process one."""
    fe, url = stack.start_frontend(live.engine, live.model, tmp_path_factory.mktemp("logs2"),
                                   extra=WORKERS)
    two = copy.copy(live)
    two.url, two.base = url, url[: -len("/v1")]
    two.proc = fe
    yield two
    fe.stop()


def children(pid: int) -> list[int]:
    """The processes whose parent is pid."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return sorted(out)


def gone(pid: int) -> bool:
    """Exited (a zombie left for a parent that does not reap counts as exited)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return True
    return fields[0] == "Z"


def completions_200(base: str) -> float:
    return stack.metric(base[len("http://"):],
                        'exl3_frontend_requests_total{endpoint="completions",status="200"}')


def one_request(url: str, name: str) -> str:
    c = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
    try:  # a client of its own: a new connection, which either worker may accept
        return c.completions.create(model=name, prompt="w", max_tokens=2, temperature=0).id
    finally:
        c.close()


def test_two_worker_processes(live):
    assert "(2 workers)" in live.proc.text()
    assert len(children(live.proc.p.pid)) == 2


def test_models_same_from_every_worker(live):
    cards = {stack.get(f"{live.url}/models")[1] for _ in range(12)}
    assert len(cards) == 1, cards


def test_metrics_sum_over_workers_and_dead_workers_are_restarted(live):
    before = completions_200(live.base)
    for _ in range(10):
        one_request(live.url, live.name)
    assert completions_200(live.base) == before + 10
    # Both workers that served those requests die (SIGKILL) and are replaced, one after the other.
    for _ in range(2):
        workers = children(live.proc.p.pid)
        os.kill(workers[0], signal.SIGKILL)
        live.proc.wait_for(rf"worker \d \(pid {workers[0]}\) was killed by signal 9 .*; restarting")
        assert stack.wait_until(lambda: len(set(children(live.proc.p.pid)) - set(workers)) == 1, 30)
        assert stack.wait_until(lambda: stack.get(f"{live.base}/health")[0] == 200, 30)
    # The dead workers' counts stay in the sums (whichever new worker answers the scrape), their
    # open-request gauges left with them.
    for _ in range(4):
        assert completions_200(live.base) == before + 10
        assert stack.metric(live.base[len("http://"):], "exl3_frontend_requests_running") == 0
    for _ in range(6):
        one_request(live.url, live.name)
    assert completions_200(live.base) == before + 16


def _post_stream(url: str, body: dict) -> http.client.HTTPResponse:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    return resp


@pytest.mark.parametrize("how", ["SIGTERM to the parent", "SIGINT to its process group"])
def test_a_signal_drains_open_stream_and_leaves_nothing(live, tmp_path, monkeypatch, how):
    """The second is what a terminal's Ctrl-C does: every worker gets the SIGINT, and then the
    parent's SIGTERM, which must not make uvicorn cut the stream (a second SIGINT would)."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where the parent makes its metrics directory
    fe, url = stack.start_frontend(live.engine, live.model, tmp_path / "logs", extra=WORKERS)
    workers = children(fe.p.pid)
    assert len(workers) == 2 and list(tmp_path.glob("exl3serve-openai-metrics.*"))
    # 200 tokens: open when the signal comes, and done well within the 5 s the drain allows
    # (frontend/server.py GRACEFUL_SHUTDOWN_S) on a loaded 2-core machine, where 1000 were not.
    resp = _post_stream(url, {"model": live.name, "prompt": "drain", "max_tokens": 200,
                              "temperature": 0, "stream": True, "ignore_eos": True})
    assert resp.readline().startswith(b"data: ")
    t0 = time.monotonic()
    if how.startswith("SIGTERM"):
        fe.p.send_signal(signal.SIGTERM)
    else:
        os.killpg(fe.p.pid, signal.SIGINT)  # stack.Proc starts it as a session leader
    rest = resp.read().decode()  # the open stream runs to its end
    assert rest.endswith("data: [DONE]\n\n"), rest[-300:]
    assert fe.p.wait(30) == 0
    assert time.monotonic() - t0 < 15
    assert stack.wait_until(lambda: all(gone(p) for p in workers), 5)
    assert not list(tmp_path.glob("exl3serve-openai-metrics.*"))
    fe.stop()


@pytest.mark.parametrize("extra", [(), WORKERS], ids=["one process", "two workers"])
def test_answers_the_drain_cannot_finish_end_with_an_error(live, tmp_path, extra):
    """Answers still under way near the end of the drain (5 s) are ended by the front end, not
    cut: a stream with an error event (server_shutting_down) and [DONE], a whole answer with a
    503 in OpenAI's body; the front end then exits 0."""
    fe, url = stack.start_frontend(live.engine, live.model, tmp_path / "logs", extra=extra)
    long = {"model": live.name, "prompt": "drain", "max_tokens": 4000, "temperature": 0,
            "ignore_eos": True}
    resp = _post_stream(url, {**long, "stream": True})
    assert resp.readline().startswith(b"data: ")
    u = urlparse(url)
    whole = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    whole.request("POST", "/v1/completions", json.dumps(long),
                  {"Content-Type": "application/json"})
    time.sleep(0.5)  # both are generating
    t0 = time.monotonic()
    fe.p.send_signal(signal.SIGTERM)
    rest = resp.read().decode()  # a whole chunked response: not cut
    events = [e[len("data: "):] for e in rest.split("\n\n") if e]
    assert events[-1] == "[DONE]", rest[-300:]
    assert json.loads(events[-2])["error"]["code"] == "server_shutting_down"
    w = whole.getresponse()
    body = json.loads(w.read())
    assert (w.status, body["error"]["code"], body["error"]["type"]) == \
        (503, "server_shutting_down", "service_unavailable")
    assert 2 < time.monotonic() - t0 < 5.5  # near the drain's end, before uvicorn's cut
    assert fe.p.wait(30) == 0
    fe.stop()


def test_no_worker_outlives_a_killed_parent(live, tmp_path):
    fe, _ = stack.start_frontend(live.engine, live.model, tmp_path, extra=WORKERS)
    workers = children(fe.p.pid)
    assert len(workers) == 2
    fe.p.kill()
    fe.p.wait(10)
    assert stack.wait_until(lambda: all(gone(p) for p in workers), 15), workers
    fe.stop()


def test_bad_worker_count_taken_address_and_workers_that_cannot_start(live, tmp_path):
    with pytest.raises(RuntimeError, match="workers"):
        stack.start_frontend(live.engine, live.model, tmp_path, extra=("--workers", "0"))
    # Workers that fail before they serve (here: a tokenizer.json that is no JSON) are not
    # restarted: the parent stops the others and exits 1.
    broken = tmp_path / "broken"
    shutil.copytree(live.model, broken)
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(RuntimeError, match=r"exited \(1\)(.|\n)*before it served; stopping"):
        stack.start_frontend(live.engine, broken, tmp_path, extra=WORKERS)
    # The workers' SO_REUSEPORT sockets must not join those of a front end already on the port.
    port = urlparse(live.url).port
    for workers in ("1", "2"):
        with pytest.raises(RuntimeError, match="cannot listen on 127.0.0.1:%d" % port):
            stack.start_frontend(live.engine, live.model, tmp_path, port=port,
                                 extra=("--workers", workers))
