"""End to end through the real `xserv up` (engine on the demo model + REST front under
gunicorn) on free loopback ports, with the openai SDK, raw sockets and the engine's gRPC API."""

import os
import re
import signal
import socket
import subprocess
import sys
import time

import grpc
import openai
import pytest

from xserv.v1 import engine_pb2, engine_pb2_grpc
from tests.support.processes import REPO, free_port, served
from .test_gunicorn_front import open_request, read_until

pytestmark = pytest.mark.e2e


def child_pids(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.fixture(scope="module")
def up():
    with served("up", "--workers", "1", "--threads", "16", "--num-kv-blocks", "256", "--max-model-len", "1024",
                "--log-level", "warning", stdout=subprocess.PIPE, text=True) as up:
        with grpc.insecure_channel(up.grpc_address) as channel:
            yield {"process": up.process, "url": up.url, "engine": engine_pb2_grpc.EngineServiceStub(channel)}


@pytest.fixture(scope="module")
def sdk(up):
    return openai.OpenAI(base_url=up["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(sdk):
    return sdk.models.list().data[0].id


def test_models_list_and_retrieve_through_the_sdk(sdk, model):
    assert sdk.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("no-such-model")


def test_up_prints_where_to_go(up):
    banner = [up["process"].stdout.readline() for _ in range(5)]
    assert banner[0].startswith("xserv up: serving ")
    assert f"{up['url']}/v1" in banner[1]
    assert f"curl {up['url']}/v1/chat/completions" in banner[3]


def test_chat_and_completions(sdk, model):
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"},
                {"role": "user", "content": "你好 🙂"}]
    answer = sdk.chat.completions.create(model=model, messages=messages, max_tokens=8, n=2, seed=1,
                                         logprobs=True, top_logprobs=2)
    assert len(answer.choices) == 2 and answer.usage.completion_tokens <= 16
    assert all(c.finish_reason in ("stop", "length") for c in answer.choices)
    assert len(answer.choices[0].logprobs.content[0].top_logprobs) == 2
    again = sdk.chat.completions.create(model=model, messages=messages, max_tokens=8, n=2, seed=1)
    assert [c.message.content for c in again.choices] == [c.message.content for c in answer.choices]

    stream = sdk.chat.completions.create(model=model, messages=messages, max_tokens=12, stream=True,
                                         stream_options={"include_usage": True}, temperature=0)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    greedy = sdk.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
    assert text == greedy.choices[0].message.content and "\ufffd" not in text
    assert chunks[-1].usage.completion_tokens == greedy.usage.completion_tokens

    completion = sdk.completions.create(model=model, prompt="The capital of France is", max_tokens=5,
                                        temperature=0, stop=["\n"])
    streamed = "".join(c.choices[0].text for c in sdk.completions.create(
        model=model, prompt="The capital of France is", max_tokens=5, temperature=0, stop=["\n"], stream=True)
        if c.choices)
    assert streamed == completion.choices[0].text


def test_continuous_usage_stats_count_each_choices_tokens_as_they_stream(sdk, model):
    stream = sdk.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count to twenty"}], max_tokens=12, n=2, seed=3,
        stream=True, stream_options={"continuous_usage_stats": True}, extra_body={"ignore_eos": True})
    *chunks, last = list(stream)
    counts: dict[int, list[int]] = {0: [], 1: []}
    for chunk in chunks:
        assert chunk.usage.prompt_tokens == last.usage.prompt_tokens > 0
        counts[chunk.choices[0].index].append(chunk.usage.completion_tokens)
    for seen in counts.values():
        assert seen[0] == 0 and seen == sorted(seen) and seen[-1] == 12
    assert last.choices == [] and last.usage.completion_tokens == 24


def test_a_priority_on_a_first_come_first_served_engine_is_400_naming_it(sdk, model):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model=model, prompt="Hi", max_tokens=2, extra_body={"priority": 1})
    assert info.value.param == "priority" and "--scheduling-policy priority" in info.value.message


def test_context_too_long_is_400(sdk, model):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model=model, prompt=[1] * 2000, max_tokens=1)
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"


def test_chat_without_max_tokens_runs_to_the_end_of_the_context(up, model):
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    sock = open_request(up["url"], body)
    assert read_until(sock, 3).startswith(b"HTTP/1.1 200 OK")
    sock.close()
    assert kv_blocks_back(up["engine"], timeout_s=2) is not None


