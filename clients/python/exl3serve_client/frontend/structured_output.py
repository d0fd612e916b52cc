"""Structured output and logit_bias: the request fields that constrain or bias the engine's sampling,
checked and put into the engine request's SamplingParams (proto/exl3serve/v1/exl3serve.proto).

One constraint per request, from any of
  response_format      {"type": "json_object"} | {"type": "json_schema", "json_schema":
                       {"name", "schema", "strict"}} ({"type": "text"}: none);
  structured_outputs   vLLM's: {"json": schema, "regex", "choice": [...], "grammar": EBNF,
                       "json_object": true};
  guided_json, guided_regex, guided_choice, guided_grammar   vLLM's older fields.
and, on chat, `tool_choice` required or a named function with the hermes tool-call format (one
call in its tags, the arguments held to the function's schema: tool_call_constraint).
Two of them in one request are refused 400 naming both. The router compiles the constraint (a
schema, regex or grammar that does not compile is its 400, with the library's words); the engine
masks every token the constraint does not allow (engine/token_constraint.h).

logit_bias: OpenAI's {"token id as a string": bias in [-100, 100]}; the engine refuses ids outside
the vocabulary."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from exl3serve.v1 import exl3serve_pb2 as pb

from .protocol import INT32_MAX, APIError

MAX_LOGIT_BIAS = 100.0

# structured_outputs' keys this server honours, and those that change nothing here: every
# constraint is compiled by xgrammar into compact JSON (no free whitespace), with no fallback,
# which is what disable_any_whitespace / disable_fallback ask and within what their defaults
# allow; disable_additional_properties is the strict schema it compiles anyway.
_STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_STRUCTURED_OUTPUT_NO_OPS = ("disable_fallback", "disable_any_whitespace",
                             "disable_additional_properties")


@dataclass(frozen=True)
class Constraint:
    """One constraint of a request: which field gave it, and what it is."""
    param: str   # the request field, as a 400 names it
    kind: str    # json_schema | json_object | regex | grammar | choice | tagged_json
    # the schema's JSON text, True, the regex or grammar text, the choices, or (begin, schema's
    # JSON text, end) per alternative
    value: Any


def _schema_text(value: Any, param: str) -> str:
    """A JSON schema given as an object or as JSON text, as JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise APIError(400, f"{param} must be a JSON schema (an object, or its JSON text)",
                           param=param) from None
    if not isinstance(value, dict):
        raise APIError(400, f"{param} must be a JSON schema (an object)", param=param)
    return json.dumps(value)


