"""The reasoning split (--reasoning-parser) and n > 1 choices through the real exl3serve-openai
process, driven by the openai SDK. The engine is the fake of fake_engine.py, so that the model's
output can be chosen: each request's (or choice's) reply is the tokens of a text the test writes,
with its <think> tags split across several tokens (GLM's tokenizer) or as added tokens of their
own (Qwen3's). For each format (glm45, qwen3, deepseek_r1): the reasoning and the content, streamed
and not, include_reasoning false, tool calls parsed from the content only. The qwen3 model is the
qwen3_moe fixture with <think> and </think> made non-special (as in Qwen3's own tokenizer.json:
the detokenizer keeps them in the text) and a template that honours enable_thinking, as Qwen3's
does (the fixtures' templates do not)."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import httpx
import openai
import pytest

import stack
from exl3serve_client.frontend.text import ModelTokenizer
from fake_engine import FAIL_AFTER, FakeEngine, ThreadedServer

ROOT = Path(__file__).resolve().parents[3]
ASK = [{"role": "user", "content": "What is 2+2?"}]
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object",
                                                                       "properties": {}}}}
THINKING_OFF = "<think>\n\n</think>\n\n"  # what Qwen3's template adds for enable_thinking false


def _qwen3_model(dst: Path) -> None:
    """The qwen3_moe fixture as Qwen3's tokenizer has it: <think>, </think> not special, and
    enable_thinking honoured by the template."""
    tj = json.loads((dst / "tokenizer.json").read_text())
    for t in tj["added_tokens"]:
        if t["content"] in ("<think>", "</think>"):
            t["special"] = False
    (dst / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False))
    conf = json.loads((dst / "tokenizer_config.json").read_text())
    for t in (conf.get("added_tokens_decoder") or {}).values():
        if t.get("content") in ("<think>", "</think>"):
            t["special"] = False
    end = "<|im_start|>assistant\n{% endif %}"
    assert conf["chat_template"].endswith(end)
    conf["chat_template"] = conf["chat_template"][:-len("{% endif %}")] + \
        "{% if enable_thinking is defined and enable_thinking is false %}" + \
        THINKING_OFF.replace("\n", "{{ '\\n' }}") + "{% endif %}{% endif %}"
    (dst / "tokenizer_config.json").write_text(json.dumps(conf, ensure_ascii=False))


class Fake:
    def __init__(self, family, parser, engine, fe, url, model):
        self.family, self.parser = family, parser
        self.engine, self.fe, self.url, self.model = engine, fe, url, model
        self.tok = ModelTokenizer(model)
        self.client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=30)

    def ids(self, text):
        ids = self.tok.encode(text, add_special_tokens=False)
        assert self.tok.decode(ids) == text
        return ids

    def replies(self, *texts, prefix="chatcmpl-"):
        """The request id whose answer is texts[0] (one text), or whose choice i's is texts[i]."""
        rid = uuid.uuid4().hex
        if len(texts) == 1:
            self.engine.replies[prefix + rid] = self.ids(texts[0])
        else:
            for i, text in enumerate(texts):
                self.engine.replies[f"{prefix}{rid}-{i}"] = self.ids(text)
        return {"X-Request-Id": rid}

    def opening(self):
        """What the output opens its reasoning with (deepseek_r1: nothing, the prompt did)."""
        return "" if self.parser == "deepseek_r1" else "<think>"

    def last_prompt(self):
        return self.tok.decode(list(self.engine.starts[-1].prompt_token_ids),
                               skip_special_tokens=False)


def _start(tmp, family, parser, extra=()):
    model = tmp / family
    shutil.copytree(ROOT / "tests/fixtures/tokenizer" / family, model)
    if family == "qwen3_moe":
        _qwen3_model(model)
    engine = FakeEngine(step_s=0.002)
    server = ThreadedServer(engine).start()
    try:
        fe, url = stack.start_frontend(server.target, model, tmp / "logs",
                                       extra=("--reasoning-parser", parser, *extra))
    except BaseException:
        server.close()
        raise
    return Fake(family, parser, engine, fe, url, model), server


