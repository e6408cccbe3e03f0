"""Forced tool calls (tool_choice "required" or a named function) as one Lark grammar.

The answer is the model's own tool-call format, calls separated by a newline. Qwen3's JSON:
    <tool_call>\\n{"name": "get_weather", "arguments": {...}}\\n</tool_call>
with the arguments held to the tool's `parameters` schema by llguidance's %json. Qwen3-Coder's XML:
    <tool_call>\\n<function=get_weather>\\n<parameter=city>\\nParis\\n</parameter>\\n</function>\\n</tool_call>
with the parameters in the schema's order (the required ones always, the others optional); a
string parameter is free text without "</parameter>" (or one of its enum values), any other the
%json of its schema, so that the qwen3_coder parser reads back the values the schema asks for.
<tool_call> and </tool_call> are matched by token id (the model's ChatTokens), as the model writes them.
"""

import json
from typing import Any

from xserv_engine.errors import InvalidRequest
from xserv_engine.structured.constraint import GRAMMAR, Constraint
from xserv_engine.tokenizer.chat_tokens import TOOL_CALL_END, TOOL_CALL_START, ChatTokens
from xserv_engine.tokenizer.tool_call_parsers import JSON_PARSER, XML_PARSER
from xserv_engine.tokenizer.xml_tool_calls import is_text_parameter

FIELD = "chat.tools"
# an XML string parameter's text ({lo,hi} characters) through its closing tag: the first
# "</parameter>", after a newline
TEXT = r"/(?s:.{%s,%s})\n<\/parameter>/ & ~/(?s:.*)<\/parameter>(?s:.+)/"


def tool_call_constraint(tools: list[dict[str, Any]] | None, tool_choice: str, tokens: ChatTokens,
                         parallel_tool_calls: bool = True, parser: str = JSON_PARSER) -> Constraint | None:
    """None when the choice leaves the model free ("auto", "none"). `tokens`: the model's
    <tool_call> ids; `parser`: its format (tool_call_parsers.py)."""
    if tool_choice in ("auto", "none", ""):
        return None
    if tokens.tool_call_start is None or tokens.tool_call_end is None:
        raise InvalidRequest("chat.tool_choice", f"this model's vocabulary has no {TOOL_CALL_START} and "
                                                 f"{TOOL_CALL_END} tokens: a tool call cannot be forced")
    functions = [_function(i, tool) for i, tool in enumerate(tools or [])]
    if tool_choice != "required":
        functions = [f for f in functions if f["name"] == tool_choice]
        if not functions:
            raise InvalidRequest("chat.tool_choice", f"names {tool_choice!r}, which is not among the tools offered")
    if not functions:
        raise InvalidRequest("chat.tool_choice", "'required' needs at least one tool in chat.tools")
    grammar = xml_tool_call_grammar if parser == XML_PARSER else tool_call_grammar
    return Constraint(GRAMMAR, grammar(functions, parallel_tool_calls, tokens), field=FIELD)


def tool_call_grammar(functions: list[dict[str, Any]], parallel: bool, tokens: ChatTokens) -> str:
    """Qwen3's JSON calls."""
    lines = _calls(len(functions), parallel, tokens)
    for i, function in enumerate(functions):
        opening = '{"name": ' + json.dumps(function["name"], ensure_ascii=False) + ', "arguments": '
        lines.append(f'fn{i}: {_literal(opening)} args{i} "}}"')
        lines.append(f"args{i}: {_json(function['parameters'])}")
    return "\n".join(lines) + "\n"


def xml_tool_call_grammar(functions: list[dict[str, Any]], parallel: bool, tokens: ChatTokens) -> str:
    """Qwen3-Coder's XML calls."""
    lines = _calls(len(functions), parallel, tokens)
    for i, function in enumerate(functions):
        parameters = function["parameters"]
        properties = parameters.get("properties")
        required = parameters.get("required") or ()
        items = []
        for j, (name, schema) in enumerate(properties.items() if isinstance(properties, dict) else ()):
            value = _xml_value(schema, parameters, f"TEXT{i}_{j}", lines)
            lines.append(f"p{i}_{j}: {_opening('parameter', name)} {value}")
            items.append(f"p{i}_{j}" if name in required else f"p{i}_{j}?")
        lines.append(f"fn{i}: {_opening('function', function['name'])} {' '.join(items)} \"</function>\"")
    return "\n".join(lines) + "\n"


def _calls(count: int, parallel: bool, tokens: ChatTokens) -> list[str]:
    """The rules every format shares: one or more calls, each <tool_call>, a function, </tool_call>."""
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    call = f'call: <[{tokens.tool_call_start}]> "\\n" body "\\n" <[{tokens.tool_call_end}]>'
    return [start, call,
            "body: " + " | ".join(f"fn{i}" for i in range(count))]


def _opening(tag: str, name: str) -> str:
    return _literal(f"<{tag}={name}>\n")


def _xml_value(schema: Any, parameters: dict[str, Any], text_rule: str, lines: list[str]) -> str:
    """A parameter's value, its closing tag and the newline after it; a free-text value's
    terminal (its length bounded by the schema's minLength / maxLength) joins `lines`."""
    closing = _literal("\n</parameter>\n")
    if not is_text_parameter(schema):
        definitions = {key: parameters[key] for key in ("$defs", "definitions") if key in parameters}
        return f"{_json({**definitions, **schema} if isinstance(schema, dict) else {})} {closing}"
    enum = schema.get("enum")
    if enum and all(isinstance(value, str) for value in enum):
        return "(" + " | ".join(_literal(value) for value in enum) + f") {closing}"
    low, high = (_count(schema.get(key)) for key in ("minLength", "maxLength"))
    lines.append(f"{text_rule}: " + TEXT % (low or 0, "" if high is None else high))
    return text_rule + " " + _literal("\n")


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _json(schema: dict[str, Any]) -> str:
    """%json of the schema, with no free whitespace unless the schema asks for it (x-guidance)."""
    options = {"whitespace_flexible": False, **schema.get("x-guidance", {})}
    return "%json " + json.dumps({**schema, "x-guidance": options}, ensure_ascii=False)


def _function(position: int, tool: dict[str, Any]) -> dict[str, Any]:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise InvalidRequest(FIELD, f"tool {position} has no function name")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object"}
    if not isinstance(parameters, dict):
        raise InvalidRequest(FIELD, f"tool {position} ({function['name']}): parameters must be a JSON schema object")
    return {"name": function["name"], "parameters": parameters}
