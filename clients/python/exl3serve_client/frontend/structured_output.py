"""Structured output and logit_bias: the request fields that constrain or bias the engine's sampling,
checked and put into the engine request's SamplingParams (proto/exl3serve/v1/exl3serve.proto).

One constraint per request, from any of
  response_format      {"type": "json_object"} | {"type": "json_schema", "json_schema":
                       {"name", "schema", "strict"}} | {"type": "structural_tag", "format": {...}}
                       (xgrammar's structural tag, as vLLM takes it; vLLM's older
                       {"structures": [{"begin", "schema", "end"}], "triggers": [...]} too)
                       ({"type": "text"}: none);
  structured_outputs   vLLM's: {"json": schema, "regex", "choice": [...], "grammar": EBNF,
                       "json_object": true, "structural_tag": the same as JSON text};
  guided_json, guided_regex, guided_choice, guided_grammar, structural_tag   vLLM's older fields.
and, on chat, `tool_choice` required or a named function (the call written in the model's
tool-call format, its arguments held to the function's schema: tool_call_grammar.py).
With the reasoning split on (--reasoning-parser), the constraint holds only after the model's
reasoning block (after_reasoning): the model thinks freely first, as vLLM's reasoning parsers allow.
Two of them in one request are refused 400 naming both. The router compiles the constraint (a
schema, regex or grammar that does not compile is its 400, with the library's words); the engine
masks every token the constraint does not allow (engine/sampling/token_constraint.h).

logit_bias: OpenAI's {"token id as a string": bias in [-100, 100]}; the engine refuses ids outside
the vocabulary."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from exl3serve.v1 import exl3serve_pb2 as pb

from .protocol import INT32_MAX, APIError
from .reasoning import THINK_END, THINK_START

MAX_LOGIT_BIAS = 100.0

# structured_outputs' keys this server honours, and those that change nothing here: every
# constraint is compiled by xgrammar into compact JSON (no free whitespace), with no fallback,
# which is what disable_any_whitespace / disable_fallback ask and within what their defaults
# allow; disable_additional_properties is the strict schema it compiles anyway.
_STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# A whitespace pattern (vLLM's guided_whitespace_pattern, structured_outputs.whitespace_pattern)
# is outlines' feature: xgrammar's JSON has either free or no whitespace, not a pattern of it.
WHITESPACE_PATTERN_REFUSAL = ("is not supported: JSON constraints are compiled by xgrammar into "
                              "compact JSON (no whitespace between tokens), which takes no "
                              "whitespace pattern")
_STRUCTURED_OUTPUT_NO_OPS = ("disable_fallback", "disable_any_whitespace",
                             "disable_additional_properties")


@dataclass(frozen=True)
class Constraint:
    """One constraint of a request: which field gave it, and what it is."""
    param: str   # the request field, as a 400 names it
    # json_schema | json_object | regex | grammar | choice | tagged_json | structural_tag
    kind: str
    # the schema's JSON text, True, the regex or grammar text, the choices, (begin, schema's
    # JSON text, end) per alternative, or a StructuralTag
    value: Any


@dataclass(frozen=True)
class StructuralTag:
    """xgrammar's structural tag as JSON text; `compact_json`: its JSON values compact, as the
    json_schema constraint gives them and templates' tojson writes them (one space after ":" and
    ","), else with the free whitespace xgrammar's structural tags allow."""
    json: str
    compact_json: bool = False


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
    if kind == "structural_tag":
        return [Constraint("response_format", "structural_tag",
                           StructuralTag(structural_tag_text(rf, "response_format")))]
    raise APIError(400, f"response_format of type {kind!r} is not supported: text, json_object, "
                   "json_schema or structural_tag", param="response_format")


def structural_tag_text(tag: Any, param: str) -> str:
    """A structural tag ({"type": "structural_tag", "format": {...}}, or vLLM's older
    {"structures": [{"begin", "schema", "end"}], "triggers": [...]}: free text in which a
    trigger starts one of the structures), given as an object or its JSON text, as the JSON text
    xgrammar compiles (its format tree is checked there: a bad one is the router's 400)."""
    if isinstance(tag, str):
        try:
            tag = json.loads(tag)
        except ValueError:
            raise APIError(400, f"{param} must be a structural tag (an object, or its JSON text)",
                           param=param) from None
    if not isinstance(tag, dict):
        raise APIError(400, f"{param} must be a structural tag (an object)", param=param)
    if "format" in tag:
        if not isinstance(tag["format"], dict):
            raise APIError(400, f"{param}.format must be an object (xgrammar's format tree)",
                           param=param)
        return json.dumps({"type": "structural_tag", "format": tag["format"]}, ensure_ascii=False)
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list) or \
            not all(isinstance(t, str) and t for t in triggers):
        raise APIError(400, f"{param}: a structural tag needs format, or structures and triggers "
                       "(non-empty lists)", param=param)
    tags = []
    for i, st in enumerate(structures):
        if not isinstance(st, dict) or not isinstance(st.get("begin"), str) or \
                not isinstance(st.get("end"), str) or not isinstance(st.get("schema"), dict):
            raise APIError(400, f"{param}.structures[{i}] must be {{\"begin\": str, \"schema\": "
                           "object, \"end\": str}", param=param)
        tags.append({"type": "tag", "begin": st["begin"],
                     "content": {"type": "json_schema", "json_schema": st["schema"]},
                     "end": st["end"]})
    return json.dumps({"type": "structural_tag",
                       "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}},
                      ensure_ascii=False)


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
        elif key == "structural_tag":
            out.append(Constraint(param, "structural_tag",
                                  StructuralTag(structural_tag_text(value, param))))
        elif key == "whitespace_pattern":
            raise APIError(400, f"{param} {WHITESPACE_PATTERN_REFUSAL}", param=param)
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
    if extra.get("structural_tag") is not None:  # vLLM's older field: the tag's JSON text
        out.append(Constraint("structural_tag", "structural_tag", StructuralTag(
            structural_tag_text(extra["structural_tag"], "structural_tag"))))
    return out


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
    elif c.kind == "structural_tag":
        sampling.structural_tag.json = c.value.json
        sampling.structural_tag.json_layout = (pb.JSON_LAYOUT_COMPACT if c.value.compact_json
                                               else pb.JSON_LAYOUT_FREE_WHITESPACE)
    else:
        sampling.choice.choices.extend(c.value)


def set_after_reasoning(sampling: pb.SamplingParams, starts_inside: bool) -> None:
    """The constraint holds after the reasoning block (reasoning.py; `starts_inside`: the output
    starts inside it): free text first, the constrained answer after its end tag."""
    sampling.constraint_after_reasoning.start = THINK_START
    sampling.constraint_after_reasoning.end = THINK_END
    sampling.constraint_after_reasoning.output_starts_inside = starts_inside


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
