"""exl3serve-openai's --engine-calls stream and per-request against the fake engine of fake_engine.py
(no exl3-router needed): the same answers, errors as the same HTTP statuses, a disconnect that
cancels the engine request at once, a deadline, and 503 while the engine is away then recovery by
itself, in both modes."""

from __future__ import annotations

import asyncio
import http.client
import json
import shutil
import time
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlparse

import grpc
import openai
import pytest

import stack
from exl3serve_client.frontend.text import ModelTokenizer
from fake_engine import FAIL_AFTER, HANG, OVERLOAD, REFUSE, RUN, FakeEngine, ThreadedServer

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT_S = 1.5  # the front end's --request-timeout


class Fake:
    def __init__(self, engine: FakeEngine, server: ThreadedServer, fe: stack.Proc, url: str,
                 model: Path, mode: str) -> None:
        self.engine, self.server, self.fe, self.url, self.model, self.mode = \
            engine, server, fe, url, model, mode
        self.base = url[: -len("/v1")]
        self.client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=30)


@pytest.fixture(scope="module", params=["stream", "per-request"])
def fake(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"fake-{request.param}")
    model = tmp / "model"
    shutil.copytree(ROOT / "tests/fixtures/tokenizer/glm4_moe", model)
    engine = FakeEngine(step_s=0.005)
    server = ThreadedServer(engine).start()
    try:
        fe, url = stack.start_frontend(server.target, model, tmp / "logs",
                                       extra=("--engine-calls", request.param,
                                              "--request-timeout", str(TIMEOUT_S)))
    except BaseException:
        server.close()
        raise
    yield Fake(engine, server, fe, url, model, request.param)
    fe.stop()
    server.close()


