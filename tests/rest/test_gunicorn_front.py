"""The REST front as users run it: `xserv rest` under gunicorn (gthread) in front of the fake
engine, spoken to with the official openai SDK, raw sockets and many streams at once."""

import json
import socket
import threading
import time
from urllib.parse import urlparse

import openai
import pytest
import requests

from .fake_grpc_engine import HELLO, MODEL_ID, UNICODE

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def sdk(front):
    return openai.OpenAI(base_url=front + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_sdk_chat(sdk, fake):
    answer = sdk.chat.completions.create(model=MODEL_ID, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}], seed=3, n=2)
    assert [c.message.content for c in answer.choices] == ["Hello world", "Hello world"]
    assert answer.choices[1].index == 1 and answer.choices[0].finish_reason == "stop"
    assert answer.usage.total_tokens == 7 + 8 and answer.usage.prompt_tokens_details.cached_tokens == 3
    request = fake.engine.requests[-1]
    assert [m.content for m in request.chat.messages] == ["be brief", "hi", "hello", "again"]
    assert request.params.seed == 3


def test_sdk_chat_stream_keeps_unicode_intact(sdk):
    stream = sdk.chat.completions.create(model=MODEL_ID, stream=True, stream_options={"include_usage": True},
                                         messages=[{"role": "user", "content": "say unicode"}])
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert pieces == UNICODE and "".join(pieces) == "你好，世界 🙂🎉!"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(UNICODE)


def test_sdk_chat_stop_and_logprobs(sdk, fake):
    answer = sdk.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}],
                                         stop=["lo w"], logprobs=True, top_logprobs=2)
    assert answer.choices[0].message.content == "Hello"
    assert [t.token for t in answer.choices[0].logprobs.content] == HELLO[:2]
    assert len(answer.choices[0].logprobs.content[0].top_logprobs) == 2
    assert list(fake.engine.requests[-1].params.stop) == ["lo w"]


def test_sdk_completions(sdk):
    answer = sdk.completions.create(model=MODEL_ID, prompt="hi", max_tokens=3, logprobs=1)
    assert answer.choices[0].text == "Hello wor" and answer.choices[0].finish_reason == "length"
    assert answer.choices[0].logprobs.tokens == HELLO[:3]
    stream = sdk.completions.create(model=MODEL_ID, prompt="say unicode", stream=True, n=2,
                                    stream_options={"include_usage": True})
    texts = {0: "", 1: ""}
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        usage = chunk.usage or usage
    assert texts == {0: "".join(UNICODE), 1: "".join(UNICODE)}
    assert usage.completion_tokens == 2 * len(UNICODE)


def test_sdk_sees_errors(sdk):
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "error:context"}])
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.RateLimitError) as info:
        sdk.completions.create(model=MODEL_ID, prompt="error:overloaded")
    assert info.value.response.headers["retry-after"] == "1"
    with pytest.raises(openai.APIError):
        list(sdk.completions.create(model=MODEL_ID, prompt="midstream", stream=True))


def test_body_too_large_through_gunicorn(front):
    resp = requests.post(front + "/v1/completions", data=b"{" + b" " * 70000 + b"}",
                         headers={"content-type": "application/json"})
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"


def test_32_simultaneous_streams_complete(front):
    results = [None] * 32

    def one(i: int) -> None:
        with requests.post(front + "/v1/chat/completions", stream=True, timeout=60, json={
                "model": MODEL_ID, "stream": True, "messages": [{"role": "user", "content": f"{i} unicode"}]}) as resp:
            results[i] = resp.content

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for body in results:
        assert body.endswith(b"data: [DONE]\n\n")
        texts = [json.loads(f[6:])["choices"][0]["delta"].get("content", "")
                 for f in body.split(b"\n\n")[:-2]]
        assert "".join(texts) == "".join(UNICODE)


def open_request(front: str, body: dict) -> socket.socket:
    url = urlparse(front)
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    payload = json.dumps(body).encode()
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def read_until(sock: socket.socket, count: int) -> bytes:
    data = b""
    while data.count(b"data: ") < count:
        data += sock.recv(4096)
    return data


def test_stream_disconnect_cancels_the_engine_call(front, fake):
    sock = open_request(front, {"prompt": "slow", "stream": True, "user": "disconnect-stream"})
    read_until(sock, 2)
    closed_at = time.monotonic()
    sock.close()
    request_id = fake.engine.requests[-1].request_id
    cancelled_at = fake.engine.wait_cancelled(request_id, timeout_s=2)
    assert cancelled_at is not None and cancelled_at - closed_at < 2


def test_non_stream_disconnect_cancels_the_engine_call(front, fake):
    before = len(fake.engine.requests)
    sock = open_request(front, {"prompt": "slow", "stream": False})
    deadline = time.monotonic() + 5
    while len(fake.engine.requests) == before and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)
    closed_at = time.monotonic()
    sock.close()
    cancelled_at = fake.engine.wait_cancelled(fake.engine.requests[-1].request_id, timeout_s=2)
    assert cancelled_at is not None and cancelled_at - closed_at < 2
