"""POST /v1/embeddings in front of the fake engine: the openai SDK's embeddings.create (base64
under the hood by default, or floats), OpenAI's four input forms, dimensions and vLLM's
truncate_prompt_tokens passed to the engine, and every error a user can cause."""

import base64
import json
import socket
import struct
import time
from urllib.parse import urlparse

import openai
import pytest

from .conftest import make_client
from .fake_grpc_engine import EMBEDDING_SIZE, MODEL_ID, NOT_AN_EMBEDDING_MODEL, embedding_of
from .test_errors import chat, error_of

PATH = "/v1/embeddings"


def float32(values: list[float]) -> list[float]:
    """The values as the engine sends them (protobuf floats are float32)."""
    return list(struct.unpack(f"<{len(values)}f", struct.pack(f"<{len(values)}f", *values)))


def expected(text_or_ids, dimensions: int | None = None) -> list[float]:
    tokens = [ord(c) for c in text_or_ids] if isinstance(text_or_ids, str) else text_or_ids
    return float32(embedding_of(tokens, dimensions))


@pytest.fixture(scope="module")
def sdk(front):
    return openai.OpenAI(base_url=front + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.mark.e2e
def test_sdk_default_asks_base64_and_gets_the_engine_s_vectors(sdk):
    texts = ["first", "the second text", "你好 🙂"]
    raw = sdk.embeddings.with_raw_response.create(model=MODEL_ID, input=texts)
    assert json.loads(raw.http_request.content)["encoding_format"] == "base64"
    assert all(isinstance(item["embedding"], str) for item in json.loads(raw.text)["data"])
    answer = raw.parse()
    assert [item.index for item in answer.data] == [0, 1, 2]
    assert [item.embedding for item in answer.data] == [expected(text) for text in texts]
    assert answer.model == MODEL_ID and answer.object == "list"
    tokens = sum(len(text) for text in texts)
    assert (answer.usage.prompt_tokens, answer.usage.total_tokens) == (tokens, tokens)


@pytest.mark.e2e
def test_sdk_float_and_base64_carry_the_same_floats(sdk):
    floats = sdk.embeddings.create(model=MODEL_ID, input="hello", encoding_format="float").data[0].embedding
    assert floats == expected("hello") and len(floats) == EMBEDDING_SIZE
    encoded = sdk.embeddings.create(model=MODEL_ID, input="hello", encoding_format="base64").data[0].embedding
    raw = base64.b64decode(encoded)
    assert list(struct.unpack(f"<{EMBEDDING_SIZE}f", raw)) == floats and len(raw) == 4 * EMBEDDING_SIZE


@pytest.mark.e2e
def test_sdk_dimensions_and_truncation_reach_the_engine(sdk, fake):
    answer = sdk.embeddings.create(model=MODEL_ID, input=["abcdef", "xy"], dimensions=16,
                                   extra_body={"truncate_prompt_tokens": 3})
    request = fake.engine.embed_requests[-1]
    assert (request.dimensions, request.truncate_prompt_tokens) == (16, 3)
    assert [item.embedding for item in answer.data] == [expected("def", 16), expected("xy", 16)]
    assert sum(v * v for v in answer.data[0].embedding) == pytest.approx(1, rel=1e-5)
    assert answer.usage.prompt_tokens == 3 + 2


@pytest.mark.e2e
def test_sdk_sees_engine_errors(sdk):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.embeddings.create(model=MODEL_ID, input=["fine", "too long error:context"])
    assert (info.value.code, info.value.param) == ("context_length_exceeded", "input[1]")
    with pytest.raises(openai.BadRequestError) as info:
        sdk.embeddings.create(model=MODEL_ID, input="hi error:wrong-runner")
    assert info.value.body["message"] == NOT_AN_EMBEDDING_MODEL and info.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        sdk.embeddings.create(model="text-embedding-3-small", input="hi")


@pytest.mark.parametrize("body_input, engine_inputs", [
    ("one text", ["one text"]),
    (["a", "bc", "def"], ["a", "bc", "def"]),
    ([9707, 1879, 0], [[9707, 1879, 0]]),
    ([[9707, 1879], [11], [9707]], [[9707, 1879], [11], [9707]]),
], ids=["string", "strings", "token_ids", "lists_of_token_ids"])
def test_the_four_input_forms(client, fake, body_input, engine_inputs):
    resp = client.simulate_post(PATH, json={"input": body_input})
    assert resp.status_code == 200, resp.text
    request = fake.engine.embed_requests[-1]
    sent = [item.text if item.HasField("text") else list(item.token_ids.ids) for item in request.inputs]
    assert sent == engine_inputs
    assert not request.HasField("dimensions") and not request.HasField("truncate_prompt_tokens")
    body = resp.json
    assert [(item["object"], item["index"]) for item in body["data"]] == [
        ("embedding", i) for i in range(len(engine_inputs))]
    assert [item["embedding"] for item in body["data"]] == [expected(item) for item in engine_inputs]
    tokens = sum(len(item) for item in engine_inputs)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert set(body) == {"object", "data", "model", "usage"} and body["model"] == MODEL_ID


def test_user_is_accepted_and_changes_nothing(client):
    plain = client.simulate_post(PATH, json={"input": "same"}).json
    assert client.simulate_post(PATH, json={"input": "same", "user": "u-1", "model": MODEL_ID}).json == plain


def test_the_http_request_id_reaches_the_engine(client, fake):
    resp = client.simulate_post(PATH, json={"input": "hi"}, headers={"X-Request-Id": "trace-embed"})
    request_id = fake.engine.embed_requests[-1].request_id
    assert resp.status_code == 200 and request_id.startswith("embd-")
    assert fake.engine.metadata[request_id]["x-request-id"] == "trace-embed"


@pytest.mark.parametrize("body, param, message", [
    ({"input": []}, "input", "'input' must not be empty"),
    ({"input": ""}, "input", "'input' must not be an empty string"),
    ({"input": ["a", ""]}, "input[1]", "'input[1]' must not be empty"),
    ({"input": [[1], []]}, "input[1]", "'input[1]' must not be empty"),
    ({"input": ["a"] * 2049}, "input", "'input' must hold at most 2048 inputs, got 2049"),
    ({"input": [[1]] * 2049}, "input", "'input' must hold at most 2048 inputs, got 2049"),
    ({"input": ["a", [1]]}, "input", "'input' must be a string, an array of strings"),
    ({"input": [-1]}, "input", "'input' must be a string, an array of strings"),
    ({}, "input", "'input' is required"),
    ({"input": "a", "dimensions": 0}, "dimensions", "'dimensions' must be greater than or equal to 1"),
    ({"input": "a", "dimensions": EMBEDDING_SIZE + 1}, "dimensions",
     "'dimensions' must be between 1 and 64 (the model's embedding size), got 65"),
    ({"input": "a", "encoding_format": "hex"}, "encoding_format", "'encoding_format' must be 'float' or 'base64'"),
    ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "'truncate_prompt_tokens' must be"),
])
def test_bodies_refused_before_the_engine(client, fake, body, param, message):
    before = len(fake.engine.embed_requests)
    error = error_of(client.simulate_post(PATH, json=body), 400)
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert error["message"].startswith(message)
    assert len(fake.engine.embed_requests) == before