@pytest.fixture(scope="module", params=[("glm4_moe", "glm45"), ("qwen3_moe", "qwen3"),
                                        ("glm4_moe", "deepseek_r1")], ids=lambda p: p[1])
def fake(request, tmp_path_factory):
    family, parser = request.param
    f, server = _start(tmp_path_factory.mktemp(f"reasoning-{parser}"), family, parser)
    yield f
    f.fe.stop()
    server.close()


def _reasoning_of(obj):
    """reasoning_content of a message or delta (a field the openai SDK keeps as an extra)."""
    return getattr(obj, "reasoning_content", None)


def _stream(fake, texts, **kw):
    """A streamed answer: per choice index [reasoning, content, finish, kinds of its deltas in
    order]; and the usage."""
    chunks = fake.client.chat.completions.create(
        model="fake", messages=kw.pop("messages", ASK), stream=True,
        stream_options={"include_usage": True}, extra_headers=fake.replies(*texts), **kw)
    out, usage = {}, None
    for c in chunks:
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            got = out.setdefault(ch.index, ["", "", None, []])
            r = _reasoning_of(ch.delta)
            if r:
                got[0] += r
                got[3].append("reasoning")
            if ch.delta.content:
                got[1] += ch.delta.content
                got[3].append("content")
            if ch.finish_reason:
                got[2] = ch.finish_reason
    return out, usage


THOUGHT = "The user asks 2+2 <simple>. Four, surely; </thinking> is not my tag."


def test_reasoning_split(fake):
    said = fake.opening() + THOUGHT + "</think>\n\nIt is 4."
    r = fake.client.chat.completions.create(model="fake", messages=ASK,
                                            extra_headers=fake.replies(said))
    m = r.choices[0].message
    assert (_reasoning_of(m), m.content, r.choices[0].finish_reason) == \
        (THOUGHT, "\n\nIt is 4.", "stop")
    assert r.usage.completion_tokens == len(fake.ids(said))
    got, usage = _stream(fake, [said])
    reasoning, content, finish, kinds = got[0]
    assert (reasoning, content, finish) == (THOUGHT, "\n\nIt is 4.", "stop")
    # Reasoning deltas until the closing tag, then content; never a tag in either.
    assert kinds.index("content") > max(i for i, k in enumerate(kinds) if k == "reasoning")
    assert kinds.count("reasoning") >= 2 and usage.completion_tokens == len(fake.ids(said))


def test_reasoning_cut_off_and_without_reasoning(fake):
    cut = fake.opening() + "Thinking, thinking"
    past_the_tag = len(fake.ids(fake.opening())) + 2
    r = fake.client.chat.completions.create(model="fake", messages=ASK, max_tokens=past_the_tag,
                                            extra_headers=fake.replies(cut))
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "length" and m.content is None
    assert cut.startswith(fake.opening() + _reasoning_of(m)) and _reasoning_of(m)
    plain = "Four."
    r = fake.client.chat.completions.create(model="fake", messages=ASK,
                                            extra_headers=fake.replies(plain))
    m = r.choices[0].message
    if fake.parser == "deepseek_r1":  # the output starts inside the reasoning
        assert (_reasoning_of(m), m.content) == ("Four.", None)
    else:  # no <think>: all content (as with enable_thinking false)
        assert (_reasoning_of(m), m.content) == (None, "Four.")
    got, _ = _stream(fake, [plain])
    assert tuple(got[0][:2]) == ((plain, "") if fake.parser == "deepseek_r1" else ("", plain))


def test_include_reasoning_false_drops_it(fake):
    said = fake.opening() + THOUGHT + "</think>Four."
    r = fake.client.chat.completions.create(model="fake", messages=ASK,
                                            extra_body={"include_reasoning": False},
                                            extra_headers=fake.replies(said))
    m = r.choices[0].message
    assert (_reasoning_of(m), m.content) == (None, "Four.")
    got, _ = _stream(fake, [said], extra_body={"include_reasoning": False})
    assert tuple(got[0][:3]) == ("", "Four.", "stop") and "reasoning" not in got[0][3]


