"""Structured output and logit_bias through the whole stack (the openai SDK, exl3serve-openai, the
real exl3-router with the random-weight test model and its tokenizer): every constrained answer
parses and matches its constraint because the engine masks the tokens that would break it
(structured_output.py, engine/sampling/token_constraint.h)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import stack  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "member"],
}
HI = [{"role": "user", "content": "Describe a person as JSON."}]


def check_person(text: str) -> None:
    """SCHEMA's checks: json.loads (strict: no raw control characters) and each property."""
    doc = json.loads(text)
    assert isinstance(doc, dict) and set(doc) == {"name", "age", "tags", "member"}, text
    assert isinstance(doc["name"], str) and len(doc["name"]) <= 8, text
    assert isinstance(doc["age"], int) and not isinstance(doc["age"], bool), text
    assert 0 <= doc["age"] <= 150, text
    assert isinstance(doc["tags"], list) and len(doc["tags"]) <= 3, text
    assert all(t in ("a", "b", "c") for t in doc["tags"]), text
    assert isinstance(doc["member"], bool), text


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url, api_key="none", max_retries=0, timeout=120)


def test_json_schema_holds_in_100_of_100_sampled_answers(client, live):
    texts = []
    for seed in range(10):
        r = client.chat.completions.create(
            model=live.name, messages=HI, max_tokens=200, temperature=1.0, seed=seed, n=10,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}})
        for c in r.choices:
            assert c.finish_reason == "stop", c
            texts.append(c.message.content)
    assert len(texts) == 100
    for t in texts:
        check_person(t)
    assert len(set(texts)) > 10  # sampled, not one answer forced


def test_json_schema_streamed(client, live):
    stream = client.chat.completions.create(
        model=live.name, messages=HI, max_tokens=200, temperature=1.0, seed=7, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})
    text, finish = "", None
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert finish == "stop"
    check_person(text)


def test_json_object(client, live):
    for seed in range(4):
        r = client.chat.completions.create(model=live.name, messages=HI, max_tokens=300,
                                           temperature=0.7, seed=seed,
                                           response_format={"type": "json_object"})
        if r.choices[0].finish_reason == "stop":  # an object may run past max_tokens
            assert isinstance(json.loads(r.choices[0].message.content), dict)
        else:
            assert r.choices[0].message.content.startswith("{")


def test_structured_outputs_regex_and_choice(client, live):
    for seed in range(4):
        r = client.completions.create(model=live.name, prompt="Code:", max_tokens=30, seed=seed,
                                      temperature=1.0,
                                      extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}})
        assert re.fullmatch("[A-Z]{2}-[0-9]{3}", r.choices[0].text), r.choices[0].text
        assert r.choices[0].finish_reason == "stop"
        r = client.chat.completions.create(
            model=live.name, messages=HI, max_tokens=30, seed=seed, temperature=1.0,
            extra_body={"structured_outputs": {"choice": ["red", "green", "dark blue"]}})
        assert r.choices[0].message.content in ("red", "green", "dark blue")


def test_guided_fields(client, live):
    r = client.completions.create(model=live.name, prompt="x", max_tokens=200, seed=3,
                                  temperature=1.0, extra_body={"guided_json": SCHEMA})
    check_person(r.choices[0].text)
    r = client.completions.create(model=live.name, prompt="x", max_tokens=20, seed=3,
                                  temperature=1.0, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no")
    r = client.completions.create(model=live.name, prompt="x", max_tokens=20, seed=3,
                                  temperature=1.0, stream=True,
                                  extra_body={"guided_regex": "(ab)+c"})
    assert re.fullmatch("(ab)+c", "".join(c.choices[0].text for c in r if c.choices))
    r = client.completions.create(model=live.name, prompt="x", max_tokens=20, seed=3,
                                  temperature=1.0,
                                  extra_body={"guided_grammar": 'root ::= "go " ("left" | "right")'})
    assert r.choices[0].text in ("go left", "go right")


@pytest.mark.parametrize("extra,says", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}},
     "json_schema constraint"),
    ({"guided_regex": "(ab"}, "regex constraint"),
    ({"guided_grammar": "root ::= missing_rule"}, "grammar constraint"),
], ids=["schema", "regex", "grammar"])
def test_what_does_not_compile_is_a_400(client, live, extra, says):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=live.name, messages=HI, max_tokens=5,
                                           stream=stream, extra_body=extra)
        err = e.value.body
        assert e.value.status_code == 400 and err["type"] == "invalid_request_error", err
        assert says in err["message"], err


