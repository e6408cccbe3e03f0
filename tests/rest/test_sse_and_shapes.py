"""Wire shapes of the REST front, in-process (falcon.testing) against the fake gRPC engine:
SSE framing byte for byte, JSON bodies, and how request fields reach the engine."""

import json

from .fake_grpc_engine import HELLO, MODEL_ID

CHAT = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}]}


def frames(body: bytes) -> list[bytes]:
    assert body.endswith(b"\n\n")
    return [frame + b"\n\n" for frame in body[:-2].split(b"\n\n")]


def data(event) -> bytes:
    return b"data: " + json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def test_chat_stream_frames_are_byte_exact(client):
    resp = client.simulate_post("/v1/chat/completions", json=dict(CHAT, stream=True))
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "text/event-stream"
    assert resp.headers["cache-control"] == "no-cache"
    got = frames(resp.content)
    first = json.loads(got[0][len(b"data: "):])
    head = {"id": first["id"], "object": "chat.completion.chunk", "created": first["created"], "model": MODEL_ID}
    assert head["id"].startswith("chatcmpl-")

    def chunk(delta, reason=None):
        return data(dict(head, choices=[{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]))

    expected = [chunk({"role": "assistant", "content": ""})]
    expected += [chunk({"content": piece}) for piece in HELLO]
    expected += [chunk({}, "stop"), b"data: [DONE]\n\n"]
    assert got == expected


def test_usage_chunk_only_with_include_usage(client):
    plain = client.simulate_post("/v1/chat/completions", json=dict(CHAT, stream=True)).content
    assert b'"usage"' not in plain
    body = client.simulate_post("/v1/chat/completions", json=dict(
        CHAT, stream=True, stream_options={"include_usage": True})).content
    events = [json.loads(f[len(b"data: "):]) for f in frames(body)[:-1]]
    assert all(e["usage"] is None for e in events[:-1])
    assert events[-1]["choices"] == []
    assert events[-1]["usage"] == {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11,
                                   "prompt_tokens_details": {"cached_tokens": 3},
                                   "completion_tokens_details": {"reasoning_tokens": 0}}
    assert frames(body)[-1] == b"data: [DONE]\n\n"


def test_completion_stream_frames(client):
    resp = client.simulate_post("/v1/completions", json={"model": MODEL_ID, "prompt": "hi", "stream": True})
    got = frames(resp.content)
    first = json.loads(got[0][len(b"data: "):])
    head = {"id": first["id"], "object": "text_completion", "created": first["created"], "model": MODEL_ID}
    assert head["id"].startswith("cmpl-")

    def chunk(text, reason=None):
        return data(dict(head, choices=[{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]))

    assert got == [chunk(p) for p in HELLO] + [chunk("", "stop"), b"data: [DONE]\n\n"]


def test_chat_answer_body(client):
    body = client.simulate_post("/v1/chat/completions", json=CHAT).json
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert list(body) == ["id", "object", "created", "model", "choices", "usage"]
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello world", "refusal": None},
                                "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"]["total_tokens"] == 11


def test_chat_logprobs_shape(client):
    body = client.simulate_post("/v1/chat/completions", json=dict(CHAT, logprobs=True, top_logprobs=2)).json
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == HELLO
    assert content[0] == {"token": "Hel", "logprob": -0.5, "bytes": list(b"Hel"), "top_logprobs": [
        {"token": "Hel", "logprob": -0.5, "bytes": list(b"Hel")},
        {"token": "Hel1", "logprob": -1.5, "bytes": list(b"Hel1")}]}


def test_completion_logprobs_shape(client):
    body = client.simulate_post("/v1/completions", json={"prompt": "hi", "logprobs": 1}).json
    assert body["choices"][0]["logprobs"] == {
        "tokens": HELLO, "token_logprobs": [-0.5] * 4,
        "top_logprobs": [{p: -0.5} for p in HELLO], "text_offset": [0, 3, 5, 9]}


def test_reasoning_and_tool_calls(client):
    body = client.simulate_post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "tools"}]}).json
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    assert choice["message"]["reasoning_content"] == choice["message"]["reasoning"] == "I should call the tool."
    assert choice["message"]["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]


def test_streamed_tool_call_deltas(client):
    body = client.simulate_post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "tools"}], "stream": True}).content
    deltas = [json.loads(f[6:])["choices"][0] for f in frames(body)[:-1]]
    assert deltas[1]["delta"] == {"reasoning_content": "I should call ", "reasoning": "I should call "}
    assert deltas[3]["delta"]["tool_calls"] == [{"index": 0, "id": "call_1", "type": "function",
                                                 "function": {"name": "get_weather", "arguments": '{"city": '}}]
    assert deltas[4]["delta"]["tool_calls"] == [{"index": 0, "function": {"arguments": '"Paris"}'}}]
    assert deltas[-1] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}


