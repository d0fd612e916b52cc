"""The tool-call parser (frontend/tool_calls.py) on crafted model text: what it makes of a whole
text, and that the same comes out however the text is split (at every character, in two pieces,
and one character at a time), with each call's start before its arguments."""

from __future__ import annotations

import json

import pytest

from exl3serve_client.frontend.tool_calls import (DS_CALL_BEGIN, DS_CALL_END, DS_CALLS_BEGIN,
                                                  DS_CALLS_END, DS_SEP, CallArguments, CallStart,
                                                  Content, ToolCallFormat, ToolCallParser,
                                                  template_tool_call_format, tool_call_format)
from exl3serve_client.make_tokenizer import FAMILIES
from qwen3_coder_template import QWEN3_CODER_TEMPLATE

HERMES, GLM = ToolCallFormat.HERMES, ToolCallFormat.GLM45
DS3, DS31 = ToolCallFormat.DEEPSEEK_V3, ToolCallFormat.DEEPSEEK_V31
DS4, DS32 = ToolCallFormat.DEEPSEEK_V4, ToolCallFormat.DEEPSEEK_V32
CODER = ToolCallFormat.QWEN3_CODER


def dsml(*invokes, block="tool_calls"):
    """A DSML calls block as DeepSeek's encodings write it: "\n\n", the block, the invokes (name,
    [(key, string attribute, value text)]) joined by "\n"."""
    calls = [f'<｜DSML｜invoke name="{name}">\n' + "\n".join(
        f'<｜DSML｜parameter name="{k}" string="{s}">{v}</｜DSML｜parameter>' for k, s, v in params) +
        "\n</｜DSML｜invoke>" for name, params in invokes]
    return f"\n\n<｜DSML｜{block}>\n" + "\n".join(calls) + f"\n</｜DSML｜{block}>"


# DeepSeek-V3.2's published example of two calls (its encoding's docs and vLLM's parser's).
DS32_EXAMPLE = dsml(("get_weather", [("location", "true", "杭州"), ("date", "true", "2024-01-16")]),
                    ("get_weather", [("location", "true", "北京"), ("date", "true", "2024-01-16")]),
                    block="function_calls")
SCHEMAS = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "where": {"type": "object"}, "tags": {"type": ["array", "null"]}, "code": {"type": "string"}}},
    "now": {"type": "object", "properties": {}},
    "enums": {"type": "object", "properties": {"n": {"enum": [1, 2]}, "s": {"enum": ["1", "2"]}}},
}


def fold(events):
    """Events into (content, [(name, arguments text)]); checks their order."""
    content, calls = [], []
    for e in events:
        if isinstance(e, Content):
            assert e.text, "an empty content event"
            content.append(e.text)
        elif isinstance(e, CallStart):
            assert e.index == len(calls) and e.id.startswith("call_") and e.name
            calls.append([e.name, ""])
        else:
            assert isinstance(e, CallArguments) and e.index == len(calls) - 1, e
            calls[e.index][1] += e.text
    return "".join(content), [tuple(c) for c in calls]


def parse(fmt, pieces, parallel=True):
    p = ToolCallParser(fmt, SCHEMAS, parallel)
    events = []
    for i, piece in enumerate(pieces):
        events += p.push(piece, final=i == len(pieces) - 1)
    return fold(events)


def splits(text):
    yield [text]
    yield list(text) or [""]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


