"""Qwen3-Coder's tool calls: the XML inside a <tool_call> block, typed by the tools' schemas.

Qwen3-Coder writes a call as
    <tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>
Every VALUE is bare text. As vLLM's qwen3_coder parser reads it, the parameter's JSON schema says
what it is: a string parameter keeps the text as it is; integer and number become numbers and
boolean a bool (when the text is one, else it stays text); any other declared type (object,
array) and a parameter the tool does not declare are read as JSON, else kept as text. "null" is
None unless the parameter is a plain string. One newline on each side of VALUE is framing.

Like vLLM, a missing </parameter> ends at the next <parameter= or at the function's end, and a
missing </function> at the body's end; anything else outside the tags makes the call malformed.
"""

import json
import math
import re
from typing import Any

# function name -> {parameter name: its JSON schema}, from the request's tools
ParameterSchemas = dict[str, dict[str, Any]]

_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>(.*?)(?:</function>|\Z)", re.DOTALL)
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)
_INTEGER = re.compile(r"[+-]?[0-9]+")
_DECIMAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")
_FAILED = object()


def parameter_schemas(tools: list[dict[str, Any]] | None) -> ParameterSchemas:
    """Each OpenAI tool's parameter schemas (its parameters' "properties"), by function name."""
    schemas: ParameterSchemas = {}
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        schemas[function["name"]] = properties if isinstance(properties, dict) else {}
    return schemas


def parse_xml_calls(body: str, schemas: ParameterSchemas) -> list[tuple[str, str]] | None:
    """[(name, arguments JSON)] for each <function=...> in a <tool_call> body; None when malformed."""
    functions = _matches(_FUNCTION, body)
    if not functions:
        return None
    calls = []
    for function in functions:
        name = function.group(1).strip()
        arguments = _parse_parameters(function.group(2), schemas.get(name, {}))
        if not name or arguments is None:
            return None
        calls.append((name, json.dumps(arguments, ensure_ascii=False)))
    return calls


def _parse_parameters(text: str, properties: dict[str, Any]) -> dict[str, Any] | None:
    parameters = _matches(_PARAMETER, text)
    if parameters is None:
        return None
    arguments: dict[str, Any] = {}
    for parameter in parameters:
        name = parameter.group(1).strip()
        if not name:
            return None
        value = parameter.group(2).removeprefix("\n").removesuffix("\n")
        arguments[name] = typed_value(value, properties.get(name))
    return arguments


def _matches(pattern: re.Pattern, text: str) -> list[re.Match] | None:
    """The matches of `pattern` one after the other through `text` (trailing whitespace aside);
    None when anything else stands between them."""
    matches: list[re.Match] = []
    position = 0
    while text[position:].strip():
        match = pattern.match(text, position)
        if match is None:
            return None
        matches.append(match)
        position = match.end()
    return matches


def declared_types(schema: Any) -> list[str]:
    """The JSON types a parameter schema declares ("type", a string enum's, or its anyOf / oneOf
    members'); [] for an undeclared parameter or one that declares none."""
    if not isinstance(schema, dict):
        return []
    declared = schema.get("type")
    if isinstance(declared, str):
        return [declared.strip().lower()]
    if isinstance(declared, list):
        return [t.strip().lower() for t in declared if isinstance(t, str)]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(value, str) for value in enum):
        return ["string"]
    members = schema.get("anyOf") or schema.get("oneOf") or []
    return [t for member in members if isinstance(member, dict) for t in declared_types(member)]


def is_text_parameter(schema: Any) -> bool:
    """A parameter whose value is taken as plain text (a string in its declared types)."""
    return "string" in declared_types(schema)


def typed_value(text: str, schema: Any) -> Any:
    """The JSON value of a parameter's text, as its schema types it."""
    types = declared_types(schema)
    bare = text.strip()
    if "string" in types and not (bare == "null" and "null" in types):
        return text
    if bare == "null":
        return None
    for type_ in types or ["json"]:
        value = _CONVERTERS.get(type_, _json)(bare)
        if value is not _FAILED:
            return value
    return text


def _integer(text: str) -> Any:
    if not _INTEGER.fullmatch(text):
        return _FAILED
    try:
        return int(text)
    except ValueError:  # more digits than Python converts
        return _FAILED


def _number(text: str) -> Any:
    if not _DECIMAL.fullmatch(text):
        return _FAILED
    value = _integer(text)
    if value is _FAILED:
        value = float(text)
    return value if math.isfinite(value) else _FAILED  # 1e999: JSON has no Infinity


def _boolean(text: str) -> Any:
    return {"true": True, "false": False}.get(text.lower(), _FAILED)


def _json(text: str) -> Any:
    try:
        return json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return _FAILED


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


_CONVERTERS = {"integer": _integer, "number": _number, "boolean": _boolean, "null": lambda text: _FAILED}
