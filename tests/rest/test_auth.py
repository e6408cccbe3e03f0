"""API keys on the REST side, and the engine token the front sends on every gRPC call."""

import argparse

import pytest

from .conftest import make_client
from .fake_grpc_engine import MODEL_ID
from .test_errors import chat, error_of
from xserv_rest import cli


def test_missing_or_wrong_key_is_401_in_openai_format(fake):
    locked = make_client(fake, api_keys=("sesame", "open"))
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
        resp = locked.simulate_post("/v1/chat/completions", json=chat("hi"), headers=headers)
        error = error_of(resp, 401)
        assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "invalid_api_key", None)
        assert "sesame" not in resp.text
    error_of(locked.simulate_get("/v1/models"), 401)


def test_every_configured_key_works(fake):
    locked = make_client(fake, api_keys=("sesame", "open"))
    for key in ("sesame", "open"):
        resp = locked.simulate_post("/v1/chat/completions", json=chat("hi"), headers={"Authorization": f"Bearer {key}"})
        assert resp.status_code == 200 and resp.json["choices"][0]["message"]["content"] == "Hello world"


def test_every_route_that_runs_the_engine_needs_the_key(fake):
    """vLLM guards only /v1; the tokenizer, rerank and score routes run the engine too."""
    locked = make_client(fake, api_keys=("sesame",))
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]}), ("/rerank", {}),
                       ("/v2/rerank", {}), ("/score", {}), ("/v1/embeddings", {"input": "hi"})):
        error_of(locked.simulate_post(path, json=body), 401)
    error_of(locked.simulate_get("/tokenizer_info"), 401)
    resp = locked.simulate_post("/tokenize", json={"prompt": "hi"}, headers={"Authorization": "Bearer sesame"})
    assert resp.status_code == 200


def test_health_metrics_and_openapi_stay_open(fake):
    locked = make_client(fake, api_keys=("sesame",))
    for path in ("/health", "/metrics", "/openapi.json"):
        assert locked.simulate_get(path).status_code == 200, path


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_keys_from_flags_and_file(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("alpha\n\n  beta  \n")
    config = cli.config_from_args(parse("--api-key", "one", "--api-key", "two", "--api-key-file", str(keys)))
    assert config.api_keys == ("one", "two", "alpha", "beta")
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    assert cli.config_from_args(parse("--grpc-token-file", str(token))).grpc_token == "s3cret"
    assert cli.config_from_args(parse("--grpc-token", "t")).grpc_token == "t"
    with pytest.raises(ValueError, match="cannot read"):
        cli.config_from_args(parse("--api-key-file", str(tmp_path / "missing")))


@pytest.fixture
def token_engine(fake):
    fake.set_token("engine-secret")
    yield fake
    fake.set_token(None)


def test_the_front_sends_its_grpc_token(token_engine):
    client = make_client(token_engine, grpc_token="engine-secret")
    resp = client.simulate_post("/v1/chat/completions", json=chat("hi"))
    assert resp.status_code == 200
    request_id = resp.json["id"]
    assert token_engine.engine.metadata[request_id]["authorization"] == "Bearer engine-secret"
    assert client.simulate_get("/health").status_code == 200
    assert client.simulate_get("/v1/models").json["data"][0]["id"] == MODEL_ID


@pytest.mark.parametrize("token", [None, "wrong"])
def test_a_rejected_grpc_token_is_a_server_error_not_401(token_engine, token):
    client = make_client(token_engine, grpc_token=token)
    for resp in (client.simulate_get("/v1/models"),
                 client.simulate_post("/v1/completions", json={"prompt": "hi", "model": MODEL_ID}),
                 client.simulate_post("/v1/chat/completions", json=chat("hi", stream=True))):
        error = error_of(resp, 500)
        assert (error["type"], error["code"]) == ("server_error", "engine_auth_failed")
        assert "gRPC token" in error["message"]
