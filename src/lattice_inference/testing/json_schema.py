"""Whether a value follows a JSON schema, for the schema features the structured-output tests and bench use.

Not a JSON Schema validator: objects (``properties``, ``required``, ``additionalProperties: false``), arrays
(``items``), strings, integers, numbers, booleans and ``enum``; anything else is refused loudly, so a test or bench
never passes on a schema this check does not read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

KNOWN = frozenset({"type", "properties", "required", "additionalProperties", "items", "enum"})


def follows(value: object, schema: Mapping[str, Any]) -> bool:
    """Whether ``value`` (parsed JSON) follows ``schema``."""
    unknown = set(schema) - KNOWN
    if unknown:
        raise ValueError(f"this check does not read the schema keywords {sorted(unknown)}")
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "object":
        if not isinstance(value, dict) or any(k not in value for k in schema.get("required", [])):
            return False
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is False and any(k not in props for k in value):
            return False
        return all(follows(v, props[k]) for k, v in value.items() if k in props)
    if kind == "array":
        return isinstance(value, list) and all(follows(v, schema["items"]) for v in value)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str)
    raise ValueError(f"this check does not read the type {kind!r}")
