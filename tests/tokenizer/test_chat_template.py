"""Our jinja rendering equals transformers' apply_chat_template, for the official Qwen3 template
and for the demo model's own template."""

import shutil

import pytest

from tests.support.hf_reference import auto_tokenizer
from tests.support.reference import QWEN3
from xserv_engine.errors import InvalidRequest
from xserv_engine.inputs import ChatInput
from xserv_engine.tokenizer.template import ChatTemplate
from xserv_engine.tokenizer.tokenizer import Tokenizer

OFFICIAL = QWEN3 / "chat_template.jinja"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "天气 — current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    }
]

CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "Hi there"}],
    "system_multi_turn_reasoning": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Simple arithmetic."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "\nAgain simple.\n"},
    ],
    "think_in_content": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nanswer"},
        {"role": "user", "content": "q2"},
    ],
    "tool_round_trip": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris and 東京?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Two cities, two calls.",
            "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "c2", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "東京", "unit": "c"}}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
        {"role": "tool", "tool_call_id": "c2", "content": "22C"},
        {"role": "assistant", "content": "Paris 18C, Tokyo 22C.", "reasoning_content": "Done."},
        {"role": "user", "content": "Thanks"},
    ],
    "tool_result_last": [
        {"role": "user", "content": "Weather in Rome?"},
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [{"id": "c1", "type": "function",
                            "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 25}"},
    ],
}

CASES = [
    (name, tools, add_generation_prompt, thinking)
    for name in CONVERSATIONS
    for tools in (None, TOOLS)
    for add_generation_prompt in (True, False)
    for thinking in (None, True, False)
]


@pytest.fixture(scope="module")
def hf_tokenizer(demo_dir):
    pytest.importorskip("transformers")
    return auto_tokenizer(demo_dir)


@pytest.fixture(scope="module")
def official_tokenizer(demo_dir, tmp_path_factory):
    """The demo tokenizer with the official Qwen3 template in chat_template.jinja."""
    model_dir = tmp_path_factory.mktemp("official-template")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_dir / name, model_dir / name)
    shutil.copy(OFFICIAL, model_dir / "chat_template.jinja")
    return Tokenizer.from_dir(model_dir)


def render_both(ours, hf_tokenizer, template, name, tools, add_generation_prompt, thinking):
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    messages = CONVERSATIONS[name]
    chat = ChatInput(messages, tools=tools, add_generation_prompt=add_generation_prompt, template_kwargs=kwargs)
    mine = ours.render_chat(chat)
    theirs = hf_tokenizer.apply_chat_template(
        messages, tools=tools, chat_template=template, tokenize=False,
        add_generation_prompt=add_generation_prompt, **kwargs,
    )
    return mine, theirs


@pytest.mark.reference
@pytest.mark.parametrize("name,tools,add_generation_prompt,thinking", CASES)
def test_official_template_renders_like_transformers(
    official_tokenizer, hf_tokenizer, name, tools, add_generation_prompt, thinking
):
    mine, theirs = render_both(
        official_tokenizer, hf_tokenizer, OFFICIAL.read_text(), name, tools, add_generation_prompt, thinking
    )
    assert mine == theirs


@pytest.mark.parametrize("name,tools,add_generation_prompt,thinking", CASES)
def test_demo_template_renders_like_transformers(
    tokenizer, hf_tokenizer, demo_dir, name, tools, add_generation_prompt, thinking
):
    template = (demo_dir / "chat_template.jinja").read_text()
    mine, theirs = render_both(tokenizer, hf_tokenizer, template, name, tools, add_generation_prompt, thinking)
    assert mine == theirs


def test_demo_template_speaks_qwen3(tokenizer):
    no_thinking = {"enable_thinking": False}
    chat = ChatInput(CONVERSATIONS["tool_round_trip"][:-1], tools=TOOLS, template_kwargs=no_thinking)
    text = tokenizer.render_chat(chat)
    assert text.startswith("<|im_start|>system\nUse tools.\n\n# Tools")
    assert '"description": "天气 — current weather for a city"' in text  # tojson keeps non-ASCII
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '"arguments": {"city": "東京", "unit": "c"}' in text
    tool_turn = "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n22C\n</tool_response>"
    assert tool_turn + "<|im_end|>" in text
    # the reasoning of the turns answering the latest user message is kept
    assert "<|im_start|>assistant\n<think>\nTwo cities, two calls.\n</think>\n\n<tool_call>" in text
    assert "<think>\nDone.\n</think>\n\nParis 18C" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    chat = ChatInput(CONVERSATIONS["single_user"], template_kwargs={"enable_thinking": True})
    thinking = tokenizer.render_chat(chat)
    assert thinking == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"


def test_demo_template_drops_reasoning_of_earlier_questions(tokenizer):
    text = tokenizer.render_chat(ChatInput(CONVERSATIONS["tool_round_trip"]))
    assert "Two cities" not in text and "Done." not in text
    assert "<|im_start|>assistant\nParis 18C, Tokyo 22C.<|im_end|>" in text


def test_raise_exception_is_a_user_error():
    template = ChatTemplate("{{ raise_exception('Conversation roles must alternate') }}")
    with pytest.raises(InvalidRequest) as excinfo:
        template.render({"messages": []})
    assert excinfo.value.field == "messages"
    assert "alternate" in excinfo.value.message


def test_unrenderable_messages_are_a_user_error(tokenizer):
    with pytest.raises(InvalidRequest, match="unsupported message role"):
        tokenizer.render_chat(ChatInput([{"role": "narrator", "content": "x"}]))
    with pytest.raises(InvalidRequest):
        tokenizer.render_chat(ChatInput([{"content": "no role"}]))


def test_template_helpers_match_transformers():
    template = ChatTemplate(
        "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ strftime_now('%Y') | length }}"
        "{% for i in [1, 2, 3] %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}|{{ flag }}"
    )
    text = template.render({"x": {"b": "é<>", "a": 1}, "flag": True})
    assert text == '{"b": "é<>", "a": 1}|{\n  "b": "é<>",\n  "a": 1\n}|41|True'