CASES = [
    # (format, model text, content, calls as (name, arguments parsed))
    (HERMES, "Just an answer, with <b>tags</b> and a < b.\n", "Just an answer, with <b>tags</b> "
     "and a < b.\n", []),
    (HERMES, "", "", []),
    (HERMES, "  ", "  ", []),
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
     "</tool_call>", "", [("get_weather", {"city": "Paris", "days": 3})]),
    (HERMES, 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich '
     '}{ \\"x\\"", "where": {"lat": 1, "lon": [2, {"a": "}"}]}}}\n</tool_call>\n<tool_call>\n'
     '{"name": "now", "arguments": {}}\n</tool_call>',
     "Let me look.", [("get_weather", {"city": 'Zürich }{ "x"', "where": {"lat": 1, "lon": [
         2, {"a": "}"}]}}), ("now", {})]),
    # Keys in another order: a call all the same, once whole.
    (HERMES, '<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call> ok',
     "ok", [("get_weather", {"city": "Oslo"})]),
    # Not a call: content, tags and all.
    (HERMES, "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    (HERMES, "see <tool_c", "see <tool_c", []),
    # Cut off by max_tokens inside a call: the call, arguments as far as they came.
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', "",
     [("get_weather", None)]),
    (GLM, "Plain <arg_key> text", "Plain <arg_key> text", []),
    (GLM, "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
     "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>metric"
     "</arg_key>\n<arg_value>true</arg_value>\n<arg_key>where</arg_key>\n<arg_value>{\"lat\": "
     "48.8}</arg_value>\n<arg_key>code</arg_key>\n<arg_value>007</arg_value>\n<arg_key>tags"
     "</arg_key>\n<arg_value>[\"a\"]</arg_value>\n</tool_call>",
     "Checking.", [("get_weather", {"city": "Paris", "days": 3, "metric": True,
                                    "where": {"lat": 48.8}, "code": "007", "tags": ["a"]})]),
    # A value that does not parse as its type stays text; an unknown key stays text.
    (GLM, "<tool_call>get_weather\n<arg_key>days</arg_key>\n<arg_value>three</arg_value>\n"
     "<arg_key>extra</arg_key>\n<arg_value>12</arg_value>\n</tool_call>", "",
     [("get_weather", {"days": "three", "extra": "12"})]),
    (GLM, "<tool_call>now\n</tool_call>\n<tool_call>now</tool_call>Done.", "Done.",
     [("now", {}), ("now", {})]),
    (GLM, "<tool_call>\n</tool_call>", "<tool_call>\n</tool_call>", []),
    # An untyped property with a non-string enum: JSON; with string values only: text.
    (GLM, "<tool_call>enums\n<arg_key>n</arg_key>\n<arg_value>2</arg_value>\n<arg_key>s</arg_key>"
     "\n<arg_value>2</arg_value>\n</tool_call>", "", [("enums", {"n": 2, "s": "2"})]),
    # DeepSeek-V3: calls in a block, each with its type, name and a ```json block.
    (DS3, "Let me look." + DS_CALLS_BEGIN + DS_CALL_BEGIN + "function" + DS_SEP + "get_weather\n"
     "```json\n{\"city\": \"Zürich ``` }\", \"days\": 2}\n```" + DS_CALL_END + "\n" + DS_CALL_BEGIN +
     "function" + DS_SEP + "now\n```json\n{}\n```" + DS_CALL_END + DS_CALLS_END, "Let me look.",
     [("get_weather", {"city": "Zürich ``` }", "days": 2}), ("now", {})]),
    (DS3, "Plain text with <｜tool and ``` fences.", "Plain text with <｜tool and ``` fences.", []),
    (DS3, DS_CALLS_BEGIN + DS_CALL_BEGIN + "not a head" + DS_CALL_END + DS_CALLS_END,
     DS_CALL_BEGIN + "not a head" + DS_CALL_END, []),
    # Cut off inside the arguments: the call, its arguments as far as they came.
    (DS3, DS_CALLS_BEGIN + DS_CALL_BEGIN + "function" + DS_SEP + "get_weather\n```json\n{\"ci",
     "", [("get_weather", None)]),
    # DeepSeek-V3.1: the name, the separator, the arguments' JSON.
    (DS31, "Sure. " + DS_CALLS_BEGIN + DS_CALL_BEGIN + "get_weather" + DS_SEP + '{"city": "Oslo",'
     ' "days": 3}' + DS_CALL_END + DS_CALL_BEGIN + "now" + DS_SEP + "{}" + DS_CALL_END +
     DS_CALLS_END, "Sure.", [("get_weather", {"city": "Oslo", "days": 3}), ("now", {})]),
    (DS31, DS_CALLS_BEGIN + DS_CALL_BEGIN + "now" + DS_SEP + DS_CALL_END + DS_CALLS_END + " Done.",
     "Done.", [("now", {})]),
    # qwen3_coder: values between the tags' newlines, typed by the schema (a string raw, other
    # types as JSON, or the Python spelling the templates write: True, None); text before the
    # first call is content.
    (CODER, "Checking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich <b>\n"
     "line 2\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n"
     "</parameter>\n<parameter=where>\n{\"lat\": 48.8}\n</parameter>\n<parameter=code>\n007\n"
     "</parameter>\n<parameter=tags>\nNone\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
     "<function=now>\n</function>\n</tool_call>", "Checking.",
     [("get_weather", {"city": "Zürich <b>\nline 2", "days": 3, "metric": True,
                       "where": {"lat": 48.8}, "code": "007", "tags": None}), ("now", {})]),
    # A value that is not of its type stays text; stray text in a call is dropped; no <function=
    # head: content, tags and all; cut off inside a parameter: the whole ones.
    (CODER, "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\nstray\n"
     "</function>\n</tool_call> Done.", "Done.", [("get_weather", {"days": "three"})]),
    (CODER, '<tool_call>\n{"name": "now"}\n</tool_call>', '<tool_call>\n{"name": "now"}\n'
     "</tool_call>", []),
    (CODER, "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
     "<parameter=days>\n2", "", [("get_weather", {"city": "Oslo"})]),
    # DeepSeek-V4's DSML: string="true" values raw (any text but the closing tag), the others
    # JSON; text before the block is content; a call without parameters has none.
    (DS4, "Let me look." + dsml(
        ("get_weather", [("city", "true", 'Zürich "<b>" {x}\nline 2'), ("days", "false", "2"),
                         ("metric", "false", "true"), ("where", "false", '{"lat": 48.8, "l": [1]}'),
                         ("code", "true", "007"), ("tags", "false", "null")]),
        ("now", [])), "Let me look.",
     [("get_weather", {"city": 'Zürich "<b>" {x}\nline 2', "days": 2, "metric": True,
                       "where": {"lat": 48.8, "l": [1]}, "code": "007", "tags": None}),
      ("now", {})]),
    # The string attribute decides, not the schema: "2" as text is a string; a string="false"
    # value that is no JSON (NaN is none) stays text; a repeated parameter keeps its first value.
    (DS4, dsml(("get_weather", [("days", "true", "2"), ("city", "false", "Paris"),
                                ("metric", "false", "NaN"), ("days", "false", "3")])), "",
     [("get_weather", {"days": "2", "city": "Paris", "metric": "NaN"})]),
    (DS32, "Sure." + DS32_EXAMPLE, "Sure.",
     [("get_weather", {"location": "杭州", "date": "2024-01-16"}),
      ("get_weather", {"location": "北京", "date": "2024-01-16"})]),
    # V3.2's block is not V4's: V4's parser leaves V3.2's block tags as content (the calls in it
    # are calls all the same: an invoke is a call wherever it stands).
    (DS4, "A" + DS32_EXAMPLE.replace("\n<｜DSML｜invoke", "<｜DSML｜invoke", 1),
     "A\n\n<｜DSML｜function_calls></｜DSML｜function_calls>",
     [("get_weather", {"location": "杭州", "date": "2024-01-16"}),
      ("get_weather", {"location": "北京", "date": "2024-01-16"})]),
    # Plain text with DSML-like fragments; an invoke without a name's head: content, tags and all.
    (DS4, "a <｜DSML｜ b <｜DSML｜invo", "a <｜DSML｜ b <｜DSML｜invo", []),
    (DS4, '<｜DSML｜invoke nom="x">\n</｜DSML｜invoke> after', '<｜DSML｜invoke nom="x">\n'
     "</｜DSML｜invoke> after", []),
    # Within a call, what is neither a parameter nor the invoke's end is dropped up to the end
    # (a parameter without its string attribute, stray text).
    (DS4, dsml(("get_weather", [("city", "true", "Oslo")])).replace(
        "\n</｜DSML｜invoke>", '\n<｜DSML｜parameter name="days">2</｜DSML｜parameter>\nstray'
        "\n</｜DSML｜invoke>"), "", [("get_weather", {"city": "Oslo"})]),
    # Cut off by max_tokens inside a parameter: the call, with the parameters that were whole.
    (DS4, dsml(("get_weather", [("city", "true", "Oslo"), ("days", "false", "2")]))[:-60], "",
     [("get_weather", {"city": "Oslo"})]),
    # What vLLM's qwen3_xml (and qwen3_coder) parsers also read: a bare <function=…> without its
    # <tool_call> wrapper is a call, up to </function>; a parameter without </parameter> ends
    # before the next parameter's tag or </function> on a line of their own.
    (CODER, "Sure.\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>"
     "\n<function=now>\n</function> ok", "Sure.ok",
     [("get_weather", {"city": "Oslo"}), ("now", {})]),
    (CODER, "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n<parameter=days>\n2"
     "\n</function>\n</tool_call>", "", [("get_weather", {"city": "Oslo", "days": 2})]),
    (CODER, "<function=get_weather>\n<parameter=city>\nOslo\n</function>", "",
     [("get_weather", {"city": "Oslo"})]),
    # A bare <function= that is no head (no name and ">"): content, as it was written.
    (CODER, "use <function=> here </function> x", "use <function=> here </function> x", []),
]


