"""`xserv up --grpc-token --api-key --request-timeout` end to end on the demo model: the front
passes the real engine's token check, clients need the key, X-Request-Id and /metrics work, the
real engine's context-length answer becomes OpenAI's context_length_exceeded, and a request past
its timeout gets 504 while the engine frees its blocks."""

import json
import subprocess
import time

import grpc
import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from xserv.v1 import engine_pb2, engine_pb2_grpc
from tests.support.processes import served

pytestmark = pytest.mark.e2e

KEY = "client-key"
TOKEN = "engine-token"
MAX_MODEL_LEN = 4096  # room for a request far longer than TIMEOUT_S
TIMEOUT_S = 2


@pytest.fixture(scope="module")
def secured():
    with served("up", "--workers", "2", "--threads", "8", "--num-kv-blocks", "256", "--max-model-len",
                str(MAX_MODEL_LEN), "--grpc-token", TOKEN, "--api-key", KEY, "--request-timeout", str(TIMEOUT_S),
                "--log-level", "warning", stdout=subprocess.DEVNULL) as up:
        yield {"url": up.url, "grpc": up.grpc_address}


def test_clients_need_the_key_and_the_front_has_the_engine_token(secured):
    sdk = openai.OpenAI(base_url=secured["url"] + "/v1", api_key=KEY, max_retries=0, timeout=120)
    answer = sdk.chat.completions.create(model=sdk.models.list().data[0].id, max_tokens=4,
                                         messages=[{"role": "user", "content": "Hello"}])
    assert answer.usage.completion_tokens == 4
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=secured["url"] + "/v1", api_key="wrong", max_retries=0).models.list()
    with grpc.insecure_channel(secured["grpc"]) as channel:
        with pytest.raises(grpc.RpcError) as info:
            engine_pb2_grpc.EngineServiceStub(channel).GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_request_id_context_length_and_metrics(secured):
    auth = {"Authorization": f"Bearer {KEY}", "X-Request-Id": "e2e-7"}
    resp = requests.post(secured["url"] + "/v1/chat/completions", headers=auth, timeout=120, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": MAX_MODEL_LEN})
    assert resp.status_code == 400 and resp.headers["x-request-id"] == "e2e-7"
    error = resp.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "max_tokens")
    assert f"maximum context length is {MAX_MODEL_LEN}" in error["message"]
    before = metrics(secured["url"])
    for _ in range(3):
        requests.post(secured["url"] + "/v1/completions", headers=auth, timeout=120,
                      json={"prompt": "Hi", "max_tokens": 3, "stream": True}).raise_for_status()
    # a streamed request is counted when its response generator closes, which may come just after
    # the client has read the last byte: wait (bounded) for the third one
    after = metrics_when(secured["url"], lambda m: m.get(("xserv_rest_requests_total", "/v1/completions", "200")) == 3)
    assert after["xserv_rest_time_to_first_token_seconds_count"] - before["xserv_rest_time_to_first_token_seconds_count"] == 3
    assert after["xserv_rest_inter_token_latency_seconds_count"] > before["xserv_rest_inter_token_latency_seconds_count"]
    assert after[("xserv_rest_requests_total", "/v1/chat/completions", "400")] == 1
    assert after[("xserv_rest_requests_total", "/v1/completions", "200")] == 3


def metrics_when(url: str, ready, timeout_s: float = 5.0) -> dict:
    """The metrics once `ready(metrics)` holds, or as they are after timeout_s."""
    deadline = time.monotonic() + timeout_s
    found = metrics(url)
    while not ready(found) and time.monotonic() < deadline:
        time.sleep(0.05)
        found = metrics(url)
    return found


def metrics(url: str) -> dict:
    """Unlabelled samples by name; request counts by (name, route, status)."""
    found = {}
    for family in text_string_to_metric_families(requests.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if not sample.labels:
                found[sample.name] = sample.value
            elif sample.name == "xserv_rest_requests_total":
                found[(sample.name, sample.labels["route"], sample.labels["status"])] = sample.value
    return found


def blocks_back(grpc_address: str, timeout_s: float) -> bool:
    with grpc.insecure_channel(grpc_address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=10,
                                     metadata=(("authorization", f"Bearer {TOKEN}"),))
            if info.kv_blocks_free == info.kv_blocks_total and info.num_running == 0:
                return True
            time.sleep(0.05)
    return False


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_past_the_timeout_gets_504_and_the_engine_frees_it(secured, stream):
    """3500 tokens take the CPU demo engine far longer than the 2 s timeout (~2 ms a token)."""
    started = time.monotonic()
    resp = requests.post(secured["url"] + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                         timeout=60, json={"prompt": "Once", "max_tokens": 3500, "ignore_eos": True, "stream": stream})
    elapsed = time.monotonic() - started
    if stream:
        assert resp.status_code == 200
        last = resp.content.split(b"\n\n")[-2]
        error = json.loads(last[len(b"data: "):])["error"]
    else:
        assert resp.status_code == 504
        error = resp.json()["error"]
    assert (error["type"], error["code"]) == ("timeout", "request_timeout")
    assert TIMEOUT_S - 0.5 <= elapsed < TIMEOUT_S + 3
    assert blocks_back(secured["grpc"], timeout_s=2)
