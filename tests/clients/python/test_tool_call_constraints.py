"""Forced tool calls (tool_choice required / a named function) in the formats whose calls are
structural tags (glm45, qwen3_coder, deepseek_v3, deepseek_v31, deepseek_v4's DSML:
frontend/tool_call_grammar.py), structural tags
in response_format, and constraints after the reasoning (--reasoning-parser), through the whole
stack: the openai SDK, exl3serve-openai, the real exl3-router with a random-weight test model. The
random model prefers nothing in particular, so every answer that parses into calls whose arguments
validate does so because the engine's mask forces it (N of N sampled generations)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import openai
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import stack  # noqa: E402
from exl3serve_client.frontend.text import ModelTokenizer  # noqa: E402
from test_reasoning_api import _qwen3_model  # noqa: E402
from test_structured_output import HI, SCHEMA, check_person  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "units": {"type": "string", "enum": ["C", "F"]},
                   "hourly": {"type": "boolean"},
                   "at": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                     "maximum": 23}, "maxItems": 2}},
    "required": ["city", "days"]}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object",
                                                                       "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Bern for 3 days?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def check_call(name: str, arguments: str, as_written: bool = False) -> None:
    """A call of an offered function whose arguments match its schema; `as_written`: the
    arguments' text is the model's (DeepSeek's formats), laid out as templates' tojson writes
    JSON."""
    args = json.loads(arguments)
    if as_written:
        assert arguments == json.dumps(args, ensure_ascii=False), arguments
    assert isinstance(args, dict), arguments
    if name == "now":
        assert args == {}, arguments
        return
    assert name == "get_weather", name
    assert {"city", "days"} <= set(args) <= {"city", "days", "units", "hourly", "at"}, args
    assert isinstance(args["city"], str) and len(args["city"]) <= 12, args
    assert isinstance(args["days"], int) and not isinstance(args["days"], bool), args
    assert 1 <= args["days"] <= 7, args
    assert args.get("units", "C") in ("C", "F"), args
    assert isinstance(args.get("hourly", True), bool), args
    at = args.get("at", [])
    assert isinstance(at, list) and len(at) <= 2 and all(
        isinstance(h, int) and 0 <= h <= 23 for h in at), args


def forced_answers(client, name, tool_choice, seeds, as_written=False, **kw):
    """Non-streamed answers under tool_choice: their calls, each checked. max_tokens leaves room
    for long chains: under required the random model may begin another call after each one."""
    calls_per_answer = []
    for seed in seeds:
        r = client.chat.completions.create(model=name, messages=ASK, tools=[WEATHER, NOW],
                                           tool_choice=tool_choice, max_tokens=2000, seed=seed,
                                           temperature=1.0, **kw)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
        assert c.message.content is None, c  # nothing but the calls
        for call in c.message.tool_calls:
            check_call(call.function.name, call.function.arguments, as_written)
        calls_per_answer.append([call.function.name for call in c.message.tool_calls])
    return calls_per_answer


def streamed_calls(client, name, tool_choice, seed, as_written=False):
    chunks = list(client.chat.completions.create(
        model=name, messages=ASK, tools=[WEATHER, NOW], tool_choice=tool_choice, max_tokens=2000,
        seed=seed, temperature=1.0, stream=True))
    calls: dict[int, list[str]] = {}
    for ch in chunks:
        for c in ch.choices:
            assert not c.delta.content, c  # nothing but the calls
            for tc in c.delta.tool_calls or []:
                if tc.id is not None:
                    calls[tc.index] = [tc.function.name, tc.function.arguments or ""]
                else:
                    calls[tc.index][1] += tc.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert calls
    for name_, arguments in calls.values():
        check_call(name_, arguments, as_written)
    return calls


def check_forced_calls(client, name, as_written=False):
    """required (parallel calls allowed), a named function, required without parallel calls;
    streamed and not."""
    required = forced_answers(client, name, "required", range(12), as_written)
    assert {n for calls in required for n in calls} == {"get_weather", "now"}, required
    named = forced_answers(client, name, NAMED, range(4), as_written)
    assert all(calls == ["get_weather"] for calls in named), named
    single = forced_answers(client, name, "required", range(4), as_written,
                            parallel_tool_calls=False)
    assert all(len(calls) == 1 for calls in single), single
    for seed in range(2):
        streamed_calls(client, name, "required", seed, as_written)
    assert [n for n, _ in streamed_calls(client, name, NAMED, 7, as_written).values()] == \
        ["get_weather"]
    return required


@pytest.fixture(scope="module")
def glm(live):
    return openai.OpenAI(base_url=live.url, api_key="none", max_retries=0, timeout=120), live.name


def test_glm45_forced_calls_hold_to_the_schema(glm, live):
    """The live stack's GLM test model: forced calls in GLM's argument tags, every one parsing
    into arguments that validate, and several calls in some answers under required."""
    client, name = glm
    required = check_forced_calls(client, name)
    assert any(len(calls) > 1 for calls in required), required


def test_glm45_forced_call_is_the_templates_syntax(glm, live):
    """The constrained text is what GLM's template writes for the same call: rendered back into
    a conversation, the call reads as the template's own."""
    client, name = glm
    r = client.chat.completions.create(model=name, messages=ASK, tools=[WEATHER],
                                       tool_choice=NAMED, max_tokens=400, seed=3, temperature=1.0,
                                       logprobs=True)
    # The answer's tokens, the end-of-sequence token that ended it aside.
    text = "".join(t.token for t in r.choices[0].logprobs.content).removesuffix("<|endoftext|>")
    [call] = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    # GLM's template: "\n<tool_call>NAME" then per argument "\n<arg_key>K</arg_key>\n<arg_value>V
    # </arg_value>" (strings raw, other values as its tojson writes them: one space after ":"
    # and ","), then "\n</tool_call>".
    want = "\n<tool_call>get_weather" + "".join(
        f"\n<arg_key>{k}</arg_key>\n<arg_value>"
        f"{v if isinstance(v, str) else json.dumps(v)}</arg_value>" for k, v in args.items()) + \
        "\n</tool_call>"
    assert text == want


def _two_frontends(build_dir, tmp, arch: str, found: str, named: str):
    """A test model of `arch` behind one router and two front ends: one that finds its tool-call
    format from the template (`found`), one started with --tool-call-parser `named`. Yields the
    two formats' clients and the model's name."""
    model = stack.make_model(build_dir, tmp / f"{arch}-test", arch=arch)
    router, engine, _ = stack.start_router(build_dir, model, tmp)
    fes = []
    try:
        fe, url = stack.start_frontend(engine, model, tmp)
        fes.append(fe)
        fe_named, url_named = stack.start_frontend(engine, model, tmp,
                                                   extra=("--tool-call-parser", named))
        fes.append(fe_named)
        yield ({fmt: openai.OpenAI(base_url=u, api_key="none", max_retries=0, timeout=120)
                for fmt, u in ((found, url), (named, url_named))}, model.name)
    finally:
        for f in fes:
            f.stop()
        router.stop()


@pytest.fixture(scope="module")
def deepseek(build_dir, tmp_path_factory):
    """A DeepSeek-V3 test model (its template writes DeepSeek-V3's calls: deepseek_v3 found from
    it), with a second front end that names deepseek_v31."""
    yield from _two_frontends(build_dir, tmp_path_factory.mktemp("deepseek"), "deepseek_v3",
                              "deepseek_v3", "deepseek_v31")


@pytest.mark.parametrize("fmt", ["deepseek_v3", "deepseek_v31"])
def test_deepseek_forced_calls_hold_to_the_schema(deepseek, fmt):
    clients, name = deepseek
    required = check_forced_calls(clients[fmt], name, as_written=True)
    assert any(len(calls) > 1 for calls in required), required


def test_deepseek_round_trip(deepseek):
    """A forced call, its result sent back through the template (the call's arguments reach it
    as JSON text, as DeepSeek's templates concatenate them), then an answer."""
    import httpx
    clients, name = deepseek
    client = clients["deepseek_v3"]
    r = client.chat.completions.create(model=name, messages=ASK, tools=[WEATHER, NOW],
                                       tool_choice=NAMED, max_tokens=400, seed=1)
    call = r.choices[0].message.tool_calls[0]
    messages = ASK + [r.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r2 = client.chat.completions.create(model=name, messages=messages, tools=[WEATHER, NOW],
                                        max_tokens=4, temperature=0)
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens
    base = str(client.base_url).rstrip("/").removesuffix("/v1")
    ids = httpx.post(f"{base}/tokenize", json={"model": name, "messages": messages,
                                               "tools": [WEATHER, NOW]}, timeout=30).json()
    assert ids["count"] == r2.usage.prompt_tokens
    prompt = httpx.post(f"{base}/detokenize", json={"model": name, "tokens": ids["tokens"]},
                        timeout=30).json()["prompt"]
    assert ("<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n" +
            json.dumps(json.loads(call.function.arguments), ensure_ascii=False) +
            "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>") in prompt
    assert "<｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜>" in prompt


@pytest.fixture(scope="module")
def deepseek_v4(build_dir, tmp_path_factory):
    """A DeepSeek-V4 test model: its template writes DeepSeek-V4's DSML (deepseek_v4 found
    from it), with a second front end that names deepseek_v32 (V3.2's block name)."""
    for clients, name in _two_frontends(build_dir, tmp_path_factory.mktemp("deepseek_v4"),
                                        "deepseek_v4", "deepseek_v4", "deepseek_v32"):
        yield clients["deepseek_v4"], name, clients


def test_deepseek_v4_forced_calls_hold_to_the_schema(deepseek_v4):
    """DSML calls under required (one or more), a named function and required without parallel
    calls, streamed and not: every answer's calls parse and validate (strings raw with
    string="true", the others JSON with string="false")."""
    client, name, _ = deepseek_v4
    required = check_forced_calls(client, name, as_written=True)
    assert any(len(calls) > 1 for calls in required), required


def test_deepseek_v32_forced_calls_hold_to_the_schema(deepseek_v4):
    """V3.2's block (function_calls), fewer answers: the same grammar but for the block's name."""
    _, name, clients = deepseek_v4
    required = forced_answers(clients["deepseek_v32"], name, "required", range(6), True)
    assert any(len(calls) > 1 for calls in required), required
    named = forced_answers(clients["deepseek_v32"], name, NAMED, range(2), True)
    assert all(calls == ["get_weather"] for calls in named), named
    streamed_calls(clients["deepseek_v32"], name, "required", 0, True)


def test_deepseek_v4_forced_call_is_the_encodings_syntax(deepseek_v4):
    """The constrained text is what DeepSeek-V4's encoding (and the test model's template) writes
    for the same call after an empty content."""
    client, name, _ = deepseek_v4
    for seed in range(3):
        r = client.chat.completions.create(model=name, messages=ASK, tools=[WEATHER],
                                           tool_choice=NAMED, max_tokens=400, seed=seed,
                                           temperature=1.0, logprobs=True)
        # The answer's tokens (their bytes: a token may hold part of a character), the
        # end-of-sequence token that ended it aside.
        text = b"".join(bytes(t.bytes) for t in r.choices[0].logprobs.content).decode()
        text = text.removesuffix("<｜end▁of▁sentence｜>")
        [call] = r.choices[0].message.tool_calls
        args = json.loads(call.function.arguments)
        params = "\n".join(
            f'<｜DSML｜parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
            f'{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}</｜DSML｜parameter>'
            for k, v in args.items())
        assert text == ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n' + params +
                        "\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>"), text


def test_deepseek_v4_round_trip(deepseek_v4):
    """request -> tool_calls -> the tool's result -> an answer, on the real stack, streamed and
    not: the call and the result reach the prompt as DeepSeek-V4's encoding writes them."""
    import httpx
    client, name, _ = deepseek_v4
    r = client.chat.completions.create(model=name, messages=ASK, tools=[WEATHER, NOW],
                                       tool_choice=NAMED, max_tokens=400, seed=1)
    assert r.choices[0].finish_reason == "tool_calls"
    call = r.choices[0].message.tool_calls[0]
    check_call(call.function.name, call.function.arguments, as_written=True)
    messages = ASK + [r.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r2 = client.chat.completions.create(model=name, messages=messages, tools=[WEATHER, NOW],
                                        max_tokens=8, temperature=0)
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    chunks = list(client.chat.completions.create(model=name, messages=messages,
                                                 tools=[WEATHER, NOW], max_tokens=8,
                                                 temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason == r2.choices[0].finish_reason
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        (r2.choices[0].message.content or "")
    base = str(client.base_url).rstrip("/").removesuffix("/v1")
    ids = httpx.post(f"{base}/tokenize", json={"model": name, "messages": messages,
                                               "tools": [WEATHER, NOW]}, timeout=30).json()
    assert ids["count"] == r2.usage.prompt_tokens
    prompt = httpx.post(f"{base}/detokenize", json={"model": name, "tokens": ids["tokens"]},
                        timeout=30).json()["prompt"]
    args = json.loads(call.function.arguments)
    assert '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">' + \
        args["city"] + "</｜DSML｜parameter>" in prompt
    # Thinking mode (the template's default, as vLLM's V4 tokenizer): the answer opens <think>.
    assert prompt.endswith("<｜User｜><tool_result>sunny</tool_result><｜Assistant｜><think>")
    assert "### Available Tool Schemas" in prompt


def test_structural_tag_response_format(glm, live):
    """response_format structural_tag (xgrammar's format tree, as vLLM and OpenAI take it) and
    vLLM's older structures/triggers shape hold every answer; a bad tag is a 400 naming it."""
    client, name = glm
    fmt = {"type": "sequence", "elements": [
        {"type": "const_string", "value": "Answer: "},
        {"type": "tag", "begin": "<n>", "content": {"type": "regex", "pattern": "[0-9]{1,3}"},
         "end": "</n>"},
        {"type": "or", "elements": [{"type": "const_string", "value": " yes"},
                                    {"type": "const_string", "value": " no"}]}]}
    for seed in range(6):
        r = client.chat.completions.create(
            model=name, messages=HI, max_tokens=60, seed=seed, temperature=1.0,
            response_format={"type": "structural_tag", "format": fmt})
        assert r.choices[0].finish_reason == "stop"
        assert re.fullmatch(r"Answer: <n>[0-9]{1,3}</n> (yes|no)", r.choices[0].message.content)
    legacy = {"type": "structural_tag", "triggers": ["<n"],
              "structures": [{"begin": "<n>", "schema": {"type": "object", "properties": {
                  "v": {"type": "integer"}}, "required": ["v"]}, "end": "</n>"}]}
    for field in ("response_format", "structural_tag", "structured_outputs"):
        value = legacy if field == "response_format" else json.dumps(legacy)
        body = {"structural_tag": value} if field == "structured_outputs" else value
        kw = {"response_format": body} if field == "response_format" else \
            {"extra_body": {field: body}}
        r = client.chat.completions.create(model=name, messages=HI, max_tokens=80, seed=2,
                                           temperature=1.0, **kw)
        # Free text, except that "<n" starts a tagged JSON object.
        for m in re.finditer(r"<n", r.choices[0].message.content):
            rest = r.choices[0].message.content[m.start():]
            if r.choices[0].finish_reason == "stop" or "</n>" in rest:
                doc = json.loads(rest[len("<n>"):rest.index("</n>")])
                assert isinstance(doc["v"], int)
    for bad, says in [({"type": "structural_tag", "format": {"type": "nope"}}, "structural_tag"),
                      ({"type": "structural_tag"}, "format"),
                      ({"type": "structural_tag", "format": 5}, "format")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=name, messages=HI, max_tokens=4,
                                           response_format=bad)
        assert says in e.value.body["message"], e.value.body


def test_whitespace_patterns_are_refused_by_name(glm, live):
    client, name = glm
    for field, value in [("guided_whitespace_pattern", r"[ ]?"),
                         ("structured_outputs", {"json": SCHEMA, "whitespace_pattern": r"[ ]?"})]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=name, messages=HI, max_tokens=4,
                                           extra_body={field: value})
        assert "whitespace_pattern" in e.value.body["message"]
        assert "whitespace_pattern" in e.value.body["param"]


@pytest.fixture(scope="module")
def thinking(build_dir, tmp_path_factory):
    """A Qwen3-MoE test model whose <think> tags are text (as in Qwen3's tokenizer), with front
    ends splitting its reasoning as qwen3 (the output may open a block) and deepseek_r1 (the
    output starts inside one), and one naming qwen3_coder (its calls forced whatever the
    template shows: test_qwen3_coder_forced_calls_hold_to_the_schema)."""
    tmp = tmp_path_factory.mktemp("thinking")
    model = stack.make_model(build_dir, tmp / "qwen-thinking", arch="qwen3_moe")
    _qwen3_model(model)
    router, engine, _ = stack.start_router(build_dir, model, tmp)
    fes, clients = [], {}
    try:
        # The reasoning parsers, and (no reasoning split) the qwen3_coder tool-call format.
        for key, extra in (("qwen3", ("--reasoning-parser", "qwen3")),
                           ("deepseek_r1", ("--reasoning-parser", "deepseek_r1")),
                           ("qwen3_coder", ("--tool-call-parser", "qwen3_coder"))):
            fe, url = stack.start_frontend(engine, model, tmp, extra=extra)
            fes.append(fe)
            clients[key] = openai.OpenAI(base_url=url, api_key="none", max_retries=0,
                                         timeout=120)
    except BaseException:
        for f in fes:
            f.stop()
        router.stop()
        raise
    yield clients, model
    for f in fes:
        f.stop()
    router.stop()


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_constraints_hold_after_the_reasoning(thinking, parser):
    """json_schema with the reasoning split on: the model reasons in free text first, and the
    answer after </think> parses and matches the schema in N of N sampled generations. The
    think tags are made likely (logit_bias) so that blocks open and close within the budget."""
    clients, model = thinking
    tok = ModelTokenizer(model)
    [think] = tok.encode("<think>", add_special_tokens=False)
    [end] = tok.encode("</think>", add_special_tokens=False)
    reasonings = []
    for seed in range(10):
        r = clients[parser].chat.completions.create(
            model=model.name, messages=HI, max_tokens=300, temperature=1.0, seed=seed,
            logit_bias={str(think): 4, str(end): 4},
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": SCHEMA}})
        c = r.choices[0]
        assert c.finish_reason == "stop", c
        check_person(c.message.content)
        reasonings.append(getattr(c.message, "reasoning_content", None) or "")
    # Some answers reasoned first, in text no JSON constraint allows.
    free = [t for t in reasonings if t.strip()]
    assert free, reasonings
    assert any(not t.lstrip().startswith("{") for t in free), reasonings
    # Streamed: the same split, the content the schema's.
    chunks = list(clients[parser].chat.completions.create(
        model=model.name, messages=HI, max_tokens=300, temperature=1.0, seed=3, stream=True,
        logit_bias={str(think): 4, str(end): 4},
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    check_person(content)


def test_forced_calls_hold_after_the_reasoning(thinking):
    """tool_choice required on a thinking model (hermes calls): reasoning first, then the call."""
    clients, model = thinking
    tok = ModelTokenizer(model)
    [think] = tok.encode("<think>", add_special_tokens=False)
    [end] = tok.encode("</think>", add_special_tokens=False)
    for seed in range(4):
        r = clients["qwen3"].chat.completions.create(
            model=model.name, messages=ASK, tools=[WEATHER, NOW], tool_choice="required",
            max_tokens=400, temperature=1.0, seed=seed, logit_bias={str(think): 4, str(end): 4})
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) >= 1, c
        for call in c.message.tool_calls:
            check_call(call.function.name, call.function.arguments)


def test_qwen3_coder_forced_calls_hold_to_the_schema(thinking):
    """Qwen3-Coder's tags under required, a named function and required without parallel calls,
    streamed and not: every answer's calls parse and validate (the front end names qwen3_coder;
    that a Qwen3-Coder template is read as it, test_tool_calls.py and test_tool_call_api.py)."""
    clients, model = thinking
    required = check_forced_calls(clients["qwen3_coder"], model.name, as_written=True)
    assert any(len(calls) > 1 for calls in required), required
