"""Tool calls through the real exl3serve-openai process, driven by the openai SDK, for each family
whose chat template writes tool calls (Qwen's hermes format, GLM-4.5's tags, DeepSeek-V3's,
DeepSeek-V4's DSML, and Qwen3-Coder's tags on a Qwen tokenizer given a template in their layout,
qwen3_coder_template.py). The
engine is the
fake of fake_engine.py, so that the model's output can be chosen: each request's reply is the
tokens of a text written in the family's format. A round trip (request -> tool_calls -> the tool's
result -> the answer), streamed and not; the prompt the engine gets holds the tools, the call and
the result as the template renders them."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import httpx
import openai
import pytest
from exl3serve.v1 import exl3serve_pb2 as pb

import stack
from exl3serve_client.frontend.text import ModelTokenizer
from fake_engine import FakeEngine, ThreadedServer
from qwen3_coder_template import with_qwen3_coder_template

ROOT = Path(__file__).resolve().parents[3]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object",
                                                                       "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Zürich for 2 days?"}]


def tool_result_text(family, content):
    """A tool's result as the family's template renders it."""
    if family == "deepseek_v3":
        return f"<｜tool▁output▁begin｜>{content}<｜tool▁output▁end｜>"
    if family == "deepseek_v4":  # thinking mode (the template's default): the answer opens <think>
        return f"<｜User｜><tool_result>{content}</tool_result><｜Assistant｜><think>"
    return f"<tool_response>\n{content}\n</tool_response>"


def call_text(family, name, arguments):
    """A call as the family's model writes it."""
    if family == "deepseek_v3":
        return ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>" + name +
                "\n```json\n" + json.dumps(arguments, ensure_ascii=False) +
                "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    if family == "deepseek_v4":  # after the content, "\n\n" and the block (DeepSeek's encoding)
        params = "\n".join(
            f'<｜DSML｜parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
            f'{v if isinstance(v, str) else json.dumps(v)}</｜DSML｜parameter>'
            for k, v in arguments.items())
        return (f'\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="{name}">\n{params}\n'
                "</｜DSML｜invoke>\n</｜DSML｜tool_calls>")
    if family == "qwen3_coder":
        params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n"
                         "</parameter>\n" for k, v in arguments.items())
        return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"
    if family == "qwen3_moe":
        return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments},
                                            ensure_ascii=False) + "\n</tool_call>"
    args = "".join(f"\n<arg_key>{k}</arg_key>\n<arg_value>"
                   f"{v if isinstance(v, str) else json.dumps(v)}</arg_value>"
                   for k, v in arguments.items())
    return f"<tool_call>{name}{args}\n</tool_call>"


class Fake:
    def __init__(self, family, engine, fe, url, model):
        self.family, self.engine, self.fe, self.url, self.model = family, engine, fe, url, model
        self.tok = ModelTokenizer(model)
        self.client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=30)

    def replies(self, text):
        """The request id whose answer is `text` (the engine's tokens of it)."""
        rid = uuid.uuid4().hex
        ids = self.tok.encode(text, add_special_tokens=False)
        assert self.tok.decode(ids) == text
        self.engine.replies["chatcmpl-" + rid] = ids
        return {"X-Request-Id": rid}

    def last_prompt(self):
        return self.tok.decode(list(self.engine.starts[-1].prompt_token_ids),
                               skip_special_tokens=False)


def _start(tmp, family, extra=()):
    model = tmp / family
    if family == "qwen3_coder":  # Qwen's tokenizer, a template of Qwen3-Coder's calls
        shutil.copytree(ROOT / "tests/fixtures/tokenizer/qwen3_moe", model)
        with_qwen3_coder_template(model)
    else:
        shutil.copytree(ROOT / "tests/fixtures/tokenizer" / family, model)
    engine = FakeEngine(step_s=0.002)
    server = ThreadedServer(engine).start()
    try:
        fe, url = stack.start_frontend(server.target, model, tmp / "logs", extra=extra)
    except BaseException:
        server.close()
        raise
    return Fake(family, engine, fe, url, model), server


@pytest.fixture(scope="module", params=["qwen3_moe", "glm4_moe", "deepseek_v3", "deepseek_v4",
                                        "qwen3_coder"])
