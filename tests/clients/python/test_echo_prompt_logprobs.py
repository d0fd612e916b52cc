"""The evaluation harnesses' requests on the live stack (exl3-router's random-weight test model),
driven by the openai SDK: completions' echo with and without logprobs, streamed and not (the
prompt's logprobs equal to a teacher-forced pass: what the model gave each token when it generated
it); vLLM's prompt_logprobs on both endpoints; several prompts in one completions request with
n = 2; usage.prompt_tokens_details.cached_tokens after a repeated prompt
(--enable-prompt-tokens-details); lm-eval-harness' log-likelihood request (echo, logprobs=1,
max_tokens=0)."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

import stack

PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url, api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def details(live, tmp_path_factory):
    """A second front end on the same engine, with --enable-prompt-tokens-details."""
    fe, url = stack.start_frontend(live.engine, live.model, tmp_path_factory.mktemp("logs"),
                                   extra=("--enable-prompt-tokens-details",))
    yield openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
    fe.stop()


def _greedy_with_logprobs(client, live, prompt_ids, n_tokens):
    r = client.completions.create(model=live.name, prompt=prompt_ids, max_tokens=n_tokens,
                                  temperature=0, logprobs=1, extra_body={"ignore_eos": True,
                                                                         "return_tokens_as_token_ids": True})
    ids = [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens]
    return ids, r.choices[0].logprobs.token_logprobs


def test_echo_logprobs_are_a_teacher_forced_pass(client, live):
    prompt = httpx.post(f"{live.base}/tokenize", json={"model": live.name, "prompt": PROMPT},
                        timeout=30).json()["tokens"]
    generated, logprobs = _greedy_with_logprobs(client, live, prompt, 6)
    # The prompt and its continuation scored in one pass: lm-eval's log-likelihood request.
    r = client.completions.create(model=live.name, prompt=prompt + generated, max_tokens=0,
                                  echo=True, logprobs=1, temperature=0,
                                  extra_body={"return_tokens_as_token_ids": True})
    c = r.choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(prompt) + len(generated)  # the prompt alone: no new token
    assert [int(t.split(":")[1]) for t in lp.tokens] == prompt + generated
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first has none
    assert all(x is not None for x in lp.token_logprobs[1:])
    for got, want in zip(lp.token_logprobs[len(prompt):], logprobs):
        assert math.isclose(got, want, abs_tol=1e-3), (got, want)
    # Greedy continuation: each continuation token is its position's top 1 (lm-eval's is_greedy).
    for k in range(len(prompt), len(prompt) + len(generated)):
        top = lp.top_logprobs[k]
        assert max(top, key=top.get) == lp.tokens[k]
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert c.finish_reason == "length"
    assert r.usage.prompt_tokens == len(prompt) + len(generated)
    assert r.usage.completion_tokens == 0


def test_echo_text_whole_and_streamed(client, live):
    kw = dict(model=live.name, prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    plain = client.completions.create(**{**kw, "echo": False})
    r = client.completions.create(**kw)
    assert r.choices[0].text == PROMPT + plain.choices[0].text
    assert r.choices[0].logprobs is None
    chunks = list(client.completions.create(**kw, stream=True))
    texts = [ch.text for c in chunks for ch in c.choices]
    assert texts[0].startswith(PROMPT)  # the prompt comes first, in the first chunk
    assert "".join(texts) == r.choices[0].text
    # With logprobs: the prompt's tokens then the answer's, streamed the same as whole.
    whole = client.completions.create(**kw, logprobs=2)
    lp = whole.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == r.usage.prompt_tokens + 5
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])
    streamed = list(client.completions.create(**kw, logprobs=2, stream=True))
    tokens, token_lps = [], []
    for c in streamed:
        for ch in c.choices:
            if ch.logprobs is not None:
                tokens += ch.logprobs.tokens
                token_lps += ch.logprobs.token_logprobs
    assert tokens == lp.tokens
    assert token_lps[0] is None
    assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(token_lps[1:], lp.token_logprobs[1:]))


def test_prompt_logprobs_both_endpoints(client, live):
    r = client.completions.create(model=live.name, prompt=PROMPT, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    pl = r.choices[0].model_extra["prompt_logprobs"]
    assert len(pl) == r.usage.prompt_tokens and pl[0] is None
    echo = client.completions.create(model=live.name, prompt=PROMPT, max_tokens=0, echo=True,
                                     logprobs=2, extra_body={"return_tokens_as_token_ids": True})
    ids = [int(t.split(":")[1]) for t in echo.choices[0].logprobs.tokens]
    for k in range(1, len(pl)):
        entry = pl[k]
        own = entry[str(ids[k])]  # the prompt's own token, then up to 2 more
        assert 1 <= len(entry) <= 3
        assert math.isclose(own["logprob"], echo.choices[0].logprobs.token_logprobs[k], abs_tol=1e-5)
        assert own["rank"] >= 1 and isinstance(own["decoded_token"], str)
        best = min(entry.values(), key=lambda e: e["rank"])
        assert best["rank"] == 1 and all(e["logprob"] <= best["logprob"] + 1e-6 for e in entry.values())
    # Chat: vLLM's place for them is the response's top level.
    chat = client.chat.completions.create(model=live.name, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2, extra_body={"prompt_logprobs": 0})
    cpl = chat.model_extra["prompt_logprobs"]
    assert len(cpl) == chat.usage.prompt_tokens and cpl[0] is None
    assert all(len(e) == 1 for e in cpl[1:])  # 0: the prompt's token alone
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=live.name, prompt=PROMPT, max_tokens=2, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    assert e.value.body["param"] == "prompt_logprobs"


def test_several_prompts_with_n(client, live):
    prompts = ["Once upon a time", "The capital of France", "1 2 3"]
    kw = dict(model=live.name, max_tokens=4, temperature=1.0, seed=11)
    r = client.completions.create(prompt=prompts, n=2, **kw)
    assert [c.index for c in r.choices] == list(range(6))  # prompt by prompt, n each
    for i, p in enumerate(prompts):
        alone = client.completions.create(prompt=p, n=2, **kw)
        assert [c.text for c in r.choices[2 * i:2 * i + 2]] == [c.text for c in alone.choices]
    counts = [client.completions.create(prompt=p, max_tokens=1, model=live.name).usage.prompt_tokens
              for p in prompts]
    assert r.usage.prompt_tokens == sum(counts)  # each prompt once, not once per choice
    # Token-id prompts, echoed: each choice starts with its own prompt.
    ids = [[5, 6, 7], [8, 9]]
    e = client.completions.create(model=live.name, prompt=ids, n=2, max_tokens=0, echo=True,
                                  logprobs=0, extra_body={"return_tokens_as_token_ids": True})
    assert [c.logprobs.tokens for c in e.choices] == [[f"token_id:{t}" for t in ids[i // 2]]
                                                      for i in range(4)]
    streamed = list(client.completions.create(prompt=prompts, n=2, stream=True, **kw))
    got = {}
    for c in streamed:
        for ch in c.choices:
            got[ch.index] = got.get(ch.index, "") + ch.text
    assert [got[i] for i in range(6)] == [c.text for c in r.choices]


def test_cached_tokens_after_a_repeated_prompt(details, live):
    long_prompt = " ".join(["the rain in spain falls mainly on the plain"] * 8)
    first = details.completions.create(model=live.name, prompt=long_prompt, max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = details.completions.create(model=live.name, prompt=long_prompt, max_tokens=1)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached <= again.usage.prompt_tokens
    # Prompt logprobs need every position's logits: that request skips the cache.
    scored = details.completions.create(model=live.name, prompt=long_prompt, max_tokens=1,
                                        extra_body={"prompt_logprobs": 0})
    assert scored.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(details.completions.create(model=live.name, prompt=long_prompt, max_tokens=1,
                                             stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached


def test_max_tokens_zero_needs_echo(client, live):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=live.name, prompt=PROMPT, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"


def test_grpc_prompt_logprobs(live):
    """The Generator service's prompt_logprobs: prompt tokens 1.. once, with rank and top N, on
    the first message with tokens; the same values as the front end's echo."""
    from exl3serve_client import GenerateClient
    prompt = [5, 6, 7, 8, 9, 10, 11]
    with GenerateClient(live.engine) as g:
        r = g.generate(prompt, max_tokens=2, prompt_logprobs=3, ignore_eos=True)
        plain = g.generate(prompt, max_tokens=2, ignore_eos=True)
    assert [p[0] for p in r.prompt_logprobs] == prompt[1:]
    for token, logprob, rank, top in r.prompt_logprobs:
        assert len(top) == 3 and rank >= 1
        assert top == sorted(top, key=lambda e: -e[1])
        assert logprob <= top[0][1] + 1e-6
        assert (rank == 1) == (token == top[0][0]) or math.isclose(logprob, top[0][1])
    assert r.token_ids == plain.token_ids  # the continuation does not change
    assert r.usage.cached_tokens == 0
    assert plain.prompt_logprobs == []
