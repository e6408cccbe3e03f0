"""The 2507 releases end to end: `xserv up` on scripted models with their kinds of chat template,
spoken to with the openai SDK through /v1/chat/completions and /v1/responses, streamed and not.

Qwen3-*-Thinking-2507 templates end the generation prompt with "<think>\\n": the model's output
starts inside its reasoning and only "</think>" appears, and enable_thinking changes nothing.
Qwen3-*-Instruct-2507 templates have no thinking at all: enable_thinking (or a reasoning effort)
must not turn any of the answer into reasoning. Both templates are the official Qwen3 template
with its generation prompt changed so.
"""

import openai
import pytest

from tests.support.reference import QWEN3
from tests.support.scripted_model import script_tokens, served_scripted, write_scripted_model
from xserv_engine.tokenizer.chat_tokens import THINK_END
from xserv_engine.tokenizer.tokenizer import Tokenizer

pytestmark = [pytest.mark.e2e, pytest.mark.reference]

OFFICIAL_TEMPLATE = QWEN3 / "chat_template.jinja"
GENERATION_PROMPT = "{%- if add_generation_prompt %}"
THINKING_PROMPT = GENERATION_PROMPT + "\n    {{- '<|im_start|>assistant\\n<think>\\n' }}\n{%- endif %}"
INSTRUCT_PROMPT = GENERATION_PROMPT + "\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}"
REASONING = "The user says hello. A short greeting back is enough."
CONTENT = "Hello! How can I help?"
PLAIN = "Hi there, no thinking needed!"
QUESTION = [{"role": "user", "content": "Hello"}]


def template_2507(generation_prompt: str) -> str:
    """The official template with its generation prompt (the last block) replaced."""
    official = OFFICIAL_TEMPLATE.read_text()
    head, _, tail = official.rpartition(GENERATION_PROMPT)
    assert "enable_thinking is false" in tail
    return head + generation_prompt


def serve_scripted(tmp_path_factory, demo_dir, template: str, *script: str | int):
    """`xserv up` on a model that answers a prompt ending in "\\n" with `script`; yields an SDK client."""
    path = tmp_path_factory.mktemp("scripted-2507")
    write_scripted_model(path, demo_dir, [script_tokens(Tokenizer.from_dir(demo_dir), "\n", *script)],
                         chat_template=template)
    with served_scripted(path) as up:
        yield openai.OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def thinking(tmp_path_factory, demo_dir):
    # the prompt's "<think>\n" ends in the "\n" that starts the script
    yield from serve_scripted(tmp_path_factory, demo_dir, template_2507(THINKING_PROMPT),
                              REASONING[:-1], ".\n", THINK_END, "\n\n", CONTENT)


@pytest.fixture(scope="module")
def instruct(tmp_path_factory, demo_dir):
    yield from serve_scripted(tmp_path_factory, demo_dir, template_2507(INSTRUCT_PROMPT), PLAIN)


def chat(sdk, enable_thinking=None, **kwargs):
    extra = {} if enable_thinking is None else {"chat_template_kwargs": {"enable_thinking": enable_thinking}}
    return sdk.chat.completions.create(model=sdk.models.list().data[0].id, messages=QUESTION, max_tokens=100,
                                       extra_body=extra, **kwargs)


def streamed_chat(sdk, enable_thinking=None) -> tuple[str, str, str]:
    """(reasoning, content, finish_reason) as a streaming client joins them."""
    reasoning, content, finish = [], [], None
    for chunk in chat(sdk, enable_thinking, stream=True):
        delta = chunk.choices[0].delta
        reasoning.append(getattr(delta, "reasoning_content", None) or "")
        content.append(delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    return "".join(reasoning), "".join(content), finish


def streamed_response(sdk, **kwargs) -> tuple[str, str, list[str]]:
    """(reasoning, output text, item types) from /v1/responses' event stream."""
    model = sdk.models.list().data[0].id
    with sdk.responses.stream(model=model, input="Hello", max_output_tokens=100, **kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    return reasoning, text, [item.type for item in final.output]


@pytest.mark.parametrize("enable_thinking", [None, True, False])
def test_thinking_2507_chat_splits_reasoning_from_content(thinking, enable_thinking):
    choice = chat(thinking, enable_thinking).choices[0]
    assert (choice.message.reasoning_content, choice.message.content) == (REASONING, CONTENT)
    assert choice.finish_reason == "stop"
    assert streamed_chat(thinking, enable_thinking) == (REASONING, CONTENT, "stop")


def test_thinking_2507_responses_give_a_reasoning_item_then_the_message(thinking, demo_dir):
    model = thinking.models.list().data[0].id
    response = thinking.responses.create(model=model, input="Hello", max_output_tokens=100)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == REASONING
    assert message.type == "message" and response.output_text == CONTENT
    # the reasoning's tokens through </think>, however the engine's messages split them
    thought = script_tokens(Tokenizer.from_dir(demo_dir), REASONING[:-1], ".\n", THINK_END)
    assert response.usage.output_tokens_details.reasoning_tokens == len(thought)
    chat_usage = chat(thinking).usage
    assert chat_usage.completion_tokens_details.reasoning_tokens == len(thought)
    assert chat_usage.completion_tokens == response.usage.output_tokens > len(thought)
    assert streamed_response(thinking) == (REASONING, CONTENT, ["reasoning", "message"])


@pytest.mark.parametrize("enable_thinking", [None, True, False])
def test_instruct_2507_chat_is_all_content_whatever_enable_thinking_says(instruct, enable_thinking):
    choice = chat(instruct, enable_thinking).choices[0]
    assert choice.message.content == PLAIN and getattr(choice.message, "reasoning_content", None) is None
    assert choice.finish_reason == "stop"
    assert streamed_chat(instruct, enable_thinking) == ("", PLAIN, "stop")


@pytest.mark.parametrize("effort", [None, "high", "none"])
def test_instruct_2507_responses_are_one_message_whatever_the_effort(instruct, effort):
    reasoning = {} if effort is None else {"reasoning": {"effort": effort}}
    response = instruct.responses.create(model=instruct.models.list().data[0].id, input="Hello",
                                         max_output_tokens=100, **reasoning)
    assert [item.type for item in response.output] == ["message"] and response.output_text == PLAIN
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    assert streamed_response(instruct, **reasoning) == ("", PLAIN, ["message"])
