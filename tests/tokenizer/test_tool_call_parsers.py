"""--tool-call-parser: auto reads the model's chat template; the names are vLLM's."""

import pytest

from tests.support.reference import QWEN3
from xserv_engine.errors import InvalidRequest
from xserv_engine.tokenizer.parsers import parse_json_calls
from xserv_engine.tokenizer.tool_call_parsers import JSON_PARSER, XML_PARSER, call_parser, resolve_tool_call_parser


@pytest.mark.reference
@pytest.mark.parametrize("name, parser", [("chat_template-Qwen3-Coder.jinja", XML_PARSER),
                                          ("chat_template.jinja", JSON_PARSER)])
def test_auto_picks_the_format_the_official_templates_ask_for(name, parser):
    assert resolve_tool_call_parser("auto", (QWEN3 / name).read_text()) == parser


def test_auto_without_xml_in_the_template_is_qwen3_json(tokenizer):
    assert resolve_tool_call_parser("auto", tokenizer.chat_template) == JSON_PARSER
    assert resolve_tool_call_parser("auto", None) == JSON_PARSER


@pytest.mark.parametrize("choice, parser", [("hermes", JSON_PARSER), ("qwen3", JSON_PARSER),
                                            ("qwen3_coder", XML_PARSER)])
def test_a_named_parser_overrides_the_template(choice, parser):
    assert resolve_tool_call_parser(choice, "<function=f><parameter=p>") == parser
    assert resolve_tool_call_parser(choice, None) == parser


def test_an_unknown_parser_names_the_setting():
    with pytest.raises(InvalidRequest) as error:
        resolve_tool_call_parser("mistral", None)
    assert error.value.field == "tool_call_parser" and "qwen3_coder" in error.value.message


def test_the_json_parser_ignores_the_tools_and_the_xml_one_reads_their_types():
    assert call_parser(JSON_PARSER, None) is parse_json_calls
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"n": {"type": "number"}}}}}]
    body = "\n<function=f>\n<parameter=n>\n2.5\n</parameter>\n</function>\n"
    assert call_parser(XML_PARSER, tools)(body) == [("f", '{"n": 2.5}')]
    assert call_parser(XML_PARSER, None)(body) == [("f", '{"n": 2.5}')]  # undeclared: read as JSON
