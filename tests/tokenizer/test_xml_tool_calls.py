"""Qwen3-Coder's XML tool calls: values typed by the tools' schemas (as vLLM's qwen3_coder parser
types them), several calls, every cut of the stream, malformed calls as content, reasoning first."""

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer

from tests.support.reference import QWEN3
from tests.tokenizer.test_parsers import CALL, END_CALL, END_THINK, THINK, parse_every_way, run, token_stream
from xserv_engine.engine.output_stream import NO_TOKEN
from xserv_engine.inputs import ChatInput
from xserv_engine.outputs import ToolCallDelta
from xserv_engine.tokenizer.detokenizer import IncrementalDetokenizer
from xserv_engine.tokenizer.parsers import OutputParser
from xserv_engine.tokenizer.tokenizer import Tokenizer
from xserv_engine.tokenizer.tool_call_parsers import XML_PARSER, call_parser
from xserv_engine.tokenizer.xml_tool_calls import typed_value

CODER_TEMPLATE = QWEN3 / "chat_template-Qwen3-Coder.jinja"
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "hourly": {"type": "boolean"},
        "threshold": {"type": "number"}, "options": {"type": "object"}, "fields": {"type": "array"},
        "note": {"type": ["string", "null"]}, "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}},
]
WEATHER = ("\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
           "<parameter=days>\n3\n</parameter>\n<parameter=hourly>\nTrue\n</parameter>\n</function>\n")
WEATHER_ARGS = {"city": "San Francisco", "days": 3, "hourly": True}
TIME = "\n<function=get_time>\n<parameter=zone>\nEurope/Paris\n</parameter>\n</function>\n"


def xml(items, **options):
    options.setdefault("parse_call", call_parser(XML_PARSER, TOOLS))
    content, reasoning, calls = parse_every_way(items, **options)
    return content, reasoning, [(id_, name, json.loads(arguments)) for id_, name, arguments in calls]


@pytest.mark.parametrize("name, text, value", [
    ("city", "  New York\n  ", "  New York\n  "),  # a string stays as written, spaces and all
    ("city", "42", "42"),
    ("city", "null", "null"),
    ("days", " 7 ", 7),
    ("days", "-12", -12),
    ("days", "seven", "seven"),  # not an integer: kept as text, as vLLM does
    ("days", "1.5", "1.5"),
    ("days", "null", None),
    ("threshold", "2.5", 2.5),
    ("threshold", "4", 4),
    ("threshold", "1e-3", 0.001),
    ("threshold", "1e999", "1e999"),  # JSON has no Infinity
    ("threshold", "NaN", "NaN"),
    ("hourly", "false", False),
    ("hourly", "TRUE", True),
    ("hourly", "yes", "yes"),
    ("options", '{"a": [1, {"b": null}]}', {"a": [1, {"b": None}]}),
    ("options", "{not json}", "{not json}"),
    ("fields", '["temp", "wind"]', ["temp", "wind"]),
    ("note", "null", None),  # a nullable string
    ("note", "nothing", "nothing"),
    ("limit", "5", 5),
    ("limit", "null", None),
    ("undeclared", '{"x": 1}', {"x": 1}),  # a parameter the tool does not declare: JSON if it is JSON
    ("undeclared", "[1, 2", "[1, 2"),
    ("undeclared", "12", 12),
    ("undeclared", "NaN", "NaN"),
])
def test_values_are_typed_by_the_parameter_schema(name, text, value):
    properties = TOOLS[0]["function"]["parameters"]["properties"]
    assert typed_value(text, properties.get(name)) == value
    assert type(typed_value(text, properties.get(name))) is type(value)


def test_a_call_becomes_typed_json_arguments_however_the_stream_is_cut():
    assert xml([CALL, WEATHER, END_CALL]) == ("", "", [("call_0", "get_weather", WEATHER_ARGS)])


def test_several_calls_in_blocks_and_in_one_block():
    two_blocks = xml(["Checking both.\n\n", CALL, WEATHER, END_CALL, "\n", CALL, TIME, END_CALL])
    expected = [("call_0", "get_weather", WEATHER_ARGS), ("call_1", "get_time", {"zone": "Europe/Paris"})]
    assert two_blocks == ("Checking both.", "", expected)
    assert xml([CALL, WEATHER + TIME, END_CALL]) == ("", "", expected)


def test_reasoning_then_content_then_a_call():
    items = [THINK, "\nThe user wants the weather.\n", END_THINK, "\n\nLet me check.\n\n", CALL, WEATHER, END_CALL]
    assert xml(items) == ("Let me check.", "The user wants the weather.",
                          [("call_0", "get_weather", WEATHER_ARGS)])


