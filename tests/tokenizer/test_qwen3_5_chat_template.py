"""The official Qwen3.5 chat template gives the same prompt token ids through xserv (a chat sent
over gRPC, rendered by xserv's template code, encoded by xserv's tokenizer) as through
transformers' apply_chat_template on the Qwen3.5 demo's tokenizer."""

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from xserv.v1 import engine_pb2

from tests.support.hf_reference import auto_tokenizer
from tests.support.reference import QWEN3_5
from xserv_engine.server import convert
from xserv_engine.tokenizer.tokenizer import Tokenizer

pytestmark = pytest.mark.reference

OFFICIAL_TEMPLATE = QWEN3_5 / "chat_template-Qwen3.5-4B.jinja"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "hours": {"type": "array", "items": {"type": "integer"}}}}}}
SEARCH_TOOL = {"type": "function", "function": {
    "name": "search", "description": "Web search",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}

CONVERSATIONS = {
    "system and user": ([
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is the capital of Canada? 加拿大的首都是哪里？"},
    ], None),
    "multi-turn with reasoning": ([
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "2", "reasoning_content": "Simple addition."},
        {"role": "user", "content": "  And times three?\n"},
        {"role": "assistant", "content": "<think>\nReasoning sent back inside the content.\n</think>\n\n6"},
        {"role": "user", "content": "Sure?"},
        {"role": "assistant", "content": "6", "reasoning_content": "\n2 * 3 = 6.\n"},
        {"role": "user", "content": "Thanks — спасибо!"},
    ], None),
    "tools": ([
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "Weather in Paris and Oslo, then search for umbrellas."},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "Two cities.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {
                "city": "Paris", "days": 2, "metric": True, "hours": [9, 18]}}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain, 9 C"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_3", "type": "function", "function": {"name": "search", "arguments": {"query": "umbrella"}}},
        ]},
        {"role": "tool", "tool_call_id": "call_3", "content": "3 results"},
    ], [WEATHER_TOOL, SEARCH_TOOL]),
}


@pytest.fixture(scope="module")
def official(demo_qwen3_5_dir):
    """xserv's tokenizer of the Qwen3.5 demo with the official template in place of ours."""
    config = json.loads((demo_qwen3_5_dir / "tokenizer_config.json").read_text())
    return Tokenizer(HFTokenizer.from_file(str(demo_qwen3_5_dir / "tokenizer.json")), config,
                     OFFICIAL_TEMPLATE.read_text())


@pytest.fixture(scope="module")
def hf_tokenizer(demo_qwen3_5_dir):
    pytest.importorskip("transformers")
    return auto_tokenizer(demo_qwen3_5_dir)


def chat_pb(messages, tools, enable_thinking) -> engine_pb2.ChatInput:
    """The chat as the REST front sends it: tool-call arguments and tools as JSON text."""
    pb_messages = []
    for m in messages:
        calls = [engine_pb2.ToolCall(id=c["id"], type="function", name=c["function"]["name"],
                                     arguments=json.dumps(c["function"]["arguments"]))
                 for c in m.get("tool_calls", [])]
        pb_messages.append(engine_pb2.ChatMessage(role=m["role"], content=m["content"], tool_calls=calls,
                                                  reasoning_content=m.get("reasoning_content"),
                                                  tool_call_id=m.get("tool_call_id", "")))
    return engine_pb2.ChatInput(messages=pb_messages, tools=[json.dumps(t) for t in tools or []],
                                enable_thinking=enable_thinking)


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_official_template_gives_transformers_prompt_ids(official, hf_tokenizer, name, thinking):
    messages, tools = CONVERSATIONS[name]
    expected = hf_tokenizer.apply_chat_template(
        messages, tools=tools, chat_template=OFFICIAL_TEMPLATE.read_text(), add_generation_prompt=True,
        enable_thinking=thinking, tokenize=True, return_dict=False)
    prompt = official.render_chat(convert.chat_from_pb(chat_pb(messages, tools, thinking)))
    assert official.encode(prompt) == expected
    assert prompt.endswith("<|im_start|>assistant\n<think>\n" if thinking else "<think>\n\n</think>\n\n")


def test_official_template_renders_reasoning_and_xml_calls_as_expected(official):
    messages, tools = CONVERSATIONS["tools"]
    prompt = official.render_chat(convert.chat_from_pb(chat_pb(messages, tools, True)))
    assert ("<|im_start|>assistant\n<think>\nTwo cities.\n</think>\n\nLet me check.\n\n<tool_call>\n"
            "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
            "<parameter=metric>\nTrue\n</parameter>\n<parameter=hours>\n[9, 18]\n</parameter>\n</function>\n"
            "</tool_call>\n<tool_call>\n<function=get_weather>\n") in prompt
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response>\n<tool_response>\nrain" in prompt
    assert "\n\nUse the tools.<|im_end|>\n" in prompt  # the system text follows the tools' instructions
