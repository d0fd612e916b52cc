"""The constraint of a forced tool call (tool_choice required or a named function): the answer is
calls written exactly as the model's chat template writes them (tool_calls.py parses them back),
each call's arguments held to its function's parameters schema.

Every format as an xgrammar structural tag (its format tree: const strings, JSON schemas, free text
inside tags, sequences, alternatives, repetitions), with one call, or one or more under tool_choice
required when parallel_tool_calls is not false:
- hermes (Qwen's templates): `<tool_call>\\n{"name": "NAME", "arguments": {...}}\\n</tool_call>`,
  later calls after a "\\n";
- glm45, deepseek_v3, deepseek_v31: their templates' tags (below).

glm45's arguments, as GLM's templates write them, are `\\n<arg_key>K</arg_key>\\n<arg_value>V
</arg_value>` per argument: the schema's properties in its order, the required ones always, the
others optional; a string's value raw (its enum or const one of those strings, its pattern a
regular expression, else characters other than "<" within its minLength and maxLength), any other
type's as JSON held to the property's schema (tool_calls.py types values back by the same rule).
"""

from __future__ import annotations

import json
from typing import Any, Optional

from .structured_output import Constraint, StructuralTag
from .tool_calls import (CALL_END, CALL_START, DS_CALL_BEGIN, DS_CALL_END, DS_CALLS_BEGIN,
                         DS_CALLS_END, DS_SEP, DS_V3_JSON_CLOSE, DS_V3_JSON_OPEN, ToolCallFormat,
                         raw_string_argument)

# A hermes tool call (Qwen's templates): the call object's JSON between these.
HERMES_CALL_BEGIN = "<tool_call>\n"
HERMES_CALL_END = "\n</tool_call>"


def tool_call_constraint(fmt: ToolCallFormat, schemas: dict[str, Any], forced: tuple[str, ...],
                         several: bool) -> Optional[Constraint]:
    """The constraint of tool_choice required (`forced`: every function) or a named function
    (`forced`: that one); None when no call is forced. `several`: one or more calls (required
    with parallel_tool_calls), else exactly one."""
    if not forced:
        return None
    calls = [_call(fmt, name, schemas[name] or {"type": "object"}) for name in forced]
    one = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
    body = _one_or_more(fmt, one) if several else one
    if fmt.deepseek:
        body = _sequence(_const(DS_CALLS_BEGIN), body, _const(DS_CALLS_END))
    # Compact JSON: the templates' tojson layout (one space after ":" and ",").
    return Constraint("tool_choice", "structural_tag", StructuralTag(
        json.dumps({"type": "structural_tag", "format": body}, ensure_ascii=False),
        compact_json=True))


def _const(value: str) -> dict[str, Any]:
    return {"type": "const_string", "value": value}


def _sequence(*elements: dict[str, Any]) -> dict[str, Any]:
    return {"type": "sequence", "elements": list(elements)}


def _json(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": schema}


def _one_or_more(fmt: ToolCallFormat, call: dict[str, Any]) -> dict[str, Any]:
    """Calls in a row as the format's templates join them: hermes' and DeepSeek-V3's with "\n"
    between them, the others' without (GLM's calls begin with their own "\n")."""
    if fmt in (ToolCallFormat.HERMES, ToolCallFormat.DEEPSEEK_V3):
        return _sequence(call, {"type": "star", "content": _sequence(_const("\n"), call)})
    return {"type": "plus", "content": call}


def _call(fmt: ToolCallFormat, name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """One call of `name`, as the format's templates write it."""
    if fmt is ToolCallFormat.HERMES:
        # The name as the template writes it between quotes (tojson's escaping of the name).
        head = f'{HERMES_CALL_BEGIN}{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '
        return _sequence(_const(head), _json(schema), _const("}" + HERMES_CALL_END))
    if fmt is ToolCallFormat.GLM45:
        # GLM's templates put "\n" before each call (after the message's content).
        props = schema.get("properties")
        required = schema.get("required")
        required = required if isinstance(required, list) else []
        args = [_glm_argument(schema, key, prop, key in required)
                for key, prop in (props if isinstance(props, dict) else {}).items()]
        return _sequence(_const("\n" + CALL_START + name), *args, _const("\n" + CALL_END))
    if fmt is ToolCallFormat.DEEPSEEK_V3:
        return _sequence(_const(DS_CALL_BEGIN + "function" + DS_SEP + name + DS_V3_JSON_OPEN),
                         _json(schema), _const(DS_V3_JSON_CLOSE + DS_CALL_END))
    return _sequence(_const(DS_CALL_BEGIN + name + DS_SEP), _json(schema), _const(DS_CALL_END))


def _glm_argument(schema: dict[str, Any], key: str, prop: Any, required: bool) -> dict[str, Any]:
    prop = prop if isinstance(prop, dict) else {}
    if raw_string_argument(prop):
        value = _raw_string(prop)
    else:
        # The property's schema alone, with the definitions its references may name.
        defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
        value = _json({**defs, **prop})
    arg = _sequence(_const(f"\n<arg_key>{key}</arg_key>\n"),
                    {"type": "tag", "begin": "<arg_value>", "content": value,
                     "end": "</arg_value>"})
    return arg if required else {"type": "optional", "content": arg}


# A raw string's characters: any but "<" (so no "</arg_value>" can begin inside it), and never the
# surrogate code points, whose UTF-8 encodings are no UTF-8 (RFC 3629; cmake/xgrammar_patch.cmake
# excludes them from JSON strings likewise).
_RAW_CHAR = r"[^<\uD800-\uDFFF]"


def _raw_string(prop: dict[str, Any]) -> dict[str, Any]:
    """A string argument's raw text: its const or enum values, its pattern, or characters (within
    its minLength / maxLength)."""
    if "const" in prop:
        return _const(_template_text(prop["const"]))
    if isinstance(prop.get("enum"), list) and prop["enum"]:
        return {"type": "or", "elements": [_const(_template_text(v)) for v in prop["enum"]]}
    if isinstance(prop.get("pattern"), str):
        return {"type": "regex", "pattern": prop["pattern"]}
    low = prop.get("minLength")
    low = low if isinstance(low, int) and low > 0 else 0
    high = prop.get("maxLength")
    count = f"{{{low},{high}}}" if isinstance(high, int) and high >= low else \
        f"{{{low},}}" if low else "*"
    return {"type": "regex", "pattern": _RAW_CHAR + count}


def _template_text(value: Any) -> str:
    """A value as GLM's templates write it: a string raw, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
