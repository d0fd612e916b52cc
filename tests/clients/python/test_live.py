"""The front end against a live stack (exl3-router + exl3serve-openai on loopback), driven by the
official openai SDK (sync and async, streaming and not), curl and raw HTTP."""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import subprocess
import time
from urllib.parse import urlparse

import openai
import pytest

import stack
from exl3serve_client import AsyncGenerateClient, GenerateClient, RequestError
from exl3serve_client.frontend.text import ModelTokenizer

HI = [{"role": "user", "content": "Hello, who are you?"}]


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url, api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tok(live):
    return ModelTokenizer(live.model)


def test_models(client, live):
    models = client.models.list()
    assert [m.id for m in models.data] == [live.name]
    assert client.models.retrieve(live.name).id == live.name


def test_chat_not_streaming(client, live):
    r = client.chat.completions.create(model=live.name, messages=HI, max_tokens=12, temperature=0)
    c = r.choices[0]
    assert r.object == "chat.completion" and c.message.role == "assistant"
    assert isinstance(c.message.content, str)
    assert c.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_equals_not_streaming(client, live):
    want = client.chat.completions.create(model=live.name, messages=HI, max_tokens=24,
                                          temperature=0)
    chunks = list(client.chat.completions.create(
        model=live.name, messages=HI, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [want.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == want.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_stream_usage_only_when_asked(client, live):
    """stream_options.include_usage on /v1/completions: a last chunk with no choices and the usage
    of the whole answer, every other chunk usage null; without it, no usage at all."""
    kw = dict(model=live.name, prompt="Usage", max_tokens=10, temperature=0, stream=True,
              extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 10
    assert all(c.usage is None for c in chunks[:-1])
    plain = list(client.completions.create(**kw))
    assert all(c.usage is None for c in plain) and plain[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in plain) == \
        "".join(c.choices[0].text for c in chunks if c.choices)


def test_greedy_tokens_equal_direct_generate(client, live, tok):
    """Greedy text through the front end equals decode of a direct Generate call's token ids."""
    with GenerateClient(live.engine) as g:
        for prompt in ("The router", "Experts are", "Once upon a time"):
            ids = tok.encode(prompt)
            direct = g.generate(ids, max_tokens=16, temperature=0)
            r = client.completions.create(model=live.name, prompt=prompt, max_tokens=16,
                                          temperature=0)
            assert r.choices[0].text == tok.decode(direct.token_ids)
            assert r.usage.completion_tokens == len(direct.token_ids)
            r2 = client.completions.create(model=live.name, prompt=ids, max_tokens=16,
                                           temperature=0)
            assert r2.choices[0].text == r.choices[0].text


def test_async_sdk_streaming_and_not(live):
    async def run():
        c = openai.AsyncOpenAI(base_url=live.url, api_key="none", max_retries=0, timeout=60)
        whole = await c.completions.create(model=live.name, prompt="Streams", max_tokens=20,
                                           temperature=0)
        parts = []
        async for ch in await c.completions.create(model=live.name, prompt="Streams",
                                                   max_tokens=20, temperature=0, stream=True):
            parts.extend(x.text for x in ch.choices)
        # Several at once.
        many = await asyncio.gather(*[c.chat.completions.create(
            model=live.name, messages=[{"role": "user", "content": f"n{i}"}], max_tokens=8,
            temperature=0) for i in range(6)])
        await c.close()
        return whole, "".join(parts), many
    whole, streamed, many = asyncio.run(run())
    assert streamed == whole.choices[0].text
    assert len(many) == 6 and all(m.choices[0].finish_reason in ("stop", "length") for m in many)


def test_async_generate_client(live, tok):
    async def run():
        async with AsyncGenerateClient(live.engine) as g:
            info = await g.describe()
            r = await g.generate(tok.encode("abc"), max_tokens=5, temperature=0, logprobs=2)
            return info, r
    info, r = asyncio.run(run())
    assert info.vocab_size == 512
    assert len(r.token_ids) == 5 and r.finish_reason == "length"
    assert all(len(t) == 2 for t in r.top_logprobs)


def test_stop_string_not_returned(client, live):
    base = client.completions.create(model=live.name, prompt="The router", max_tokens=24,
                                     temperature=0, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    if len(text) < 4:
        pytest.skip(f"greedy output too short for a stop string: {text!r}")
    stop = text[len(text) // 2: len(text) // 2 + 2]
    want = text[: text.index(stop)]
    for stream in (False, True):
        if stream:
            got = "".join(c.choices[0].text for c in client.completions.create(
                model=live.name, prompt="The router", max_tokens=24, temperature=0, stop=[stop],
                stream=True, extra_body={"ignore_eos": True}) if c.choices)
        else:
            r = client.completions.create(model=live.name, prompt="The router", max_tokens=24,
                                          temperature=0, stop=stop, extra_body={"ignore_eos": True})
            got = r.choices[0].text
            assert r.choices[0].finish_reason == "stop"
        assert got == want, (stream, stop, text)


def _sampled(client, live, tok, **kw):
    """A seeded sampled completion: its text, its token ids and each token's text."""
    r = client.completions.create(model=live.name, prompt="Once upon a time", max_tokens=32,
                                  temperature=1.0, seed=7, logprobs=0,
                                  extra_body={"ignore_eos": True,
                                              "return_tokens_as_token_ids": True, **kw})
    ids = [int(t.split(":", 1)[1]) for t in r.choices[0].logprobs.tokens]
    return r.choices[0].text, ids, [tok.decode([i]) for i in ids]


def test_stop_string_across_token_boundaries(client, live, tok):
    """A stop string made of the end of one token, (a whole token,) and the start of the next is
    found, cut with what follows, and not returned; streamed and not."""
    text, ids, pieces = _sampled(client, live, tok)
    cases = []
    for span in (2, 3):  # across one boundary; across a whole token in between
        for i in range(len(ids) - span):
            before = tok.decode(ids[:i + 1])  # the text up to the boundary after token i
            after = "".join(pieces[i + 1:i + span])
            if not before or not text.startswith(before) or \
                    not text[len(before):].startswith(after) or "\ufffd" in before[-1] + after:
                continue
            stop = before[-1] + "".join(pieces[i + 1:i + span - 1]) + pieces[i + span - 1][:1]
            if all(pieces[i + 1:i + span]) and text.find(stop) == len(before) - 1:  # first seen there
                cases.append(stop)
                break
    assert len(cases) == 2, (pieces, cases)
    for stop in cases:
        want = text[: text.index(stop)]
        kw = dict(model=live.name, prompt="Once upon a time", max_tokens=32, temperature=1.0,
                  seed=7, stop=[stop], extra_body={"ignore_eos": True})
        r = client.completions.create(**kw)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop"), (stop, pieces)
        chunks = list(client.completions.create(stream=True, **kw))
        got = "".join(c.choices[0].text for c in chunks if c.choices)
        assert got == want, (stop, pieces)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        chat = client.chat.completions.create(
            model=live.name, messages=HI, max_tokens=16, temperature=0, stop=stop)
        assert stop not in (chat.choices[0].message.content or "")


def test_stop_token_ids_min_tokens_ignore_eos(client, live, tok):
    """vLLM's extras over HTTP: stop_token_ids end the answer at the first such token
    (finish_reason stop), min_tokens holds it back, ignore_eos runs to max_tokens."""
    text, ids, pieces = _sampled(client, live, tok)
    stop_id = ids[5]
    first = ids.index(stop_id)
    r = client.completions.create(model=live.name, prompt="Once upon a time", max_tokens=32,
                                  temperature=1.0, seed=7,
                                  extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == first + 1
    assert text.startswith(r.choices[0].text)
    r = client.completions.create(model=live.name, prompt="Once upon a time", max_tokens=32,
                                  temperature=1.0, seed=7,
                                  extra_body={"ignore_eos": True, "stop_token_ids": [stop_id],
                                              "min_tokens": 32})
    assert r.usage.completion_tokens == 32 and r.choices[0].finish_reason == "length"
    eos = client.completions.create(model=live.name, prompt="Once upon a time", max_tokens=32,
                                    temperature=1.0, seed=7,
                                    extra_body={"ignore_eos": False, "stop_token_ids": [1]})
    assert eos.usage.completion_tokens <= 32  # the test model's eos (1) may or may not come


def test_streamed_logprobs(client, live):
    """logprobs / top_logprobs in streamed chunks, chat and completions: one entry per token, as
    the same request not streamed gives them."""
    kw = dict(model=live.name, messages=HI, max_tokens=8, temperature=0, logprobs=True,
              top_logprobs=2)
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = [e for c in client.chat.completions.create(stream=True, **kw)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.bytes, len(e.top_logprobs)) for e in streamed] == \
        [(e.token, e.bytes, 2) for e in whole]
    for a, b in zip(streamed, whole):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
    kw = dict(model=live.name, prompt="x", max_tokens=6, temperature=0, logprobs=3)
    whole = client.completions.create(**kw).choices[0].logprobs
    tokens, offsets = [], []
    for c in client.completions.create(stream=True, **kw):
        if c.choices and c.choices[0].logprobs:
            tokens += c.choices[0].logprobs.tokens
            offsets += c.choices[0].logprobs.text_offset
            assert all(len(t) == 3 for t in c.choices[0].logprobs.top_logprobs)
    assert tokens == whole.tokens and offsets == whole.text_offset


def test_seed_and_sampling_fields(client, live):
    kw = dict(model=live.name, prompt="seeded", max_tokens=12, temperature=1.0, top_p=0.9,
              seed=1234, presence_penalty=0.5, frequency_penalty=0.5,
              extra_body={"top_k": 50, "min_p": 0.01})
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b


def test_max_completion_tokens(client, live):
    """max_completion_tokens bounds a chat answer, and wins over the older max_tokens."""
    for kw in ({"max_completion_tokens": 5}, {"max_completion_tokens": 5, "max_tokens": 9}):
        r = client.chat.completions.create(model=live.name, messages=HI, temperature=0,
                                           extra_body={"ignore_eos": True}, **kw)
        assert r.usage.completion_tokens == 5, kw
        assert r.choices[0].finish_reason == "length", kw


SAMPLED = {"temperature": 1.0, "seed": 11}
VARIANTS = [{}, {"temperature": 0.6}, {"top_p": 0.5}, {"top_k": 3}, {"min_p": 0.3},
            {"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 3.0},
            {"seed": 12}]


def test_sampling_fields_reach_the_engine(client, live, tok):
    """Each sampling field of an HTTP request is the engine's: the front end's seeded sample equals
    a direct Generate call's with the same fields, and every field changes the sample."""
    prompt = "Once upon a time"
    ids = tok.encode(prompt)
    got = []
    with GenerateClient(live.engine) as g:
        for v in VARIANTS:
            fields = {**SAMPLED, **v}
            extra = {k: fields.pop(k) for k in ("top_k", "min_p", "repetition_penalty")
                     if k in fields}
            r = client.completions.create(model=live.name, prompt=prompt, max_tokens=24,
                                          logprobs=0, **fields,
                                          extra_body={"ignore_eos": True,
                                                      "return_tokens_as_token_ids": True, **extra})
            via = [int(t.split(":", 1)[1]) for t in r.choices[0].logprobs.tokens]
            direct = g.generate(ids, max_tokens=24, ignore_eos=True, **fields, **extra)
            assert via == direct.token_ids, v
            got.append(tuple(via))
    for v, ids_of_v in zip(VARIANTS[1:], got[1:]):
        assert ids_of_v != got[0], f"{v} did not change the sample"


def test_logprobs(client, live):
    r = client.chat.completions.create(model=live.name, messages=HI, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0.0
        assert e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-4)  # greedy: the best
    c = client.completions.create(model=live.name, prompt="x", max_tokens=4, temperature=0,
                                  logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4


@pytest.mark.parametrize("body,status,param", [
    ({"model": "nope", "messages": HI}, 404, "model"),
    ({"messages": HI, "n": 17}, 400, "n"),
    ({"messages": HI, "temperature": 5}, 400, "temperature"),
    ({"messages": HI, "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": []}, 400, "messages"),
    ({"messages": HI, "max_tokens": 100000}, 400, "max_tokens"),
    ({"messages": HI, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ({"messages": HI, "max_completion_tokens": 100000}, 400, "max_completion_tokens"),
    ({"messages": HI, "top_p": 1.5}, 400, "top_p"),
    ({"messages": HI, "top_k": -2}, 400, "top_k"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ({"messages": HI, "tools": [{"type": "function", "function": {"name": ""}}]}, 400, "tools"),
    ({"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
])
def test_bad_chat_requests(live, body, status, param):
    body = {"model": live.name, **body}
    s, text = _post(live, "/v1/chat/completions", json.dumps(body))
    err = json.loads(text)["error"]
    assert s == status, text
    assert err["message"] and err["type"]
    assert param in (err["param"] or "")


def test_bad_bodies(live):
    s, text = _post(live, "/v1/completions", "{not json")
    assert s == 400 and "error" in json.loads(text)
    s, text = _post(live, "/v1/completions", json.dumps({"model": live.name, "prompt": [1, 99999],
                                                          "max_tokens": 2}))
    assert s == 400 and "error" in json.loads(text)
    # Several prompts are one choice each (test_echo_prompt_logprobs.py); a list mixing token
    # ids and texts is no prompt.
    s, text = _post(live, "/v1/completions", json.dumps({"model": live.name, "prompt": ["a", "b"],
                                                          "max_tokens": 1}))
    assert s == 200 and len(json.loads(text)["choices"]) == 2
    s, text = _post(live, "/v1/completions", json.dumps({"model": live.name, "prompt": [[1], "b"]}))
    assert s == 400


@pytest.mark.parametrize("extra,param", [
    ({"prompt": [1, 99999]}, "prompt"),
    ({"min_tokens": 9}, "min_tokens"),
    ({"stop_token_ids": [99999]}, "stop_token_ids"),
])
def test_engine_refusals_name_the_field(live, extra, param):
    """What only the engine checks (the vocabulary, min_tokens against max_tokens) comes back as a
    400 whose OpenAI error names the field, with the engine's message."""
    body = {"model": live.name, "prompt": "x", "max_tokens": 4, **extra}
    s, text = _post(live, "/v1/completions", json.dumps(body))
    err = json.loads(text)["error"]
    assert s == 400, text
    assert err["param"] == param and err["type"] == "invalid_request_error", text
    assert param.split("_")[0] in err["message"], text


def test_sdk_raises_on_errors(client, live):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=HI)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=live.name, messages=HI, n=17)  # above --max-n


def test_curl(live):
    body = json.dumps({"model": live.name, "messages": HI, "max_tokens": 8, "temperature": 0})
    out = subprocess.run(["curl", "-sS", "--max-time", "60", f"{live.url}/chat/completions",
                          "-H", "Content-Type: application/json", "-d", body],
                         capture_output=True, text=True, check=True, timeout=90).stdout
    assert json.loads(out)["object"] == "chat.completion"
    stream = json.dumps({"model": live.name, "prompt": "curl", "max_tokens": 8, "stream": True,
                         "temperature": 0})
    out = subprocess.run(["curl", "-sSN", "--max-time", "60", f"{live.url}/completions",
                          "-H", "Content-Type: application/json", "-d", stream],
                         capture_output=True, text=True, check=True, timeout=90).stdout
    events = [e for e in out.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    for e in events[:-1]:
        assert json.loads(e[len("data: "):])["object"] == "text_completion"


def test_disconnect_cancels_engine_request(live):
    """A client that goes away mid-stream frees its engine sequence at once (streaming), and so
    does one that gives up on a non-streaming answer."""
    aborted = lambda: stack.metric(live.engine_metrics,  # noqa: E731
                                   'exl3_engine_requests_finished_total{finish_reason="abort"}')
    running = lambda: stack.metric(live.engine_metrics, "exl3_engine_num_requests_running")  # noqa: E731
    kv = lambda: stack.metric(live.engine_metrics, "exl3_engine_kv_cache_usage_ratio")  # noqa: E731
    for streaming in (True, False):
        before = aborted()
        body = json.dumps({"model": live.name, "prompt": "long", "max_tokens": 3000,
                           "temperature": 0, "stream": streaming, "ignore_eos": True})
        u = urlparse(live.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        if streaming:
            resp = conn.getresponse()
            assert resp.status == 200
            assert resp.readline().startswith(b"data: ")
        else:
            assert stack.wait_until(lambda: (running() or 0) >= 1, 10)
        assert stack.wait_until(lambda: (kv() or 0) > 0, 5), "no KV blocks in use"
        t0 = time.monotonic()
        conn.sock.close()
        conn.close()
        assert stack.wait_until(lambda: aborted() > before, 5), "engine request not aborted"
        assert time.monotonic() - t0 < 5
        assert stack.wait_until(lambda: running() == 0 and kv() == 0, 5), "KV blocks not freed"


def test_health_and_metrics(live, client):
    client.completions.create(model=live.name, prompt="m", max_tokens=3, temperature=0, stream=True)
    s, text = stack.get(f"{live.base}/health")
    assert s == 200 and json.loads(text)["status"] == "ok"
    s, text = stack.get(f"{live.base}/metrics")
    assert s == 200
    for name in ("exl3_frontend_requests_total", "exl3_frontend_time_to_first_token_seconds_bucket",
                 "exl3_frontend_inter_token_latency_seconds_bucket",
                 "exl3_frontend_e2e_request_latency_seconds_count",
                 "exl3_frontend_prompt_tokens_total", "exl3_frontend_generation_tokens_total",
                 "exl3_frontend_engine_up 1.0"):
        assert name in text, name
    assert 'exl3_frontend_requests_total{endpoint="completions",status="200"}' in text
    assert 'exl3_frontend_requests_total{endpoint="chat_completions",status="404"}' in text


@pytest.mark.parametrize("workers,engine_calls", [(1, "stream"), (2, "stream"), (1, "per-request")])
def test_engine_restart_503_then_recovers(build_dir, model, tmp_path, workers, engine_calls):
    """An engine that goes away makes the front end answer 503; once it is back on the same
    address, the front end serves again by itself (every worker of it: /health waits for the one
    that answers, which may not have seen the engine go or come back yet, for up to its 1 s cache).
    With --engine-calls stream the GenerateStream call broken by the restart is opened again."""
    port = stack.free_port()
    router, engine, _ = stack.start_router(build_dir, model, tmp_path, port=port)
    fe, url = stack.start_frontend(engine, model, tmp_path, extra=("--workers", str(workers)),
                                   engine_calls=engine_calls)
    health = lambda: stack.get(url[:-3] + "/health")[0]  # noqa: E731
    c = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=30)
    try:
        assert c.completions.create(model=model.name, prompt="a", max_tokens=2).choices
        router.stop()
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(model=model.name, prompt="a", max_tokens=2)
        _expect_openai_error(e.value, 503, "service_unavailable", "engine_unavailable")
        assert stack.wait_until(lambda: health() == 503, 5)
        router, _, _ = stack.start_router(build_dir, model, tmp_path, port=port)

        def serving() -> bool:
            try:
                return bool(c.completions.create(model=model.name, prompt="a", max_tokens=2).choices)
            except openai.APIStatusError as err:
                assert err.status_code == 503
                return False
        assert stack.wait_until(serving, 30, step=0.2)
        assert stack.wait_until(lambda: all(health() == 200 for _ in range(4)), 5)
    finally:
        fe.stop()
        router.stop()


def test_generate_client_errors(live):
    with GenerateClient(live.engine) as g:
        with pytest.raises(RequestError) as e:
            g.generate([1, 2], max_tokens=0)
        assert e.value.code.name == "INVALID_ARGUMENT"


def _expect_openai_error(exc: openai.APIStatusError, status: int, type_: str, code: str) -> None:
    """The answer was `status` with OpenAI's error body: {"error": {message, type, param, code}}."""
    assert exc.status_code == status
    body = exc.response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["message"] and err["type"] == type_ and err["code"] == code, err


def _post(live, path: str, body: str) -> tuple[int, str]:
    u = urlparse(live.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


@pytest.mark.parametrize("engine_calls", ["stream", "per-request"])
def test_overload_429_and_timeout_504(build_dir, model, tmp_path, engine_calls):
    """An engine that refuses more requests makes the front end answer 429; a request past the
    front end's --request-timeout is answered 504 (in-stream as an error event once streaming)."""
    router, engine, metrics = stack.start_router(build_dir, model, tmp_path,
                                                 extra=("--max-pending-requests", "1"))
    fe, url = stack.start_frontend(engine, model, tmp_path, extra=("--request-timeout", "1.5"),
                                   engine_calls=engine_calls)
    held_by_engine = lambda: sum(stack.metric(metrics, f"exl3_engine_num_requests_{s}") or 0  # noqa: E731
                                 for s in ("running", "waiting"))
    c = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=30)
    long = dict(model=model.name, prompt="long", max_tokens=3500, temperature=0,
                extra_body={"ignore_eos": True})
    try:
        held = c.completions.create(stream=True, **long)
        first = next(iter(held))          # the engine holds this one now
        assert first.choices
        with pytest.raises(openai.RateLimitError) as e:
            c.completions.create(model=model.name, prompt="b", max_tokens=2)
        _expect_openai_error(e.value, 429, "rate_limit_error", "overloaded")
        assert "max_pending_requests" in e.value.response.json()["error"]["message"]
        with pytest.raises(openai.APIError) as e:  # the held stream hits the deadline
            for _ in held:
                pass
        assert "timed out" in str(e.value)
        # The engine ends the held request on its next step (its deadline, or the front end's
        # cancel): until then a new one would be refused 429.
        assert stack.wait_until(lambda: held_by_engine() == 0, 5)
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(**long)
        _expect_openai_error(e.value, 504, "timeout", "timeout")
    finally:
        fe.stop()
        router.stop()


@pytest.mark.parametrize("engine_calls", ["stream", "per-request"])
def test_two_front_ends_one_engine(live, tmp_path, engine_calls):
    """Front ends keep no state of their own: a second one on the same engine answers the same
    greedy text (whichever --engine-calls either has)."""
    fe, url = stack.start_frontend(live.engine, live.model, tmp_path, engine_calls=engine_calls)
    try:
        texts = [openai.OpenAI(base_url=u, api_key="none", max_retries=0, timeout=60)
                 .completions.create(model=live.name, prompt="Same", max_tokens=10,
                                     temperature=0).choices[0].text for u in (live.url, url)]
        assert texts[0] == texts[1]
    finally:
        fe.stop()


@pytest.mark.parametrize("engine_calls", ["stream", "per-request"])
def test_front_end_restart_keeps_nothing(live, tmp_path, engine_calls):
    """A front end holds nothing a restart would lose but its open requests: killed with a stream
    open, it leaves no request in the engine (its channel's calls end with it: the GenerateStream
    call with every request on it, or each Generate call), and a new one on the same address
    answers as the old one did."""
    running = lambda: stack.metric(live.engine_metrics, "exl3_engine_num_requests_running")  # noqa: E731
    kv = lambda: stack.metric(live.engine_metrics, "exl3_engine_kv_cache_usage_ratio")  # noqa: E731
    port = stack.free_port()
    fe, url = stack.start_frontend(live.engine, live.model, tmp_path, port=port,
                                   engine_calls=engine_calls)
    try:
        c = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)

        def ask() -> str:
            return c.completions.create(model=live.name, prompt="Restart", max_tokens=10,
                                        temperature=0).choices[0].text
        before = ask()
        held = c.completions.create(model=live.name, prompt="long", max_tokens=3000,
                                    temperature=0, stream=True, extra_body={"ignore_eos": True})
        assert next(iter(held)).choices
        assert stack.wait_until(lambda: (running() or 0) >= 1, 5)
        fe.stop(signal.SIGKILL)
        held.close()
        assert stack.wait_until(lambda: running() == 0 and kv() == 0, 10), \
            "the killed front end's engine request still runs"
        fe, again = stack.start_frontend(live.engine, live.model, tmp_path, port=port,
                                         engine_calls=engine_calls)
        assert again == url
        assert ask() == before
        assert [m.id for m in c.models.list().data] == [live.name]
    finally:
        fe.stop()
