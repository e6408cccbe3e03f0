"""A chat sent over gRPC renders with the official Qwen3 template the way transformers would:
tool-call arguments as a JSON object, reasoning of the current turn, tools listed, thinking switch."""

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from xserv.v1 import engine_pb2

from tests.support.reference import QWEN3
from xserv_engine.demo import default_model_dir
from xserv_engine.server import convert
from xserv_engine.tokenizer.tokenizer import Tokenizer

pytestmark = pytest.mark.reference

OFFICIAL_TEMPLATE = QWEN3 / "chat_template.jinja"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def tokenizer():
    model_dir = Path(default_model_dir())
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    return Tokenizer(HFTokenizer.from_file(str(model_dir / "tokenizer.json")), config,
                     OFFICIAL_TEMPLATE.read_text())


def test_tool_call_history_renders_as_qwen3_expects(tokenizer):
    chat = engine_pb2.ChatInput(
        messages=[
            engine_pb2.ChatMessage(role="user", content="Weather in Paris?"),
            engine_pb2.ChatMessage(role="assistant", content="", reasoning_content="I should call the tool.",
                                   tool_calls=[engine_pb2.ToolCall(id="call_1", type="function", name="get_weather",
                                                                   arguments='{"city": "Paris"}')]),
            engine_pb2.ChatMessage(role="tool", content="sunny, 21 C", tool_call_id="call_1"),
        ],
        tools=[json.dumps(WEATHER_TOOL)],
        enable_thinking=False,
    )
    prompt = tokenizer.render_chat(convert.chat_from_pb(chat))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tools>\n" + json.dumps(WEATHER_TOOL) + "\n</tools>" in prompt
    assert "<think>\nI should call the tool.\n</think>" in prompt  # this turn's reasoning is kept
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_thinking_on_by_default_and_template_kwargs_reach_the_template(tokenizer):
    hi = [engine_pb2.ChatMessage(role="user", content="Hi")]
    default = tokenizer.render_chat(convert.chat_from_pb(engine_pb2.ChatInput(messages=hi)))
    assert default.endswith("<|im_start|>assistant\n")
    off = tokenizer.render_chat(convert.chat_from_pb(engine_pb2.ChatInput(
        messages=hi, template_kwargs_json='{"enable_thinking": false}')))
    assert off.endswith("<think>\n\n</think>\n\n")
