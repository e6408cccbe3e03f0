"""Protobuf <-> engine types: what a gRPC client sends is what the engine gets, and back."""

import json

import pytest
from xserv.v1 import engine_pb2

from xserv_engine.errors import InvalidRequest
from xserv_engine.inputs import ChatInput, image_parts
from xserv_engine.outputs import EngineStats, ModelInfo, RequestOutput, TokenLogprob, ToolCallDelta, Usage
from xserv_engine.sampling_params import SamplingParams
from xserv_engine.server import convert

VOCAB = 1000


def from_pb(**fields):
    return convert.generate_request_from_pb(engine_pb2.GenerateRequest(**fields))


def test_unset_params_take_the_engine_defaults():
    _, prompt, params = from_pb(text="Hello")
    assert prompt == "Hello"
    assert params == SamplingParams()
    assert (params.max_tokens, params.temperature, params.top_p, params.n) == (None, 1.0, 1.0, 1)
    assert params.repetition_penalty == 1.0 and params.skip_special_tokens is True


def test_explicit_zero_is_kept_where_unset_differs_from_zero():
    _, _, params = from_pb(text="x", params=engine_pb2.SamplingParams(
        temperature=0.0, max_tokens=0, skip_special_tokens=False, seed=0))
    assert params.greedy
    assert params.max_tokens == 0  # the engine's validation rejects it, naming max_tokens
    assert params.skip_special_tokens is False
    assert params.seed == 0


QWEN3_DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}  # Qwen3's generation_config.json


def test_unset_sampling_fields_take_the_models_defaults_and_set_ones_win():
    _, _, params = convert.generate_request_from_pb(engine_pb2.GenerateRequest(text="x"), QWEN3_DEFAULTS)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.6, 0.95, 20, 0.0)
    # set fields win, also the ones equal to the OpenAI default or to zero (top_k 0: off)
    request = engine_pb2.GenerateRequest(text="x", params=engine_pb2.SamplingParams(temperature=1.0, top_k=0))
    _, _, params = convert.generate_request_from_pb(request, QWEN3_DEFAULTS)
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 0.95, 0)
    request = engine_pb2.GenerateRequest(text="x", params=engine_pb2.SamplingParams(temperature=0.0, min_p=0.0))
    assert convert.generate_request_from_pb(request, {"min_p": 0.1})[2].min_p == 0.0


def test_every_sampling_field_reaches_the_engine():
    pb = engine_pb2.SamplingParams(
        max_tokens=5, min_tokens=2, temperature=0.7, top_p=0.5, top_k=40, min_p=0.25, seed=42,
        stop=["END", "\n\n"], stop_token_ids=[3, 4], include_stop_str_in_output=True,
        ignore_eos=True, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.25,
        logit_bias={5: -100.0}, n=3, logprobs=True, top_logprobs=2, skip_special_tokens=False, prompt_logprobs=0)
    request_id, _, params = from_pb(request_id="r1", text="x", params=pb)
    assert request_id == "r1"
    assert params == SamplingParams(
        max_tokens=5, min_tokens=2, temperature=pytest.approx(0.7), top_p=0.5, top_k=40, min_p=0.25,
        seed=42, stop=("END", "\n\n"), stop_token_ids=(3, 4), include_stop_str_in_output=True,
        ignore_eos=True, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.25,
        logit_bias={5: -100.0}, n=3, logprobs=True, top_logprobs=2, skip_special_tokens=False, prompt_logprobs=0)
    assert from_pb(text="x")[2].prompt_logprobs is None  # unset: none (0 asks for them, no alternatives)


def test_a_request_without_input_names_the_oneof():
    with pytest.raises(InvalidRequest) as info:
        from_pb()
    assert info.value.field == "input"


def test_token_ids_pass_through():
    assert from_pb(token_ids=engine_pb2.TokenIds(ids=[1, 2, VOCAB - 1]))[1] == [1, 2, VOCAB - 1]


def chat(**fields) -> ChatInput:
    return from_pb(chat=engine_pb2.ChatInput(**fields))[1]


