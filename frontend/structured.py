"""Structured outputs: what a request constrains its reply to, as one llguidance grammar.

At most one of these fields may constrain a request:

- ``response_format`` (OpenAI): ``{"type": "json_object"}``, or ``{"type": "json_schema",
  "json_schema": {"schema": ..., "strict": ...}}``; ``strict`` closes every object the schema
  leaves open (``additionalProperties: false``, as vLLM does), so no key outside it appears;
- ``structured_outputs`` (vLLM): exactly one of ``json``, ``regex``, ``choice``, ``grammar``
  (Lark, or EBNF/GBNF);
- ``tools`` with ``tool_choice`` ``"required"`` or a named function (``frontend.tool_calls``).

JSON is compact (no free whitespace): a small model otherwise wanders into blank lines. Making
the grammar text is cheap and happens here; compiling it against the vocabulary is
``GrammarChecker``'s, off the event loop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import llguidance

from frontend.errors import ApiError
from frontend.json_schema import COMPACT, close_objects
from frontend.schemas import (
    ChatCompletionRequest,
    ResponseFormat,
    SamplingFields,
    StructuredOutputs,
)
from frontend.tool_calls import ToolChoice, tool_choice


@dataclass(frozen=True)
class Constraint:
    """A request's grammar, the body field it came from (named in errors), and, for tool
    calls, how its reply becomes ``tool_calls``."""

    grammar: str
    param: str
    tools: ToolChoice | None = None


def constraint_for(request: SamplingFields, renders_tools: bool) -> Constraint | None:
    """The request's constraint, or None; ApiError 400 for a malformed or conflicting one.
    ``renders_tools``: whether the model's chat template shows the model its tools."""
    found = []
    if request.response_format is not None and request.response_format.type != "text":
        found.append(_response_format(request.response_format))
    if request.structured_outputs is not None:
        found.append(_structured_outputs(request.structured_outputs))
    if isinstance(request, ChatCompletionRequest):
        tools = tool_choice(request, renders_tools)
        if tools is not None:
            found.append(Constraint(tools.grammar, "tools", tools))
    if len(found) > 1:
        names = " and ".join(c.param for c in found)
        raise ApiError(400, f"{names} both constrain the reply: give one", param=found[1].param)
    return found[0] if found else None


def json_grammar(schema: dict[str, Any], *, strict: bool, param: str) -> str:
    """The grammar of a JSON schema, compact unless its ``x-guidance`` says otherwise."""
    if strict:
        schema = close_objects(schema)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT)
    except ValueError as exc:
        raise ApiError(400, f"invalid JSON schema: {exc}", param=param) from None


def _response_format(fmt: ResponseFormat) -> Constraint:
    param = "response_format"
    if fmt.type == "json_object":
        return Constraint(json_grammar({"type": "object"}, strict=False, param=param), param)
    if fmt.type != "json_schema":
        kinds = '"text", "json_object" or "json_schema"'
        raise ApiError(400, f"response_format.type must be {kinds}, got {fmt.type!r}", param=param)
    if fmt.json_schema is None or fmt.json_schema.schema is None:
        message = 'response_format "json_schema" needs json_schema.schema'
        raise ApiError(400, message, param=param)
    strict = bool(fmt.json_schema.strict)
    return Constraint(json_grammar(fmt.json_schema.schema, strict=strict, param=param), param)


def _structured_outputs(spec: StructuredOutputs) -> Constraint:
    param = "structured_outputs"
    given = {
        name: getattr(spec, name)
        for name in spec.__struct_fields__
        if getattr(spec, name) is not None
    }
    if len(given) != 1:
        message = "structured_outputs must give exactly one of json, regex, choice, grammar"
        raise ApiError(400, f"{message}, got {sorted(given) or 'none'}", param=param)
    ((kind, value),) = given.items()
    if kind == "json":
        return Constraint(json_grammar(_schema(value), strict=False, param=param), param)
    if kind == "choice":
        if not value or not all(value):
            message = "structured_outputs.choice must be a list of non-empty strings"
            raise ApiError(400, message, param=param)
        return Constraint(llguidance.grammar_from("choice", json.dumps(value)), param)
    if kind == "regex":
        return Constraint(llguidance.LLMatcher.grammar_from_regex(value), param)
    try:
        return Constraint(llguidance.grammar_from("grammar", value), param)  # Lark or GBNF
    except ValueError as exc:
        raise ApiError(400, f"invalid grammar: {exc}", param=param) from None


def _schema(value: dict[str, Any] | str) -> dict[str, Any]:
    """``structured_outputs.json``: a schema, or its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            message = f"structured_outputs.json is not JSON: {exc}"
            raise ApiError(400, message, param="structured_outputs") from None
    if not isinstance(value, dict):
        message = "structured_outputs.json must be a JSON object"
        raise ApiError(400, message, param="structured_outputs")
    return value