def _post(f: Fake, body: dict[str, Any]) -> tuple[int, str]:
    u = urlparse(f.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        conn.request("POST", "/v1/completions", json.dumps({"model": "fake", **body}),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


def test_answers_streamed_and_not(fake):
    want = ModelTokenizer(fake.model).decode(list(range(100, 108)))
    r = fake.client.completions.create(model="fake", prompt=[RUN, 100], max_tokens=8)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "length")
    assert r.usage.completion_tokens == 8
    chunks = list(fake.client.completions.create(model="fake", prompt=[RUN, 100], max_tokens=8,
                                                 stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"
    # The engine got the front end's deadline with the request.
    assert fake.engine.starts[-1].timeout_us == int(TIMEOUT_S * 1e6)


def test_many_concurrent_streams(fake):
    tok = ModelTokenizer(fake.model)

    async def run() -> list[str]:
        c = openai.AsyncOpenAI(base_url=fake.url, api_key="none", max_retries=0, timeout=30)

        async def one(i: int) -> str:
            parts = []
            async for ch in await c.completions.create(model="fake", prompt=[RUN, 10 * i],
                                                       max_tokens=5 + i % 4, stream=True):
                parts.extend(x.text for x in ch.choices)
            return "".join(parts)
        try:
            return await asyncio.gather(*[one(i) for i in range(24)])
        finally:
            await c.close()
    for i, text in enumerate(asyncio.run(run())):
        assert text == tok.decode(list(range(10 * i, 10 * i + 5 + i % 4))), i


@pytest.mark.parametrize("kind,status,code,param", [
    (REFUSE, 400, None, "max_tokens"),
    (OVERLOAD, 429, "overloaded", None),
])
def test_refusals(fake, kind, status, code, param):
    for stream in (False, True):
        s, text = _post(fake, {"prompt": [kind, 0], "max_tokens": 4, "stream": stream})
        err = json.loads(text)["error"]
        assert s == status, text
        assert (err["code"], err["param"]) == (code, param), text


def _count(f: Fake, status: int) -> Optional[float]:
    return stack.metric(f.base[len("http://"):],
                        f'exl3_frontend_requests_total{{endpoint="completions",status="{status}"}}')


def test_refusals_before_the_engine(fake):
    """What the front end refuses itself (the body, the model, a field): OpenAI's error body with
    the field as `param`, counted by status, and nothing sent to the engine."""
    sent = len(fake.engine.starts)
    n400, n404 = _count(fake, 400), _count(fake, 404)
    u = urlparse(fake.url)
    for raw, status, param in (("{not json", 400, None), ("[1, 2]", 400, None), ("", 400, None),
                               ('{"model": "fake"}', 400, "prompt"),
                               ('{"model": "fake", "prompt": [1], "max_tokens": 0}', 400, "max_tokens"),
                               ('{"model": "fake", "prompt": [1], "top_p": "x"}', 400, "top_p"),
                               ('{"model": "nope", "prompt": [1]}', 404, "model")):
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        conn.request("POST", "/v1/completions", raw, {"Content-Type": "application/json"})
        r = conn.getresponse()
        text = r.read().decode()
        conn.close()
        err = json.loads(text)["error"]
        assert (r.status, err["param"]) == (status, param), text
        assert err["message"] and err["type"] == "invalid_request_error", text
    assert len(fake.engine.starts) == sent
    assert (_count(fake, 400) - n400, _count(fake, 404) - n404) == (6, 1)


def test_error_after_tokens(fake):
    s, text = _post(fake, {"prompt": [FAIL_AFTER, 0], "max_tokens": 10})
    assert s == 500 and "lost experts" in json.loads(text)["error"]["message"], text
    s, text = _post(fake, {"prompt": [FAIL_AFTER, 0], "max_tokens": 10, "stream": True})
    events = [e[len("data: "):] for e in text.split("\n\n") if e]
    assert s == 200 and events[-1] == "[DONE]", text
    assert "lost experts" in json.loads(events[-2])["error"]["message"], text


def test_deadline_504(fake):
    t0 = time.monotonic()
    s, text = _post(fake, {"prompt": [HANG, 100], "max_tokens": 10})
    assert s == 504 and json.loads(text)["error"]["code"] == "timeout", text
    assert TIMEOUT_S - 0.1 < time.monotonic() - t0 < TIMEOUT_S + 2


def test_disconnect_cancels_engine_request(fake):
    for streaming in (True, False):
        before = len(fake.engine.cancels)
        u = urlparse(fake.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        conn.request("POST", "/v1/completions",
                     json.dumps({"model": "fake", "prompt": [HANG, 100], "max_tokens": 10,
                                 "stream": streaming}), {"Content-Type": "application/json"})
        if streaming:
            resp = conn.getresponse()
            assert resp.status == 200 and resp.readline().startswith(b"data: ")
        else:
            assert stack.wait_until(lambda: fake.engine.starts[-1].prompt_token_ids[0] == HANG, 1)
            time.sleep(0.1)
        t0 = time.monotonic()
        conn.sock.close()
        conn.close()
        # At once: well before the request's deadline (TIMEOUT_S after it started) would cancel it.
        assert stack.wait_until(lambda: len(fake.engine.cancels) > before, 0.7), streaming
        assert time.monotonic() - t0 < 0.7


def test_metrics(fake):
    s, text = stack.get(f"{fake.base}/metrics")
    assert s == 200
    for series in ('exl3_frontend_requests_total{endpoint="completions",status="200"}',
                   'exl3_frontend_requests_total{endpoint="completions",status="400"}',
                   'exl3_frontend_requests_total{endpoint="completions",status="429"}',
                   'exl3_frontend_requests_total{endpoint="completions",status="504"}',
                   'exl3_frontend_requests_total{endpoint="completions",status="499"}',
                   "exl3_frontend_engine_up 1.0"):
        assert series in text, series


def test_engine_away_503_then_recovers(fake):
    """Last in the module: the engine stops (an open stream ends with an error event), requests are
    answered 503, and once it is back on the same address the front end serves by itself."""
    u = urlparse(fake.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("POST", "/v1/completions",
                 json.dumps({"model": "fake", "prompt": [HANG, 100], "max_tokens": 10,
                             "stream": True}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    fake.server.stop()
    rest = resp.read().decode()
    conn.close()
    assert '"error"' in rest and rest.endswith("data: [DONE]\n\n"), rest
    with pytest.raises(openai.APIStatusError) as e:
        fake.client.completions.create(model="fake", prompt=[RUN, 0], max_tokens=2)
    assert e.value.status_code == 503
    assert stack.wait_until(lambda: stack.get(f"{fake.base}/health")[0] == 503, 5)
    fake.server.start()

    def serving() -> bool:
        try:
            return bool(fake.client.completions.create(model="fake", prompt=[RUN, 0],
                                                       max_tokens=2).choices)
        except openai.APIStatusError as err:
            assert err.status_code == 503
            return False
    assert stack.wait_until(serving, 15, step=0.2)
    assert stack.get(f"{fake.base}/health")[0] == 200


class _OldEngine(FakeEngine):
    """An engine from before GenerateStream: its calls end UNIMPLEMENTED (as gRPC answers a method
    the server does not have; the servicer's own default raises, which grpc.aio's server may report
    as UNKNOWN instead)."""

    async def GenerateStream(self, request_iterator: Any, context: Any):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        yield  # an async generator, as the real method


def test_engine_without_generate_stream(tmp_path):
    """--engine-calls stream against an engine without GenerateStream: a 500 whose message names
    --engine-calls per-request, with which the same front end serves it."""
    model = tmp_path / "model"
    shutil.copytree(ROOT / "tests/fixtures/tokenizer/glm4_moe", model)
    server = ThreadedServer(_OldEngine()).start()
    try:
        for mode in ("stream", "per-request"):
            fe, url = stack.start_frontend(server.target, model, tmp_path / "logs",
                                           engine_calls=mode)
            try:
                c = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=30)
                if mode == "stream":
                    with pytest.raises(openai.InternalServerError) as e:
                        c.completions.create(model="fake", prompt=[RUN, 0], max_tokens=2)
                    assert "--engine-calls per-request" in str(e.value)
                else:
                    assert c.completions.create(model="fake", prompt=[RUN, 0],
                                                max_tokens=2).usage.completion_tokens == 2
            finally:
                fe.stop()
    finally:
        server.close()


def test_client_request_id_reaches_the_engine(fake):
    """The client's X-Request-Id is the engine's request id (its logs' tag), behind the answer's
    prefix, and comes back in the answer's header."""
    raw = fake.client.completions.with_raw_response.create(
        model="fake", prompt=[RUN, 100], max_tokens=2, extra_headers={"X-Request-Id": "trace-7"})
    assert raw.headers["x-request-id"] == "trace-7"
    assert fake.engine.starts[-1].request_id == "cmpl-trace-7" == raw.parse().id
