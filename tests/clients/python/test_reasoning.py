"""The reasoning split (frontend/reasoning.py) on crafted model text: what each format makes of a
whole text, and that the same comes out however the text is split (at every character, and one
character at a time), with no text given out while it could still be the start of a tag."""

from __future__ import annotations

import pytest

from exl3serve_client.frontend.reasoning import (THINK_END, THINK_START, Content, Reasoning,
                                                 ReasoningFormat, ReasoningParser,
                                                 split_reasoning)

GLM, QWEN, R1 = ReasoningFormat.GLM45, ReasoningFormat.QWEN3, ReasoningFormat.DEEPSEEK_R1

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
]


def fold(events):
    reasoning, content = [], []
    for e in events:
        assert e.text, "an empty event"
        (reasoning if isinstance(e, Reasoning) else content).append(e.text)
    return "".join(reasoning), "".join(content)


@pytest.mark.parametrize("fmt,text,reasoning,content", CASES)
def test_whole_text(fmt, text, reasoning, content):
    assert split_reasoning(fmt, text) == (reasoning, content)
    assert fold(ReasoningParser(fmt).push(text, final=True)) == (reasoning, content)


@pytest.mark.parametrize("fmt,text,reasoning,content", CASES)
def test_any_split_gives_the_same(fmt, text, reasoning, content):
    for cut in range(len(text) + 1):
        p = ReasoningParser(fmt)
        events = p.push(text[:cut]) + p.push(text[cut:], final=True)
        assert fold(events) == (reasoning, content), cut
    p = ReasoningParser(fmt)
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
    assert [f.value for f in ReasoningFormat] == ["glm45", "qwen3", "deepseek_r1"]