@pytest.mark.parametrize("fmt,text,content,calls", CASES, ids=range(len(CASES)))
def test_parsed_the_same_however_split(fmt, text, content, calls):
    want = None
    for pieces in splits(text):
        got = parse(fmt, pieces)
        if want is None:
            want = got
            assert got[0] == content
            assert [c[0] for c in got[1]] == [c[0] for c in calls]
            for (_, args), (_, want_args) in zip(got[1], calls):
                if want_args is not None:
                    assert json.loads(args) == want_args, args
        assert got == want, pieces


def test_not_parallel_keeps_the_first_call():
    text = ('<tool_call>{"name": "now", "arguments": {}}</tool_call>\n<tool_call>{"name": '
            '"get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    assert parse(HERMES, [text], parallel=False) == ("", [("now", "{}")])
    assert len(parse(HERMES, [text])[1]) == 2


def test_streamed_events_come_as_soon_as_they_are_decided():
    """The call's name goes out before its arguments are complete; content before a call goes out
    before the call's tag is complete; a possible tag start is held back."""
    p = ToolCallParser(HERMES, SCHEMAS)
    assert p.push("Hi <tool_") == [Content("Hi")]
    events = p.push('call>\n{"name": "get_weather", "arguments": {"ci')
    assert [type(e) for e in events] == [CallStart, CallArguments]
    assert (events[0].name, events[1].text) == ("get_weather", '{"ci')
    assert p.push('ty": "Paris"}') == [CallArguments(0, 'ty": "Paris"')]  # "}" may close the call
    g = ToolCallParser(GLM, SCHEMAS)
    started = g.push("<tool_call>get_weather\n<arg_key>city")
    assert [type(e) for e in started] == [CallStart]
    # DSML: the content before the block at once, the call's start once its head is whole, each
    # parameter once it is.
    d = ToolCallParser(DS4, SCHEMAS)
    assert d.push("Looking.\n\n<｜DSML｜tool") == [Content("Looking.")]
    assert d.push('_calls>\n<｜DSML｜invoke name="get_wea') == []
    [start] = d.push('ther">\n<｜DSML｜parameter name="city" string="true">Os')
    assert isinstance(start, CallStart) and start.name == "get_weather"
    assert d.push("lo</｜DSML｜parameter>\n") == [CallArguments(0, '{"city": "Oslo"')]
    assert d.push('<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n</｜DSML｜') \
        == [CallArguments(0, ', "days": 2')]
    assert d.push("invoke>\n</｜DSML｜tool_calls>", final=True) == [CallArguments(0, "}")]


def test_formats_of_the_families_templates():
    by_family = {f.name: template_tool_call_format(f.template) for f in FAMILIES.values()}
    assert by_family == {"glm4_moe": GLM, "qwen3_moe": HERMES, "mixtral": None,
                         "deepseek_v3": DS3, "deepseek_v4": DS4}
    # Qwen3-Coder's <function=…><parameter=…> tags inside <tool_call>: qwen3_coder.
    assert template_tool_call_format(QWEN3_CODER_TEMPLATE) is CODER
    assert tool_call_format("qwen3_coder", None) is CODER
    # vLLM's qwen3_xml names the same format (what its parser reads, qwen3_coder reads here).
    assert tool_call_format("qwen3_xml", None) is CODER
    # DeepSeek-V3.2's DSML block is function_calls (a template writing it is read as deepseek_v32).
    assert template_tool_call_format("{{ '<｜DSML｜function_calls>' }}") is DS32
    assert tool_call_format("deepseek_v32", None) is DS32
    # DeepSeek-V3.1's own template: the name before the separator, no ```json block.
    v31 = ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] + "
           "'<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}")
    assert template_tool_call_format(v31) is DS31
    assert tool_call_format("deepseek_v31", None) is DS31
    assert tool_call_format("auto", FAMILIES["Qwen3MoeForCausalLM"].template) is HERMES
    assert tool_call_format("glm45", None) is GLM
    assert tool_call_format("hermes", FAMILIES["Glm4MoeForCausalLM"].template) is HERMES


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "Glm4MoeForCausalLM",
                                  "DeepseekV3ForCausalLM", "DeepseekV4ForCausalLM"])
