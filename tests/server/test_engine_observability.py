"""The real `xserv engine` with --grpc-token-file, --metrics-port 0 and --log-level info:
the token is enforced, /metrics moves with the engine, each request logs one line with its
x-request-id, and a client deadline aborts the request."""

import re
import time

import grpc
import pytest
import requests
from xserv.v1 import engine_pb2

from .engine_process import start_engine

pytestmark = pytest.mark.e2e

TOKEN = "engine-test-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    token_file = tmp_path_factory.mktemp("auth") / "token"
    token_file.write_text(TOKEN + "\n")
    process = start_engine(tmp_path_factory, "--grpc-token-file", str(token_file), "--metrics-port", "0",
                           "--log-level", "info")
    port = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", process.log_text()).group(1)
    process.metrics_url = f"http://127.0.0.1:{port}/metrics"
    yield process
    assert process.stop() == 0


def generate(engine, max_tokens: int, timeout: float = 60, metadata=AUTH):
    request = engine_pb2.GenerateRequest(text="Hello", params=engine_pb2.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, temperature=0))
    return engine.stub.Generate(request, timeout=timeout, metadata=metadata)


def model_info(engine) -> engine_pb2.GetModelInfoResponse:
    return engine.stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=5, metadata=AUTH)


def scrape(engine) -> dict[str, float]:
    samples = {}
    for line in requests.get(engine.metrics_url, timeout=5).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def wait_blocks_free(engine, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = model_info(engine)
        if info.kv_blocks_free == info.kv_blocks_total and info.num_running == 0:
            return True
        time.sleep(0.05)
    return False


def test_the_token_is_required_but_health_is_open(engine):
    with pytest.raises(grpc.RpcError) as info:
        list(generate(engine, 2, metadata=None))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert engine.health_status() == "SERVING"
    assert list(generate(engine, 2))[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH


def test_metrics_follow_a_long_generation(engine):
    before = scrape(engine)
    assert before["xserv_kv_cache_blocks_used"] == 0
    assert before["xserv_kv_cache_blocks_total"] == 256
    call = generate(engine, 400)
    next(call), next(call)
    busy = scrape(engine)
    assert busy["xserv_kv_cache_blocks_used"] > 0 and busy["xserv_num_requests_running"] == 1
    call.cancel()
    assert wait_blocks_free(engine)
    after = scrape(engine)
    assert after["xserv_kv_cache_blocks_used"] == 0 and after["xserv_num_requests_running"] == 0
    assert after["xserv_generation_tokens_total"] >= before["xserv_generation_tokens_total"] + 2
    assert after['xserv_request_errors_total{code="CANCELLED"}'] >= 1


def logged(engine, text: str, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while text not in engine.log_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    return text in engine.log_text()


def test_each_request_logs_one_line_with_its_x_request_id(engine):
    list(generate(engine, 4, metadata=AUTH + (("x-request-id", "e2e-trace-7"),)))
    assert logged(engine, "request_id=e2e-trace-7 ")
    lines = [line for line in engine.log_text().splitlines() if "request_id=e2e-trace-7 " in line]
    assert len(lines) == 1
    assert (" INFO xserv.engine.requests: request_id=e2e-trace-7 trace_id=e2e-trace-7 status=OK "
            "finish_reason=length ") in lines[0]
    assert "prompt_tokens=1 completion_tokens=4 cached_tokens=" in lines[0] and "peer=ipv4:127.0.0.1:" in lines[0]


def test_a_client_deadline_aborts_the_request(engine):
    with pytest.raises(grpc.RpcError) as info:
        list(generate(engine, 500, timeout=0.3, metadata=AUTH + (("x-request-id", "late-1"),)))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_blocks_free(engine)
    assert logged(engine, "request_id=late-1 trace_id=late-1 status=DEADLINE_EXCEEDED")