def kv_blocks_back(engine, timeout_s: float) -> float | None:
    """Seconds until every KV block is free again, or None."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        info = engine.GetModelInfo(engine_pb2.GetModelInfoRequest())
        if info.kv_blocks_free == info.kv_blocks_total and info.num_running == 0:
            return time.monotonic() - start
        time.sleep(0.05)
    return None


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_frees_kv_blocks(up, sdk, model, stream):
    body = {"model": model, "prompt": "Tell me a long story", "max_tokens": 900, "ignore_eos": True,
            "stream": stream}
    sock = open_request(up["url"], body)
    if stream:
        read_until(sock, 2)
    else:
        deadline = time.monotonic() + 30
        while up["engine"].GetModelInfo(engine_pb2.GetModelInfoRequest()).num_running == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    info = up["engine"].GetModelInfo(engine_pb2.GetModelInfoRequest())
    assert info.kv_blocks_free < info.kv_blocks_total
    sock.close()
    assert kv_blocks_back(up["engine"], timeout_s=2) is not None
    answer = sdk.completions.create(model=model, prompt="next", max_tokens=4)
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_sigint_drains_a_running_stream_then_stops_both_and_leaves_nothing(up, model):
    process = up["process"]
    children = child_pids(process.pid)
    grandchildren = [g for c in children for g in child_pids(c)]
    assert len(children) == 2 and grandchildren  # engine, gunicorn master (+ its worker)
    sock = open_request(up["url"], {"model": model, "prompt": "Once", "max_tokens": 40, "ignore_eos": True,
                                    "stream": True})
    data = read_until(sock, 2)
    process.send_signal(signal.SIGINT)
    while b"data: [DONE]" not in data:
        chunk = sock.recv(65536)
        assert chunk, "the stream was cut off"
        data += chunk
    sock.close()
    assert b'"finish_reason":"length"' in data
    assert process.wait(timeout=60) == 0
    deadline = time.monotonic() + 10
    while any(alive(p) for p in children + grandchildren) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in children + grandchildren)


def test_up_exits_nonzero_when_a_child_fails():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = subprocess.run(
            [sys.executable, "-m", "xserv_cli", "up", "--port", str(port), "--grpc-port", str(free_port()),
             "--workers", "1", "--threads", "4", "--log-level", "warning", "--ready-timeout", "120"],
            cwd=REPO, capture_output=True, text=True, timeout=180)
    assert process.returncode != 0
    assert "rest exited" in process.stderr


def test_up_on_port_zero_serves_on_the_free_ports_its_banner_names(tmp_path):
    """At the default log levels, as a newcomer runs it: the log says the start's slow steps, no
    health probe, and a calm stop on Ctrl-C."""
    log = tmp_path / "up.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "xserv_cli", "up", "--port", "0", "--grpc-port", "0", "--workers", "1",
         "--threads", "4", "--num-kv-blocks", "64", "--max-model-len", "512", "--ready-timeout", "120"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    try:
        banner = [process.stdout.readline() for _ in range(3)]
        rest_url = banner[1].split()[-1]  # "  OpenAI REST  http://127.0.0.1:PORT/v1"
        grpc_address = banner[2].split()[1]  # "  gRPC         127.0.0.1:PORT  (grpcurl ...)"
        assert not rest_url.endswith(":0/v1") and not grpc_address.endswith(":0"), banner
        client = openai.OpenAI(base_url=rest_url, api_key="unused", max_retries=0, timeout=60)
        reply = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=4,
                                               messages=[{"role": "user", "content": "Hi"}])
        assert reply.choices[0].finish_reason == "length"
        with grpc.insecure_channel(grpc_address) as channel:
            info = engine_pb2_grpc.EngineServiceStub(channel).GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=10)
        assert info.model_id == reply.model
    finally:
        process.send_signal(signal.SIGINT)
        code = process.wait(timeout=90)
    assert code == 0  # Ctrl-C: both drained and stopped
    said = log.read_text()
    assert "INFO xserv.engine.startup: warming up: " in said and "route=/v1/chat/completions status=200" in said
    assert "route=/health" not in said  # up's readiness probes
    assert "INFO xserv.engine.server: asked to stop (SIGTERM): shutting down cleanly" in said
    assert "received SIG" not in said and "Traceback" not in said
    assert not re.search(r"^[IW]\d{4} ", said, re.MULTILINE)  # grpc's own INFO lines ("I1207 ... Got goaway")
