"""Tool calls in the model's text: the formats chat templates teach models, parsed into OpenAI's
`tool_calls` as the text streams in.

- hermes (Qwen's templates): `<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`
- glm45 (GLM-4.5's): `<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>...</tool_call>`,
  each value JSON-decoded where the function's schema gives the argument a type other than string
  and the value parses as JSON, else kept as a string.
- qwen3_coder (Qwen3-Coder's and the later Qwen templates'): `<tool_call>\\n<function=NAME>\\n`, per
  argument `<parameter=K>\\nV\\n</parameter>\\n`, then `</function>\\n</tool_call>`; V is typed as
  glm45's values are (by the schema), and the templates' Python spellings of a non-string scalar
  (`True`, `False`, `None`) read as JSON's. As vLLM's qwen3_xml and qwen3_coder parsers read
  them, a `<function=NAME>` without its `<tool_call>` wrapper is a call up to `</function>`, and a
  parameter without `</parameter>` ends before the next `\n<parameter=` or `\n</function>`.
  vLLM's name qwen3_xml is this format (TOOL_CALL_PARSER_ALIASES).
- deepseek_v3 (DeepSeek-V3's): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
  \\n```json\\n{...}\\n```<｜tool▁call▁end｜>` (calls after the first preceded by "\\n"), then
  `<｜tool▁calls▁end｜>`.
- deepseek_v31 (DeepSeek-V3.1's): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`.
- deepseek_v4 / deepseek_v32 (DeepSeek's DSML, V4's and V3.2's encodings):
  `\\n\\n<｜DSML｜tool_calls>\\n` (V3.2: `function_calls`), per call
  `<｜DSML｜invoke name="NAME">\\n`, its parameters
  `<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>` joined by "\\n", then
  `\\n</｜DSML｜invoke>`; calls joined by "\\n"; then `\\n</｜DSML｜tool_calls>`. `string="true"`:
  V is the argument's text, raw; `string="false"`: V is its JSON (a value that does not parse as
  JSON is kept as text).
The DeepSeek formats' outer tags (calls begin / end, DSML's block) are markup: neither content nor
a call.

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
from typing import Any, Callable, Optional, Union

from .stream_tags import tag_prefix_length

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
_ARG_KEY, _ARG_KEY_END = "<arg_key>", "</arg_key>"
_ARG_VALUE, _ARG_VALUE_END = "<arg_value>", "</arg_value>"
# qwen3_coder's tags inside <tool_call>.
QWEN_FUNCTION, QWEN_FUNCTION_END = "<function=", "</function>"
QWEN_PARAMETER, QWEN_PARAMETER_END = "<parameter=", "</parameter>"


# DeepSeek's tags (single tokens in its tokenizer).
DS_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
DS_CALLS_END = "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN = "<｜tool▁call▁begin｜>"
DS_CALL_END = "<｜tool▁call▁end｜>"
DS_SEP = "<｜tool▁sep｜>"
DS_V3_JSON_OPEN = "\n```json\n"   # deepseek_v3: the arguments in a JSON code block
DS_V3_JSON_CLOSE = "\n```"

# DeepSeek's DSML tags (DeepSeek-V3.2's and V4's encodings): a block of invokes, each with its
# parameters. The block's name is V4's `tool_calls`, V3.2's `function_calls`.
DSML = "｜DSML｜"
DSML_V4_BLOCK = "tool_calls"
DSML_V32_BLOCK = "function_calls"
DSML_INVOKE = f"<{DSML}invoke"
DSML_INVOKE_END = f"</{DSML}invoke>"
DSML_PARAMETER = f"<{DSML}parameter"
DSML_PARAMETER_END = f"</{DSML}parameter>"


def dsml_block_tags(block: str) -> tuple[str, str]:
    """A DSML calls block's opening and closing tags."""
    return f"<{DSML}{block}>", f"</{DSML}{block}>"


