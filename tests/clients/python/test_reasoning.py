"""The reasoning split (frontend/reasoning.py) on crafted model text: what each format makes of a
whole text, and that the same comes out however the text is split (at every character, and one
character at a time), with no text given out while it could still be the start of a tag."""

from __future__ import annotations

import pytest

from exl3serve_client.frontend.reasoning import (THINK_END, THINK_START, Content, Reasoning,
                                                 ReasoningFormat, ReasoningParser,
                                                 split_reasoning, thinking_mode)

GLM, QWEN, R1 = ReasoningFormat.GLM45, ReasoningFormat.QWEN3, ReasoningFormat.DEEPSEEK_R1
V4 = ReasoningFormat.DEEPSEEK_V4
# DeepSeek-V4's modes: the parser as a request in thinking mode (the default) or chat mode gets it.
V4_THINKING = (V4, V4.starts_in_reasoning({}))
V4_CHAT = (V4, V4.starts_in_reasoning({"thinking": False}))
DSML_BLOCK = ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="now">\n\n</｜DSML｜invoke>\n'
              "</｜DSML｜tool_calls>")

# (format, model text, reasoning, content)
CASES = [
    (GLM, "<think>Let me see: 2+2.</think>It is 4.", "Let me see: 2+2.", "It is 4."),
    (QWEN, "<think>\nhmm\n</think>\n\nFour.", "\nhmm\n", "\n\nFour."),
    (QWEN, "\n<think>a</think>b", "a", "b"),               # leading whitespace before <think>
    (GLM, "No thinking here.", "", "No thinking here."),   # enable_thinking false: all content
    (GLM, "<thin>not a tag</think>", "", "<thin>not a tag</think>"),
    (GLM, "<think>cut off by max_tokens", "cut off by max_tokens", ""),
    (GLM, "<think></think>Just the answer", "", "Just the answer"),
    (GLM, "<think>x</think>y</think>z", "x", "y</think>z"),  # only the first closes
    (GLM, "<think>a < b </thinking></think>ok", "a < b </thinking>", "ok"),
    (R1, "the prompt opened it</think>Answer", "the prompt opened it", "Answer"),
    (R1, "<think>repeated tag</think>Answer", "repeated tag", "Answer"),
    (R1, "never closed", "never closed", ""),
    (GLM, "", "", ""),
    (GLM, "<thi", "", "<thi"),                             # a tag's start at the end: content
    (R1, "abc</thi", "abc</thi", ""),
    (QWEN, "<think>é✓ 中文</think>ü", "é✓ 中文", "ü"),
    # deepseek_v4, thinking mode: the prompt ends with <think>; deepseek_r1's rule, and a DSML
    # calls block ends the reasoning (the block is content, for the tool-call parser).
    (V4_THINKING, "Weigh it.</think>Answer", "Weigh it.", "Answer"),
    (V4_THINKING, "<think>repeated</think>A", "repeated", "A"),
    (V4_THINKING, "never closed", "never closed", ""),
    (V4_THINKING, "r</think>" + DSML_BLOCK, "r", DSML_BLOCK),
    (V4_THINKING, "call now" + DSML_BLOCK, "call now\n\n", DSML_BLOCK[2:]),
    (V4_THINKING, "a <｜DSML｜tool_call", "a <｜DSML｜tool_call", ""),
    # deepseek_v4, chat mode: the prompt ends with </think>; the answer is content unless it
    # opens with <think> (glm45's rule).
    (V4_CHAT, "Plain answer", "", "Plain answer"),
    (V4_CHAT, "<think>x</think>y", "x", "y"),
    (V4_CHAT, "a</think>b" + DSML_BLOCK, "", "a</think>b" + DSML_BLOCK),
]


def fold(events):
    reasoning, content = [], []
    for e in events:
        assert e.text, "an empty event"
        (reasoning if isinstance(e, Reasoning) else content).append(e.text)
    return "".join(reasoning), "".join(content)