def test_2048_inputs_and_a_long_token_list_are_accepted(client):
    assert len(client.simulate_post(PATH, json={"input": ["a"] * 2048}).json["data"]) == 2048
    assert len(client.simulate_post(PATH, json={"input": [1] * 2049}).json["data"]) == 1


def test_another_model_is_404(client):
    error = error_of(client.simulate_post(PATH, json={"input": "hi", "model": "text-embedding-3-small"}), 404)
    assert (error["code"], error["param"]) == ("model_not_found", "model")


@pytest.mark.parametrize("body, param", [
    ({"input": ["fine", "bad error:invalid"]}, "input[1]"),
    ({"input": "bad error:invalid"}, "input"),  # one input: the engine's inputs[0] is the body's input
])
def test_engine_invalid_argument_names_the_body_s_field(client, body, param):
    error = error_of(client.simulate_post(PATH, json=body), 400)
    assert (error["param"], error["code"]) == (param, None)
    assert error["message"].endswith("cannot be embedded")


def test_an_input_longer_than_the_context(client):
    error = error_of(client.simulate_post(PATH, json={"input": ["ok", "x" * 4097]}), 400)
    assert (error["code"], error["param"]) == ("context_length_exceeded", "input[1]")
    assert "4097 tokens" in error["message"] and "4096" in error["message"]
    error = error_of(client.simulate_post(PATH, json={"input": "x" * 4097}), 400)
    assert (error["code"], error["param"]) == ("context_length_exceeded", "input")
    fits = client.simulate_post(PATH, json={"input": "x" * 4097, "truncate_prompt_tokens": 4096})
    assert fits.json["usage"]["prompt_tokens"] == 4096


def test_a_generation_model_s_engine_answers_400_with_its_reason(client):
    error = error_of(client.simulate_post(PATH, json={"input": "hi error:wrong-runner"}), 400)
    assert error == {"message": NOT_AN_EMBEDDING_MODEL, "type": "invalid_request_error", "param": "model",
                     "code": None}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_generation_on_an_embedding_model_s_engine_is_400(client, path):
    body = chat("error:wrong-runner") if "chat" in path else {"prompt": "error:wrong-runner"}
    error = error_of(client.simulate_post(path, json=body), 400)
    assert error["param"] == "model" and error["message"] == (
        f"this model does not serve text generation: {MODEL_ID} is an embedding model (/v1/embeddings); for this "
        "endpoint start xserv with a generation model (such as Qwen3-8B): xserv up --model DIR")


def test_engine_overloaded_and_unavailable(client):
    resp = client.simulate_post(PATH, json={"input": ["a", "error:overloaded"]})
    assert error_of(resp, 429)["code"] == "engine_overloaded" and resp.headers["retry-after"] == "1"
    error = error_of(client.simulate_post(PATH, json={"input": "error:unavailable"}), 503)
    assert error["code"] == "engine_unavailable"


def test_past_the_request_timeout_is_504_and_the_engine_call_ends(fake):
    hurried = make_client(fake, request_timeout_s=1.0)
    error = error_of(hurried.simulate_post(PATH, json={"input": "slow"}), 504)
    assert error["code"] == "request_timeout"
    assert fake.engine.wait_cancelled(fake.engine.embed_requests[-1].request_id, timeout_s=2) is not None


@pytest.mark.e2e
def test_a_client_that_hangs_up_cancels_the_engine_call(front, fake):
    before = len(fake.engine.embed_requests)
    url = urlparse(front)
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    payload = json.dumps({"input": ["a", "slow"]}).encode()
    sock.sendall(f"POST {PATH} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    deadline = time.monotonic() + 5
    while len(fake.engine.embed_requests) == before and time.monotonic() < deadline:
        time.sleep(0.02)
    closed_at = time.monotonic()
    sock.close()
    cancelled_at = fake.engine.wait_cancelled(fake.engine.embed_requests[-1].request_id, timeout_s=2)
    assert cancelled_at is not None and cancelled_at - closed_at < 2
