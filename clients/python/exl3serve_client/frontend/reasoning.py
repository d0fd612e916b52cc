"""Reasoning in the model's text: the `<think>...</think>` convention of thinking models, split from
the answer's content as the text streams in (exl3serve-openai --reasoning-parser, vLLM's names).

- glm45 (GLM-4.5 and the GLM family after it) and qwen3 (Qwen3's thinking models): the reasoning is
  what the output opens with `<think>` (leading whitespace allowed) and closes with `</think>`;
  an output that does not open with `<think>` is all content (as with enable_thinking false).
- deepseek_r1 (DeepSeek-R1, QwQ, and templates that put `<think>` in the prompt): the output starts
  inside the reasoning, whether or not it repeats `<think>`; everything before `</think>` is
  reasoning, all of it if the tag never comes.
- deepseek_v4 (DeepSeek-V4, whose encoding ends the prompt with `<think>` in thinking mode and
  `</think>` in chat mode): the request's mode decides (thinking_mode below, from its
  chat_template_kwargs, as vLLM's parser of that name reads them). Thinking: deepseek_r1's rule,
  and a DSML tool-call block (`<｜DSML｜tool_calls>`) also ends the reasoning, the block itself
  content (the model may call tools without closing its reasoning). Chat: glm45's rule.

ReasoningParser.push takes text as it comes (any split) and returns Reasoning and Content events
(the tags themselves in neither). Text that could still be the start of a tag is held back until
it is decided, so the events of a text are the same however it is split, joined
(tests/clients/python/test_reasoning.py splits at every character)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Optional, Union

from .stream_tags import tag_prefix_length

THINK_START = "<think>"
THINK_END = "</think>"


# DeepSeek-V4's DSML tool-call block: where it starts, the reasoning has ended (deepseek_v4).
DSML_CALLS_START = "<｜DSML｜tool_calls>"


class ReasoningFormat(enum.Enum):
    """A reasoning format, by vLLM's --reasoning-parser name."""
    GLM45 = "glm45"
    QWEN3 = "qwen3"
    DEEPSEEK_R1 = "deepseek_r1"
    DEEPSEEK_V4 = "deepseek_v4"

    def starts_in_reasoning(self, template_kwargs: Optional[dict[str, Any]]) -> bool:
        """The output of a request with these chat_template_kwargs starts inside the reasoning
        (its `<think>` is in the prompt)."""
        if self is ReasoningFormat.DEEPSEEK_R1:
            return True
        if self is ReasoningFormat.DEEPSEEK_V4:
            return thinking_mode(template_kwargs)
        return False

    @property
    def ends_reasoning(self) -> tuple[str, ...]:
        """Text that ends the reasoning without `</think>`, itself the content's start."""
        return (DSML_CALLS_START,) if self is ReasoningFormat.DEEPSEEK_V4 else ()


REASONING_PARSERS = tuple(f.value for f in ReasoningFormat)


def thinking_mode(template_kwargs: Optional[dict[str, Any]]) -> bool:
    """DeepSeek-V4's mode for a request's chat_template_kwargs, as vLLM reads them for it (and the
    test models' DeepSeek-V4 template, make_tokenizer.py): thinking where `thinking` or
    `enable_thinking` is true, or where neither is given; chat where those given are false, or
    where `reasoning_effort` is "none"."""
    kw = template_kwargs or {}
    if kw.get("reasoning_effort") == "none":
        return False
    if "thinking" not in kw and "enable_thinking" not in kw:
        return True
    return bool(kw.get("thinking")) or bool(kw.get("enable_thinking"))


@dataclass(frozen=True)
class Reasoning:
    """Text of the model's reasoning."""
    text: str


@dataclass(frozen=True)
class Content:
    """Text of the answer after (or without) the reasoning."""
    text: str


ReasoningEvent = Union[Reasoning, Content]


class _Where(enum.Enum):
    OPENING = enum.auto()    # before the output's first non-space text decides whether it opens <think>
    REASONING = enum.auto()  # inside the reasoning, until </think>
    CONTENT = enum.auto()    # past the reasoning (or without any): everything is content


class ReasoningParser:
    """One answer's text split into reasoning and content as it streams in; `starts_inside`: the
    output starts inside the reasoning (ReasoningFormat.starts_in_reasoning of the request)."""

    def __init__(self, fmt: ReasoningFormat, starts_inside: Optional[bool] = None) -> None:
        self.fmt = fmt
        self.starts_inside = fmt.starts_in_reasoning(None) if starts_inside is None \
            else starts_inside
        self.where = _Where.OPENING
        self.held = ""  # text not yet decided

    def push(self, text: str, final: bool = False) -> list[ReasoningEvent]:
        """The events that `text` (the next part of the answer) decides; `final`: the answer ends
        with it, and everything held is given out."""
        held = self.held + text
        self.held = ""
        out: list[ReasoningEvent] = []
        if self.where is _Where.OPENING:
            body = held.lstrip()
            if body.startswith(THINK_START):
                self.where = _Where.REASONING
                held = body[len(THINK_START):]
            elif (not body or THINK_START.startswith(body)) and not final:
                self.held = held  # still maybe <think>
                return out
            elif self.starts_inside:
                self.where = _Where.REASONING
            else:
                self.where = _Where.CONTENT
        if self.where is _Where.REASONING:
            # The first end: </think> (dropped), or text that ends the reasoning and is content.
            ends = [(i, t) for t in (THINK_END, *self.fmt.ends_reasoning)
                    if (i := held.find(t)) >= 0]
            if ends:
                end, tag = min(ends)
                if end:
                    out.append(Reasoning(held[:end]))
                self.where = _Where.CONTENT
                held = held[end + len(tag):] if tag == THINK_END else held[end:]
            else:
                keep = 0 if final else max(tag_prefix_length(held, t)
                                           for t in (THINK_END, *self.fmt.ends_reasoning))
                if len(held) > keep:
                    out.append(Reasoning(held[:len(held) - keep]))
                self.held = held[len(held) - keep:]
                return out
        if held:
            out.append(Content(held))
        return out


def split_reasoning(fmt: ReasoningFormat, text: str,
                    starts_inside: Optional[bool] = None) -> tuple[str, str]:
    """A whole answer's (reasoning, content)."""
    reasoning: list[str] = []
    content: list[str] = []
    for e in ReasoningParser(fmt, starts_inside).push(text, final=True):
        (reasoning if isinstance(e, Reasoning) else content).append(e.text)
    return "".join(reasoning), "".join(content)
