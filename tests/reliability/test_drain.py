"""SIGTERM to the real `xserv up` while a long stream runs: the stream finishes within the drain
grace, the engine and the front refuse new work meanwhile, and every process exits 0 leaving
nothing behind."""

import signal
import time

import grpc
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc
from xserv.v1 import engine_pb2

from .processes import alive, child_pids, completion, running_up, stream_events

pytestmark = pytest.mark.e2e

# a stream that is still running after the checks below: one stream decodes at 80-250 tok/s on
# 2 CPU cores (120 tokens once ended before the first check), and ends within the grace even
# when the parallel test worker slows it several-fold (at 30 s, once it did not, in CI)
DRAIN_GRACE_S = 120
STREAM_TOKENS = 1200
CONTEXT = "2048"  # for it (running_up's default is 512)


@pytest.fixture
def up(tmp_path):
    with running_up(tmp_path / "up.log", "--drain-grace", str(DRAIN_GRACE_S), "--max-model-len", CONTEXT) as process:
        yield process


def test_sigterm_lets_the_running_stream_finish_then_everything_exits(up):
    processes = child_pids(up.proc.pid)
    processes += [g for c in processes for g in child_pids(c)]  # + the gunicorn worker
    health = health_pb2_grpc.HealthStub(up.channel)
    with completion(up.url, stream=True, max_tokens=STREAM_TOKENS) as response:
        assert response.status_code == 200, response.text
        events = stream_events(response)
        next(events)
        up.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.5)
        engine_health = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
        with pytest.raises(grpc.RpcError) as refused:
            list(up.engine.Generate(engine_pb2.GenerateRequest(text="hi"), timeout=5))
        rest = list(events)
    assert rest[-1] == "[DONE]" and rest[-2]["choices"][0]["finish_reason"] == "length", (rest[-1], up.log_text()[-4000:])
    assert time.monotonic() - signalled < DRAIN_GRACE_S
    assert engine_health == health_pb2.HealthCheckResponse.NOT_SERVING
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert up.proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 10
    while any(alive(p) for p in processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in processes)
    assert "xserv.engine.server: stopped" in up.log_text()


def test_new_requests_during_the_drain_are_answered_at_once(up):
    with completion(up.url, stream=True, max_tokens=STREAM_TOKENS) as response:
        events = stream_events(response)  # kept open: the stream must stay in flight
        next(events)
        up.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        seen = new_http_requests(up.url)
        rest = list(events)
        # once in CI (2026-12-06) the running stream ended in engine_unavailable instead; the log says why
        assert rest[-1] == "[DONE]", (rest[-1], up.log_text()[-4000:])
    assert set(seen) <= {503, "refused"}, seen


def new_http_requests(url: str) -> list:
    """What /health and a new completion get while the front drains: status codes or "refused"."""
    seen = []
    for send in (lambda: requests.get(f"{url}/health", timeout=3), lambda: completion(url, timeout=3)):
        try:
            seen.append(send().status_code)
        except requests.ConnectionError:
            seen.append("refused")
        except requests.Timeout:
            seen.append("no answer in 3 s")
    return seen