def test_unclosed_parameter_and_function_tags_are_read_as_vllm_reads_them():
    body = "\n<function=get_weather>\n<parameter=city>\nOslo\n<parameter=days>\n2\n"
    assert xml([CALL, body, END_CALL])[2] == [("call_0", "get_weather", {"city": "Oslo", "days": 2})]


def test_values_keep_markup_newlines_and_non_ascii_text():
    body = "<function=get_weather>\n<parameter=city>\n<b>北京</b> ☀️\n\nline two\n</parameter>\n</function>"
    assert xml([CALL, body, END_CALL])[2] == [("call_0", "get_weather", {"city": "<b>北京</b> ☀️\n\nline two"})]


def test_a_function_without_parameters_has_empty_arguments():
    assert xml([CALL, "\n<function=now>\n</function>\n", END_CALL])[2] == [("call_0", "now", {})]


@pytest.mark.parametrize("body", [
    '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n',  # Qwen3's JSON, not this model's XML
    "\n<function=>\n</function>\n",  # no name
    "\nSure!\n<function=get_time>\n</function>\n",  # text before the function
    "\n<function=get_time>\n</function>\ntrailing words\n",
    "\n<function=get_time>\nzone: UTC\n</function>\n",  # text where parameters go
    "\n<function=get_time>\n<parameter=>\nUTC\n</parameter>\n</function>\n",
    "\n",
])
def test_a_malformed_call_comes_back_as_content_verbatim(body):
    items = ["Sure.\n", CALL, body, END_CALL, "\nbye"]
    assert xml(items) == ("Sure.\n<tool_call>" + body + "</tool_call>\nbye", "", [])


def detokenized(tokenizer: Tokenizer, text: str) -> list[tuple[int, str]]:
    """(token id, piece) as the engine's detokenizer hands them to the parser, then its flush."""
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    pairs = [(token_id, detokenizer.add(token_id)) for token_id in tokenizer.encode(text)]
    return pairs + [(NO_TOKEN, detokenizer.flush())]


def test_streamed_token_by_token_with_qwen_pieces_the_call_arrives_whole_at_its_close(tokenizer):
    text = "I'll look it up.\n<tool_call>" + WEATHER.replace("San Francisco", "Zürich 🌧") + "</tool_call>"
    stream = detokenized(tokenizer, text)
    assert len(stream) > 40 and stream[-2][0] == END_CALL
    parser = OutputParser(tokenizer.chat_tokens, starts_in_reasoning=False,
                          parse_call=call_parser(XML_PARSER, TOOLS), new_call_id=lambda: "call_x")
    deltas = [parser.feed(token_id, piece) for token_id, piece in stream] + [parser.finish()]
    assert "".join(delta.content for delta in deltas) == "I'll look it up."
    assert all(not delta.tool_calls for delta in deltas[:-3])
    closing = deltas[-3]
    arguments = json.dumps({**WEATHER_ARGS, "city": "Zürich 🌧"}, ensure_ascii=False)
    assert closing.tool_calls == [ToolCallDelta(index=0, id="call_x", name="get_weather", arguments=""),
                                  ToolCallDelta(index=0, arguments=arguments)]
    assert parser.has_tool_calls


def test_unterminated_call_is_content_at_finish():
    items = ["x ", CALL, "\n<function=get_time>\n<parameter=zone>\nUT"]
    assert xml(items) == ("x <tool_call>\n<function=get_time>\n<parameter=zone>\nUT", "", [])


def test_with_tool_parsing_off_the_xml_stays_text():
    assert run(token_stream([CALL, TIME, END_CALL]), parse_tools=False)[0] == "<tool_call>" + TIME + "</tool_call>"


@pytest.fixture(scope="module")
def coder_tokenizer(demo_dir):
    config = json.loads((demo_dir / "tokenizer_config.json").read_text())
    return Tokenizer(HFTokenizer.from_file(str(demo_dir / "tokenizer.json")), config, CODER_TEMPLATE.read_text())


@pytest.mark.reference
def test_a_call_the_coder_template_renders_in_history_parses_back_to_its_arguments(coder_tokenizer):
    arguments = {"city": "Lyon", "days": 2, "hourly": False, "threshold": 0.5, "options": {"units": ["si"]}}
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    prompt = coder_tokenizer.render_chat(ChatInput(messages, tools=TOOLS, add_generation_prompt=False))
    body = prompt[prompt.rindex("<tool_call>") + len("<tool_call>"):prompt.rindex("</tool_call>")]
    assert xml([CALL, body, END_CALL])[2] == [("call_0", "get_weather", arguments)]