def _parser(fmt):
    """A parser of `fmt`: a format, or (format, starts_inside) for deepseek_v4's modes."""
    return ReasoningParser(*fmt) if isinstance(fmt, tuple) else ReasoningParser(fmt)


@pytest.mark.parametrize("fmt,text,reasoning,content", CASES)
def test_whole_text(fmt, text, reasoning, content):
    fmt_, starts_inside = fmt if isinstance(fmt, tuple) else (fmt, None)
    assert split_reasoning(fmt_, text, starts_inside) == (reasoning, content)
    assert fold(_parser(fmt).push(text, final=True)) == (reasoning, content)


@pytest.mark.parametrize("fmt,text,reasoning,content", CASES)
def test_any_split_gives_the_same(fmt, text, reasoning, content):
    for cut in range(len(text) + 1):
        p = _parser(fmt)
        events = p.push(text[:cut]) + p.push(text[cut:], final=True)
        assert fold(events) == (reasoning, content), cut
    p = _parser(fmt)
    events = [e for ch in text for e in p.push(ch)] + p.push("", final=True)
    assert fold(events) == (reasoning, content)


def test_reasoning_before_content_and_tags_never_shown():
    text = "<think>step one, step two</think>the answer"
    p = ReasoningParser(GLM)
    seen = []
    for ch in text:
        for e in p.push(ch):
            seen.append(e)
            assert THINK_START not in e.text and THINK_END not in e.text
            assert "<" not in e.text  # both tags' starts are held until decided
    seen += p.push("", final=True)
    kinds = [type(e) for e in seen]
    assert kinds.index(Content) > max(i for i, k in enumerate(kinds) if k is Reasoning)


def test_held_until_decided():
    p = ReasoningParser(GLM)
    assert p.push("<th") == []              # could still be <think>
    assert p.push("ink>abc</") == [Reasoning("abc")]   # </ could be </think>
    assert p.push("thin") == []
    assert p.push("k>done") == [Content("done")]
    p = ReasoningParser(QWEN)
    assert p.push("  ") == []               # whitespace before a possible <think>
    assert p.push("Hi") == [Content("  Hi")]
    p = ReasoningParser(R1)
    assert p.push("x</think") == [Reasoning("x")]
    assert p.push("y") == [Reasoning("</thinky")]


def test_names_are_vllms():
    assert [f.value for f in ReasoningFormat] == ["glm45", "qwen3", "deepseek_r1", "deepseek_v4"]


def test_deepseek_v4_mode_from_the_template_kwargs():
    """As vLLM's deepseek_v4 parser and tokenizer read chat_template_kwargs: thinking unless
    `thinking` / `enable_thinking` are given and false, or reasoning_effort is "none"."""
    assert thinking_mode(None) and thinking_mode({}) and thinking_mode({"drop_thinking": False})
    assert thinking_mode({"thinking": True}) and thinking_mode({"enable_thinking": True})
    assert thinking_mode({"thinking": False, "enable_thinking": True})
    assert not thinking_mode({"thinking": False})
    assert not thinking_mode({"enable_thinking": False})
    assert not thinking_mode({"thinking": True, "reasoning_effort": "none"})
    assert thinking_mode({"reasoning_effort": "max"})
    assert V4.starts_in_reasoning({}) and not V4.starts_in_reasoning({"thinking": False})
    # The other formats do not depend on the request.
    assert R1.starts_in_reasoning({"thinking": False})
    assert not GLM.starts_in_reasoning({}) and not QWEN.starts_in_reasoning({"thinking": True})


def test_deepseek_v4_held_until_decided():
    p = ReasoningParser(*V4_THINKING)
    assert p.push("plan\n\n<｜DSML｜tool") == [Reasoning("plan\n\n")]  # could be the block
    assert p.push("_calls>\n") == [Content("<｜DSML｜tool_calls>\n")]
