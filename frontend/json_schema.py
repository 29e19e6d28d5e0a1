"""JSON schemas as nanoserve compiles them: which objects are closed, and where whitespace goes.

Two switches, named after vLLM's (``--structured-outputs-config`` there, a server option and a
``structured_outputs`` field here):

- ``disable_additional_properties`` (default on): an object schema that names its properties
  but does not set ``additionalProperties`` is closed, as in OpenAI's strict mode and vLLM's
  xgrammar backend: a reply has no property the schema does not name, so a small model cannot
  wander into an invented property of unbounded length. A schema that sets
  ``additionalProperties`` (true, false or a schema) is honoured. Off, such objects are open, as
  JSON Schema reads them.
- ``disable_any_whitespace`` (default on, measured: docs/structured_outputs.md): JSON without
  free whitespace between tokens. Off, llguidance's flexible whitespace lets the model put any
  run of blanks and newlines between items, which a small model may fill until ``max_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import llguidance

# Keywords whose value is a schema or a list of schemas, and those whose value maps names to
# schemas.
_SUBSCHEMAS = (
    "items",
    "prefixItems",
    "additionalItems",
    "additionalProperties",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "anyOf",
    "oneOf",
    "allOf",
)
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


@dataclass(frozen=True)
class JsonOptions:
    """How JSON schemas become grammars: the server's defaults, or one request's."""

    disable_any_whitespace: bool = True
    disable_additional_properties: bool = True

    def with_overrides(
        self, disable_any_whitespace: bool | None, disable_additional_properties: bool | None
    ) -> JsonOptions:
        """These options, with a request's fields where it gives them (None: keep)."""
        return JsonOptions(
            self.disable_any_whitespace
            if disable_any_whitespace is None
            else disable_any_whitespace,
            self.disable_additional_properties
            if disable_additional_properties is None
            else disable_additional_properties,
        )

    @property
    def guidance(self) -> dict[str, Any]:
        """llguidance's JSON options (``x-guidance``) for these switches."""
        return {"whitespace_flexible": not self.disable_any_whitespace}

    def prepare(self, schema: dict[str, Any], strict: bool = False) -> dict[str, Any]:
        """The schema as it compiles: closed where these options or ``strict`` say so."""
        return close_objects(schema) if strict or self.disable_additional_properties else schema

    def grammar(self, schema: dict[str, Any], strict: bool = False) -> str:
        """The llguidance grammar of ``schema``; its own ``x-guidance`` wins over ``guidance``.
        ValueError for a schema llguidance cannot read."""
        prepared = self.prepare(schema, strict)
        return llguidance.LLMatcher.grammar_from_json_schema(prepared, defaults=self.guidance)


def close_objects(schema: Any, close_self: bool = True) -> Any:
    """A copy of ``schema`` in which every object schema that names its members
    (``properties`` or ``patternProperties``) and does not set ``additionalProperties`` has
    ``additionalProperties: false``.

    Two kinds stay open: an object schema that names no member (``{"type": "object"}``, a
    free-form ``dict``), which closed would only allow ``{}``; and the parts of an ``allOf``
    and the schema that holds them, because ``additionalProperties`` sees only its own
    schema's ``properties``: each part closed would forbid the others' (their members' own
    schemas are closed as usual)."""
    if isinstance(schema, list):
        return [close_objects(s, close_self) for s in schema]
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key in _SUBSCHEMAS:
        if key in closed:
            closed[key] = close_objects(closed[key], close_self=key != "allOf")
    for key in _MAPS:
        if isinstance(closed.get(key), dict):
            closed[key] = {name: close_objects(s) for name, s in closed[key].items()}
    names_members = "properties" in closed or "patternProperties" in closed
    if close_self and names_members and "allOf" not in closed:
        closed.setdefault("additionalProperties", False)
    return closed