def test_the_templates_calls_parse_back(arch):
    """An assistant turn's calls as the family's template renders them are what the parser of
    the template's format makes of that text: the model is shown the format it is parsed in."""
    from exl3serve_client.frontend.text import compile_chat_template
    template = FAMILIES[arch].template
    calls = [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Zürich", "days": 2, "where": {"a": [1]}}}},
        {"id": "c2", "type": "function", "function": {"name": "now", "arguments": {}}}]
    # DeepSeek-V4's in chat mode: the answer follows the prompt's </think> (in thinking mode it
    # opens with the reasoning and </think>, reasoning.py's to split off).
    mode = {"thinking": False} if arch == "DeepseekV4ForCausalLM" else {}
    before = compile_chat_template(template).render(
        messages=[{"role": "user", "content": "q"}], add_generation_prompt=True, **mode)
    whole = compile_chat_template(template).render(
        messages=[{"role": "user", "content": "q"},
                  {"role": "assistant", "content": "Looking.", "tool_calls": calls}],
        add_generation_prompt=False, **mode)
    if arch == "DeepseekV4ForCausalLM":  # its string and non-string parameters
        assert '<｜DSML｜parameter name="city" string="true">Zürich</｜DSML｜parameter>\n' \
            '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>' in whole
    assert whole.startswith(before)
    # The turn's end: Qwen's, DeepSeek's.
    answer = whole[len(before):].removesuffix("<|im_end|>\n").removesuffix("<｜end▁of▁sentence｜>")
    content, got = parse(template_tool_call_format(template), [answer])
    assert content == "Looking."
    assert [(n, json.loads(a)) for n, a in got] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_qwen3_coder_templates_calls_parse_back():
    """Calls as a Qwen3-Coder-style template writes them (a boolean as True, null as None, an
    object as JSON) parse back into the same arguments, typed by the schema."""
    from exl3serve_client.frontend.text import compile_chat_template
    template = compile_chat_template(QWEN3_CODER_TEMPLATE)
    args = {"city": "Zürich", "days": 2, "metric": False, "where": {"a": [1]}, "tags": None,
            "code": "007"}
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": args}},
             {"id": "c2", "type": "function", "function": {"name": "now", "arguments": {}}}]
    user = [{"role": "user", "content": "q"}]
    before = template.render(messages=user, add_generation_prompt=True)
    whole = template.render(messages=user + [{"role": "assistant", "content": "Looking.",
                                              "tool_calls": calls}], add_generation_prompt=False)
    assert whole.startswith(before) and "<parameter=metric>\nFalse\n</parameter>" in whole
    content, got = parse(CODER, [whole[len(before):].removesuffix("<|im_end|>\n")])
    assert content == "Looking."
    assert [(n, json.loads(a)) for n, a in got] == [("get_weather", args), ("now", {})]