def test_tool_calls_from_the_content_only(fake):
    if fake.family == "qwen3_moe":
        call = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    else:
        call = "<tool_call>now\n</tool_call>"
    thought = "Maybe " + call + " would help."
    said = fake.opening() + thought + "</think>Calling." + call
    r = fake.client.chat.completions.create(model="fake", messages=ASK, tools=[NOW],
                                            extra_headers=fake.replies(said))
    m = r.choices[0].message
    assert (_reasoning_of(m), m.content, r.choices[0].finish_reason) == \
        (thought, "Calling.", "tool_calls")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == \
        [("now", {})]
    chunks = list(fake.client.chat.completions.create(model="fake", messages=ASK, tools=[NOW],
                                                      stream=True,
                                                      extra_headers=fake.replies(said)))
    reasoning = "".join(_reasoning_of(c.choices[0].delta) or "" for c in chunks if c.choices)
    calls = [tc.function.name for c in chunks for tc in (c.choices[0].delta.tool_calls or [])
             if tc.id]
    assert (reasoning, calls, chunks[-1].choices[0].finish_reason) == \
        (thought, ["now"], "tool_calls")


def test_enable_thinking_reaches_the_template(fake):
    """chat_template_kwargs reach the template: Qwen3's (here) closes an empty reasoning in the
    prompt for enable_thinking false; the GLM fixture's template has no enable_thinking, and its
    prompt is the same either way."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    r = fake.client.chat.completions.create(model="fake", messages=ASK, extra_body=off,
                                            extra_headers=fake.replies("Four."))
    prompt_off = fake.last_prompt()
    if fake.parser != "deepseek_r1":
        assert (_reasoning_of(r.choices[0].message), r.choices[0].message.content) == \
            (None, "Four.")
    fake.client.chat.completions.create(model="fake", messages=ASK,
                                        extra_headers=fake.replies("ok"))
    prompt_on = fake.last_prompt()
    if fake.family == "qwen3_moe":
        assert prompt_off == prompt_on + THINKING_OFF
        assert prompt_on.endswith("<|im_start|>assistant\n")
    else:
        assert prompt_off == prompt_on


def test_n_choices_with_reasoning(fake):
    """n = 3: three generations, each choice its own reasoning and content, in index order;
    streamed interleaved with each chunk's index; usage summed over the choices."""
    texts = [fake.opening() + f"thought {i}</think>answer {i}" for i in range(3)]
    tokens = sum(len(fake.ids(t)) for t in texts)
    r = fake.client.chat.completions.create(model="fake", messages=ASK, n=3,
                                            extra_headers=fake.replies(*texts))
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [(_reasoning_of(c.message), c.message.content) for c in r.choices] == \
        [(f"thought {i}", f"answer {i}") for i in range(3)]
    assert r.usage.completion_tokens == tokens
    assert len({s.request_id for s in fake.engine.starts[-3:]}) == 3
    got, usage = _stream(fake, texts, n=3)
    assert sorted(got) == [0, 1, 2]
    assert [tuple(got[i][:3]) for i in range(3)] == \
        [(f"thought {i}", f"answer {i}", "stop") for i in range(3)]
    assert usage.completion_tokens == tokens


def test_unknown_parser_refused_at_start(tmp_path):
    model = tmp_path / "glm4_moe"
    shutil.copytree(ROOT / "tests/fixtures/tokenizer/glm4_moe", model)
    with pytest.raises(RuntimeError) as e:
        stack.start_frontend("127.0.0.1:1", model, tmp_path / "logs",
                             extra=("--reasoning-parser", "nope"))
    assert "no reasoning parser 'nope'" in str(e.value)
    assert "glm45, qwen3, deepseek_r1, deepseek_v4" in str(e.value)