def fake(request, tmp_path_factory):
    f, server = _start(tmp_path_factory.mktemp(f"tools-{request.param}"), request.param)
    yield f
    f.fe.stop()
    server.close()


def _stream(fake, text, **kw):
    """A streamed answer: (content, {index: [id, name, arguments]}, finish, order of deltas)."""
    chunks = fake.client.chat.completions.create(
        model="fake", messages=kw.pop("messages", ASK), tools=[WEATHER, NOW], stream=True,
        extra_headers=fake.replies(text), **kw)
    content, calls, finish, order = "", {}, None, []
    for c in chunks:
        d = c.choices[0].delta
        if d.content:
            content += d.content
            order.append("content")
        for tc in d.tool_calls or []:
            if tc.id is not None:  # a call's first delta: id, type and name
                assert tc.index not in calls and tc.type == "function" and tc.function.name
                calls[tc.index] = [tc.id, tc.function.name, tc.function.arguments or ""]
                order.append(f"start {tc.index}")
            else:
                assert tc.function.name is None
                calls[tc.index][2] += tc.function.arguments
                order.append(f"args {tc.index}")
        if c.choices[0].finish_reason:
            finish = c.choices[0].finish_reason
    return content, calls, finish, order


def test_round_trip(fake):
    said = "Let me look that up.\n" + call_text(fake.family, "get_weather",
                                                {"city": "Zürich", "days": 2})
    r = fake.client.chat.completions.create(model="fake", messages=ASK, tools=[WEATHER, NOW],
                                            extra_headers=fake.replies(said))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look that up."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Zürich", "days": 2}
    # The template got the tools.
    prompt = fake.last_prompt()
    assert ("<tools>" in prompt or "## Tools" in prompt)
    assert '"name": "get_weather"' in prompt or "<name>get_weather</name>" in prompt
    # The tool's result goes back; the model answers.
    messages = ASK + [choice.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 °C"}]
    r2 = fake.client.chat.completions.create(model="fake", messages=messages,
                                             tools=[WEATHER, NOW],
                                             extra_headers=fake.replies("Sunny, 21 °C."))
    assert (r2.choices[0].message.content, r2.choices[0].finish_reason) == ("Sunny, 21 °C.", "stop")
    assert r2.choices[0].message.tool_calls is None
    prompt = fake.last_prompt()
    assert call_text(fake.family, "get_weather", {"city": "Zürich", "days": 2}) in prompt
    assert tool_result_text(fake.family, "sunny, 21 °C") in prompt


def test_round_trip_streamed(fake):
    said = "Checking.\n" + call_text(fake.family, "get_weather", {"city": "Zürich", "days": 2})
    content, calls, finish, order = _stream(fake, said)
    assert (content, finish) == ("Checking.", "tool_calls")
    [(cid, name, arguments)] = calls.values()
    assert cid.startswith("call_") and name == "get_weather"
    assert json.loads(arguments) == {"city": "Zürich", "days": 2}
    # Content first, then the call's start, then its arguments in fragments.
    assert order[0] == "content" and order.index("start 0") < order.index("args 0")
    assert order.count("args 0") >= 2
    messages = ASK + [{"role": "assistant", "content": content, "tool_calls": [
        {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": cid, "content": "sunny"}]
    content, calls, finish, _ = _stream(fake, "Sunny.", messages=messages)
    assert (content, calls, finish) == ("Sunny.", {}, "stop")


def test_tool_results_in_the_order_of_the_calls(fake):
    """Two calls of one assistant turn answered in the other order: DeepSeek-V4's prompt has the
    results in the order of the calls (its encoding sorts them by call id; user text in the same
    turn keeps its place), the other families' keep the messages' order; through /tokenize too."""
    calls = [{"id": "call_b", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
             {"id": "call_a", "type": "function", "function": {"name": "now", "arguments": "{}"}}]
    messages = ASK + [{"role": "assistant", "content": "", "tool_calls": calls},
                      {"role": "tool", "tool_call_id": "call_a", "content": "noon"},
                      {"role": "user", "content": "(both done)"},
                      {"role": "tool", "tool_call_id": "call_b", "content": "rain"}]
    fake.client.chat.completions.create(model="fake", messages=messages, tools=[WEATHER, NOW],
                                        extra_headers=fake.replies("ok"))
    prompt = fake.last_prompt()
    rain, noon = prompt.index("rain"), prompt.index("noon")
    if fake.family == "deepseek_v4":
        assert "<｜User｜><tool_result>rain</tool_result>\n\n(both done)\n\n" \
            "<tool_result>noon</tool_result><｜Assistant｜>" in prompt
    else:
        assert noon < prompt.index("(both done)") < rain
    base = fake.url[: -len("/v1")]
    r = httpx.post(f"{base}/tokenize", json={"model": "fake", "messages": messages,
                                             "tools": [WEATHER, NOW]}, timeout=30)
    assert r.status_code == 200
    assert fake.tok.encode(prompt, add_special_tokens=False) == r.json()["tokens"]


def test_a_result_of_an_unknown_call_is_refused(fake):
    """A tool message whose tool_call_id names no call of the assistant message before it (or
    with no assistant message before it) is refused 400 naming the field."""
    call = {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}
    cases = [(ASK + [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
                     {"role": "tool", "tool_call_id": "call_9", "content": "?"}], 3),
             (ASK + [{"role": "tool", "tool_call_id": "call_1", "content": "noon"}], 1),
             (ASK + [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
                     {"role": "assistant", "content": "It is noon."},
                     {"role": "tool", "tool_call_id": "call_1", "content": "again"}], 4)]
    for messages, at in cases:
        with pytest.raises(openai.BadRequestError) as e:
            fake.client.chat.completions.create(model="fake", messages=messages,
                                                tools=[WEATHER, NOW])
        err = e.value.body
        assert err["param"] == f"messages[{at}].tool_call_id", err
        assert f"messages[{at}].tool_call_id" in err["message"]


def test_parallel_calls_and_not(fake):
    said = call_text(fake.family, "now", {}) + "\n" + call_text(fake.family, "get_weather",
                                                                  {"city": "Oslo"})
    r = fake.client.chat.completions.create(model="fake", messages=ASK, tools=[WEATHER, NOW],
                                            extra_headers=fake.replies(said))
    calls = r.choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [("now", {}), ("get_weather", {"city": "Oslo"})]
    assert r.choices[0].message.content is None and len({c.id for c in calls}) == 2
    _, streamed, finish, _ = _stream(fake, said)
    assert [(n, json.loads(a)) for _, n, a in streamed.values()] == \
        [("now", {}), ("get_weather", {"city": "Oslo"})] and finish == "tool_calls"
    r = fake.client.chat.completions.create(model="fake", messages=ASK, tools=[WEATHER, NOW],
                                            parallel_tool_calls=False,
                                            extra_headers=fake.replies(said))
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["now"]


def test_tool_choice_none_and_plain_answers(fake):
    said = call_text(fake.family, "now", {})
    r = fake.client.chat.completions.create(model="fake", messages=ASK, tools=[WEATHER, NOW],
                                            tool_choice="none", extra_headers=fake.replies(said))
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (said, "stop")
    assert r.choices[0].message.tool_calls is None
    # With tools but no call: the text as it is, whitespace included.
    plain = "  No call <here>, a < b.\n\n"
    r = fake.client.chat.completions.create(model="fake", messages=ASK, tools=[WEATHER],
                                            extra_headers=fake.replies(plain))
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (plain, "stop")
    content, calls, finish, _ = _stream(fake, plain)
    assert (content, calls, finish) == (plain, {}, "stop")


def test_developer_role_and_refusals(fake):
    r = fake.client.chat.completions.create(
        model="fake", messages=[{"role": "developer", "content": "Be terse."}] + ASK,
        tools=[WEATHER], extra_headers=fake.replies("ok"))
    assert r.choices[0].message.content == "ok"
    assert "Be terse." in fake.last_prompt()
    for choice in ["required", {"type": "function", "function": {"name": "now"}}]:
        # The engine request carries the call's constraint (the fake engine answers what it is
        # told, constraint or not): hermes' tagged JSON, one alternative per function the answer
        # may call; glm45's structural tag (test_tool_call_constraints.py runs both on models).
        r = fake.client.chat.completions.create(
            model="fake", messages=ASK, tools=[NOW, WEATHER], tool_choice=choice,
            extra_headers=fake.replies(call_text(fake.family, "now", {})))
        assert r.choices[0].finish_reason == "tool_calls"
        assert r.choices[0].message.tool_calls[0].function.name == "now"
        sampling = fake.engine.starts[-1].sampling
        if fake.family == "deepseek_v3":
            assert sampling.WhichOneof("constraint") == "structural_tag"
            tag = sampling.structural_tag.json
            assert "<｜tool▁call▁begin｜>function<｜tool▁sep｜>now" in tag
            assert ("<｜tool▁sep｜>get_weather" in tag) == (choice == "required")
            continue
        if fake.family == "qwen3_coder":
            assert sampling.WhichOneof("constraint") == "structural_tag"
            assert sampling.structural_tag.json_layout == pb.JSON_LAYOUT_COMPACT
            tag = sampling.structural_tag.json
            assert json.dumps("<tool_call>\n<function=now>\n") in tag
            assert (json.dumps("<tool_call>\n<function=get_weather>\n") in tag) == \
                (choice == "required")
            continue
        if fake.family == "deepseek_v4":
            assert sampling.WhichOneof("constraint") == "structural_tag"
            assert sampling.structural_tag.json_layout == pb.JSON_LAYOUT_COMPACT
            tag = sampling.structural_tag.json
            assert '<｜DSML｜invoke name=\\"now\\">' in tag
            assert ('<｜DSML｜invoke name=\\"get_weather\\">' in tag) == (choice == "required")
            assert "\\n\\n<｜DSML｜tool_calls>\\n" in tag
            continue
        if fake.family == "glm4_moe":
            assert sampling.WhichOneof("constraint") == "structural_tag"
            assert sampling.structural_tag.json_layout == pb.JSON_LAYOUT_COMPACT
            tag = json.loads(sampling.structural_tag.json)
            calls = tag["format"]["content"] if choice == "required" else tag["format"]
            assert tag["format"]["type"] == ("plus" if choice == "required" else "sequence")
            heads = [c["elements"][0]["value"] for c in calls["elements"]] \
                if choice == "required" else [calls["elements"][0]["value"]]
            assert heads == (["\n<tool_call>now", "\n<tool_call>get_weather"]
                             if choice == "required" else ["\n<tool_call>now"])
            continue
        # hermes: one call, or under required one or more joined by "\n" as Qwen's templates write them.
        assert sampling.WhichOneof("constraint") == "structural_tag"
        assert sampling.structural_tag.json_layout == pb.JSON_LAYOUT_COMPACT
        tag = json.loads(sampling.structural_tag.json)["format"]
        one = tag["elements"][0] if choice == "required" else tag
        calls = one["elements"] if choice == "required" else [one]
        heads = [c["elements"][0]["value"] for c in calls]
        assert heads == (['<tool_call>\n{"name": "now", "arguments": ',
                          '<tool_call>\n{"name": "get_weather", "arguments": ']
                         if choice == "required" else ['<tool_call>\n{"name": "now", "arguments": '])
        assert all(c["elements"][2]["value"] == "}\n</tool_call>" for c in calls)
        weather = calls[-1]["elements"][1]["json_schema"]
        assert weather == (WEATHER["function"]["parameters"] if choice == "required"
                           else NOW["function"]["parameters"])
        if choice == "required":
            assert tag["elements"][1]["type"] == "star"
            assert tag["elements"][1]["content"]["elements"][0]["value"] == "\n"
    for choice, says in [({"type": "function", "function": {"name": "nope"}}, "not among"),
                         ({"type": "function"}, "tool_choice must be"), ("any", "not 'any'")]:
        with pytest.raises(openai.BadRequestError) as e:
            fake.client.chat.completions.create(model="fake", messages=ASK, tools=[NOW],
                                                tool_choice=choice)
        assert e.value.body["param"] == "tool_choice" and says in e.value.body["message"], e
    with pytest.raises(openai.BadRequestError) as e:
        fake.client.chat.completions.create(model="fake", messages=ASK, tool_choice="required")
    assert e.value.body["param"] == "tool_choice" and "needs tools" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        fake.client.chat.completions.create(model="fake", messages=ASK, tools=[NOW],
                                            tool_choice="required",
                                            response_format={"type": "json_object"})
    assert "response_format" in e.value.body["message"]
    assert "tool_choice" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        fake.client.chat.completions.create(model="fake", messages=ASK,
                                            tools=[{"type": "function", "function": {}}])
    assert e.value.body["param"] == "tools" and "tools[0]" in e.value.body["message"]
    bad_call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "now", "arguments": "[1"}}]}
    with pytest.raises(openai.BadRequestError) as e:
        fake.client.chat.completions.create(model="fake", messages=ASK + [bad_call], tools=[NOW])
    assert e.value.body["param"] == "messages" and "arguments" in e.value.body["message"]


def test_a_template_without_tool_calls_refuses_tools(tmp_path):
    """Mixtral's template writes no tool calls: tools are refused unless a parser is named."""
    f, server = _start(tmp_path, "mixtral")
    try:
        with pytest.raises(openai.BadRequestError) as e:
            f.client.chat.completions.create(model="fake", messages=ASK, tools=[NOW])
        assert e.value.body["param"] == "tools" and "--tool-call-parser" in e.value.body["message"]
        r = f.client.chat.completions.create(model="fake", messages=ASK, tools=[NOW],
                                             tool_choice="none", extra_headers=f.replies("hi"))
        assert r.choices[0].message.content == "hi"
    finally:
        f.fe.stop()
        server.close()


def test_qwen3_xml_parser_name(tmp_path):
    """--tool-call-parser qwen3_xml (vLLM's other parser of Qwen3-Coder's calls) reads them as
    qwen3_coder: a call without its <tool_call> wrapper and a parameter without </parameter>
    included, streamed and not."""
    f, server = _start(tmp_path, "qwen3_coder", extra=("--tool-call-parser", "qwen3_xml"))
    said = ("Checking.\n<function=get_weather>\n<parameter=city>\nZürich\n<parameter=days>\n2\n"
            "</function>")
    try:
        r = f.client.chat.completions.create(model="fake", messages=ASK, tools=[WEATHER],
                                             extra_headers=f.replies(said))
        m = r.choices[0].message
        assert (m.content, r.choices[0].finish_reason) == ("Checking.", "tool_calls")
        assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == \
            [("get_weather", {"city": "Zürich", "days": 2})]
        content, calls, finish, _ = _stream(f, said)
        assert (content, finish) == ("Checking.", "tool_calls")
        assert [(name, json.loads(args)) for _, name, args in calls.values()] == \
            [("get_weather", {"city": "Zürich", "days": 2})]
    finally:
        f.fe.stop()
        server.close()


def test_tools_on_the_real_stack(live):
    """exl3-router's random-weight model (GLM's template): tools and a tool round trip are
    rendered into the prompt and answered, streamed and not, whatever the model writes."""
    client = openai.OpenAI(base_url=live.url, api_key="none", max_retries=0, timeout=60)
    plain = client.chat.completions.create(model=live.name, messages=ASK, max_tokens=4)
    r = client.chat.completions.create(model=live.name, messages=ASK, tools=[WEATHER, NOW],
                                       max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 20  # the tools' descriptions
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Zürich", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r2 = client.chat.completions.create(model=live.name, messages=messages, tools=[WEATHER, NOW],
                                        max_tokens=4, temperature=0)
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens
    chunks = list(client.chat.completions.create(model=live.name, messages=messages,
                                                 tools=[WEATHER, NOW], max_tokens=4,
                                                 temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason == r2.choices[0].finish_reason
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        (r2.choices[0].message.content or "")


def test_tokenize_renders_tools(fake):
    """/tokenize's messages with tools count what the chat request's prompt holds."""
    import httpx
    base = fake.url[: -len("/v1")]
    r = fake.client.chat.completions.create(model="fake", messages=ASK, tools=[WEATHER],
                                            extra_headers=fake.replies("ok"))
    t = httpx.post(f"{base}/tokenize", json={"model": "fake", "messages": ASK,
                                             "tools": [WEATHER]}, timeout=30).json()
    assert t["count"] == r.usage.prompt_tokens
    plain = httpx.post(f"{base}/tokenize", json={"model": "fake", "messages": ASK},
                       timeout=30).json()
    assert plain["count"] < t["count"]
