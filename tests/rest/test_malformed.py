"""Malformed input of every kind, sent to `xserv rest` under gunicorn while well-formed streams
run: each gets a 4xx with a clear OpenAI-format message, and the streams finish untouched."""

import json
import threading

import pytest
import requests

from .fake_grpc_engine import MODEL_ID

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def chat(**fields) -> bytes:
    return json.dumps(dict({"messages": USER}, **fields)).encode()


CASES = [  # (path, raw body, status, param)
    (CHAT, b"{not json", 400, None),
    (CHAT, b"", 400, None),
    (CHAT, b"[1, 2]", 400, None),
    (CHAT, b'"hello"', 400, None),
    (CHAT, b"null", 400, None),
    (CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, None),
    (CHAT, json.dumps({"messages": "hi"}).encode(), 400, "messages"),
    (CHAT, json.dumps({"messages": []}).encode(), 400, "messages"),
    (CHAT, json.dumps({"messages": [1]}).encode(), 400, "messages[0]"),
    (CHAT, json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}).encode(), 400, "messages[0].role"),
    (CHAT, json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(), 400, "messages[0].content"),
    (CHAT, json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]}]}).encode(), 400,
     "messages[0].content[0].image_url"),  # no --allowed-media-domains
    (CHAT, chat(temperature="hot"), 400, "temperature"),
    (CHAT, chat(stream="yes"), 400, "stream"),
    (CHAT, chat(max_tokens="10"), 400, "max_tokens"),
    (CHAT, chat(n=1.5), 400, "n"),
    (CHAT, chat(stop=5), 400, "stop"),
    (CHAT, chat(tools={}), 400, "tools"),
    (CHAT, chat(max_tokens=1e308), 400, "max_tokens"),
    (CHAT, chat(max_tokens=2**70), 400, "max_tokens"),
    (CHAT, chat(seed=2**70), 400, "seed"),
    (CHAT, chat(n=2**70), 400, "n"),
    (CHAT, chat(temperature=1e308), 400, "temperature"),
    (CHAT, chat(top_logprobs=2**70, logprobs=True), 400, "top_logprobs"),
    (CHAT, chat(logit_bias={"1": 1e308}), 400, "logit_bias"),
    (CHAT, chat(stop_token_ids=[2**70]), 400, "stop_token_ids[0]"),
    ("/v1/completions", json.dumps({"prompt": [2**70]}).encode(), 400, "prompt"),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": -5}).encode(), 400, "max_tokens"),
    (CHAT, b"{" + b" " * (10 * 1024 * 1024) + b"}", 413, None),
]


def send(front: str, path: str, body: bytes) -> requests.Response:
    return requests.post(front + path, data=body, headers={"content-type": "application/json"}, timeout=30)


SLOW_TEXT = "".join(f"t{step} " for step in range(300))  # the fake's "slow" answer


def stream_text(front: str) -> str:
    with requests.post(front + CHAT, stream=True, timeout=60, json={
            "model": MODEL_ID, "stream": True, "messages": [{"role": "user", "content": "slow"}]}) as resp:
        body = resp.content
    assert body.endswith(b"data: [DONE]\n\n")
    return "".join(json.loads(f[6:])["choices"][0]["delta"].get("content", "") for f in body.split(b"\n\n")[:-2])


@pytest.fixture
def quick_slow_streams(fake):
    """The fake's "slow" streams run ~3 s (300 frames, 10 ms apart) for the length of the test."""
    before, fake.engine.slow_interval_s = fake.engine.slow_interval_s, 0.01
    yield
    fake.engine.slow_interval_s = before


def test_malformed_requests_get_4xx_while_streams_run(front, quick_slow_streams):
    texts = [None] * 8

    def one(i: int) -> None:
        texts[i] = stream_text(front)

    streams = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
    for thread in streams:
        thread.start()
    try:
        for path, body, status, param in CASES:
            resp = send(front, path, body)
            assert resp.status_code == status, (body[:80], resp.text)
            error = resp.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["type"] == "invalid_request_error" and error["message"], body[:80]
            assert error["param"] == param, (body[:80], error)
    finally:
        for thread in streams:
            thread.join()
    assert texts == [SLOW_TEXT] * len(texts)


@pytest.mark.parametrize("path", [CHAT, "/v1/completions"])
def test_a_body_that_is_not_an_object_names_the_problem(front, path):
    error = send(front, path, b"[]").json()["error"]
    assert "must be a JSON object" in error["message"]