def test_a_failed_choice_fails_the_request(tmp_path):
    """n = 2 where choice 1's generation fails (the fake engine's FAIL_AFTER script) and choice
    0's does not: the request fails cleanly (500, or the stream's error event), choice 0's call
    is cancelled, and the next request is answered."""
    f, server = _start(tmp_path, "glm4_moe", "glm45")
    try:
        base = f.url[: -len("/v1")]
        long = list(range(10, 210))  # choice 0: 200 tokens, far longer than choice 1 lives

        def post(body, rid):
            f.engine.replies[f"cmpl-{rid}-0"] = long
            return httpx.post(f"{base}/v1/completions", headers={"X-Request-Id": rid},
                              json={"model": "fake", "prompt": [FAIL_AFTER, 0], "n": 2,
                                    "max_tokens": 300, **body}, timeout=30)

        cancels = len(f.engine.cancels)
        r = post({}, "whole")
        assert r.status_code == 500 and "lost experts" in r.json()["error"]["message"]
        r = post({"stream": True}, "streamed")
        assert r.status_code == 200
        events = [e[len("data: "):] for e in r.text.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        assert "lost experts" in json.loads(events[-2])["error"]["message"]
        assert stack.wait_until(lambda: len(f.engine.cancels) >= cancels + 2, 10)
        ok = f.client.completions.create(model="fake", prompt="hi", max_tokens=20, n=2,
                                         extra_headers=f.replies("a b c", "d e f",
                                                                 prefix="cmpl-"))
        assert [c.text for c in ok.choices] == ["a b c", "d e f"]
    finally:
        f.fe.stop()
        server.close()


# ---- DeepSeek-V4 (--reasoning-parser deepseek_v4): the mode of each request, from its
# chat_template_kwargs, decides both the prompt (the test template renders V4's encoding) and the
# split of the answer.

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}
DSML_CALL = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
             '<｜DSML｜parameter name="city" string="true">Oslo</｜DSML｜parameter>\n'
             "</｜DSML｜invoke>\n</｜DSML｜tool_calls>")
