"""exl3serve-openai's operational options against the live stack's engine, each on a front end of
its own: --api-key (and $EXL3SERVE_API_KEY), CORS (--allowed-origins ...), X-Request-Id,
--host/--port, --max-model-len, --version, the access log and a client's disconnect."""

from __future__ import annotations

import http.client
import json
import re
import socket
import subprocess
import time
from importlib.metadata import version
from typing import Any, Optional
from urllib.parse import urlparse

import openai
import pytest

import stack

HI = [{"role": "user", "content": "Hello"}]
KEY = "sk-test-0123456789"


def _call(url: str, method: str, path: str, body: Optional[Any] = None,
          headers: Optional[dict[str, str]] = None) -> tuple[int, dict[str, str], str]:
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        data = None if body is None else json.dumps(body)
        h = {"Content-Type": "application/json"} if body is not None else {}
        conn.request(method, path, data, {**h, **(headers or {})})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode()
    finally:
        conn.close()


@pytest.fixture
def frontend(live, tmp_path):
    """Starts front ends on the live stack's engine with the given options; stops them after."""
    procs: list[stack.Proc] = []

    def start(*extra: str, env: Optional[dict[str, str]] = None) -> tuple[stack.Proc, str]:
        fe, url = stack.start_frontend(live.engine, live.model, tmp_path / "logs", extra=extra,
                                       env=env)
        procs.append(fe)
        return fe, url
    yield start
    for p in procs:
        p.stop()


@pytest.mark.parametrize("how", ["flag", "env", "workers"])
def test_api_key(live, frontend, how):
    fe, url = frontend("--api-key", KEY) if how == "flag" else \
        frontend(env={"EXL3SERVE_API_KEY": KEY}) if how == "env" else \
        frontend("--api-key", KEY, "--workers", "2")
    good = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60)
    r = good.chat.completions.create(model=live.name, messages=HI, max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert [m.id for m in good.models.list().data] == [live.name]
    bad = openai.OpenAI(base_url=url, api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model=live.name, messages=HI, max_tokens=2)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=live.name, prompt="x", max_tokens=2, stream=True)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    base = url[: -len("/v1")]
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        s, _, text = _call(base, "POST", path, body)
        assert s == 401 and json.loads(text)["error"]["code"] == "invalid_api_key", text
        s, _, _ = _call(base, "POST", path, body, {"Authorization": f"Bearer {KEY}"})
        assert s == 200
    s, _, _ = _call(base, "GET", "/v1/models", headers={"Authorization": KEY})  # not Bearer
    assert s == 401
    # Health and metrics stay open.
    assert _call(base, "GET", "/health")[0] == 200
    assert _call(base, "GET", "/metrics")[0] == 200
    assert KEY not in fe.text()


def test_cors(live, frontend):
    _, url = frontend("--api-key", KEY, "--allowed-origins", '["http://app.example"]',
                      "--allowed-methods", '["GET", "POST"]',
                      "--allowed-headers", '["Authorization", "Content-Type", "X-Request-Id"]',
                      "--allow-credentials")
    base = url[: -len("/v1")]
    pre = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "Authorization, Content-Type"}
    for path in ("/v1/chat/completions", "/v1/models", "/tokenize"):
        # A preflight needs no key.
        s, h, _ = _call(base, "OPTIONS", path, headers=pre)
        assert s == 200, (path, s, h)
        assert h["access-control-allow-origin"] == "http://app.example"
        assert "POST" in h["access-control-allow-methods"]
        assert h["access-control-allow-credentials"] == "true"
    s, h, _ = _call(base, "OPTIONS", "/v1/chat/completions",
                    headers={**pre, "Origin": "http://evil.example"})
    assert s == 400 and "access-control-allow-origin" not in h
    auth = {"Authorization": f"Bearer {KEY}", "Origin": "http://app.example"}
    s, h, text = _call(base, "POST", "/v1/chat/completions",
                       {"model": live.name, "messages": HI, "max_tokens": 2}, auth)
    assert s == 200 and h["access-control-allow-origin"] == "http://app.example", text
    s, h, _ = _call(base, "POST", "/v1/completions", {"model": live.name, "prompt": "x",
                                                      "max_tokens": 2, "stream": True}, auth)
    assert s == 200 and h["access-control-allow-origin"] == "http://app.example"
    s, h, _ = _call(base, "GET", "/v1/models", headers={**auth, "Origin": "http://evil.example"})
    assert s == 200 and "access-control-allow-origin" not in h