class ToolCallFormat(enum.Enum):
    """A tool-call format, by vLLM's --tool-call-parser name."""
    HERMES = "hermes"
    GLM45 = "glm45"
    QWEN3_CODER = "qwen3_coder"
    DEEPSEEK_V3 = "deepseek_v3"
    DEEPSEEK_V31 = "deepseek_v31"
    DEEPSEEK_V32 = "deepseek_v32"
    DEEPSEEK_V4 = "deepseek_v4"

    @property
    def deepseek(self) -> bool:
        """DeepSeek-V3's and V3.1's call tags (the DSML formats are `dsml`)."""
        return self in (ToolCallFormat.DEEPSEEK_V3, ToolCallFormat.DEEPSEEK_V31)

    @property
    def dsml(self) -> bool:
        return self in (ToolCallFormat.DEEPSEEK_V32, ToolCallFormat.DEEPSEEK_V4)

    @property
    def dsml_block(self) -> str:
        """A DSML format's block name."""
        return DSML_V32_BLOCK if self is ToolCallFormat.DEEPSEEK_V32 else DSML_V4_BLOCK

    @property
    def call_start(self) -> str:
        if self.dsml:
            return DSML_INVOKE
        return DS_CALL_BEGIN if self.deepseek else CALL_START

    @property
    def call_starts(self) -> tuple[str, ...]:
        """What starts a call: call_start, and for qwen3_coder also a bare `<function=` (a call
        without its <tool_call> wrapper, as vLLM's qwen3_xml and qwen3_coder parsers read it)."""
        if self is ToolCallFormat.QWEN3_CODER:
            return (CALL_START, QWEN_FUNCTION)
        return (self.call_start,)

    @property
    def call_end(self) -> str:
        """The end of a call (deepseek_v3's is after its code block's close)."""
        if self.dsml:
            return DSML_INVOKE_END
        return DS_CALL_END if self.deepseek else CALL_END

    @property
    def markup(self) -> tuple[str, ...]:
        """Tags outside calls that are neither content nor a call (dropped)."""
        if self.dsml:
            return dsml_block_tags(self.dsml_block)
        return (DS_CALLS_BEGIN, DS_CALLS_END) if self.deepseek else ()

    @property
    def arguments_as_text(self) -> bool:
        """Its templates take an assistant call's arguments as JSON text (DeepSeek's concatenate
        them into the prompt), not as an object (GLM's and Qwen's iterate or dump it)."""
        return self.deepseek


# vLLM's other names of these formats: its qwen3_xml parser reads Qwen3-Coder's calls, as
# qwen3_coder does (a bare <function=…> and a parameter without </parameter> included).
TOOL_CALL_PARSER_ALIASES = {"qwen3_xml": ToolCallFormat.QWEN3_CODER}

# --tool-call-parser: a format, or "auto": the one the model's chat template writes.
TOOL_CALL_PARSERS = ("auto", *(f.value for f in ToolCallFormat), *TOOL_CALL_PARSER_ALIASES)


def template_tool_call_format(template: Optional[str]) -> Optional[ToolCallFormat]:
    """The tool-call format a chat template teaches (None: it teaches none this module parses):
    DeepSeek's DSML (V3.2's where its block is `function_calls`, else V4's), DeepSeek's call tags
    (V3's with the arguments in a ```json block, else V3.1's), then, with <tool_call> tags,
    Qwen3-Coder's <function=…> and <parameter=…> tags, GLM-4.5's argument tags, else Qwen's
    JSON."""
    if not template:
        return None
    if DSML in template:
        return ToolCallFormat.DEEPSEEK_V32 if DSML_V32_BLOCK in template else \
            ToolCallFormat.DEEPSEEK_V4
    if DS_CALL_BEGIN in template:
        return ToolCallFormat.DEEPSEEK_V3 if "```json" in template else ToolCallFormat.DEEPSEEK_V31
    if CALL_START not in template:
        return None
    if QWEN_FUNCTION in template and QWEN_PARAMETER in template:
        return ToolCallFormat.QWEN3_CODER
    return ToolCallFormat.GLM45 if _ARG_KEY in template else ToolCallFormat.HERMES