def test_chat_messages_are_shaped_like_openai_messages():
    tool_call = engine_pb2.ToolCall(id="call_1", type="function", name="get_weather",
                                    arguments='{"city": "Paris"}')
    prompt = chat(messages=[
        engine_pb2.ChatMessage(role="user", content="Weather?"),
        engine_pb2.ChatMessage(role="assistant", content="", reasoning_content="Use the tool.",
                               tool_calls=[tool_call]),
        engine_pb2.ChatMessage(role="tool", content="sunny", tool_call_id="call_1", name="get_weather"),
    ])
    assert prompt.messages == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "get_weather"},
    ]
    assert prompt.add_generation_prompt is True
    assert prompt.tools is None and prompt.template_kwargs == {}


def test_tool_call_arguments_that_are_not_an_object_stay_text():
    call = engine_pb2.ToolCall(id="c", name="f", arguments="not json")
    prompt = chat(messages=[engine_pb2.ChatMessage(role="assistant", tool_calls=[call])])
    assert prompt.messages[0]["tool_calls"][0]["function"]["arguments"] == "not json"
    assert prompt.messages[0]["tool_calls"][0]["type"] == "function"


def test_empty_reasoning_content_is_sent_only_when_set():
    prompt = chat(messages=[engine_pb2.ChatMessage(role="assistant", content="a", reasoning_content="")])
    assert prompt.messages[0] == {"role": "assistant", "content": "a", "reasoning_content": ""}


def test_tools_template_kwargs_and_thinking_switch():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    prompt = chat(messages=[engine_pb2.ChatMessage(role="user", content="hi")], tools=[json.dumps(tool)],
                  add_generation_prompt=False, enable_thinking=False,
                  template_kwargs_json='{"enable_thinking": true, "custom": 1}')
    assert prompt.tools == [tool]
    assert prompt.add_generation_prompt is False
    assert prompt.template_kwargs == {"enable_thinking": False, "custom": 1}


def test_tool_choice_reaches_the_engine():
    hi = [engine_pb2.ChatMessage(role="user", content="hi")]
    assert chat(messages=hi).tool_choice == "auto"
    assert chat(messages=hi, tool_choice="none").tool_choice == "none"
    assert chat(messages=hi, tool_choice="get_weather").tool_choice == "get_weather"


@pytest.mark.parametrize("fields, field_name", [
    ({"tools": ["{not json"]}, "chat.tools"),
    ({"tools": ["[1, 2]"]}, "chat.tools"),
    ({"template_kwargs_json": "{"}, "chat.template_kwargs_json"),
    ({"template_kwargs_json": "[]"}, "chat.template_kwargs_json"),
])
def test_bad_chat_extras_name_the_field(fields, field_name):
    with pytest.raises(InvalidRequest) as info:
        chat(messages=[engine_pb2.ChatMessage(role="user", content="hi")], **fields)
    assert info.value.field == field_name


def text_part(text):
    return engine_pb2.ContentPart(text=text)


def image_part(data):
    return engine_pb2.ContentPart(image=engine_pb2.Image(data=data))


def test_image_parts_reach_the_engine_as_bytes_in_order():
    prompt = chat(messages=[engine_pb2.ChatMessage(role="user", parts=[
        text_part("Which is redder?"), image_part(b"\x89PNG one"), image_part(b"\x89PNG two")])])
    assert prompt.messages == [{"role": "user", "content": [
        {"type": "text", "text": "Which is redder?"}, {"type": "image", "image": b"\x89PNG one"},
        {"type": "image", "image": b"\x89PNG two"}]}]
    assert image_parts(prompt) == [b"\x89PNG one", b"\x89PNG two"]


def test_text_only_parts_are_one_string_as_text_only_templates_expect():
    prompt = chat(messages=[engine_pb2.ChatMessage(role="user", parts=[text_part("one"), text_part("two")])])
    assert prompt.messages == [{"role": "user", "content": "one\ntwo"}]


