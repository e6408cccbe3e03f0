"""Forced tool calls (tool_choice "required" or a named function) as one Lark grammar.

The answer is Qwen3's own tool-call format, calls separated by a newline:
    <tool_call>\\n{"name": "get_weather", "arguments": {...}}\\n</tool_call>
with the arguments held to the tool's `parameters` schema by llguidance's %json. <tool_call> and
</tool_call> are matched by token id, as the model writes them.
"""

import json
from typing import Any

from xserv_engine.errors import InvalidRequest
from xserv_engine.structured.constraint import GRAMMAR, Constraint
from xserv_engine.tokenizer.parsers import TOOL_CALL_END_ID, TOOL_CALL_START_ID

FIELD = "chat.tools"


def tool_call_constraint(tools: list[dict[str, Any]] | None, tool_choice: str,
                         parallel_tool_calls: bool = True) -> Constraint | None:
    """None when the choice leaves the model free ("auto", "none")."""
    if tool_choice in ("auto", "none", ""):
        return None
    functions = [_function(i, tool) for i, tool in enumerate(tools or [])]
    if tool_choice != "required":
        functions = [f for f in functions if f["name"] == tool_choice]
        if not functions:
            raise InvalidRequest("chat.tool_choice", f"names {tool_choice!r}, which is not among the tools offered")
    if not functions:
        raise InvalidRequest("chat.tool_choice", "'required' needs at least one tool in chat.tools")
    return Constraint(GRAMMAR, tool_call_grammar(functions, parallel_tool_calls), field=FIELD)


def tool_call_grammar(functions: list[dict[str, Any]], parallel: bool) -> str:
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    lines = [start, f'call: <[{TOOL_CALL_START_ID}]> "\\n" body "\\n" <[{TOOL_CALL_END_ID}]>',
             "body: " + " | ".join(f"fn{i}" for i in range(len(functions)))]
    for i, function in enumerate(functions):
        opening = '{"name": ' + json.dumps(function["name"], ensure_ascii=False) + ', "arguments": '
        lines.append(f'fn{i}: {_literal(opening)} args{i} "}}"')
        lines.append(f"args{i}: %json {json.dumps(_compact(function['parameters']), ensure_ascii=False)}")
    return "\n".join(lines) + "\n"


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _compact(schema: dict[str, Any]) -> dict[str, Any]:
    """No free whitespace inside the arguments, unless the schema asks for it (x-guidance)."""
    options = {"whitespace_flexible": False, **schema.get("x-guidance", {})}
    return {**schema, "x-guidance": options}


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
