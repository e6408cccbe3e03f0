"""Forced tool calls in Qwen3-Coder's XML: the grammar accepts the calls the model is asked for,
refuses what the qwen3_coder parser could not read back as the schema says, and what it accepts
parses to the arguments that were meant; an engine forcing a random model gets valid calls."""

import json

import pytest

from tests.engine.conftest import make_engine
from tests.structured.conftest import EOS_IDS
from tests.structured.schemas import TOOLS
from tests.structured.test_engine import assert_all_freed, forced_calls
from tests.structured.test_grammars import accepts
from tests.tokenizer.test_chat_tokens import QWEN3_TOKENS
from xserv_engine.structured.tool_grammar import tool_call_constraint
from xserv_engine.tokenizer.tool_call_parsers import XML_PARSER, call_parser
from xserv_engine.tokenizer.tokenizer import Tokenizer

SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object",
    "properties": {"query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1},
                   "exact": {"type": "boolean"}, "filters": {"$ref": "#/$defs/Filters"}},
    "required": ["query", "limit"],
    "$defs": {"Filters": {"type": "object", "properties": {"site": {"type": "string"}}, "required": ["site"],
                          "additionalProperties": False}}}}}


@pytest.fixture(scope="module")
def tokenizer(demo_dir):
    return Tokenizer.from_dir(demo_dir)


def call(name: str, **parameters: str) -> str:
    """A call as Qwen3-Coder writes it, each parameter's value as text."""
    lines = [f"<tool_call>\n<function={name}>"]
    lines += [f"<parameter={key}>\n{value}\n</parameter>" for key, value in parameters.items()]
    return "\n".join(lines) + "\n</function>\n</tool_call>"


def complete(backend, tokenizer, constraint, text: str) -> bool:
    """The grammar takes all of `text` and may end there."""
    matcher = backend.compile(constraint).matcher()
    return all(matcher.accept(t) for t in tokenizer.encode(text) + EOS_IDS[:1])


def parsed(text: str, tools) -> list[tuple[str, dict]]:
    """What the qwen3_coder parser makes of each <tool_call> block of `text`."""
    parse = call_parser(XML_PARSER, tools)
    blocks = [block.split("</tool_call>")[0] for block in text.split("<tool_call>")[1:]]
    return [(name, json.loads(arguments)) for block in blocks for name, arguments in parse(block)]


def test_required_accepts_coder_calls_with_valid_values_only(backend, tokenizer):
    required = tool_call_constraint(TOOLS, "required", QWEN3_TOKENS, parser=XML_PARSER)
    weather = call("get_weather", city="Oslo", unit="celsius")
    assert complete(backend, tokenizer, required, weather)
    assert parsed(weather, TOOLS) == [("get_weather", {"city": "Oslo", "unit": "celsius"})]
    assert not accepts(backend, tokenizer, required, weather.replace("celsius", "kelvin"))
    assert not accepts(backend, tokenizer, required, weather.replace("get_weather", "get_news"))
    assert not accepts(backend, tokenizer, required, call("get_weather", city="Oslo"))  # unit is required
    assert not accepts(backend, tokenizer, required, call("get_weather", unit="celsius", city="Oslo"))  # order
    assert not accepts(backend, tokenizer, required, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    two = weather + "\n" + call("get_time", zone="UTC")
    assert complete(backend, tokenizer, required, two)
    single = tool_call_constraint(TOOLS, "required", QWEN3_TOKENS, False, XML_PARSER)
    assert not accepts(backend, tokenizer, single, two)


def test_a_string_value_is_free_text_up_to_its_closing_tag(backend, tokenizer):
    named = tool_call_constraint([SEARCH], "search", QWEN3_TOKENS, parser=XML_PARSER)
    query = "how to close </param tags\n\nin <b>HTML</b>? 你好"
    text = call("search", query=query, limit="5")
    assert complete(backend, tokenizer, named, text)
    assert parsed(text, [SEARCH]) == [("search", {"query": query, "limit": 5})]
    assert not accepts(backend, tokenizer, named, call("search", query="a </parameter> b", limit="5"))


def test_a_string_s_length_bounds_hold(backend, tokenizer):
    required = tool_call_constraint(TOOLS, "required", QWEN3_TOKENS, parser=XML_PARSER)  # city: maxLength 10
    assert complete(backend, tokenizer, required, call("get_weather", city="Ouagadougo", unit="celsius"))
    assert not accepts(backend, tokenizer, required, call("get_weather", city="Ouagadougou", unit="celsius"))


def test_other_values_are_json_of_their_schema(backend, tokenizer):
    named = tool_call_constraint([SEARCH], "search", QWEN3_TOKENS, parser=XML_PARSER)
    text = call("search", query="xserv", limit="10", exact="true", filters='{"site":"github.com"}')
    assert complete(backend, tokenizer, named, text)
    assert parsed(text, [SEARCH]) == [("search", {"query": "xserv", "limit": 10, "exact": True,
                                                  "filters": {"site": "github.com"}})]
    for bad in ({"limit": "0"}, {"limit": "ten"}, {"limit": "2", "exact": "yes"}, {"limit": "2", "filters": "{}"}):
        assert not accepts(backend, tokenizer, named, call("search", query="q", **bad)), bad


def test_a_named_choice_allows_that_function_only(backend, tokenizer):
    named = tool_call_constraint(TOOLS, "get_time", QWEN3_TOKENS, parser=XML_PARSER)
    assert complete(backend, tokenizer, named, call("get_time", zone="CET"))
    assert not accepts(backend, tokenizer, named, call("get_weather", city="a", unit="celsius"))


def test_a_function_without_parameters(backend, tokenizer):
    now = {"type": "function", "function": {"name": "now"}}
    constraint = tool_call_constraint([now], "required", QWEN3_TOKENS, parser=XML_PARSER)
    assert complete(backend, tokenizer, constraint, call("now"))
    assert not accepts(backend, tokenizer, constraint, call("now", zone="UTC"))


@pytest.fixture(scope="module")
def coder_engine(demo_dir):
    """The demo model (random weights) told that its tool calls are Qwen3-Coder's XML."""
    engine = make_engine(demo_dir, max_model_len=1024, num_kv_blocks=512, tool_call_parser=XML_PARSER)
    yield engine
    engine.shutdown()


def test_forced_calls_from_a_random_model_parse_into_calls_its_schemas_accept(coder_engine):
    assert coder_engine.engine.tool_call_parser == XML_PARSER
    assert all(forced_calls(coder_engine, 8, "required"))
    for calls in forced_calls(coder_engine, 4, "get_weather", parallel_tool_calls=False):
        assert [name for name, _ in calls] == ["get_weather"]
    assert_all_freed(coder_engine)