@pytest.mark.parametrize("message, field_name", [
    (engine_pb2.ChatMessage(role="user", content="hi", parts=[image_part(b"png")]), "chat.messages[0].content"),
    (engine_pb2.ChatMessage(role="user", parts=[text_part("hi"), engine_pb2.ContentPart()]),
     "chat.messages[0].parts[1]"),
    (engine_pb2.ChatMessage(role="user", parts=[image_part(b"")]), "chat.messages[0].parts[0]"),
])
def test_bad_parts_name_the_part(message, field_name):
    with pytest.raises(InvalidRequest) as info:
        chat(messages=[message])
    assert info.value.field == field_name


def test_message_without_role_is_rejected():
    with pytest.raises(InvalidRequest) as info:
        chat(messages=[engine_pb2.ChatMessage(content="hi")])
    assert info.value.field == "chat.messages[0].role"


def test_tokenize_input():
    assert convert.tokenize_input_from_pb(engine_pb2.TokenizeRequest(text="a b")) == "a b"
    with pytest.raises(InvalidRequest):
        convert.tokenize_input_from_pb(engine_pb2.TokenizeRequest())


def test_output_to_pb_middle_and_last_messages():
    middle = convert.generate_response_to_pb(RequestOutput(
        "r", 1, token_ids=(5, 6), text="Hi", reasoning_text="hm",
        tool_calls=(ToolCallDelta(0, id="call_0", name="f", arguments='{"a"'),),
        logprobs=(TokenLogprob(5, "Hi", b"Hi", -0.5, top=(TokenLogprob(9, "Yo", b"Yo", -1.0),)),), prompt_tokens=12))
    assert (middle.request_id, middle.index, list(middle.token_ids)) == ("r", 1, [5, 6])
    assert middle.prompt_tokens == 12
    assert (middle.text, middle.reasoning_text) == ("Hi", "hm")
    assert middle.finish_reason == engine_pb2.FINISH_REASON_UNSPECIFIED
    assert not middle.HasField("usage") and middle.WhichOneof("matched_stop") is None
    assert middle.tool_calls[0].name == "f" and middle.tool_calls[0].arguments == '{"a"'
    assert middle.logprobs[0].token_bytes == b"Hi" and middle.logprobs[0].top_logprobs[0].token_id == 9
    assert not middle.prompt_logprobs

    first = convert.generate_response_to_pb(RequestOutput("r", 0, token_ids=(5,), prompt_logprobs=(
        TokenLogprob(7, "A", b"A", None), TokenLogprob(8, "B", b"B", -2.0, top=(TokenLogprob(9, "C", b"C", -1.0),)))))
    assert [lp.token_id for lp in first.prompt_logprobs] == [7, 8]
    assert not first.prompt_logprobs[0].HasField("logprob")  # the prompt's first token has none
    assert first.prompt_logprobs[1].logprob == -2.0 and first.prompt_logprobs[1].top_logprobs[0].token_id == 9

    last = convert.generate_response_to_pb(RequestOutput(
        "r", 0, finish_reason="stop", matched_stop="END", usage=Usage(3, 4, 2)))
    assert last.finish_reason == engine_pb2.FINISH_REASON_STOP
    assert last.matched_stop_str == "END"
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_prompt_tokens) == (3, 4, 2)

    by_token = convert.generate_response_to_pb(RequestOutput("r", 0, finish_reason="stop", matched_stop=7))
    assert by_token.matched_stop_token_id == 7
    for reason, value in convert.FINISH_REASONS.items():
        assert convert.generate_response_to_pb(RequestOutput("r", 0, finish_reason=reason)).finish_reason == value


def test_model_info_to_pb():
    info = ModelInfo("m", 4096, VOCAB, (1, 2), "bfloat16", "cuda:0", 16)
    response = convert.model_info_to_pb(info, EngineStats(running=2, waiting=1, free_blocks=10, total_blocks=12))
    assert (response.model_id, response.max_model_len, list(response.eos_token_ids)) == ("m", 4096, [1, 2])
    assert (response.kv_blocks_free, response.kv_blocks_total, response.block_size) == (10, 12, 16)
    assert (response.num_running, response.num_waiting, response.dtype, response.device) == (2, 1, "bfloat16", "cuda:0")