HISTORY = [{"role": "user", "content": "Hi"},
           {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
           {"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    f, server = _start(tmp_path_factory.mktemp("reasoning-deepseek_v4"), "deepseek_v4",
                       "deepseek_v4")
    yield f
    f.fe.stop()
    server.close()


def _ask(fake, said, **kw):
    r = fake.client.chat.completions.create(model="fake", messages=kw.pop("messages", ASK),
                                            extra_headers=fake.replies(said), **kw)
    return r.choices[0], fake.last_prompt()


def test_deepseek_v4_thinking_by_default(v4):
    """No kwargs: thinking mode. The prompt ends with <｜Assistant｜><think>; the answer starts
    inside the reasoning, up to </think>; streamed the same."""
    for extra in ({}, {"chat_template_kwargs": {"enable_thinking": True}},
                  {"chat_template_kwargs": {"thinking": True}}):
        choice, prompt = _ask(v4, "Two and two.</think>It is 4.", extra_body=extra)
        assert prompt.endswith("<｜User｜>What is 2+2?<｜Assistant｜><think>"), prompt
        assert (_reasoning_of(choice.message), choice.message.content) == \
            ("Two and two.", "It is 4."), extra
        got, _ = _stream(v4, ["Two and two.</think>It is 4."], extra_body=extra)
        assert tuple(got[0][:3]) == ("Two and two.", "It is 4.", "stop")


def test_deepseek_v4_chat_mode(v4):
    """thinking false (either name), or reasoning_effort none: chat mode. The prompt ends with
    <｜Assistant｜></think>; the answer is content (no reasoning_content)."""
    for kwargs in ({"thinking": False}, {"enable_thinking": False},
                   {"thinking": True, "reasoning_effort": "none"}):
        extra = {"chat_template_kwargs": kwargs}
        choice, prompt = _ask(v4, "It is 4.", extra_body=extra)
        assert prompt.endswith("<｜User｜>What is 2+2?<｜Assistant｜></think>"), prompt
        assert (_reasoning_of(choice.message), choice.message.content) == (None, "It is 4."), \
            kwargs
        got, _ = _stream(v4, ["It is 4."], extra_body=extra)
        assert tuple(got[0][:3]) == ("", "It is 4.", "stop") and "reasoning" not in got[0][3]


def test_deepseek_v4_earlier_reasoning_dropped_or_kept(v4):
    """An earlier assistant turn's reasoning_content: dropped in thinking mode (its turn gets
    </think>), kept with drop_thinking false or with tools (every turn then opens <think>), never
    rendered in chat mode."""
    _, dropped = _ask(v4, "r</think>4", messages=HISTORY)
    assert "<｜User｜>Hi<｜Assistant｜></think>Hello!<｜end▁of▁sentence｜>" in dropped
    assert "Greet back." not in dropped and dropped.endswith("<｜Assistant｜><think>")
    _, kept = _ask(v4, "r</think>4", messages=HISTORY,
                   extra_body={"chat_template_kwargs": {"drop_thinking": False}})
    assert "<｜User｜>Hi<｜Assistant｜><think>Greet back.</think>Hello!<｜end▁of▁sentence｜>" in kept
    _, with_tools = _ask(v4, "r</think>4", messages=HISTORY, tools=[WEATHER])
    assert "<｜Assistant｜><think>Greet back.</think>Hello!" in with_tools
    _, chat = _ask(v4, "4", messages=HISTORY,
                   extra_body={"chat_template_kwargs": {"thinking": False}})
    assert "<｜User｜>Hi<｜Assistant｜></think>Hello!<｜end▁of▁sentence｜>" in chat
    assert "Greet back." not in chat and chat.endswith("<｜Assistant｜></think>")


def test_deepseek_v4_tool_calls_after_the_reasoning(v4):
    """A DSML block after </think>, or written before the reasoning is closed (the block ends
    it): the call is parsed from the content, never from the reasoning; streamed the same."""
    for said, reasoning in (("Ask the tool.</think>" + DSML_CALL, "Ask the tool."),
                            ("Ask the tool." + DSML_CALL, "Ask the tool.\n\n")):
        choice, _ = _ask(v4, said, tools=[WEATHER])
        m = choice.message
        assert (_reasoning_of(m), m.content, choice.finish_reason) == \
            (reasoning, None, "tool_calls"), said
        assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == \
            [("get_weather", {"city": "Oslo"})]
        chunks = list(v4.client.chat.completions.create(
            model="fake", messages=ASK, tools=[WEATHER], stream=True,
            extra_headers=v4.replies(said)))
        streamed = "".join(_reasoning_of(c.choices[0].delta) or "" for c in chunks if c.choices)
        calls = [tc.function.name for c in chunks for tc in (c.choices[0].delta.tool_calls or [])
                 if tc.id]
        assert (streamed, calls, chunks[-1].choices[0].finish_reason) == \
            (reasoning, ["get_weather"], "tool_calls")


def test_deepseek_v4_forced_call_after_the_reasoning(v4):
    """A forced call (tool_choice required) is constrained after the reasoning: the engine's
    reasoning block starts inside the output in thinking mode, not in chat mode."""
    for kwargs, inside in (({}, True), ({"thinking": False}, False)):
        v4.client.chat.completions.create(
            model="fake", messages=ASK, tools=[WEATHER], tool_choice="required",
            extra_body={"chat_template_kwargs": kwargs},
            extra_headers=v4.replies("r</think>" + DSML_CALL if inside else DSML_CALL))
        block = v4.engine.starts[-1].sampling.constraint_after_reasoning
        assert (block.start, block.end, block.output_starts_inside) == \
            ("<think>", "</think>", inside), kwargs


def test_deepseek_v4_add_special_tokens(v4):
    """vLLM's add_special_tokens (DeepSeek-V4's tokenizer adds its BOS): on chat false by default
    (the rendering has its own BOS), true adds the tokenizer's on top; on completions true by
    default, false leaves a text prompt's out."""
    bos = v4.tok.encode("", add_special_tokens=True)
    assert len(bos) == 1
    for extra, n in (({}, 1), ({"add_special_tokens": False}, 1),
                     ({"add_special_tokens": True}, 2)):
        _ask(v4, "Four.", extra_body=extra)
        got = list(v4.engine.starts[-1].prompt_token_ids)
        assert got[:n] == bos * n and got[n] != bos[0], extra
    for extra, first in (({}, bos), ({"add_special_tokens": True}, bos),
                         ({"add_special_tokens": False}, [])):
        v4.client.completions.create(model="fake", prompt="Hello there", max_tokens=2,
                                     extra_body=extra,
                                     extra_headers=v4.replies("Hi.", prefix="cmpl-"))
        assert list(v4.engine.starts[-1].prompt_token_ids) == \
            first + v4.tok.encode("Hello there", add_special_tokens=False), extra


# ---- reasoning_effort: the top-level field (vLLM's: low, medium, high) reaches the chat template
# as its `reasoning_effort`, as chat_template_kwargs.reasoning_effort does. The test template (the
# glm4_moe fixture's) writes the value it gets at the end of the prompt.

EFFORT_MARK = "[reasoning effort: {}]"


@pytest.fixture(scope="module")
def effort(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reasoning-effort")
    model = tmp / "glm4_moe"
    shutil.copytree(ROOT / "tests/fixtures/tokenizer/glm4_moe", model)
    conf = json.loads((model / "tokenizer_config.json").read_text())
    conf["chat_template"] += ("{% if reasoning_effort is defined %}"
                              + EFFORT_MARK.format("{{ reasoning_effort }}") + "{% endif %}")
    (model / "tokenizer_config.json").write_text(json.dumps(conf, ensure_ascii=False))
    engine = FakeEngine(step_s=0.002)
    server = ThreadedServer(engine).start()
    try:
        fe, url = stack.start_frontend(server.target, model, tmp / "logs")
    except BaseException:
        server.close()
        raise
    f = Fake("glm4_moe", None, engine, fe, url, model)
    yield f
    f.fe.stop()
    server.close()


def test_reasoning_effort_reaches_the_template(effort):
    """reasoning_effort (the openai SDK's own argument) is the template's reasoning_effort,
    streamed or not; chat_template_kwargs.reasoning_effort the same; both, when they agree."""
    for value in ("low", "medium", "high"):
        r = effort.client.chat.completions.create(model="fake", messages=ASK,
                                                  reasoning_effort=value,
                                                  extra_headers=effort.replies("Four."))
        assert r.choices[0].message.content == "Four."
        assert effort.last_prompt().endswith(EFFORT_MARK.format(value)), effort.last_prompt()
    chunks = list(effort.client.chat.completions.create(
        model="fake", messages=ASK, reasoning_effort="high", stream=True,
        extra_headers=effort.replies("Four.")))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Four."
    assert effort.last_prompt().endswith(EFFORT_MARK.format("high"))
    for kw in ({"extra_body": {"chat_template_kwargs": {"reasoning_effort": "low"}}},
               {"reasoning_effort": "low",
                "extra_body": {"chat_template_kwargs": {"reasoning_effort": "low"}}}):
        effort.client.chat.completions.create(model="fake", messages=ASK,
                                              extra_headers=effort.replies("Four."), **kw)
        assert effort.last_prompt().endswith(EFFORT_MARK.format("low")), kw
    effort.client.chat.completions.create(model="fake", messages=ASK,
                                          extra_headers=effort.replies("Four."))
    assert "reasoning effort" not in effort.last_prompt()
    # /tokenize renders the messages the same way.
    r = httpx.post(effort.url[: -len("/v1")] + "/tokenize",
                   json={"messages": ASK, "reasoning_effort": "medium"}, timeout=30)
    assert r.status_code == 200
    assert effort.tok.decode(r.json()["tokens"], skip_special_tokens=False).endswith(
        EFFORT_MARK.format("medium"))


def test_reasoning_effort_refusals(effort):
    """A value outside low/medium/high is a 400 naming the field; the top-level field and
    chat_template_kwargs.reasoning_effort that differ, a 400 naming both. Nothing reaches the
    engine."""
    started = len(effort.engine.starts)
    for value in ("extreme", "minimal", 3):
        with pytest.raises(openai.BadRequestError) as e:
            effort.client.chat.completions.create(model="fake", messages=ASK,
                                                  extra_body={"reasoning_effort": value})
        err = e.value.body
        assert err["param"] == "reasoning_effort" and "reasoning_effort" in err["message"], err
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            effort.client.chat.completions.create(
                model="fake", messages=ASK, reasoning_effort="high", stream=stream,
                extra_body={"chat_template_kwargs": {"reasoning_effort": "low"}})
        err = e.value.body
        assert err["param"] == "reasoning_effort", err
        assert "chat_template_kwargs.reasoning_effort" in err["message"] and \
            "'high'" in err["message"] and "'low'" in err["message"], err
    r = httpx.post(effort.url[: -len("/v1")] + "/tokenize",
                   json={"messages": ASK, "reasoning_effort": "max"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
    assert len(effort.engine.starts) == started
