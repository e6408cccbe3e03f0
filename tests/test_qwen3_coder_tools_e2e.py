"""Qwen3-Coder's XML tool calls end to end: `xserv up` on a scripted model with Qwen3-Coder's chat
template, spoken to with the openai SDK and a gRPC stub.

The engine picks the qwen3_coder parser from the template (--tool-call-parser auto). The scripted
model answers with one XML call whose values the tool's schema types (a string, an integer, a
boolean, an object), so OpenAI's tool_calls must carry them typed, streamed and not. (Forced calls
are tested on the engine: the grammar forces its fixed text as the tokenizer spells it, which the
scripted model's own tags are not; tests/structured/test_xml_tool_grammar.py.)
"""

import json

import grpc
import openai
import pytest
from xserv.v1 import engine_pb2, engine_pb2_grpc

from tests.support.reference import QWEN3
from tests.support.scripted_model import added_token_ids, script_tokens, served_scripted, write_scripted_model
from xserv_engine.tokenizer.chat_tokens import TOOL_CALL_END, TOOL_CALL_START
from xserv_engine.tokenizer.tokenizer import Tokenizer

pytestmark = [pytest.mark.e2e, pytest.mark.reference]

CODER_TEMPLATE = QWEN3 / "chat_template-Qwen3-Coder.jinja"
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather forecast for a city",
        "parameters": {"type": "object", "required": ["city", "days"], "properties": {
            "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1},
            "hourly": {"type": "boolean"},
            "options": {"type": "object", "properties": {"units": {"enum": ["metric", "imperial"]}}}}}}},
    {"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}},
]
QUESTION = [{"role": "user", "content": "Forecast for San Francisco, hourly, three days?"}]
# The XML around the values: tokens of the scripted model's own, since the tags repeat.
TAGS = ("\n<function=get_weather>\n<parameter=city>\n", "\n</parameter>\n<parameter=days>\n",
        "\n</parameter>\n<parameter=hourly>\n", "\n</parameter>\n<parameter=options>\n",
        "\n</parameter>\n</function>\n")
VALUES = ("San Francisco", "3", "true", '{"units":"metric"}')
ARGUMENTS = {"city": "San Francisco", "days": 3, "hourly": True, "options": {"units": "metric"}}
ANSWER = "<tool_call>" + "".join(tag + value for tag, value in zip(TAGS, VALUES)) + TAGS[-1] + "</tool_call>"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, demo_dir):
    tags = added_token_ids(TAGS)
    pieces = [piece for tag, value in zip(TAGS, VALUES) for piece in (tags[tag], value)] + [tags[TAGS[-1]]]
    # the generation prompt ends "<|im_start|>assistant\n": its "\n" starts the answer
    script = script_tokens(Tokenizer.from_dir(demo_dir), "\n", TOOL_CALL_START, *pieces, TOOL_CALL_END)
    path = tmp_path_factory.mktemp("scripted-coder")
    write_scripted_model(path, demo_dir, [script], chat_template=CODER_TEMPLATE.read_text(), added_tokens=TAGS)
    return path


@pytest.fixture(scope="module")
def up(model_dir):
    with served_scripted(model_dir) as up:
        yield up


@pytest.fixture(scope="module")
def sdk(up):
    return openai.OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat(sdk, **kwargs):
    return sdk.chat.completions.create(model=sdk.models.list().data[0].id, messages=QUESTION, max_tokens=200,
                                       **kwargs)


def test_the_engine_reads_the_xml_format_off_the_template(up):
    with grpc.insecure_channel(up.grpc_address) as channel:
        info = engine_pb2_grpc.EngineServiceStub(channel).GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=10)
    assert info.tool_call_parser == "qwen3_coder"


def test_the_xml_call_is_an_openai_tool_call_with_typed_arguments(sdk):
    choice = chat(sdk, tools=TOOLS).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == ARGUMENTS


def test_streamed_the_call_comes_as_openai_deltas_that_join_to_the_same_call(sdk):
    whole = chat(sdk, tools=TOOLS).choices[0].message.tool_calls[0]
    content, calls, finish = [], {}, None
    for chunk in chat(sdk, tools=TOOLS, stream=True):
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        for call in delta.tool_calls or []:
            if call.index not in calls:
                assert call.id.startswith("call_") and call.type == "function" and call.function.arguments == ""
                calls[call.index] = {"name": call.function.name, "arguments": ""}
            else:
                calls[call.index]["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert calls == {0: {"name": "get_weather", "arguments": whole.function.arguments}}
    assert "".join(content) == "" and finish == "tool_calls"


def test_without_tools_the_xml_is_the_answer_s_text(sdk):
    choice = chat(sdk).choices[0]
    assert choice.message.content == ANSWER and not choice.message.tool_calls
    assert choice.finish_reason == "stop"
