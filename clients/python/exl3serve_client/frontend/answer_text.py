"""A chat answer's text parsed as it streams in: its reasoning split off first (reasoning.py, with
--reasoning-parser), then its content parsed for tool calls (tool_calls.py, where the request has
tools), so that a `<tool_call>` inside the reasoning is reasoning, not a call."""

from __future__ import annotations

from typing import Optional

from . import reasoning as rs
from . import tool_calls as tc
from .render import DeltaEvent, ToolCall, fold_tool_calls
from .validation import PreparedRequest


class AnswerTextParser:
    """One choice's text into its events: Reasoning (unless include_reasoning is false), content
    (tool_calls.Content) and the tool calls' events."""

    def __init__(self, req: PreparedRequest) -> None:
        self.reasoning = None if req.reasoning is None else req.reasoning.parser()
        self.include_reasoning = req.reasoning is not None and req.reasoning.include
        self.calls = None if req.tool_use is None else req.tool_use.parser()

    @property
    def called(self) -> bool:
        """The answer made tool calls (finish_reason tool_calls)."""
        return self.calls is not None and bool(self.calls.calls)

    def push(self, text: str, final: bool = False) -> list[DeltaEvent]:
        if self.reasoning is None:
            return self._content(text, final)
        out: list[DeltaEvent] = []
        content: list[str] = []
        for e in self.reasoning.push(text, final):
            if isinstance(e, rs.Reasoning):
                if self.include_reasoning:
                    out.append(e)
            else:
                content.append(e.text)
        if content or final:
            out.extend(self._content("".join(content), final))
        return out

    def _content(self, text: str, final: bool) -> list[DeltaEvent]:
        if self.calls is not None:
            return list(self.calls.push(text, final))
        return [tc.Content(text)] if text else []


def whole_answer_text(req: PreparedRequest, text: str
                      ) -> tuple[str, Optional[str], list[ToolCall]]:
    """A whole chat answer's (content, reasoning or None, tool calls)."""
    events = AnswerTextParser(req).push(text, final=True)
    reasoning = "".join(e.text for e in events if isinstance(e, rs.Reasoning))
    content, calls = fold_tool_calls([e for e in events if not isinstance(e, rs.Reasoning)])
    return content, reasoning or None, calls