def tool_call_format(parser: str, template: Optional[str]) -> Optional[ToolCallFormat]:
    """The format of --tool-call-parser `parser` for a model whose chat template is `template`."""
    if parser == "auto":
        return template_tool_call_format(template)
    return TOOL_CALL_PARSER_ALIASES.get(parser) or ToolCallFormat(parser)


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
        self._call_open = ""     # the current call's start tag, consumed ("" where it is not)
        self._call_end = fmt.call_end  # what ends the current call
        self._sent_args = 0      # hermes: characters of the arguments' text sent
        self._args_open = False  # glm45, DSML: the arguments object's "{" sent
        self._keys: set[str] = set()  # glm45, DSML: the arguments' keys sent
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
        self._keys = set()
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
            # The first tag: a call's start, or markup (dropped).
            found = [(i, t) for t in (*self.fmt.call_starts, *self.fmt.markup)
                     if (i := self._buf.find(t)) >= 0]
            if found:
                i, tag = min(found)
                self._content(self._buf[:i])
                self._buf = self._buf[i + len(tag):]
                if tag == QWEN_FUNCTION:  # a bare <function=…>: the head, up to </function>
                    self._buf = tag + self._buf
                    self._call_open, self._call_end = "", QWEN_FUNCTION_END
                    self._state = _CallState.NAME
                elif tag == self.fmt.call_start:
                    self._call_open, self._call_end = tag, self.fmt.call_end
                    self._state = _CallState.NAME
                else:
                    self._after_call = True  # whitespace around markup is not content
                return True
            keep = 0 if final else max(tag_prefix_length(self._buf, t)
                                       for t in (*self.fmt.call_starts, *self.fmt.markup))
            self._content(self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        if self._state is _CallState.UNPARSED:
            return self._unparsed(final)
        if self.fmt is ToolCallFormat.HERMES:
            return self._hermes(final)
        if self.fmt.deepseek:
            return self._deepseek(final)
        if self.fmt.dsml:
            return self._dsml(final)
        if self.fmt is ToolCallFormat.QWEN3_CODER:
            return self._qwen3_coder(final)
        return self._glm45(final)

    def _unparsed(self, final: bool) -> bool:
        """A call that does not read as its format: at its end, JSON of a whole call (hermes, any
        key order) is still a call; anything else is content, tags and all."""
        start_tag, end_tag = self._call_open, self._call_end
        end = self._buf.find(end_tag)
        if end < 0 and not final:
            return False
        body = self._buf if end < 0 else self._buf[:end]
        self._buf = "" if end < 0 else self._buf[end + len(end_tag):]
        self._state = _CallState.OUTSIDE
        whole = _json_call(body) if self.fmt is ToolCallFormat.HERMES else None
        if whole is not None:
            name, arguments = whole
            self._start_call(name)
            self._arguments(arguments)
            self._end_call()
        else:
            self._content(start_tag + body + (end_tag if end >= 0 else ""))
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

    # deepseek_v3 / deepseek_v31 ------------------------------------------------------------------
    # The head: V3's `TYPE<｜tool▁sep｜>NAME` and its code block's opening, V3.1's
    # `NAME<｜tool▁sep｜>`; then the arguments' JSON, up to the call's end (V3: its code block's
    # close first).
    _DS_V3_HEAD = re.compile(r"([^<\n]*)" + re.escape(DS_SEP) + r"([^<\n]+?)[ \t]*" +
                             re.escape(DS_V3_JSON_OPEN))
    _DS_V31_HEAD = re.compile(r"\s*([^<\n]+?)\s*" + re.escape(DS_SEP))

    def _deepseek(self, final: bool) -> bool:
        v3 = self.fmt is ToolCallFormat.DEEPSEEK_V3
        if self._state is _CallState.NAME:
            m = (self._DS_V3_HEAD if v3 else self._DS_V31_HEAD).match(self._buf)
            if m is None:
                # Not (yet) a head: decided at the call's end (_unparsed).
                if DS_CALL_END not in self._buf and not final:
                    return False
                self._state = _CallState.UNPARSED
                return True
            name = (m.group(2) if v3 else m.group(1)).strip()
            self._buf = self._buf[m.end():]
            self._start_call(name)
            return True
        # The arguments, sent as they come; a tail that may begin the end (V3: "\n```" and the
        # call's end tag) is held until decided, and the arguments' whitespace at either end is
        # not sent.
        end_tag = DS_V3_JSON_CLOSE + DS_CALL_END if v3 else DS_CALL_END
        end = self._buf.find(end_tag)
        body = self._buf if end < 0 else self._buf[:end]
        cut = len(body)
        if end < 0 and not final:
            cut -= tag_prefix_length(body, end_tag)
        while cut > 0 and body[cut - 1].isspace():
            cut -= 1
        if self._sent_args == 0:  # the arguments' leading whitespace is not sent
            self._sent_args = min(len(body) - len(body.lstrip()), cut)
        self._arguments(body[self._sent_args:cut])
        self._sent_args = max(self._sent_args, cut)
        if end < 0 and not final:
            return False
        if self._sent_args == 0 and not body.strip():
            self._arguments("{}")  # no arguments written: none
        self._buf = "" if end < 0 else self._buf[end + len(end_tag):]
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
            self._member(key, _typed_value(self.schemas.get(self._name), key, value))
            self._buf = self._buf[m.end():]
        # The call ends at </tool_call>; what is left before it is no whole argument: dropped.
        rest = self._buf.lstrip()
        end = rest.find(CALL_END)
        if end < 0 and not final:
            return False
        self._close_arguments()
        self._buf = "" if end < 0 else rest[end + len(CALL_END):]
        self._end_call()
        return True

    # deepseek_v4 / deepseek_v32 (DSML) and qwen3_coder: a head naming the function, then
    # parameters, each sent whole as one member of the arguments object, up to the call's end.
    # DSML: ` name="NAME">` after <｜DSML｜invoke, <｜DSML｜parameter name="K" string="true|false">V
    # (raw text, or JSON), up to </｜DSML｜invoke>. qwen3_coder: <function=NAME> after <tool_call>,
    # <parameter=K>\nV\n</parameter> (typed by the schema), </function>, up to </tool_call>.
    _DSML_HEAD = re.compile(r'[ \t]+name="([^"<>\n]+)"[ \t]*>')
    _DSML_PARAMETER = re.compile(re.escape(DSML_PARAMETER) + r'[ \t]+name="([^"]*)"[ \t]+'
                                 r'string="(true|false)"[ \t]*>(.*?)' +
                                 re.escape(DSML_PARAMETER_END), re.S)
    _QWEN_HEAD = re.compile(r"\s*" + re.escape(QWEN_FUNCTION) + r"([^>\n]+)>")
    # A parameter ends at </parameter>, or where the model left that out, before the next
    # parameter's or the function's closing tag on a line of its own (as vLLM's parsers read it).
    _QWEN_PARAMETER = re.compile(re.escape(QWEN_PARAMETER) + r"([^>\n]+)>(.*?)(?:" +
                                 re.escape(QWEN_PARAMETER_END) + r"|(?=\n" +
                                 re.escape(QWEN_PARAMETER) + r")|(?=\n" +
                                 re.escape(QWEN_FUNCTION_END) + r"))", re.S)

    def _dsml(self, final: bool) -> bool:
        def member(m: re.Match) -> tuple[str, Any]:
            key, string, value = m.groups()
            return key, value if string == "true" else _json_or_text(value)
        return self._tagged_parameters(final, self._DSML_HEAD, self._DSML_PARAMETER,
                                       DSML_PARAMETER, DSML_PARAMETER_END, DSML_INVOKE_END,
                                       (DSML_INVOKE_END,), member)

    def _qwen3_coder(self, final: bool) -> bool:
        def member(m: re.Match) -> tuple[str, Any]:
            key = m.group(1).strip()
            # The value between the tag's "\n" and the closing tag's.
            value = m.group(2).removeprefix("\n").removesuffix("\n")
            return key, _qwen_value(self.schemas.get(self._name), key, value)
        return self._tagged_parameters(final, self._QWEN_HEAD, self._QWEN_PARAMETER,
                                       QWEN_PARAMETER, QWEN_PARAMETER_END, self._call_end,
                                       (QWEN_FUNCTION_END, CALL_END), member)

    def _tagged_parameters(self, final: bool, head: re.Pattern, parameter: re.Pattern,
                           parameter_start: str, parameter_end: str, call_end: str,
                           closing_tags: tuple[str, ...],
                           member: Callable[[re.Match], tuple[str, Any]]) -> bool:
        """One step of a call of tagged parameters: its head, then its parameters as they complete;
        at `call_end` the call ends, and anything before it that is neither a parameter nor one of
        `closing_tags` is dropped."""
        if self._state is _CallState.NAME:
            m = head.match(self._buf)
            if m is None:
                # Not (yet) a head: decided at the call's end (_unparsed).
                if call_end not in self._buf and not final:
                    return False
                self._state = _CallState.UNPARSED
                return True
            self._buf = self._buf[m.end():]
            self._start_call(m.group(1).strip())
            return True
        while True:
            rest = self._buf.lstrip()
            if rest.startswith(parameter_start):
                m = parameter.match(rest)
                if m is not None:
                    key, value = member(m)
                    if key not in self._keys:  # a repeated parameter: the first is kept
                        self._member(key, value)
                    self._buf = rest[m.end():]
                    continue
                if parameter_end not in rest and not final:
                    self._buf = rest
                    return False
                break  # a malformed parameter, or one cut off at the answer's end
            if not final and any(len(rest) < len(t) and t.startswith(rest)
                                 for t in (parameter_start, *closing_tags)):
                self._buf = rest  # nothing yet, or the start of a tag
                return False
            break
        end = self._buf.find(call_end)
        if end < 0 and not final:
            return False
        self._close_arguments()
        self._buf = "" if end < 0 else self._buf[end + len(call_end):]
        self._end_call()
        return True

    # the arguments object, one member at a time (glm45, DSML, qwen3_coder) -----------------------
    def _member(self, key: str, value: Any) -> None:
        """An argument: the object's opening brace (first) or a comma, the key and the value."""
        self._arguments(("{" if not self._args_open else ", ") + json.dumps(key, ensure_ascii=False)
                        + ": " + json.dumps(value, ensure_ascii=False))
        self._args_open = True
        self._keys.add(key)

    def _close_arguments(self) -> None:
        self._arguments("}" if self._args_open else "{}")


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


def raw_string_argument(prop: Any) -> bool:
    """Whether glm45's templates write the argument of this property schema raw (a string): its
    type is string, or it has no type and no enum or const value that is not a string. Every
    other argument is written as JSON (tool_call_grammar.py writes forced calls by this rule)."""
    if not isinstance(prop, dict):
        return True
    kinds = prop.get("type")
    kinds = [kinds] if isinstance(kinds, str) else (kinds or [])
    if kinds:
        return kinds == ["string"]
    values = prop["enum"] if isinstance(prop.get("enum"), list) else []
    if "const" in prop:
        values = [*values, prop["const"]]
    return all(isinstance(v, str) for v in values)


def _json_or_text(value: str) -> Any:
    """A DSML `string="false"` value: its JSON, or the text where it is no JSON (NaN and the
    infinities are no JSON: they would make the arguments' text none)."""
    try:
        return json.loads(value, parse_constant=_no_constant)
    except ValueError:
        return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# The Python spellings of JSON's scalars: Qwen's templates write a non-string scalar with Jinja's
# `string` filter (str()), which spells them so.
_PYTHON_SCALARS = {"True": True, "False": False, "None": None}


def _qwen_value(schema: Any, key: str, value: str) -> Any:
    """qwen3_coder's argument value: glm45's rule (_typed_value), and where that keeps the text of
    an argument that is not raw, the Python spelling of a scalar as the scalar."""
    typed = _typed_value(schema, key, value)
    prop = schema.get("properties", {}).get(key) if isinstance(schema, dict) else None
    if typed is not value or raw_string_argument(prop):
        return typed
    return _PYTHON_SCALARS.get(value.strip(), value)


def _typed_value(schema: Any, key: str, value: str) -> Any:
    """glm45's argument value: the text where raw_string_argument says the property's arguments
    are raw, else JSON-decoded where it parses as JSON (else the text)."""
    prop = schema.get("properties", {}).get(key) if isinstance(schema, dict) else None
    if raw_string_argument(prop):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value
