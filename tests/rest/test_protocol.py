"""The protocol models as a client meets them: OpenAI fields xserv refuses (400 naming the field),
accepts without effect, or ignores with a warning; limits known before the engine call; and
every answer, chunk and error matching the model the document is generated from."""

import json
import logging

import pytest

from xserv_rest.protocol import base
from xserv_rest.protocol.chat import ChatCompletion, ChatCompletionChunk
from xserv_rest.protocol.completions import Completion
from xserv_rest.protocol.errors import ErrorResponse
from xserv_rest.protocol.models import ModelCard, ModelList

from .fake_grpc_engine import MAX_MODEL_LEN, MODEL_ID

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]

REFUSED_CHAT = [
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}),
    ("web_search_options", {}),
    ("functions", [{"name": "f", "parameters": {}}]),
    ("function_call", "auto"),
    ("reasoning_effort", "low"),
    ("verbosity", "low"),
]
REFUSED_COMPLETIONS = [("suffix", "tail"), ("best_of", 2)]
ACCEPTED_CHAT = {"user": "u1", "metadata": {"k": "v"}, "store": True, "service_tier": "auto",
                 "safety_identifier": "s", "prompt_cache_key": "c", "modalities": ["text"],
                 "response_format": {"type": "text"}, "parallel_tool_calls": True,
                 "stream_options": {"include_usage": True, "include_obfuscation": False}, "stream": True,
                 "audio": None, "prediction": None}


@pytest.mark.parametrize("field, value", REFUSED_CHAT, ids=lambda v: str(v)[:20])
def test_an_output_changing_field_xserv_lacks_is_400_naming_it(client, fake, field, value):
    before = len(fake.engine.requests)
    resp = client.simulate_post(CHAT, json={"messages": USER, field: value})
    assert resp.status_code == 400, resp.text
    error = resp.json["error"]
    assert error["param"] == field and "not supported" in error["message"]
    assert len(fake.engine.requests) == before  # refused before the engine is asked


@pytest.mark.parametrize("field, value", REFUSED_COMPLETIONS)
def test_completions_refuse_suffix_and_best_of(client, field, value):
    resp = client.simulate_post("/v1/completions", json={"prompt": "hi", field: value})
    assert resp.status_code == 400 and resp.json["error"]["param"] == field


def last_engine_request(fake):
    request = fake.engine.requests[-1]
    request.ClearField("request_id")
    return request


def test_fields_that_change_nothing_are_accepted_and_change_nothing(client, fake):
    plain = {"messages": USER, "stream": True, "stream_options": {"include_usage": True}}
    assert client.simulate_post(CHAT, json=plain).status_code == 200
    expected = last_engine_request(fake)
    assert client.simulate_post(CHAT, json=dict(plain, **ACCEPTED_CHAT)).status_code == 200
    assert last_engine_request(fake) == expected


def test_an_unknown_field_is_ignored_with_one_warning_per_name(client, fake, caplog, monkeypatch):
    """llama.cpp's clients send cache_prompt with every request: its name is logged once, not per request."""
    monkeypatch.setattr(base, "_WARNED_FIELDS", set())
    with caplog.at_level(logging.WARNING, logger="xserv.rest"):
        for extra in ({"cache_prompt": True, "guided_xyz": "a"}, {"cache_prompt": True, "guided_xyz": "a"},
                      {"cache_prompt": True, "frobnicate": 1}):
            resp = client.simulate_post(CHAT, json={"messages": USER, **extra})
            assert resp.status_code == 200
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "'cache_prompt', 'guided_xyz'" in warnings[0]
    assert "frobnicate" in warnings[1] and "cache_prompt" not in warnings[1]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_past_the_known_context_is_refused_before_the_engine(client, fake, field):
    before = len(fake.engine.requests)
    resp = client.simulate_post(CHAT, json={"messages": USER, field: MAX_MODEL_LEN})
    error = resp.json["error"]
    assert resp.status_code == 400 and (error["code"], error["param"]) == ("context_length_exceeded", field)
    assert f"maximum context length is {MAX_MODEL_LEN}" in error["message"]
    assert len(fake.engine.requests) == before
    one_token = [{"role": "user", "content": "h"}]  # the fake engine's tokens: one per character
    assert client.simulate_post(CHAT, json={"messages": one_token, field: MAX_MODEL_LEN - 1}).status_code == 200


def frames(resp) -> list[dict]:
    events = resp.content.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    return [json.loads(event[len(b"data: "):]) for event in events[:-2]]


@pytest.mark.parametrize("stream_options", [None, {"include_usage": True}])
def test_answers_and_chunks_match_their_models(client, stream_options):
    """Answer models forbid undeclared keys, so a body drifting from its documented shape fails."""
    chat = {"model": MODEL_ID, "messages": USER, "logprobs": True, "top_logprobs": 2, "n": 2}
    ChatCompletion.model_validate(client.simulate_post(CHAT, json=chat).json)
    tools = dict(chat, messages=[{"role": "user", "content": "tools"}])
    ChatCompletion.model_validate(client.simulate_post(CHAT, json=tools).json)
    for body in (chat, tools):
        streamed = client.simulate_post(CHAT, json=dict(body, stream=True, stream_options=stream_options))
        for chunk in frames(streamed):
            assert ("usage" in chunk) == bool(stream_options)
            ChatCompletionChunk.model_validate(chunk)
    completion = {"prompt": "hi", "logprobs": 1, "n": 2}
    Completion.model_validate(client.simulate_post("/v1/completions", json=completion).json)
    streamed = client.simulate_post("/v1/completions", json=dict(completion, stream=True, stream_options=stream_options))
    for chunk in frames(streamed):
        Completion.model_validate(chunk)
    ModelList.model_validate(client.simulate_get("/v1/models").json)
    ModelCard.model_validate(client.simulate_get(f"/v1/models/{MODEL_ID}").json)
    ErrorResponse.model_validate(client.simulate_post(CHAT, json={"messages": []}).json)


def test_a_tiny_positive_top_p_reaches_the_engine_positive(client, fake):
    # 1e-300 is in (0, 1] as JSON has it; the proto's float32 would round it to 0.0, which the engine refuses
    resp = client.simulate_post(CHAT, json={"messages": USER, "top_p": 1e-300, "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    assert 0 < last_engine_request(fake).params.top_p < 1e-44
