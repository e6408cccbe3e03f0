"""OpenAI's error body, and a pydantic ValidationError turned into one: the field's path in
OpenAI's form ("messages[2].content") and a message that names it."""

import re
import typing
from types import UnionType
from typing import Any

from pydantic import BaseModel, ValidationError

from xserv_engine.sampling_params import BOUNDS
from xserv_rest.protocol.base import Answer, FieldError

KINDS = {"int_type": "an integer", "float_type": "a number", "bool_type": "a boolean", "string_type": "a string",
         "list_type": "an array", "dict_type": "a JSON object", "model_type": "a JSON object",
         "model_attributes_type": "a JSON object"}
RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number"}
LONE_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")  # the escape of a UTF-16 surrogate, maybe unpaired
JSON_KINDS = {str: "string", bool: "boolean", int: "integer", float: "number", list: "array", dict: "object",
              type(None): "null"}


class ErrorDetail(Answer):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Answer):
    error: ErrorDetail


def describe(exc: ValidationError, model: type[BaseModel]) -> tuple[str, str | None, str | None]:
    """(message, param, code) of the most specific error (the deepest field) in `exc`."""
    errors = [(field_path(model, error["loc"]), error) for error in exc.errors()]
    path, error = max(errors, key=lambda pair: pair[0].count(".") + pair[0].count("[") + bool(pair[0]))
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):
        return cause.message, cause.field, cause.code
    if error["type"] == "json_invalid":
        return _invalid_json(error), None, None
    if error["type"] == "missing":
        return f"'{path}' is required", path, None
    if not path:
        return "the request body must be a JSON object", None, None
    if error["type"] in KINDS:
        kinds = [KINDS[e["type"]] for p, e in errors if p == path and e["type"] in KINDS]
        got = JSON_KINDS.get(type(error["input"]), type(error["input"]).__name__)
        return f"'{path}' must be {' or '.join(dict.fromkeys(kinds))}, got {got}", path, None
    bounds = BOUNDS.get(_field_name(path))
    if error["type"] in RANGE_ERRORS and bounds:
        return f"'{path}' must be {bounds.text()}, got {_show(error['input'])}", path, None
    if error["type"] in ("too_short", "too_long"):
        limit = error["ctx"].get("min_length", error["ctx"].get("max_length"))
        most = "least" if error["type"] == "too_short" else "most"
        return f"'{path}' must hold at {most} {limit} item(s), got {error['ctx']['actual_length']}", path, None
    if error["type"] == "string_too_short" and error["ctx"]["min_length"] == 1:
        return f"'{path}' must not be empty", path, None
    if error["type"] == "string_pattern_mismatch" and error["loc"][-1] == "[key]":
        return f"'{path}' keys must be token ids (decimal digits), got {error['loc'][-2]!r}", path, None
    message = error["msg"].removeprefix("Value error, ")
    if message.startswith("Input should be "):
        got = _show(error["input"]) if isinstance(error["input"], (int, float)) else repr(error["input"])
        return f"'{path}' must be {message.removeprefix('Input should be ')}, got {got}", path, None
    return f"'{path}' {message}", path, None


def field_path(model: type[BaseModel], loc: tuple) -> str:
    """("messages", 2, "content", "list[TextPart]", 0, "type") -> "messages[2].content[0].type":
    walks the models' annotations, dropping pydantic's union tags and stopping at dict keys."""
    return "".join(part if part.startswith("[") else f".{part}" for part in _walk(model, loc)).lstrip(".")


def _walk(annotation: Any, loc: tuple) -> list[str]:
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if not loc:
        return []
    item, rest = loc[0], loc[1:]
    if typing.get_origin(annotation) in (typing.Union, UnionType):
        members = [member for member in typing.get_args(annotation) if member is not type(None)]
        if len(members) == 1:  # X | None: pydantic adds no tag
            return _walk(members[0], loc)
        return max((_walk(member, rest) for member in members), key=len)  # `item` is a member's tag
    if typing.get_origin(annotation) is list and isinstance(item, int):
        return [f"[{item}]"] + _walk(typing.get_args(annotation)[0], rest)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel) and item in annotation.model_fields:
        return [item] + _walk(annotation.model_fields[item].annotation, rest)
    return []  # a dict key, or past what the models declare


def _invalid_json(error: dict) -> str:
    raw = error["input"]
    if not (raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)).strip():
        return "the request body is empty; send a JSON object (Content-Type: application/json)"
    if LONE_SURROGATE.search(str(raw)):
        return "the request body holds an invalid Unicode escape (a lone surrogate)"
    return f"the request body is not valid JSON: {error['msg'].removeprefix('Invalid JSON: ')}"


def _show(value: Any) -> str:
    """Numbers past 64 bits (JSON allows them) as 1.2e+21, not 22 digits."""
    return f"{value:g}" if isinstance(value, (int, float)) and abs(value) >= 2**64 else str(value)


def _field_name(path: str) -> str:
    return re.sub(r"\[\d+\]", "", path).rsplit(".", 1)[-1]