def _text(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{param} must be a non-empty string", param=param)
    return value


def _choices(value: Any, param: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise APIError(400, f"{param} must be a non-empty list of strings", param=param)
    return value


def _from_response_format(rf: Optional[dict[str, Any]]) -> list[Constraint]:
    if not rf:
        return []
    kind = rf.get("type")
    if kind in (None, "text"):
        return []
    if kind == "json_object":
        return [Constraint("response_format", "json_object", True)]
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise APIError(400, "response_format json_schema needs json_schema.schema",
                           param="response_format.json_schema")
        # strict or not, the output matches the schema (strict is how OpenAI's own constrained
        # decoding is asked for).
        return [Constraint("response_format",
                           "json_schema", _schema_text(js["schema"], "response_format.json_schema.schema"))]
    raise APIError(400, f"response_format of type {kind!r} is not supported: text, json_object "
                   "or json_schema", param="response_format")


def _from_structured_outputs(so: Any) -> list[Constraint]:
    if so is None:
        return []
    if not isinstance(so, dict):
        raise APIError(400, "structured_outputs must be an object", param="structured_outputs")
    out: list[Constraint] = []
    for key, value in so.items():
        param = f"structured_outputs.{key}"
        if value is None or key in _STRUCTURED_OUTPUT_NO_OPS:
            continue
        if key == "json":
            out.append(Constraint(param, "json_schema", _schema_text(value, param)))
        elif key == "regex":
            out.append(Constraint(param, "regex", _text(value, param)))
        elif key == "grammar":
            out.append(Constraint(param, "grammar", _text(value, param)))
        elif key == "choice":
            out.append(Constraint(param, "choice", _choices(value, param)))
        elif key == "json_object":
            if value is not False:
                out.append(Constraint(param, "json_object", True))
        else:
            raise APIError(400, f"{param} is not supported (this server honours "
                           f"{', '.join(_STRUCTURED_OUTPUT_KINDS)})", param=param)
    return out


def _from_guided(extra: dict[str, Any]) -> list[Constraint]:
    out: list[Constraint] = []
    if extra.get("guided_json") is not None:
        out.append(Constraint("guided_json", "json_schema",
                              _schema_text(extra["guided_json"], "guided_json")))
    if extra.get("guided_regex") is not None:
        out.append(Constraint("guided_regex", "regex", _text(extra["guided_regex"], "guided_regex")))
    if extra.get("guided_choice") is not None:
        out.append(Constraint("guided_choice", "choice",
                              _choices(extra["guided_choice"], "guided_choice")))
    if extra.get("guided_grammar") is not None:
        out.append(Constraint("guided_grammar", "grammar",
                              _text(extra["guided_grammar"], "guided_grammar")))
    return out


# A hermes tool call (Qwen's templates; tool_calls.py parses it back): the call object's JSON
# between these.
HERMES_CALL_BEGIN = "<tool_call>\n"
HERMES_CALL_END = "\n</tool_call>"


def tool_call_constraint(schemas: dict[str, Any], forced: tuple[str, ...]) -> Optional[Constraint]:
    """tool_choice required or a named function (`forced`: the functions one of which the answer
    calls; empty: none forced): one hermes call of one of them, its arguments held to the
    function's parameters schema (strict: no arguments the schema does not name)."""
    if not forced:
        return None
    alternatives = []
    for name in forced:
        call = {"type": "object",
                "properties": {"name": {"const": name}, "arguments": schemas[name] or
                               {"type": "object"}},
                "required": ["name", "arguments"]}
        alternatives.append((HERMES_CALL_BEGIN, json.dumps(call), HERMES_CALL_END))
    return Constraint("tool_choice", "tagged_json", alternatives)


def request_constraint(response_format: Optional[dict[str, Any]],
                       extra: Optional[dict[str, Any]],
                       tool_call: Optional[Constraint] = None) -> Optional[Constraint]:
    """The request's constraint (None: unconstrained); `extra` holds the body's undeclared
    fields (structured_outputs and the guided_* ones), `tool_call` tool_choice's."""
    extra = extra or {}
    found = (_from_response_format(response_format) +
             _from_structured_outputs(extra.get("structured_outputs")) + _from_guided(extra) +
             ([tool_call] if tool_call is not None else []))
    if len(found) > 1:
        names = " and ".join(c.param for c in found)
        raise APIError(400, f"one constraint per request: {names} both constrain the output",
                       param=found[1].param)
    return found[0] if found else None


def set_constraint(sampling: pb.SamplingParams, c: Constraint) -> None:
    if c.kind == "json_schema":
        sampling.json_schema = c.value
    elif c.kind == "json_object":
        sampling.json_object = True
    elif c.kind == "regex":
        sampling.regex = c.value
    elif c.kind == "grammar":
        sampling.grammar = c.value
    elif c.kind == "tagged_json":
        for begin, schema, end in c.value:
            sampling.tagged_json.alternatives.add(begin=begin, json_schema=schema, end=end)
    else:
        sampling.choice.choices.extend(c.value)


def logit_bias(bias: Optional[dict[str, float]]) -> dict[int, float]:
    """OpenAI's logit_bias checked: token ids (as strings) to biases in [-100, 100]."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(400, f"logit_bias: {key!r} is not a token id", param="logit_bias") from None
        if not 0 <= token <= INT32_MAX:
            raise APIError(400, f"logit_bias: token {token} is outside the vocabulary",
                           param="logit_bias")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise APIError(400, f"logit_bias: the bias of token {token} is {value}, outside "
                           "[-100, 100]", param="logit_bias")
        out[token] = float(value)
    return out
