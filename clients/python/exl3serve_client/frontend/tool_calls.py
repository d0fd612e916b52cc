"""Tool calls in the model's text: the formats chat templates teach models, parsed into OpenAI's
`tool_calls` as the text streams in.

- hermes (Qwen's templates): `<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`
- glm45 (GLM-4.5's): `<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>...</tool_call>`,
  each value JSON-decoded where the function's schema gives the argument a type other than string
  and the value parses as JSON, else kept as a string.

ToolCallParser.push takes text as it comes (any split) and returns events: content (text outside
the calls), a call's start (its id and name, once the name is known) and fragments of its
arguments (JSON text that, joined, is the arguments object). Text that could still begin
`<tool_call>` is held back until it is decided. The events of a text are the same however it is
split, joined (tests/clients/python/test_tool_calls.py splits at every byte)."""

from __future__ import annotations

import enum
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Union

from .stream_tags import tag_prefix_length

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
_ARG_KEY, _ARG_KEY_END = "<arg_key>", "</arg_key>"
_ARG_VALUE, _ARG_VALUE_END = "<arg_value>", "</arg_value>"


class ToolCallFormat(enum.Enum):
    """A tool-call format, by vLLM's --tool-call-parser name."""
    HERMES = "hermes"
    GLM45 = "glm45"


# --tool-call-parser: a format, or "auto": the one the model's chat template writes.
TOOL_CALL_PARSERS = ("auto", *(f.value for f in ToolCallFormat))


def template_tool_call_format(template: Optional[str]) -> Optional[ToolCallFormat]:
    """The tool-call format a chat template teaches (None: it teaches none this module parses):
    GLM-4.5's argument tags, else Qwen's JSON in <tool_call> tags."""
    if not template or CALL_START not in template:
        return None
    return ToolCallFormat.GLM45 if _ARG_KEY in template else ToolCallFormat.HERMES


def tool_call_format(parser: str, template: Optional[str]) -> Optional[ToolCallFormat]:
    """The format of --tool-call-parser `parser` for a model whose chat template is `template`."""
    if parser == "auto":
        return template_tool_call_format(template)
    return ToolCallFormat(parser)


@dataclass(frozen=True)
class Content:
    """Text of the answer outside tool calls."""
    text: str


@dataclass(frozen=True)
class CallStart:
    """A tool call begins: its position among the answer's calls, id and function name."""
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    """A fragment of call `index`'s arguments (JSON text)."""
    index: int
    text: str


ToolCallEvent = Union[Content, CallStart, CallArguments]


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class _CallState(enum.Enum):
    OUTSIDE = enum.auto()     # in content, looking for <tool_call>
    NAME = enum.auto()        # inside a call, before its name is known
    ARGUMENTS = enum.auto()   # inside a call whose start was sent: its arguments
    UNPARSED = enum.auto()    # inside a call that started unlike its format: held to its end


