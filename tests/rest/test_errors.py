"""Every error the REST front returns: status, OpenAI error body, headers; nothing internal leaks."""

import json

import falcon.testing
import pytest

from tests.support.processes import free_port
from xserv_rest.app import create_app
from xserv_rest.config import RestConfig
from xserv_rest.engine_client import EngineClient
from .conftest import make_client
from .fake_grpc_engine import MODEL_ID


def chat(content: str, **fields) -> dict:
    return dict({"model": MODEL_ID, "messages": [{"role": "user", "content": content}]}, **fields)


def error_of(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    assert set(resp.json) == {"error"}
    assert set(resp.json["error"]) == {"message", "type", "param", "code"}
    return resp.json["error"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_engine_invalid_argument_is_400_naming_the_field(client, path, stream):
    """The field comes from the status's BadRequest detail, not from the message."""
    body = chat("error:invalid", stream=stream) if "chat" in path else {"prompt": "error:invalid", "stream": stream}
    error = error_of(client.simulate_post(path, json=body), 400)
    assert error == {"message": "top_p: must be greater than 0 and at most 1, got 0.0",
                     "type": "invalid_request_error", "param": "top_p", "code": None}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", chat("error:content"), "messages[0].content"),
    ("/v1/completions", {"prompt": "error:token"}, "prompt"),
])
def test_engine_field_names_become_the_body_s_names(client, path, body, param):
    assert error_of(client.simulate_post(path, json=body), 400)["param"] == param


def test_context_too_long(client):
    error = error_of(client.simulate_post("/v1/chat/completions", json=chat("error:context")), 400)
    assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")
    assert "4096" in error["message"]
    error = error_of(client.simulate_post("/v1/completions", json={"prompt": "error:context"}), 400)
    assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")


def test_unknown_model_is_404(client):
    error = error_of(client.simulate_post("/v1/chat/completions", json=dict(chat("hi"), model="gpt-4")), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"


def test_body_too_large_is_413(fake):
    small = make_client(fake, max_body_bytes=1000)
    error = error_of(small.simulate_post("/v1/chat/completions", json=chat("x" * 2000)), 413)
    assert error["code"] == "request_too_large"


def test_queue_full_is_429_with_retry_after(client):
    resp = client.simulate_post("/v1/completions", json={"prompt": "error:overloaded"})
    error = error_of(resp, 429)
    assert resp.headers["retry-after"] == "1"
    assert error["type"] == "rate_limit_error"


def test_engine_unavailable_is_503(client):
    error_of(client.simulate_post("/v1/chat/completions", json=chat("error:unavailable")), 503)


def test_engine_down_is_503():
    config = RestConfig(engines=(f"127.0.0.1:{free_port()}",))  # nobody listens there
    nobody = falcon.testing.TestClient(create_app(config, EngineClient(config.engines)))
    error_of(nobody.simulate_post("/v1/chat/completions", json=chat("hi")), 503)
    error_of(nobody.simulate_get("/health"), 503)
    error_of(nobody.simulate_get("/v1/models"), 503)


def test_health_503_while_engine_not_serving(fake, client):
    fake.set_serving(False)
    try:
        error_of(client.simulate_get("/health"), 503)
    finally:
        fake.set_serving(True)
    assert client.simulate_get("/health").status_code == 200


def test_internal_errors_do_not_leak(client):
    error = error_of(client.simulate_post("/v1/completions", json={"prompt": "error:internal"}), 500)
    assert error["message"] == "internal server error"
    assert "CUDA" not in json.dumps(error)


@pytest.mark.parametrize("body, param", [
    ("{not json", None),
    ("[1, 2]", None),
    (json.dumps({"messages": "hi"}), "messages"),
    (json.dumps({"messages": []}), "messages"),
    (json.dumps({"messages": [{"content": "hi"}]}), "messages[0].role"),
    (json.dumps(chat("hi", temperature="hot")), "temperature"),
    (json.dumps(chat("hi", max_tokens=1.5)), "max_tokens"),
    (json.dumps(chat("hi", max_tokens=-1)), "max_tokens"),
    (json.dumps(chat("hi", seed=-3)), "seed"),
    (json.dumps(chat("hi", stop=[1])), "stop[0]"),
    (json.dumps(chat("hi", logit_bias={"abc": 1})), "logit_bias"),
    (json.dumps(chat("hi", top_logprobs=2)), "top_logprobs"),
    (json.dumps(chat("hi", stream_options={"include_usage": True})), "stream_options"),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
     "messages[0].content[0].image_url"),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "video_url"}]}]}), "messages[0].content[0]"),
])
def test_malformed_requests_are_400(client, body, param):
    error = error_of(client.simulate_post("/v1/chat/completions", body=body,
                                          headers={"content-type": "application/json"}), 400)
    assert error["type"] == "invalid_request_error" and error["param"] == param


@pytest.mark.parametrize("prompt", [None, 5, [], [[]], [["a"]], ["a"] * 257], ids=str)
def test_bad_prompts_are_400(client, prompt):
    error = error_of(client.simulate_post("/v1/completions", json={"prompt": prompt}), 400)
    assert error["param"] == "prompt"


def test_unknown_route_is_404_json(client):
    error_of(client.simulate_get("/v1/nope"), 404)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
                                  "/tokenize"])
@pytest.mark.parametrize("body", [b"", b" \n"], ids=["empty", "blank"])
def test_an_empty_body_is_400_saying_so(client, path, body):
    error = error_of(client.simulate_post(path, body=body), 400)
    assert error["message"] == "the request body is empty; send a JSON object (Content-Type: application/json)"
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("method, path, takes", [
    ("GET", "/v1/chat/completions", "POST"),
    ("DELETE", "/v1/models", "GET"),
    ("PUT", "/health", "GET"),
])
def test_a_wrong_method_is_405_json_naming_the_right_one(client, method, path, takes):
    resp = client.simulate_request(method, path)
    error = error_of(resp, 405)
    assert error == {"message": f"{method} is not allowed on {path}; it takes {takes}",
                     "type": "invalid_request_error", "param": None, "code": "method_not_allowed"}
    assert resp.headers["allow"] == f"{takes}, OPTIONS"


def test_api_key(fake):
    locked = make_client(fake, api_keys=("sesame",))
    error = error_of(locked.simulate_get("/v1/models"), 401)
    assert error["code"] == "invalid_api_key"
    assert locked.simulate_get("/v1/models", headers={"Authorization": "Bearer sesame"}).status_code == 200
    assert locked.simulate_get("/health").status_code == 200


def test_error_after_the_stream_started_is_an_sse_event(client):
    resp = client.simulate_post("/v1/completions", json={"prompt": "midstream", "stream": True})
    assert resp.status_code == 200
    events = resp.content.split(b"\n\n")
    assert events[-1] == b""
    assert json.loads(events[0][6:])["choices"][0]["text"] == "partial"
    last = events[-2]
    assert last.startswith(b"data: {\"error\":")
    assert json.loads(last[6:])["error"]["code"] == "engine_unavailable"
    assert b"[DONE]" not in resp.content
