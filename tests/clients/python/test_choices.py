"""n > 1 on the live stack (exl3-router's random-weight test model), driven by the openai SDK: n
choices from n generations of the prompt, streamed interleaved and not, usage summed over them;
with a seed the choices differ and the same request gives them again; greedy choices are all the
same (as vLLM's); n above --max-n is refused (test_refusals.py)."""

from __future__ import annotations

import openai
import pytest

HI = [{"role": "user", "content": "Tell me a story"}]


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url, api_key="none", max_retries=0, timeout=60)


def _streamed(chunks):
    """Per index: (text, finish); and the usage."""
    texts, finishes, usage = {}, {}, None
    for c in chunks:
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            delta = ch.delta.content if hasattr(ch, "delta") else ch.text
            texts[ch.index] = texts.get(ch.index, "") + (delta or "")
            if ch.finish_reason:
                assert ch.index not in finishes
                finishes[ch.index] = ch.finish_reason
    return texts, finishes, usage


def test_chat_n_seeded(client, live):
    kw = dict(model=live.name, messages=HI, max_tokens=12, temperature=1.0, seed=1234, n=3)
    r = client.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) == 3, texts  # each choice its own seed
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    assert 3 <= r.usage.completion_tokens <= 36  # the three choices' tokens
    again = client.chat.completions.create(**kw)
    assert [c.message.content for c in again.choices] == texts  # reproducible
    # Choice 0 is what n = 1 gives with the same seed.
    one = client.chat.completions.create(**{**kw, "n": 1})
    assert one.choices[0].message.content == texts[0]
    assert one.usage.completion_tokens < r.usage.completion_tokens
    # Streamed: the same choices, interleaved, each chunk naming its choice.
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    streamed, finishes, usage = _streamed(chunks)
    assert [streamed[i] for i in range(3)] == texts
    assert [finishes[i] for i in range(3)] == [c.finish_reason for c in r.choices]
    assert usage.completion_tokens == r.usage.completion_tokens
    roles = [ch.index for c in chunks for ch in c.choices if ch.delta.role == "assistant"]
    assert sorted(roles) == [0, 1, 2]


def test_completions_n(client, live):
    kw = dict(model=live.name, prompt="Once upon a time", max_tokens=10, temperature=1.0,
              seed=7, n=4)
    r = client.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    texts = [c.text for c in r.choices]
    assert len(set(texts)) > 1
    assert [c.text for c in client.completions.create(**kw).choices] == texts
    streamed, finishes, usage = _streamed(client.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    assert [streamed[i] for i in range(4)] == texts and len(finishes) == 4
    assert usage.completion_tokens == r.usage.completion_tokens


def test_greedy_n_choices_are_the_same(client, live):
    r = client.chat.completions.create(model=live.name, messages=HI, max_tokens=8,
                                       temperature=0, n=2)
    assert r.choices[0].message.content == r.choices[1].message.content
    assert r.usage.completion_tokens % 2 == 0  # twice the same tokens


def test_n_limit(client, live):
    client.completions.create(model=live.name, prompt="x", max_tokens=1, n=16)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=live.name, prompt="x", max_tokens=1, n=17)
    assert e.value.body["param"] == "n" and "--max-n" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=live.name, messages=HI, max_tokens=1,
                                       extra_body={"best_of": 2})
    assert e.value.body["param"] == "best_of"
