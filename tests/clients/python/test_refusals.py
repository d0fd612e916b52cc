"""Request fields vLLM honours that this front end does not: each is refused 400 with the field
named in OpenAI's error body (`param`), never accepted and ignored. Values that change nothing
(vLLM's defaults) are still taken. Driven by the openai SDK against the live stack."""

from __future__ import annotations

import openai
import pytest

HI = [{"role": "user", "content": "Hello"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

# Fields both endpoints refuse, with a value that would change the answer (vLLM's protocol names).
BOTH = [
    # Structured output this server does not do (what it does: test_structured_output.py).
    ("guided_decoding_backend", "outlines"),
    ("guided_whitespace_pattern", " "),
    ("structured_outputs", {"whitespace_pattern": " "}),
    # Structural tags without a format (or structures and triggers).
    ("structural_tag", "{}"),
    ("structured_outputs", {"structural_tag": "{}"}),
    ("structured_outputs", "json"),
    ("response_format", {"type": "grammar"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x"}}),
    ("guided_json", 5),
    ("guided_regex", ""),
    ("guided_choice", []),
    ("guided_choice", ["a", 1]),
    ("n", 17),  # above --max-n (default 16)
    ("n", 0),
    ("best_of", 2),
    ("use_beam_search", True),
    ("length_penalty", 0.5),
    ("logit_bias", {"x": 10}),
    ("logit_bias", {"5": 100.5}),
    ("logit_bias", {"-1": 1}),
    ("logit_bias", {"512": 1}),  # the test model's vocabulary is 512 tokens: the engine refuses
    ("include_stop_str_in_output", True),
    ("skip_special_tokens", False),
    ("spaces_between_special_tokens", False),
    ("truncate_prompt_tokens", 4),
    ("allowed_token_ids", [1, 2, 3]),
    ("bad_words", ["x"]),
    ("logits_processors", ["a.b"]),
    ("priority", 1),
    ("return_token_ids", True),
    ("cache_salt", "s"),
    ("kv_transfer_params", {"do_remote_prefill": True}),
    ("vllm_xargs", {"k": 1}),
    ("stream_options", {"include_usage": True, "continuous_usage_stats": True}),
    ("max_repetition_pattern_size", 4),
    ("min_repetition_pattern_size", 2),
    ("repetition_min_count", 3),
]
CHAT_ONLY = [
    # Without tools (with them: test_tool_call_api.py, test_structured_output.py).
    ("tool_choice", "required"),
    ("tool_choice", {"type": "function", "function": {"name": "f"}}),
    ("functions", [TOOL["function"]]),
    ("function_call", "auto"),
    ("echo", True),
    ("continue_final_message", True),
    ("documents", [{"title": "t", "text": "x"}]),
    ("chat_template", "{{ messages }}"),
    ("mm_processor_kwargs", {"a": 1}),
    ("reasoning_effort", "extreme"),  # low, medium, high only (test_reasoning_api.py)
    ("include_reasoning", False),  # without --reasoning-parser
]
COMPLETION_ONLY = [
    ("suffix", "tail"),
    ("prompt_embeds", "AAAA"),
]

# Values that change nothing: accepted (200).
NO_OPS = [
    ("n", 1), ("best_of", None), ("use_beam_search", False), ("length_penalty", 1.0),
    ("logit_bias", {}), ("prompt_logprobs", None), ("include_stop_str_in_output", False),
    ("skip_special_tokens", True), ("spaces_between_special_tokens", True),
    ("allowed_token_ids", None), ("bad_words", []), ("priority", 0), ("return_token_ids", False),
    ("guided_json", None), ("structured_outputs", None), ("response_format", {"type": "text"}),
    ("guided_decoding_backend", "xgrammar"), ("structured_outputs", {"disable_fallback": True}),
    ("stream_options", {"include_usage": False, "continuous_usage_stats": False}),
    ("max_repetition_pattern_size", 0), ("min_repetition_pattern_size", 0),
    ("repetition_min_count", 0),
]
CHAT_NO_OPS = [("tool_choice", "none"), ("tool_choice", "auto"), ("parallel_tool_calls", True),
               ("tools", []), ("echo", False), ("continue_final_message", False),
               ("include_reasoning", True), ("reasoning_effort", None),
               ("add_special_tokens", False)]


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url, api_key="none", max_retries=0, timeout=60)


def _chat(client, live, field, value, **kw):
    return client.chat.completions.create(model=live.name, messages=HI, max_tokens=2,
                                          extra_body={field: value}, **kw)


def _completion(client, live, field, value, **kw):
    return client.completions.create(model=live.name, prompt="Hello", max_tokens=2,
                                     extra_body={field: value}, **kw)


def _refused(call, field):
    with pytest.raises(openai.BadRequestError) as e:
        call()
    err = e.value.body
    assert e.value.status_code == 400
    assert err["param"] is not None and err["param"].split(".")[0] == field, err
    assert field in err["message"] and err["type"] == "invalid_request_error", err


@pytest.mark.parametrize("field,value", BOTH + CHAT_ONLY, ids=lambda x: str(x)[:40])
def test_chat_refuses(client, live, field, value):
    _refused(lambda: _chat(client, live, field, value), field)
    # Streamed the same: refused before the stream starts.
    _refused(lambda: _chat(client, live, field, value, stream=True), field)


@pytest.mark.parametrize("field,value", BOTH + COMPLETION_ONLY, ids=lambda x: str(x)[:40])
def test_completions_refuse(client, live, field, value):
    _refused(lambda: _completion(client, live, field, value), field)
    _refused(lambda: _completion(client, live, field, value, stream=True), field)


@pytest.mark.parametrize("field,value", NO_OPS + CHAT_NO_OPS, ids=lambda x: str(x)[:40])
def test_chat_takes_values_that_change_nothing(client, live, field, value):
    r = _chat(client, live, field, value)
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("field,value", NO_OPS + [("echo", False), ("suffix", None),
                                                   ("add_special_tokens", True)],
                         ids=lambda x: str(x)[:40])
def test_completions_take_values_that_change_nothing(client, live, field, value):
    r = _completion(client, live, field, value)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_unknown_fields_of_no_server_are_ignored(client, live):
    """A field neither OpenAI's API nor vLLM's knows is ignored, as both servers ignore it."""
    r = _chat(client, live, "x_some_client_tag", 1)
    assert r.choices[0].finish_reason in ("stop", "length")
