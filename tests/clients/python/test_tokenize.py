"""/tokenize and /detokenize in vLLM's request and response shapes, and 404/405 answered in
OpenAI's error body, against the live stack."""

from __future__ import annotations

import http.client
import json
from typing import Any, Optional
from urllib.parse import urlparse

import pytest

from exl3serve_client.frontend.text import ModelTokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def tok(live):
    return ModelTokenizer(live.model)


def _call(live, method: str, path: str, body: Optional[Any] = None,
          headers: Optional[dict[str, str]] = None) -> tuple[int, dict[str, str], Any]:
    u = urlparse(live.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    try:
        data = None if body is None else (body if isinstance(body, str) else json.dumps(body))
        conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        text = r.read().decode()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, \
            (json.loads(text) if text else None)
    finally:
        conn.close()


def test_tokenize_prompt(live, tok):
    s, _, r = _call(live, "POST", "/tokenize", {"model": live.name, "prompt": "Hello world"})
    assert s == 200, r
    want = tok.encode("Hello world", add_special_tokens=True)
    assert r["tokens"] == want and r["count"] == len(want)
    assert r["max_model_len"] > len(want) and r["token_strs"] is None
    s, _, r = _call(live, "POST", "/tokenize", {"prompt": "Hello world",
                                                "add_special_tokens": False,
                                                "return_token_strs": True})
    assert s == 200 and r["tokens"] == tok.encode("Hello world", add_special_tokens=False)
    assert r["token_strs"] == [tok.tokenizer.id_to_token(i) for i in r["tokens"]]


def test_tokenize_messages_is_the_chat_prompt(live, tok):
    s, _, r = _call(live, "POST", "/tokenize", {"model": live.name, "messages": MESSAGES})
    assert s == 200, r
    assert r["tokens"] == tok.encode_chat(MESSAGES, add_generation_prompt=True)
    s, _, r2 = _call(live, "POST", "/tokenize", {"messages": MESSAGES,
                                                 "add_generation_prompt": False})
    assert r2["tokens"] == tok.encode_chat(MESSAGES, add_generation_prompt=False)
    assert r2["count"] < r["count"]


def test_tokenize_count_equals_usage(live):
    """The chat prompt /tokenize counts is the one a chat completion's usage counts."""
    _, _, t = _call(live, "POST", "/tokenize", {"messages": MESSAGES})
    s, _, c = _call(live, "POST", "/v1/chat/completions",
                    {"model": live.name, "messages": MESSAGES, "max_tokens": 1})
    assert s == 200 and c["usage"]["prompt_tokens"] == t["count"]


def test_long_prompt_tokenized(live, tok):
    text = "word " * 5000  # past the length at which the tokenizer process tokenizes it
    s, _, r = _call(live, "POST", "/tokenize", {"prompt": text})
    assert s == 200 and r["tokens"] == tok.encode(text)


def test_detokenize(live, tok):
    ids = tok.encode("Round trip, please.", add_special_tokens=False)
    s, _, r = _call(live, "POST", "/detokenize", {"model": live.name, "tokens": ids})
    assert s == 200 and r == {"prompt": "Round trip, please."}


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"model": "other", "prompt": "x"}, "model"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"model": "other", "tokens": [1]}, "model"),
    ("/detokenize", "{not json", None),
])
def test_bad_token_requests(live, path, body, param):
    s, _, r = _call(live, "POST", path, body)
    assert s in (400, 404), r
    err = r["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    if param is not None:
        assert (err["param"] or "").split(".")[0] == param, r


def test_404_and_405_in_openai_error_body(live):
    s, _, r = _call(live, "GET", "/v1/nothing-here")
    assert s == 404 and r["error"]["type"] == "invalid_request_error" and r["error"]["message"]
    s, h, r = _call(live, "GET", "/v1/chat/completions")
    assert s == 405 and r["error"]["message"] and "POST" in h.get("allow", ""), (s, h, r)
    s, h, r = _call(live, "GET", "/v1/completions")
    assert s == 405 and r["error"]["message"]
    s, _, r = _call(live, "POST", "/v1/models", {})
    assert s == 405 and r["error"]["message"]
    s, _, r = _call(live, "GET", "/tokenize")
    assert s == 405 and r["error"]["message"]
    s, _, r = _call(live, "DELETE", "/health")
    assert s == 405 and r["error"]["message"]
