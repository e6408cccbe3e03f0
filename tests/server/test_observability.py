"""One log line per Generate call (with the caller's x-request-id) and the /metrics endpoint,
in front of the fake engine."""

import logging
import time
from types import SimpleNamespace

import grpc
import pytest
import requests
from xserv.v1 import engine_pb2

from xserv_engine.outputs import RequestOutput
from xserv_engine.server.metrics import EngineMetrics
from xserv_engine.server.request_record import RequestRecord

from .fake_engine import FakeEngine
from .harness import ServerThread


@pytest.fixture
def served():
    server = ServerThread()
    engine = FakeEngine(total_blocks=64, max_queued=2)
    server.load(engine)
    port = server.server.metrics.serve("127.0.0.1", 0)
    yield server, f"http://127.0.0.1:{port}/metrics"
    server.server.metrics.stop()
    server.close()


def generate(server, max_tokens=3, timeout=10, **fields):
    request = engine_pb2.GenerateRequest(params=engine_pb2.SamplingParams(max_tokens=max_tokens),
                                         **{"text": "a b c", **fields})
    return server.stub.Generate(request, timeout=timeout, metadata=(("x-request-id", "trace-42"),))


def scrape(url: str) -> dict[str, float]:
    """Prometheus text -> {"name{labels}": value}."""
    samples = {}
    for line in requests.get(url, timeout=5).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_x_request_id_becomes_the_request_id_and_is_logged_once(served, caplog):
    server, _ = served
    caplog.set_level(logging.INFO, logger="xserv.engine.requests")
    messages = list(generate(server))
    assert {m.request_id for m in messages} == {"trace-42"}
    lines = [r.getMessage() for r in caplog.records if r.name == "xserv.engine.requests"]
    assert len(lines) == 1
    assert lines[0].startswith("request_id=trace-42 trace_id=trace-42 status=OK finish_reason=length prompt_tokens=3 "
                               "completion_tokens=3 cached_tokens=0 ttft_ms=")
    assert "duration_ms=" in lines[0] and "peer=ipv" in lines[0]


def test_a_request_id_field_wins_over_the_metadata(served):
    server, _ = served
    assert {m.request_id for m in generate(server, request_id="field-1")} == {"field-1"}


def test_failed_calls_are_logged_with_their_status(served, caplog):
    server, _ = served
    caplog.set_level(logging.INFO, logger="xserv.engine.requests")
    with pytest.raises(grpc.RpcError):
        list(generate(server, max_tokens=1000, timeout=0.2))
    deadline = time.monotonic() + 5  # the server ends the call a moment after the client gives up
    while not (lines := [r.getMessage() for r in caplog.records if r.name == "xserv.engine.requests"]):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert lines[0].startswith("request_id=trace-42 trace_id=trace-42 status=DEADLINE_EXCEEDED finish_reason=- ")


def test_metrics_show_the_engine_and_the_requests(served):
    server, url = served
    before = scrape(url)
    assert before["xserv_kv_cache_blocks_total"] == 64 and before["xserv_kv_cache_blocks_used"] == 0
    assert before["xserv_num_requests_running"] == 0 and before["xserv_num_requests_waiting"] == 0
    for name in ("xserv_prefix_cache_hits_total", "xserv_prefix_cache_queries_total",
                 "xserv_generation_tokens_total", "xserv_preemptions_total"):
        assert name in before
    list(generate(server, request_id="ok-1"))
    bad = engine_pb2.GenerateRequest(text="x", params=engine_pb2.SamplingParams(top_p=2))
    with pytest.raises(grpc.RpcError):
        list(server.stub.Generate(bad, timeout=5))
    after = scrape(url)
    assert after['xserv_request_finished_total{finish_reason="length"}'] == 1
    assert after['xserv_request_errors_total{code="INVALID_ARGUMENT"}'] == 1
    assert after["xserv_request_duration_seconds_count"] == 2
    assert after["xserv_time_to_first_token_seconds_count"] == 1


def test_vllm_names_count_each_choice_with_the_model_name(served):
    server, url = served
    request = engine_pb2.GenerateRequest(text="a b c", params=engine_pb2.SamplingParams(max_tokens=3, n=2))
    list(server.stub.Generate(request, timeout=10))
    after = scrape(url)
    labels = 'engine="0",model_name="fake-model"'
    assert after['vllm:request_success_total{engine="0",finished_reason="length",model_name="fake-model"}'] == 2
    assert after[f"vllm:request_generation_tokens_sum{{{labels}}}"] == 6  # 3 tokens in each of 2 choices
    assert after[f"vllm:request_params_n_sum{{{labels}}}"] == 2
    assert after[f"vllm:e2e_request_latency_seconds_count{{{labels}}}"] == 1
    assert after[f"vllm:inter_token_latency_seconds_count{{{labels}}}"] == 2 * 2  # gaps within each choice
    assert after[f"vllm:num_requests_running{{{labels}}}"] == 0


def test_every_token_after_a_choice_s_first_is_one_inter_token_gap_however_outputs_coalesce():
    """A stream that fell behind the engine gets several tokens in one output, the first output
    included: each choice still counts one gap per token after its first (vLLM's ITL count)."""
    metrics = EngineMetrics()
    gaps = []
    metrics.vllm = SimpleNamespace(observe_gap=lambda seconds, tokens: gaps.extend([seconds / tokens] * tokens))
    record = RequestRecord("r", "-", "peer", metrics, n=2)
    for index, token_ids in ((0, (1, 2)), (1, (5,)), (0, (3,)), (1, (6, 7, 8)), (0, (4,))):
        record.observe(RequestOutput("r", index, token_ids=token_ids))
    assert len(gaps) == (4 - 1) + (4 - 1)
    assert gaps[0] == 0.0 and all(g >= 0 for g in gaps)
