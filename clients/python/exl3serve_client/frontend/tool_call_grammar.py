"""The constraint of a forced tool call (tool_choice required or a named function): the answer is
calls written exactly as the model's chat template writes them (tool_calls.py parses them back),
each call's arguments held to its function's parameters schema.

Every format as an xgrammar structural tag (its format tree: const strings, JSON schemas, free text
inside tags, sequences, alternatives, repetitions), with one call, or one or more under tool_choice
required when parallel_tool_calls is not false:
- hermes (Qwen's templates): `<tool_call>\\n{"name": "NAME", "arguments": {...}}\\n</tool_call>`,
  later calls after a "\\n";
- glm45, qwen3_coder, deepseek_v3, deepseek_v31: their templates' tags (below);
- deepseek_v4, deepseek_v32: DeepSeek's DSML as its encodings write it (below).

glm45's arguments, as GLM's templates write them, are `\\n<arg_key>K</arg_key>\\n<arg_value>V
</arg_value>` per argument: the schema's properties in its order, the required ones always, the
others optional; a string's value raw (its enum or const one of those strings, its pattern a
regular expression, else characters other than "<" within its minLength and maxLength), any other
type's as JSON held to the property's schema (tool_calls.py types values back by the same rule).

qwen3_coder's calls, as Qwen3-Coder's templates write them, are
`<tool_call>\\n<function=NAME>\\n`, per argument `<parameter=K>\\nV\\n</parameter>\\n` (the
schema's properties in its order, the required ones always, the others optional; V raw or JSON
by glm45's rule), then `</function>\\n</tool_call>`; later calls after a "\\n".

DSML's calls, as DeepSeek's encodings write them after an empty content, are
`\\n\\n<｜DSML｜tool_calls>\\n` (V3.2: `function_calls`), the calls joined by "\\n", each
`<｜DSML｜invoke name="NAME">\\n` + its parameters joined by "\\n" + `\\n</｜DSML｜invoke>`, then
`\\n</｜DSML｜tool_calls>`; a parameter `<｜DSML｜parameter name="K" string="true">V</｜DSML｜parameter>`
with V raw where glm45's rule writes the value raw, else `string="false"` with V JSON held to the
property's schema. The parameters are the schema's properties in its order, the required ones
always, the others optional.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from .structured_output import Constraint, StructuralTag
from .tool_calls import (CALL_END, CALL_START, DS_CALL_BEGIN, DS_CALL_END, DS_CALLS_BEGIN,
                         DS_CALLS_END, DS_SEP, DS_V3_JSON_CLOSE, DS_V3_JSON_OPEN, DSML_INVOKE,
                         DSML_INVOKE_END, DSML_PARAMETER, DSML_PARAMETER_END, QWEN_FUNCTION,
                         QWEN_FUNCTION_END, QWEN_PARAMETER, QWEN_PARAMETER_END, ToolCallFormat,
                         dsml_block_tags, raw_string_argument)

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
    if fmt.dsml:
        # The encodings put "\n\n" between the content (none here) and the block.
        begin, end = dsml_block_tags(fmt.dsml_block)
        body = _sequence(_const("\n\n" + begin + "\n"), body, _const("\n" + end))
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
    """Calls in a row as the format's templates join them: hermes', qwen3_coder's, DeepSeek-V3's
    and DSML's with "\n" between them, the others' without (GLM's calls begin with their own
    "\n")."""
    if fmt in (ToolCallFormat.HERMES, ToolCallFormat.QWEN3_CODER, ToolCallFormat.DEEPSEEK_V3) or \
            fmt.dsml:
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
    if fmt.dsml:
        return _dsml_invoke(name, schema)
    if fmt is ToolCallFormat.QWEN3_CODER:
        return _sequence(_const(f"{CALL_START}\n{QWEN_FUNCTION}{name}>\n"),
                         *_qwen_parameters(schema), _const(f"{QWEN_FUNCTION_END}\n{CALL_END}"))
    return _sequence(_const(DS_CALL_BEGIN + name + DS_SEP), _json(schema), _const(DS_CALL_END))


def _property_value(schema: dict[str, Any], prop: dict[str, Any]) -> dict[str, Any]:
    """A property's value as JSON held to its schema (with the definitions its references may
    name)."""
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    return _json({**defs, **prop})


def _glm_argument(schema: dict[str, Any], key: str, prop: Any, required: bool) -> dict[str, Any]:
    prop = prop if isinstance(prop, dict) else {}
    value = _raw_string(prop) if raw_string_argument(prop) else _property_value(schema, prop)
    arg = _sequence(_const(f"\n<arg_key>{key}</arg_key>\n"),
                    {"type": "tag", "begin": "<arg_value>", "content": value,
                     "end": "</arg_value>"})
    return arg if required else {"type": "optional", "content": arg}


def _qwen_parameters(schema: dict[str, Any]) -> list[dict[str, Any]]:
    props = schema.get("properties")
    required = schema.get("required")
    required = required if isinstance(required, list) else []
    out = []
    for key, prop in (props if isinstance(props, dict) else {}).items():
        prop = prop if isinstance(prop, dict) else {}
        value = _raw_string(prop) if raw_string_argument(prop) else _property_value(schema, prop)
        param = {"type": "tag", "begin": f"{QWEN_PARAMETER}{key}>\n", "content": value,
                 "end": f"\n{QWEN_PARAMETER_END}\n"}
        out.append(param if key in required else {"type": "optional", "content": param})
    return out


def _dsml_invoke(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """One DSML invoke: its parameters joined by "\n" (module doc). The first parameter written
    is any up to the first required one; the others follow it, each after a "\n"."""
    props = schema.get("properties")
    props = props if isinstance(props, dict) else {}
    required = schema.get("required")
    required = required if isinstance(required, list) else []
    params = [(_dsml_parameter(schema, key, prop), key in required) for key, prop in props.items()]

    def after(i: int) -> list[dict[str, Any]]:
        """The parameters after the i-th, each with its "\n"."""
        out = []
        for param, needed in params[i + 1:]:
            one = _sequence(_const("\n"), param)
            out.append(one if needed else {"type": "optional", "content": one})
        return out

    head = _const(f'{DSML_INVOKE} name="{name}">\n')
    tail = _const("\n" + DSML_INVOKE_END)
    if not params:
        return _sequence(head, tail)
    firsts = []
    for i, (param, needed) in enumerate(params):
        firsts.append(_sequence(param, *after(i)) if i + 1 < len(params) else param)
        if needed:
            break
    body = firsts[0] if len(firsts) == 1 else {"type": "or", "elements": firsts}
    if not any(needed for _, needed in params):
        body = {"type": "optional", "content": body}
    return _sequence(head, body, tail)


def _dsml_parameter(schema: dict[str, Any], key: str, prop: Any) -> dict[str, Any]:
    prop = prop if isinstance(prop, dict) else {}
    raw = raw_string_argument(prop)
    value = _raw_string(prop) if raw else _property_value(schema, prop)
    string = "true" if raw else "false"
    return {"type": "tag", "begin": f'{DSML_PARAMETER} name="{key}" string="{string}">',
            "content": value, "end": DSML_PARAMETER_END}


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
