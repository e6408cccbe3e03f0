"""Which tool-call format the model writes inside <tool_call>, by vLLM's --tool-call-parser names.

hermes (and qwen3, the same): Qwen3's JSON, {"name": ..., "arguments": {...}}.
qwen3_coder: Qwen3-Coder's XML, <function=NAME><parameter=ARG>VALUE</parameter></function>.
auto: the one the model's chat template asks for (Qwen3-Coder's shows <function= and <parameter=).
"""

import functools
from typing import Any

from xserv_engine.errors import InvalidRequest
from xserv_engine.tokenizer.parsers import CallParser, parse_json_calls
from xserv_engine.tokenizer.xml_tool_calls import parameter_schemas, parse_xml_calls

AUTO = "auto"
JSON_PARSER = "hermes"
XML_PARSER = "qwen3_coder"
TOOL_CALL_PARSERS = (AUTO, JSON_PARSER, "qwen3", XML_PARSER)
_XML_TEMPLATE_MARKS = ("<function=", "<parameter=")


def resolve_tool_call_parser(choice: str, chat_template: str | None) -> str:
    """JSON_PARSER or XML_PARSER for --tool-call-parser `choice` and the model's chat template."""
    if choice not in TOOL_CALL_PARSERS:
        raise InvalidRequest("tool_call_parser", f"must be one of {', '.join(TOOL_CALL_PARSERS)}, got {choice!r}")
    if choice == AUTO:
        writes_xml = chat_template is not None and all(mark in chat_template for mark in _XML_TEMPLATE_MARKS)
        return XML_PARSER if writes_xml else JSON_PARSER
    return XML_PARSER if choice == XML_PARSER else JSON_PARSER


def call_parser(parser: str, tools: list[dict[str, Any]] | None) -> CallParser:
    """The body parser of one request's <tool_call> blocks; the XML one types values by `tools`."""
    if parser == XML_PARSER:
        return functools.partial(parse_xml_calls, schemas=parameter_schemas(tools))
    return parse_json_calls
