"""JSON schemas as nanoserve compiles them: compact, and closed where a request is strict."""

from __future__ import annotations

from typing import Any

# llguidance's JSON options: no free whitespace (a small model otherwise wanders into blank
# lines), "," and ":" between items and keys.
COMPACT = {"whitespace_flexible": False}

# Keywords whose value is a schema, a list of schemas, or a map of names to schemas.
_ONE = ("items", "additionalItems", "additionalProperties", "contains", "not", "if", "then", "else")
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def close_objects(schema: Any) -> Any:
    """A copy of ``schema`` in which every object schema that does not say otherwise has
    ``additionalProperties: false``."""
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key in _ONE:
        if key in closed:
            closed[key] = close_objects(closed[key])
    for key in _MANY:
        if isinstance(closed.get(key), list):
            closed[key] = [close_objects(s) for s in closed[key]]
    for key in _MAPS:
        if isinstance(closed.get(key), dict):
            closed[key] = {name: close_objects(s) for name, s in closed[key].items()}
    kind = closed.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind)
    if (is_object or "properties" in closed) and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed
