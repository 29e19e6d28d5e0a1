"""Checks of one JSON value against the schema it was asked for: valid (jsonschema), and which
of its properties the schema does not name.

A property is extra when an object schema names its properties and does not set
``additionalProperties``: JSON Schema allows it, but nobody asked for it (a Pydantic model
ignores it). One allowed by ``additionalProperties: true`` or a schema is not extra.
"""

from __future__ import annotations

from typing import Any


def schema_error(value: Any, schema: dict[str, Any]) -> str | None:
    """Why ``value`` breaks ``schema`` (None: it follows it)."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema)
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "(root)"
    return f"{where}: {error.message[:200]}"


def extra_properties(value: Any, schema: dict[str, Any]) -> list[str]:
    """The paths of ``value``'s properties that ``schema`` does not name."""
    found: list[str] = []
    _walk(value, schema, schema, "$", found)
    return found


def _walk(value: Any, schema: Any, root: dict[str, Any], path: str, found: list[str]) -> None:
    schema = _resolve(schema, root)
    if not isinstance(schema, dict):
        return
    for part in schema.get("allOf", []):
        _walk(value, part, root, path, found)
    branches = schema.get("anyOf", []) + schema.get("oneOf", [])
    matching = [b for b in branches if schema_error(value, _with_defs(b, root)) is None]
    if matching:
        _walk(value, matching[0], root, path, found)
    if isinstance(value, dict) and ("properties" in schema or "patternProperties" in schema):
        _walk_object(value, schema, root, path, found)
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, item in value.items():
            _walk(item, schema["additionalProperties"], root, f"{path}.{key}", found)
    if isinstance(value, list):
        prefix = schema.get("prefixItems", [])
        for index, item in enumerate(value):
            item_schema = prefix[index] if index < len(prefix) else schema.get("items")
            _walk(item, item_schema, root, f"{path}[{index}]", found)


def _walk_object(
    value: dict[str, Any], schema: dict[str, Any], root: dict[str, Any], path: str, found: list
) -> None:
    properties = schema.get("properties", {})
    additional = schema.get("additionalProperties")
    for key, item in value.items():
        if key in properties:
            _walk(item, properties[key], root, f"{path}.{key}", found)
        elif isinstance(additional, dict):
            _walk(item, additional, root, f"{path}.{key}", found)
        elif additional is None and not _pattern_named(key, schema):
            found.append(f"{path}.{key}")


def _pattern_named(key: str, schema: dict[str, Any]) -> bool:
    import re

    return any(re.search(pattern, key) for pattern in schema.get("patternProperties", {}))


def _resolve(schema: Any, root: dict[str, Any]) -> Any:
    """``schema`` with a local ``$ref`` (``#/$defs/Name``) followed."""
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str):
        target: Any = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            target = target.get(part, {}) if isinstance(target, dict) else {}
        schema = target
    return schema


def _with_defs(schema: Any, root: dict[str, Any]) -> Any:
    """A branch of ``root`` that can be validated alone (its ``$ref``s still resolve)."""
    if not isinstance(schema, dict) or "$defs" not in root:
        return schema
    return {**schema, "$defs": root["$defs"]}
