"""Whether a value follows a JSON schema, for the schema features the structured-output tests and bench use.

Not a JSON Schema validator: objects (``properties``, ``required``, ``additionalProperties: false``), arrays
(``items``, ``minItems``, ``maxItems``), strings (``minLength``, ``maxLength``), integers, numbers, booleans,
``enum``, ``const`` and ``anyOf``; ``description`` and ``title`` are read as notes. Anything else is refused loudly, so
a test or bench never passes on a schema this check does not read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

KNOWN = frozenset(
    {"type", "properties", "required", "additionalProperties", "items", "enum", "const", "anyOf"}
    | {"minItems", "maxItems", "minLength", "maxLength", "description", "title"}
)


def follows(value: object, schema: Mapping[str, Any]) -> bool:
    """Whether ``value`` (parsed JSON) follows ``schema``."""
    unknown = set(schema) - KNOWN
    if unknown:
        raise ValueError(f"this check does not read the schema keywords {sorted(unknown)}")
    if "enum" in schema:
        return value in schema["enum"]
    if "const" in schema:
        return bool(value == schema["const"])
    if "anyOf" in schema:
        return any(follows(value, option) for option in schema["anyOf"])
    kind = schema["type"]
    if kind == "object":
        if not isinstance(value, dict) or any(k not in value for k in schema.get("required", [])):
            return False
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is False and any(k not in props for k in value):
            return False
        return all(follows(v, props[k]) for k, v in value.items() if k in props)
    if kind == "array":
        if not isinstance(value, list) or not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 1e9):
            return False
        return all(follows(v, schema["items"]) for v in value)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str) and schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", 1e9)
    raise ValueError(f"this check does not read the type {kind!r}")