def test_no_cors_headers_by_default(live):
    s, h, _ = _call(live.base, "OPTIONS", "/v1/chat/completions",
                    headers={"Origin": "http://app.example",
                             "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in h and s == 405


def test_request_id_echoed(live):
    client = openai.OpenAI(base_url=live.url, api_key="none", max_retries=0, timeout=60)
    for stream in (False, True):
        raw = client.chat.completions.with_raw_response.create(
            model=live.name, messages=HI, max_tokens=2, stream=stream,
            extra_headers={"X-Request-Id": "trace-42.a_b"})
        assert raw.headers["x-request-id"] == "trace-42.a_b"
        first = raw.parse() if not stream else next(iter(raw.parse()))
        assert first.id == "chatcmpl-trace-42.a_b"
    raw = client.completions.with_raw_response.create(model=live.name, prompt="x", max_tokens=2)
    assert raw.headers["x-request-id"].startswith("cmpl-")  # none given: the front end's own
    # vLLM's request_id body field does the same.
    r = client.completions.create(model=live.name, prompt="x", max_tokens=2,
                                  extra_body={"request_id": "from-body"})
    assert r.id == "cmpl-from-body"
    s, _, text = _call(live.base, "POST", "/v1/completions",
                       {"model": live.name, "prompt": "x", "max_tokens": 2},
                       {"X-Request-Id": "x" * 300})
    assert s == 400 and "X-Request-Id" in json.loads(text)["error"]["message"]


def _engine_lines(live, rid: str) -> tuple[list[str], list[str]]:
    """The engine's (exl3-router's) log lines of the request whose engine id is `rid`: its start
    lines and its end lines (services/router/request_log.h), once the end has come."""
    def lines(kind: str) -> list[str]:
        return [ln for ln in live.router.text().splitlines()
                if f"request {kind} id={rid} " in ln]
    assert stack.wait_until(lambda: lines("end"), 10), f"no end line of {rid} in the engine's log"
    return lines("start"), lines("end")


def test_request_id_in_the_engines_log(live):
    """The client's X-Request-Id reaches the engine (GenerateRequest.request_id, in the answer's
    id "chatcmpl-ID" / "cmpl-ID"): its log has one line when it takes the request and one when it
    ends, both with the id, the latter with the tokens, finish reason and times. Without an id the
    front end's own (the answer's id) is the engine's."""
    client = openai.OpenAI(base_url=live.url, api_key="none", max_retries=0, timeout=60)
    r = client.chat.completions.create(model=live.name, messages=HI, max_tokens=3,
                                       extra_headers={"X-Request-Id": "abc"})
    start, end = _engine_lines(live, "chatcmpl-abc")
    assert len(start) == 1 and len(end) == 1, (start, end)
    assert f" prompt_tokens={r.usage.prompt_tokens} max_tokens=3" in start[0], start
    assert f" generated_tokens={r.usage.completion_tokens} " in end[0], end
    assert f" finish_reason={r.choices[0].finish_reason} " in end[0], end
    assert re.search(r" ttft_s=\d+\.\d+ total_s=\d+\.\d+$", end[0]), end
    # Streamed, and on completions.
    chunks = list(client.chat.completions.create(model=live.name, messages=HI, max_tokens=2,
                                                 stream=True,
                                                 extra_headers={"X-Request-Id": "abc-streamed"}))
    assert chunks[0].id == "chatcmpl-abc-streamed"
    assert [len(x) for x in _engine_lines(live, "chatcmpl-abc-streamed")] == [1, 1]
    client.completions.create(model=live.name, prompt="x", max_tokens=2,
                              extra_headers={"X-Request-Id": "abc-completion"})
    assert [len(x) for x in _engine_lines(live, "cmpl-abc-completion")] == [1, 1]
    # No id given: the answer's id is the engine's.
    raw = client.completions.with_raw_response.create(model=live.name, prompt="x", max_tokens=2)
    assert [len(x) for x in _engine_lines(live, raw.parse().id)] == [1, 1]
    assert raw.headers["x-request-id"] == raw.parse().id


def test_host_and_port(live, frontend):
    port = stack.free_port()
    _, url = frontend("--host", "127.0.0.1", "--port", str(port))
    assert url == f"http://127.0.0.1:{port}/v1"
    assert stack.get(url + "/models")[0] == 200


def test_max_model_len(live, frontend, tmp_path):
    engine_ctx = json.loads(stack.get(live.url + "/models")[1])["data"][0]["max_model_len"]
    _, url = frontend("--max-model-len", "64", "--workers", "2")  # the workers get it too
    card = json.loads(stack.get(url + "/models")[1])["data"][0]
    assert card["max_model_len"] == 64
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=live.name, prompt="x", max_tokens=64)
    assert e.value.body["code"] == "context_length_exceeded" and "64" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=live.name, prompt="word " * 70, max_tokens=1)
    r = client.completions.create(model=live.name, prompt="x", max_tokens=8)
    assert r.usage.completion_tokens <= 8
    # No max_tokens: up to the front end's limit, not the engine's.
    r = client.completions.create(model=live.name, prompt=[5, 6], max_tokens=None,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 62
    # Beyond the engine's context: refused at start.
    out = subprocess.run([stack._script("exl3serve-openai"), "--engine", live.engine,
                          "--model", str(live.model), "--listen", "127.0.0.1:0",
                          "--max-model-len", str(engine_ctx + 1)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--max-model-len" in out.stderr, out.stderr[-2000:]


def test_version():
    for script in ("exl3serve-openai", "exl3serve-make-tokenizer"):
        out = subprocess.run([stack._script(script), "--version"], capture_output=True,
                             text=True, timeout=60, check=True)
        assert out.stdout.strip() == f"{script} {version('exl3serve')}"


def test_access_log_and_disconnect(live, frontend):
    fe, url = frontend()
    base = url[: -len("/v1")]
    _call(base, "POST", "/v1/completions", {"model": live.name, "prompt": "x", "max_tokens": 2},
          {"X-Request-Id": "logged-1"})
    _call(base, "GET", "/v1/models")
    _call(base, "POST", "/v1/completions", {"model": "nope", "prompt": "x"})
    # Each line is written once its answer is sent.
    assert stack.wait_until(lambda: len(re.findall(r'" \d{3} ', fe.text())) >= 3, 10)
    log = fe.text()
    assert re.search(r'"POST /v1/completions HTTP/1\.1" 200 .*logged-1', log), log
    assert re.search(r'"GET /v1/models HTTP/1\.1" 200', log), log
    assert re.search(r'"POST /v1/completions HTTP/1\.1" 404', log), log
    u = urlparse(url)
    # A client that goes away while it sends its body: one line, no traceback.
    for path in ("/v1/completions", "/tokenize"):
        s = socket.create_connection((u.hostname, u.port))
        s.sendall((f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   f"X-Request-Id: gone-early{path}\r\nContent-Length: 1000\r\n\r\n{{").encode())
        time.sleep(0.2)
        s.close()
    # A client that goes away, streaming or not: one line, no traceback.
    for rid, stream in (("gone-streamed", True), ("gone-whole", False)):
        s = socket.create_connection((u.hostname, u.port))
        body = json.dumps({"model": live.name, "prompt": "x", "max_tokens": 4000,
                           "stream": stream, "ignore_eos": True})
        s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                   f"Content-Type: application/json\r\nX-Request-Id: {rid}\r\n"
                   f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
        if stream:
            assert s.recv(4096)  # the stream has started
        else:
            time.sleep(0.3)  # the engine is generating
        s.close()
        assert stack.wait_until(lambda: rid in fe.text(), 10)
    time.sleep(0.5)
    log = fe.text()
    assert "Traceback" not in log, log
    for rid in ("gone-streamed", "gone-whole", "gone-early/v1/completions", "gone-early/tokenize"):
        lines = [ln for ln in log.splitlines() if rid in ln]
        assert len(lines) == 1 and " 499 " in lines[0] and "disconnect" in lines[0], lines


@pytest.mark.parametrize("workers", ["1", "2"])
def test_json_log_format(live, frontend, workers):
    """--log-format json: every log line is one JSON object (the ready line on stdout aside): the
    access log's (time, client, method, path, status, duration, request id, a disconnect), and
    logging's records, uvicorn's and the workers' supervisor's (time, level, logger, message)."""
    fe, url = frontend("--log-format", "json", "--log-level", "info", "--workers", workers)
    base = url[: -len("/v1")]
    _call(base, "POST", "/v1/completions", {"model": live.name, "prompt": "x", "max_tokens": 2},
          {"X-Request-Id": "json-1"})
    _call(base, "GET", "/v1/models")
    u = urlparse(url)
    s = socket.create_connection((u.hostname, u.port))
    body = json.dumps({"model": live.name, "prompt": "x", "max_tokens": 4000, "stream": True,
                       "ignore_eos": True})
    s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"X-Request-Id: json-gone\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
    assert s.recv(4096)
    s.close()
    assert stack.wait_until(lambda: "json-gone" in fe.text(), 10)
    lines = [ln for ln in fe.text().splitlines()
             if ln.strip() and not ln.startswith("openai front end listening on")]
    entries = [json.loads(ln) for ln in lines]  # every line is JSON
    access = [e for e in entries if e.get("type") == "access"]
    by_id = {e["request_id"]: e for e in access}
    one = by_id["json-1"]
    assert (one["method"], one["path"], one["status"], one["http_version"]) == \
        ("POST", "/v1/completions", 200, "1.1")
    assert one["duration_ms"] >= 0 and one["client"].startswith("127.0.0.1:")
    assert one["client_disconnected"] is False and one["time"].endswith("Z")
    # Without the client's id: the answer's own (/v1/models has none: null).
    assert any(e["path"] == "/v1/models" and e["status"] == 200 for e in access)
    gone = by_id["json-gone"]
    assert (gone["status"], gone["client_disconnected"]) == (499, True)
    records = [e for e in entries if "level" in e]
    assert all(set(e) >= {"time", "level", "logger", "message"} for e in records)
    assert any(e["logger"].startswith("uvicorn") and e["level"] == "INFO" for e in records), \
        records
    if workers == "2":
        assert any(e["logger"] == "exl3serve.frontend.workers" and "started" in e["message"]
                   for e in records), records


STATS_LINE = re.compile(r"Engine 000: Avg prompt throughput: ([\d.]+) tokens/s, Avg generation "
                        r"throughput: ([\d.]+) tokens/s, Running: (\d+) reqs, Waiting: (\d+) reqs, "
                        r"GPU KV cache usage: ([\d.]+)%, Prefix cache hit rate: ([\d.]+)%")


def test_stats_lines(live, frontend):
    """Every --log-stats-interval seconds with activity, a line as vLLM's engine logs it: this
    process's prompt and generation throughput, the engine's running and waiting requests, KV
    cache usage and prefix cache hit rate; none while idle; none with --disable-log-stats; a JSON
    object with --log-format json."""
    body = {"model": live.name, "prompt": "stats", "max_tokens": 40, "ignore_eos": True}
    fe, url = frontend("--log-stats-interval", "0.5")
    base = url[: -len("/v1")]
    assert _call(base, "POST", "/v1/completions", body)[0] == 200
    assert stack.wait_until(lambda: any(float(m.group(2)) > 0
                                        for m in STATS_LINE.finditer(fe.text())), 10), fe.text()
    m = next(m for m in STATS_LINE.finditer(fe.text()) if float(m.group(2)) > 0)
    assert float(m.group(1)) > 0 and 0 <= float(m.group(5)) <= 100
    time.sleep(1.5)  # idle: no more lines
    idle = len(STATS_LINE.findall(fe.text()))
    time.sleep(1.5)
    assert len(STATS_LINE.findall(fe.text())) == idle
    quiet, url = frontend("--log-stats-interval", "0.5", "--disable-log-stats")
    assert _call(url[: -len("/v1")], "POST", "/v1/completions", body)[0] == 200
    time.sleep(1.5)
    assert "throughput" not in quiet.text()
    js, url = frontend("--log-stats-interval", "0.5", "--log-format", "json")
    assert _call(url[: -len("/v1")], "POST", "/v1/completions", body)[0] == 200

    def stats():
        return [e for e in (json.loads(ln) for ln in js.text().splitlines()
                            if ln.startswith("{")) if e.get("type") == "stats"]
    assert stack.wait_until(lambda: any(e["generation_throughput"] > 0 for e in stats()), 10)
    e = next(e for e in stats() if e["generation_throughput"] > 0)
    assert set(e) >= {"time", "name", "prompt_throughput", "running", "waiting",
                      "kv_cache_usage_perc", "prefix_cache_hit_rate_perc"}, e