def test_chat_fields_reach_the_engine(client, fake):
    client.simulate_post("/v1/chat/completions", json={
        "model": MODEL_ID,
        "messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None, "reasoning_content": "hmm",
             "tool_calls": [{"id": "call_9", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_9", "name": "f", "content": "42"},
            {"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "tool_choice": "none",
        "chat_template_kwargs": {"enable_thinking": False, "custom": 1},
        "max_completion_tokens": 9, "max_tokens": 99, "temperature": 0, "top_p": 0.5, "n": 1, "seed": 7,
        "stop": "END", "presence_penalty": 0.1, "frequency_penalty": 0.2, "logit_bias": {"42": -100},
        "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "min_tokens": 1, "ignore_eos": True,
        "skip_special_tokens": False, "include_stop_str_in_output": True, "user": "u1"})
    request = fake.engine.requests[-1]
    assert request.request_id.startswith("chatcmpl-")
    chat = request.chat
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "user"]
    assert chat.messages[1].content == "a\nb"
    assert chat.messages[2].reasoning_content == "hmm"
    assert (chat.messages[2].tool_calls[0].id, chat.messages[2].tool_calls[0].name) == ("call_9", "f")
    assert (chat.messages[3].tool_call_id, chat.messages[3].name) == ("call_9", "f")
    assert json.loads(chat.tools[0])["function"]["name"] == "f"
    assert chat.tool_choice == "none"
    assert chat.enable_thinking is False and json.loads(chat.template_kwargs_json) == {"custom": 1}
    p = request.params
    assert (p.max_tokens, p.temperature, p.seed, list(p.stop), dict(p.logit_bias)) == (9, 0, 7, ["END"], {42: -100})
    assert (p.top_k, p.min_tokens, p.ignore_eos, p.skip_special_tokens, p.include_stop_str_in_output) == (
        5, 1, True, False, True)
    assert abs(p.top_p - 0.5) < 1e-6 and abs(p.repetition_penalty - 1.1) < 1e-6 and abs(p.min_p - 0.1) < 1e-6


def test_chat_without_max_tokens_leaves_it_unset_for_the_engine(client, fake):
    calls = len(fake.engine.requests)
    client.simulate_post("/v1/chat/completions", json=CHAT)
    assert len(fake.engine.requests) == calls + 1
    assert not fake.engine.requests[-1].params.HasField("max_tokens")  # the rest of the context


def test_unset_sampling_fields_stay_unset_and_zeros_are_sent(client, fake):
    """The engine fills unset fields from the model's generation_config.json (Qwen3: temperature
    0.6, top_p 0.95, top_k 20), so the front must not send OpenAI's defaults in their place, and
    must send an explicit 0 (top_k 0: off)."""
    names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    client.simulate_post("/v1/chat/completions", json=CHAT)
    assert not any(fake.engine.requests[-1].params.HasField(name) for name in names)
    client.simulate_post("/v1/completions", json={"prompt": "x", "top_k": 0, "min_p": 0, "temperature": 1})
    params = fake.engine.requests[-1].params
    assert [params.HasField(name) for name in names] == [True, False, True, True, False]


def test_completion_prompt_forms(client, fake):
    for prompt, expected in [("abc", "abc"), (["abc"], "abc")]:
        client.simulate_post("/v1/completions", json={"prompt": prompt})
        assert fake.engine.requests[-1].text == expected
        assert fake.engine.requests[-1].params.max_tokens == 16  # OpenAI's completions default
    for prompt in ([1, 2, 3], [[1, 2, 3]]):
        client.simulate_post("/v1/completions", json={"prompt": prompt})
        assert list(fake.engine.requests[-1].token_ids.ids) == [1, 2, 3]


def test_models_and_health(client):
    models = client.simulate_get("/v1/models").json
    assert models["object"] == "list"
    assert models["data"][0]["id"] == MODEL_ID and models["data"][0]["object"] == "model"
    assert client.simulate_get("/health").status_code == 200


def test_retrieve_model_by_id(client):
    assert client.simulate_get(f"/v1/models/{MODEL_ID}").json == client.simulate_get("/v1/models").json["data"][0]
    for unknown in ("no-such-model", "org/name"):  # ids may hold slashes, like Qwen/Qwen3-8B
        resp = client.simulate_get(f"/v1/models/{unknown}")
        assert resp.status_code == 404
        assert resp.json["error"]["code"] == "model_not_found" and unknown in resp.json["error"]["message"]
