"""Limits: --max-n, context length, --request-timeout (the call's deadline)."""

import json
import time

import pytest

from .conftest import make_client
from .test_errors import chat, error_of


@pytest.mark.parametrize("n", [0, 17, 2**70])
def test_n_beyond_the_limit_is_400_naming_n(client, n):
    error = error_of(client.simulate_post("/v1/chat/completions", json=chat("hi", n=n)), 400)
    assert error["param"] == "n" and error["type"] == "invalid_request_error"


def test_max_n_is_configurable(fake):
    strict = make_client(fake, max_n=2)
    assert strict.simulate_post("/v1/completions", json={"prompt": "hi", "n": 2}).status_code == 200
    error = error_of(strict.simulate_post("/v1/completions", json={"prompt": "hi", "n": 3}), 400)
    assert error["message"] == "'n' must be between 1 and 2, got 3"


def test_max_tokens_past_the_context_is_context_length_exceeded_naming_max_tokens(client):
    """The engine's INVALID_ARGUMENT "maximum context length" answer (scripted in the fake): a
    prompt that fits names max_tokens; one that does not names messages or prompt."""
    error = error_of(client.simulate_post("/v1/chat/completions", json=chat("error:max_tokens", max_tokens=4000)), 400)
    assert (error["code"], error["param"]) == ("context_length_exceeded", "max_tokens")
    assert "maximum context length is 4096" in error["message"]
    error = error_of(client.simulate_post("/v1/completions", json={"prompt": "error:context"}), 400)
    assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")


@pytest.fixture(scope="module")
def hurried(fake):
    return make_client(fake, request_timeout_s=1.0)


def test_a_request_past_its_timeout_gets_504_and_the_engine_call_ends(hurried, fake):
    started = time.monotonic()
    resp = hurried.simulate_post("/v1/completions", json={"prompt": "slow"})
    elapsed = time.monotonic() - started
    error = error_of(resp, 504)
    assert (error["type"], error["code"]) == ("timeout", "request_timeout")
    assert "request timeout of 1 s" in error["message"]
    assert 0.9 < elapsed < 3
    assert fake.engine.wait_cancelled(fake.engine.requests[-1].request_id, timeout_s=2) is not None


def test_a_stream_past_its_timeout_ends_with_an_error_event(hurried, fake):
    resp = hurried.simulate_post("/v1/chat/completions", json=chat("slow", stream=True))
    assert resp.status_code == 200
    frames = resp.content.split(b"\n\n")[:-1]
    assert len(frames) > 3 and b"[DONE]" not in resp.content
    error = json.loads(frames[-1][len(b"data: "):])["error"]
    assert error["code"] == "request_timeout" and error["type"] == "timeout"
    assert fake.engine.wait_cancelled(fake.engine.requests[-1].request_id, timeout_s=2) is not None
