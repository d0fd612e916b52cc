"""The per-request speculative decoding switch (`num_speculative_tokens`, an extra body field passed
to the engine's GenerateRequest.num_speculative_tokens) through the real stack, driven by the
openai SDK: on a router with n-gram drafting (K = 3, adaptive draft length) 0 turns drafting off
for the request (the engine's draft counter does not move, the text is the same) and 1..3 cap it;
4, -1 and a non-integer are refused 400 naming the field; on the session's router without
speculative decoding 0 is taken and any other value refused 400, never ignored."""

from __future__ import annotations

import time

import openai
import pytest

import stack

# Prompt text that repeats: n-gram drafts (down to single tokens) find earlier occurrences.
PROMPT = "one two three four one two three four one two three four one two"
SPEC = ("--speculative-method", "ngram", "--num-speculative-tokens", "3", "--ngram-prompt-lookup-min", "1",
        "--ngram-prompt-lookup-max", "3", "--speculative-draft-length", "adaptive")
DRAFTS = "exl3_engine_spec_decode_num_draft_tokens_total"


@pytest.fixture(scope="module")
def spec(build_dir, model, tmp_path_factory):
    """A router with speculative decoding and a front end on it: (client, router metrics address)."""
    logs = tmp_path_factory.mktemp("spec-logs")
    router, engine, metrics = stack.start_router(build_dir, model, logs, extra=SPEC)
    try:
        fe, url = stack.start_frontend(engine, model, logs)
    except BaseException:
        router.stop()
        raise
    yield openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60), metrics
    fe.stop()
    router.stop()


def _complete(client, name, **extra):
    r = client.completions.create(model=name, prompt=PROMPT, max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True, **extra})
    return r.choices[0].text


def _drafts_after_refresh(metrics):
    time.sleep(0.6)  # the router refreshes its engine counters every 250 ms
    return stack.metric(metrics, DRAFTS)


def test_zero_turns_drafting_off_and_caps_keep_the_text(spec, model):
    client, metrics = spec
    name = model.name
    before = _drafts_after_refresh(metrics)
    off = _complete(client, name, num_speculative_tokens=0)
    assert _drafts_after_refresh(metrics) == before, "drafts verified for a request that turned them off"
    default = _complete(client, name)
    after_default = _drafts_after_refresh(metrics)
    assert after_default > before, "the server's default drafted nothing: the prompt should repeat"
    assert default == off
    for k in (1, 3):
        assert _complete(client, name, num_speculative_tokens=k) == off, f"num_speculative_tokens {k}"
    assert stack.metric(metrics, "exl3_engine_spec_decode_verify_step_seconds_count") > 0
    assert stack.metric(metrics, "exl3_engine_spec_decode_mean_draft_length") is not None
    # Chat takes the field too.
    r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": PROMPT}], max_tokens=4,
                                       temperature=0, extra_body={"num_speculative_tokens": 0})
    assert r.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("value", [4, -1, 2.5, "x"])
def test_out_of_range_is_refused_naming_the_field(spec, model, value):
    client, _ = spec
    with pytest.raises(openai.BadRequestError) as e:
        _complete(client, model.name, num_speculative_tokens=value)
    assert e.value.body["param"] == "num_speculative_tokens", e.value.body
    if value == 4:
        assert "num_speculative_tokens must be in [0, 3]" in e.value.body["message"], e.value.body


def test_a_server_without_speculation_refuses_a_cap(live):
    client = openai.OpenAI(base_url=live.url, api_key="none", max_retries=0, timeout=60)
    assert _complete(client, live.name, num_speculative_tokens=0)  # what it does anyway
    with pytest.raises(openai.BadRequestError) as e:
        _complete(client, live.name, num_speculative_tokens=2)
    assert e.value.body["param"] == "num_speculative_tokens", e.value.body
    assert "without speculative decoding" in e.value.body["message"], e.value.body