def test_two_constraints_are_refused_naming_both(client, live):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=live.name, messages=HI, max_tokens=5, response_format={"type": "json_object"},
            extra_body={"guided_regex": "a+"})
    assert "response_format" in e.value.body["message"]
    assert "guided_regex" in e.value.body["message"]


def test_logit_bias_forces_and_bans(client, live):
    def ids(r):
        return [int(t.split(":")[1]) for t in r.choices[0].logprobs.tokens]

    forced = client.completions.create(model=live.name, prompt="Hello", max_tokens=6,
                                       temperature=1.0, seed=1, logprobs=0,
                                       logit_bias={"300": 100},
                                       extra_body={"ignore_eos": True,
                                                   "return_tokens_as_token_ids": True})
    assert ids(forced) == [300] * 6
    plain = client.completions.create(model=live.name, prompt="Hello", max_tokens=6,
                                      temperature=0, logprobs=0,
                                      extra_body={"ignore_eos": True,
                                                  "return_tokens_as_token_ids": True})
    banned = set(ids(plain))
    again = client.completions.create(model=live.name, prompt="Hello", max_tokens=6,
                                      temperature=0, logprobs=0,
                                      logit_bias={str(t): -100 for t in banned},
                                      extra_body={"ignore_eos": True,
                                                  "return_tokens_as_token_ids": True})
    assert not banned & set(ids(again))
    # Chat: the same through the chat endpoint.
    r = client.chat.completions.create(model=live.name, messages=HI, max_tokens=4, seed=2,
                                       temperature=1.0, logit_bias={"300": 100}, logprobs=True,
                                       extra_body={"ignore_eos": True,
                                                   "return_tokens_as_token_ids": True})
    assert [c.token for c in r.choices[0].logprobs.content] == ["token_id:300"] * 4


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object",
                                                                       "properties": {}}}}


@pytest.fixture(scope="module")
def qwen_live(build_dir, tmp_path_factory):
    """A second live stack on a Qwen3-MoE test model: its template writes hermes tool calls."""
    tmp = tmp_path_factory.mktemp("qwen")
    model = stack.make_model(build_dir, tmp / "qwen-test", arch="qwen3_moe")
    router, engine, _ = stack.start_router(build_dir, model, tmp)
    try:
        fe, url = stack.start_frontend(engine, model, tmp)
    except BaseException:
        router.stop()
        raise
    yield openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120), model.name
    fe.stop()
    router.stop()


def check_weather_call(call) -> None:
    assert call.type == "function" and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "days"}, args
    assert isinstance(args["city"], str) and len(args["city"]) <= 12, args
    assert isinstance(args["days"], int) and 1 <= args["days"] <= 7, args


def test_tool_choice_holds_the_call_to_the_schema(qwen_live):
    """tool_choice required / a named function with hermes calls: every answer is one call (or,
    under required with parallel_tool_calls, one or more) of an offered function whose arguments
    match its schema, streamed and not, whatever the random-weight model prefers."""
    client, name = qwen_live
    ask = [{"role": "user", "content": "Weather in Bern for 3 days?"}]
    seen = set()
    for seed, parallel in [(seed, True) for seed in range(8)] + [(seed, False) for seed in range(4)]:
        r = client.chat.completions.create(model=name, messages=ask, tools=[WEATHER, NOW],
                                           tool_choice="required", max_tokens=2000, seed=seed,
                                           temperature=1.0, parallel_tool_calls=parallel)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) >= 1, c
        assert parallel or len(c.message.tool_calls) == 1, c
        for call in c.message.tool_calls:
            seen.add(call.function.name)
            if call.function.name == "now":
                assert json.loads(call.function.arguments) == {}
            else:
                check_weather_call(call)
    assert seen == {"get_weather", "now"}
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        r = client.chat.completions.create(model=name, messages=ask, tools=[WEATHER, NOW],
                                           tool_choice=named, max_tokens=120, seed=seed,
                                           temperature=1.0)
        assert r.choices[0].finish_reason == "tool_calls"
        check_weather_call(r.choices[0].message.tool_calls[0])
    chunks = list(client.chat.completions.create(model=name, messages=ask, tools=[WEATHER, NOW],
                                                 tool_choice=named, max_tokens=120, seed=5,
                                                 temperature=1.0, stream=True))
    arguments = "".join(tc.function.arguments or "" for ch in chunks for c in ch.choices
                        for tc in c.delta.tool_calls or [])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    args = json.loads(arguments)
    assert set(args) == {"city", "days"} and 1 <= args["days"] <= 7
