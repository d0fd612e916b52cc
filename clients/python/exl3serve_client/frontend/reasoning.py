"""Reasoning in the model's text: the `<think>...</think>` convention of thinking models, split from
the answer's content as the text streams in (exl3serve-openai --reasoning-parser, vLLM's names).

- glm45 (GLM-4.5 and the GLM family after it) and qwen3 (Qwen3's thinking models): the reasoning is
  what the output opens with `<think>` (leading whitespace allowed) and closes with `</think>`;
  an output that does not open with `<think>` is all content (as with enable_thinking false).
- deepseek_r1 (DeepSeek-R1, QwQ, and templates that put `<think>` in the prompt): the output starts
  inside the reasoning, whether or not it repeats `<think>`; everything before `</think>` is
  reasoning, all of it if the tag never comes.

ReasoningParser.push takes text as it comes (any split) and returns Reasoning and Content events
(the tags themselves in neither). Text that could still be the start of a tag is held back until
it is decided, so the events of a text are the same however it is split, joined
(tests/clients/python/test_reasoning.py splits at every character)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Union

from .stream_tags import tag_prefix_length

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningFormat(enum.Enum):
    """A reasoning format, by vLLM's --reasoning-parser name."""
    GLM45 = "glm45"
    QWEN3 = "qwen3"
    DEEPSEEK_R1 = "deepseek_r1"

    @property
    def starts_in_reasoning(self) -> bool:
        """The output starts inside the reasoning (its `<think>` may be in the prompt)."""
        return self is ReasoningFormat.DEEPSEEK_R1


REASONING_PARSERS = tuple(f.value for f in ReasoningFormat)


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
    """One answer's text split into reasoning and content as it streams in."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
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
            elif self.fmt.starts_in_reasoning:
                self.where = _Where.REASONING
            else:
                self.where = _Where.CONTENT
        if self.where is _Where.REASONING:
            end = held.find(THINK_END)
            if end >= 0:
                if end:
                    out.append(Reasoning(held[:end]))
                self.where = _Where.CONTENT
                held = held[end + len(THINK_END):]
            else:
                keep = 0 if final else tag_prefix_length(held, THINK_END)
                if len(held) > keep:
                    out.append(Reasoning(held[:len(held) - keep]))
                self.held = held[len(held) - keep:]
                return out
        if held:
            out.append(Content(held))
        return out


def split_reasoning(fmt: ReasoningFormat, text: str) -> tuple[str, str]:
    """A whole answer's (reasoning, content)."""
    reasoning: list[str] = []
    content: list[str] = []
    for e in ReasoningParser(fmt).push(text, final=True):
        (reasoning if isinstance(e, Reasoning) else content).append(e.text)
    return "".join(reasoning), "".join(content)
