"""Numeric bounds of request fields, checked from the OpenAPI request schema itself, so the
document and the server agree (an out-of-range value is a 400 naming the field before any
engine call). Types are checked later, by Fields."""

import math

from xserv_rest.errors import invalid_request
from xserv_rest.fields import Fields


def check_ranges(body: Fields, properties: dict) -> None:
    """Top-level numbers, the values of number maps (logit_bias) and the items of number arrays."""
    for name, schema in properties.items():
        value = body.data.get(name)
        if isinstance(value, dict) and "additionalProperties" in schema:
            _check_all(value.values(), schema["additionalProperties"], name, f"'{name}' values")
        elif isinstance(value, list) and "items" in schema:
            _check_all(value, schema["items"], name, f"'{name}' items")
        else:
            _check_all([value], schema, name, f"'{name}'")


def _check_all(values, schema: dict, name: str, what: str) -> None:
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not _within(value, schema):
            raise invalid_request(f"{what} must be {_bounds(schema)}, got {value}", param=name)


def _within(value: int | float, schema: dict) -> bool:
    if isinstance(value, float) and not math.isfinite(value):
        return False
    if "minimum" in schema and value < schema["minimum"]:
        return False
    if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
        return False
    return "maximum" not in schema or value <= schema["maximum"]


def _bounds(schema: dict) -> str:
    if "minimum" not in schema and "exclusiveMinimum" not in schema:
        return f"at most {schema['maximum']:g}"
    if "exclusiveMinimum" in schema:
        return f"greater than {schema['exclusiveMinimum']:g} and at most {schema['maximum']:g}"
    return f"between {schema['minimum']:g} and {schema['maximum']:g}"
