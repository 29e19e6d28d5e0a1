"""Structured outputs: what a request constrains its reply to, as one llguidance grammar.

At most one of these fields may constrain a request:

- ``response_format`` (OpenAI): ``{"type": "json_object"}``, or ``{"type": "json_schema",
  "json_schema": {"schema": ..., "strict": ...}}``;
- ``structured_outputs`` (vLLM): exactly one of ``json``, ``regex``, ``choice``, ``grammar``
  (Lark, or EBNF/GBNF) or ``json_object``;
- ``tools`` with ``tool_choice`` ``"required"`` or a named function (``frontend.tool_calls``).

Every JSON schema, whichever field brings it, compiles under ``JsonOptions``
(``frontend.json_schema``): objects closed and no free whitespace unless the server's options or
the request's ``structured_outputs.disable_additional_properties`` and
``structured_outputs.disable_any_whitespace`` (vLLM's names) say otherwise. A
``structured_outputs`` that gives only those options may come with ``response_format`` or
``tools``, as in vLLM. ``strict: true`` (OpenAI's, on a json_schema or a function) always closes.

Making the grammar text is cheap and happens here; compiling it against the vocabulary is
``GrammarChecker``'s, off the event loop and within a time limit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import llguidance

from frontend.errors import ApiError
from frontend.json_schema import JsonOptions
from frontend.schemas import (
    ChatCompletionRequest,
    ResponseFormat,
    SamplingFields,
    StructuredOutputs,
)
from frontend.tool_calls import ToolChoice, tool_choice
from protocol.params import MAX_GRAMMAR_CHARS

_KINDS = ("json", "regex", "choice", "grammar", "json_object")  # structured_outputs' constraints
_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class Constraint:
    """A request's grammar, the body field it came from (named in errors), and, for tool
    calls, how its reply becomes ``tool_calls``."""

    grammar: str
    param: str
    tools: ToolChoice | None = None


def constraint_for(
    request: SamplingFields, renders_tools: bool, defaults: JsonOptions
) -> Constraint | None:
    """The request's constraint, or None; ApiError 400 for a malformed or conflicting one.
    ``renders_tools``: whether the model's chat template shows the model its tools;
    ``defaults``: the server's JSON options, which ``structured_outputs`` may override."""
    spec = request.structured_outputs
    options = defaults
    if spec is not None:
        options = defaults.with_overrides(
            spec.disable_any_whitespace, spec.disable_additional_properties
        )
    found = []
    if request.response_format is not None and request.response_format.type != "text":
        found.append(_response_format(request.response_format, options))
    if spec is not None and _kinds(spec):
        found.append(_structured_outputs(spec, options))
    if isinstance(request, ChatCompletionRequest):
        tools = tool_choice(request, renders_tools, options)
        if tools is not None:
            found.append(Constraint(tools.grammar, "tools", tools))
    if len(found) > 1:
        names = " and ".join(c.param for c in found)
        raise ApiError(400, f"{names} both constrain the reply: give one", param=found[1].param)
    if spec is not None and not found:
        message = f"structured_outputs must give exactly one of {', '.join(_KINDS)}, got none"
        raise ApiError(400, message, param="structured_outputs")
    return found[0] if found else None


def _json(options: JsonOptions, schema: dict[str, Any], strict: bool, param: str) -> str:
    try:
        return options.grammar(schema, strict)
    except ValueError as exc:
        raise ApiError(400, f"invalid JSON schema: {exc}", param=param) from None


def _response_format(fmt: ResponseFormat, options: JsonOptions) -> Constraint:
    param = "response_format"
    if fmt.type == "json_object":
        return Constraint(_json(options, _ANY_OBJECT, False, param), param)
    if fmt.type != "json_schema":
        kinds = '"text", "json_object" or "json_schema"'
        raise ApiError(400, f"response_format.type must be {kinds}, got {fmt.type!r}", param=param)
    if fmt.json_schema is None or fmt.json_schema.schema is None:
        message = 'response_format "json_schema" needs json_schema.schema'
        raise ApiError(400, message, param=param)
    strict = bool(fmt.json_schema.strict)
    return Constraint(_json(options, fmt.json_schema.schema, strict, param), param)


def _kinds(spec: StructuredOutputs) -> list[str]:
    """The constraints ``structured_outputs`` gives (``json_object: false`` gives none)."""
    return [kind for kind in _KINDS if getattr(spec, kind) not in (None, False)]


def _structured_outputs(spec: StructuredOutputs, options: JsonOptions) -> Constraint:
    param = "structured_outputs"
    kinds = _kinds(spec)
    if len(kinds) != 1:
        message = f"structured_outputs must give exactly one of {', '.join(_KINDS)}"
        raise ApiError(400, f"{message}, got {kinds}", param=param)
    kind = kinds[0]
    value = getattr(spec, kind)
    if kind == "json_object":
        return Constraint(_json(options, _ANY_OBJECT, False, param), param)
    if kind == "json":
        return Constraint(_json(options, _schema(value), False, param), param)
    if kind == "choice":
        if not value or not all(value):
            message = "structured_outputs.choice must be a list of non-empty strings"
            raise ApiError(400, message, param=param)
        return Constraint(llguidance.grammar_from("choice", json.dumps(value)), param)
    if kind == "regex":
        return Constraint(llguidance.LLMatcher.grammar_from_regex(value), param)
    if len(value) > MAX_GRAMMAR_CHARS:  # before an EBNF is translated, on the event loop
        message = f"structured_outputs.grammar has over {MAX_GRAMMAR_CHARS} characters"
        raise ApiError(400, message, param=param)
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