class ToolCallParser:
    """One answer's text into content and tool calls (module doc). `schemas` maps function names to
    their `parameters` JSON schema (glm45's values are typed by it); with `parallel` False, calls
    after the first are parsed and dropped."""

    def __init__(self, fmt: ToolCallFormat, schemas: dict[str, Any], parallel: bool = True) -> None:
        self.fmt = fmt
        self.schemas = schemas
        self.parallel = parallel
        self.calls = 0           # calls started (CallStart sent)
        self._state = _CallState.OUTSIDE
        self._buf = ""           # text not yet turned into events
        self._spaces = ""        # content's trailing whitespace, held: sent before more content
        self._after_call = False  # a call ended and no content has followed yet
        self._name = ""          # the current call's function name
        self._sent_args = 0      # hermes: characters of the arguments' text sent
        self._args_open = False  # glm45: the arguments object's "{" sent
        self._dropping = False   # the current call is past the first and parallel is off
        self._out: list[ToolCallEvent] = []

    def push(self, text: str, final: bool = False) -> list[ToolCallEvent]:
        """The events `text` completes; with final, the answer's end: everything is decided."""
        self._buf += text
        while self._step(final):
            pass
        if final:
            # The answer's trailing whitespace is content only in an answer without calls.
            if self._spaces and not self.calls:
                self._out.append(Content(self._spaces))
            self._spaces = ""
        out, self._out = self._out, []
        return out

    # ---- what the steps send -----------------------------------------------------------------
    def _content(self, text: str) -> None:
        """Content: whitespace around calls is not (held until more content follows)."""
        if self._after_call:
            text = text.lstrip()
        if not text:
            return
        body = text.rstrip()
        if body:
            self._out.append(Content(self._spaces + body))
            self._spaces = ""
            self._after_call = False
        self._spaces += text[len(body):]

    def _start_call(self, name: str) -> None:
        self._spaces = ""
        self._name = name
        self._dropping = not self.parallel and self.calls >= 1
        self._sent_args = 0
        self._args_open = False
        if not self._dropping:
            self._out.append(CallStart(self.calls, new_call_id(), name))
            self.calls += 1
        self._state = _CallState.ARGUMENTS

    def _end_call(self) -> None:
        self._state = _CallState.OUTSIDE
        self._after_call = True

    def _arguments(self, text: str) -> None:
        if text and not self._dropping:
            self._out.append(CallArguments(self.calls - 1, text))

    # ---- the steps ------------------------------------------------------------------------------
    def _step(self, final: bool) -> bool:
        """Turns what it can of the buffer into events; True if it should be called again."""
        if self._state is _CallState.OUTSIDE:
            i = self._buf.find(CALL_START)
            if i >= 0:
                self._content(self._buf[:i])
                self._buf = self._buf[i + len(CALL_START):]
                self._state = _CallState.NAME
                return True
            keep = 0 if final else tag_prefix_length(self._buf, CALL_START)
            self._content(self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        if self._state is _CallState.UNPARSED:
            return self._unparsed(final)
        if self.fmt is ToolCallFormat.HERMES:
            return self._hermes(final)
        return self._glm45(final)

    def _unparsed(self, final: bool) -> bool:
        """A call that does not read as its format: at its end, JSON of a whole call (hermes, any
        key order) is still a call; anything else is content, tags and all."""
        end = self._buf.find(CALL_END)
        if end < 0 and not final:
            return False
        body = self._buf if end < 0 else self._buf[:end]
        self._buf = "" if end < 0 else self._buf[end + len(CALL_END):]
        self._state = _CallState.OUTSIDE
        whole = _json_call(body) if self.fmt is ToolCallFormat.HERMES else None
        if whole is not None:
            name, arguments = whole
            self._start_call(name)
            self._arguments(arguments)
            self._end_call()
        else:
            self._content(CALL_START + body + (CALL_END if end >= 0 else ""))
        return True

    # hermes ---------------------------------------------------------------------------------------
    _HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')

    def _hermes(self, final: bool) -> bool:
        if self._state is _CallState.NAME:
            m = self._HERMES_HEAD.match(self._buf)
            if m is None:
                # Not (yet) a head: decided at the call's end (_unparsed).
                if CALL_END not in self._buf and not final:
                    return False
                self._state = _CallState.UNPARSED
                return True
            try:
                name = json.loads('"' + m.group(1) + '"')
            except ValueError:
                self._state = _CallState.UNPARSED
                return True
            self._buf = self._buf[m.end():]
            self._start_call(name)
            return True
        # The arguments: the text up to the call object's closing brace, sent as it comes; its
        # tail that may be that brace (whitespace, "}", whitespace, the start of </tool_call>) is
        # held until decided.
        end = self._buf.find(CALL_END)
        body = self._buf if end < 0 else self._buf[:end]
        cut = len(body) if (end >= 0 or final) else len(body) - tag_prefix_length(body, CALL_END)
        cut = _before_closing_brace(body, cut)
        if self._sent_args == 0:  # the arguments' leading whitespace is not sent
            self._sent_args = min(len(body) - len(body.lstrip()), cut)
        self._arguments(body[self._sent_args:cut])
        self._sent_args = max(self._sent_args, cut)
        if end < 0 and not final:
            return False
        self._buf = "" if end < 0 else self._buf[end + len(CALL_END):]
        self._end_call()
        return True

    # glm45 ----------------------------------------------------------------------------------------
    _GLM_ARG = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)

    def _glm45(self, final: bool) -> bool:
        if self._state is _CallState.NAME:
            ends = [i for i in (self._buf.find("\n"), self._buf.find(_ARG_KEY),
                                self._buf.find(CALL_END)) if i >= 0]
            if not ends:
                if final:
                    self._state = _CallState.UNPARSED
                    return True
                return False
            name = self._buf[:min(ends)].strip()
            if not name or "<" in name:
                self._state = _CallState.UNPARSED
                return True
            self._buf = self._buf[min(ends):]
            self._start_call(name)
            return True
        while True:
            m = self._GLM_ARG.match(self._buf)
            if m is None:
                break
            key, value = m.group(1).strip(), m.group(2)
            typed = _typed_value(self.schemas.get(self._name), key, value)
            self._arguments(("{" if not self._args_open else ", ") + json.dumps(key, ensure_ascii=False)
                            + ": " + json.dumps(typed, ensure_ascii=False))
            self._args_open = True
            self._buf = self._buf[m.end():]
        # The call ends at </tool_call>; what is left before it is no whole argument: dropped.
        rest = self._buf.lstrip()
        end = rest.find(CALL_END)
        if end < 0 and not final:
            return False
        self._arguments("}" if self._args_open else "{}")
        self._buf = "" if end < 0 else rest[end + len(CALL_END):]
        self._end_call()
        return True


def _before_closing_brace(body: str, cut: int) -> int:
    """Where hermes' arguments text ends within body[:cut]: before trailing whitespace, one "}"
    (the call object's) and the whitespace before it."""
    while cut > 0 and body[cut - 1].isspace():
        cut -= 1
    if cut > 0 and body[cut - 1] == "}":
        cut -= 1
        while cut > 0 and body[cut - 1].isspace():
            cut -= 1
    return cut


def _json_call(body: str) -> Optional[tuple[str, str]]:
    """A hermes call's whole JSON ({"name": ..., "arguments": {...}}, in any key order): its name
    and arguments' JSON text; None if it is not one."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        return call["name"], arguments
    return call["name"], json.dumps(arguments, ensure_ascii=False)


def _typed_value(schema: Any, key: str, value: str) -> Any:
    """glm45's argument value: JSON-decoded where the schema gives the argument a type other than
    string and the value parses as JSON; else the text."""
    prop = schema.get("properties", {}).get(key) if isinstance(schema, dict) else None
    kinds = prop.get("type") if isinstance(prop, dict) else None
    kinds = [kinds] if isinstance(kinds, str) else (kinds or [])
    if not kinds or kinds == ["string"]:
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value
