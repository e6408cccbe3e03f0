"""Qwen3 chat features end to end: `xserv up` on a scripted model, spoken to with the openai SDK.

The scripted model answers a thinking-mode prompt (ending "assistant\\n") with reasoning, a
sentence and a tool call, and a no-thinking prompt (ending with the empty think block) with
plain content, so what the engine parses and the front maps can be checked exactly.
"""

import json
import subprocess

import openai
import pytest

from tests.support.processes import served
from tests.support.reference import QWEN3
from tests.support.scripted_model import script_tokens, write_scripted_model
from xserv_engine.tokenizer.chat_tokens import THINK_END, THINK_START, TOOL_CALL_END, TOOL_CALL_START
from xserv_engine.tokenizer.tokenizer import Tokenizer

pytestmark = pytest.mark.e2e

OFFICIAL_TEMPLATE = QWEN3 / "chat_template.jinja"
REASONING = "The user wants the weather in Paris"
CONTENT = "Let me check."
ARGUMENTS = {"city": "Paris"}
# the call's JSON, in pieces tokenized apart so that no token repeats (each needs one successor)
CALL_PIECES = ('{"name":"get_weather","arguments":{"city":', '"Paris"}}')
CALL = "".join(CALL_PIECES)
PLAIN = "Hello there, no thinking here!"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                   "required": ["city"]}}}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, demo_dir):
    tokenizer = Tokenizer.from_dir(demo_dir)
    thinking = script_tokens(tokenizer, "\n", THINK_START, REASONING, THINK_END, CONTENT,
                             TOOL_CALL_START, *CALL_PIECES, TOOL_CALL_END)
    no_thinking = script_tokens(tokenizer, "\n\n", PLAIN)
    template = OFFICIAL_TEMPLATE.read_text() if OFFICIAL_TEMPLATE.is_file() else None
    path = tmp_path_factory.mktemp("scripted")
    write_scripted_model(path, demo_dir, [thinking, no_thinking], chat_template=template)
    return path


@pytest.fixture(scope="module")
def sdk(model_dir):
    with served("up", "--model", str(model_dir), "--workers", "1", "--threads", "8", "--num-kv-blocks", "64",
                "--max-model-len", "1024", "--dtype", "float32", "--log-level", "warning",
                stdout=subprocess.DEVNULL) as up:
        yield openai.OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat(sdk, **kwargs):
    return sdk.chat.completions.create(model=sdk.models.list().data[0].id, max_tokens=200, **kwargs)


def test_thinking_answer_has_reasoning_content_and_a_tool_call(sdk):
    response = chat(sdk, messages=QUESTION, tools=TOOLS)
    choice = response.choices[0]
    assert choice.message.reasoning_content == REASONING
    assert choice.message.reasoning == REASONING
    assert choice.message.content == CONTENT
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == ARGUMENTS


def test_streamed_reasoning_content_and_tool_call_fragments_join_to_the_same_answer(sdk):
    whole = chat(sdk, messages=QUESTION, tools=TOOLS).choices[0]
    reasoning, content, calls, finish = [], [], {}, None
    for chunk in chat(sdk, messages=QUESTION, tools=TOOLS, stream=True):
        delta = chunk.choices[0].delta
        reasoning.append(getattr(delta, "reasoning_content", None) or "")
        content.append(delta.content or "")
        for call in delta.tool_calls or []:
            if call.index not in calls:
                assert call.id.startswith("call_") and call.type == "function" and call.function.name
                assert call.function.arguments == ""
                calls[call.index] = {"name": call.function.name, "arguments": ""}
            else:
                calls[call.index]["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(reasoning) == whole.message.reasoning_content
    assert "".join(content) == whole.message.content
    assert "</think>" not in "".join(content) + "".join(reasoning)
    assert calls == {0: {"name": "get_weather", "arguments": whole.message.tool_calls[0].function.arguments}}
    assert finish == "tool_calls"


def test_without_tools_the_tool_call_block_stays_text(sdk):
    message = chat(sdk, messages=QUESTION).choices[0].message
    assert not message.tool_calls
    assert message.reasoning_content == REASONING
    assert CALL in message.content


def test_thinking_disabled_answers_without_reasoning(sdk):
    response = chat(sdk, messages=QUESTION, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = response.choices[0].message
    assert message.content == PLAIN  # only a prompt ending in the empty think block leads here
    assert getattr(message, "reasoning_content", None) is None
    assert response.choices[0].finish_reason == "stop"


@pytest.mark.reference
def test_second_turn_with_the_tool_result_renders_as_transformers_does(sdk, model_dir):
    from transformers import AutoTokenizer

    first = chat(sdk, messages=QUESTION, tools=TOOLS).choices[0].message
    call = first.tool_calls[0]
    conversation = QUESTION + [
        {"role": "assistant", "content": first.content, "reasoning_content": first.reasoning_content,
         "tool_calls": [{"id": call.id, "type": "function",
                         "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})},
    ]
    second = chat(sdk, messages=conversation, tools=TOOLS)
    reference = json.loads(json.dumps(conversation))
    reference[1]["tool_calls"][0]["function"]["arguments"] = json.loads(call.function.arguments)
    hf = AutoTokenizer.from_pretrained(model_dir)
    prompt = hf.apply_chat_template(reference, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert second.usage.prompt_tokens == len(hf(prompt, add_special_tokens=False)["input_ids"])
    assert second.choices[0].message.tool_calls[0].function.name == "get_weather"
