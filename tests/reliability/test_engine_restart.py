"""`xserv rest` in front of an `xserv engine` that is killed (-9) mid-stream and started again
on the same address: the open stream ends with an error event, requests and /health get 503
while the engine is gone, and the front serves again without a restart."""

import time

import pytest
import requests

from tests.server.engine_process import EngineProcess

from .processes import RestProcess, stream_events

pytestmark = pytest.mark.e2e

RECOVERY_S = 30.0  # from the new engine's SERVING to a request that succeeds through the front


@pytest.fixture
def engine_and_front(tmp_path):
    engine = EngineProcess(log_path=tmp_path / "engine-1.log")
    front = RestProcess(engine.address, "--workers", "1", "--threads", "16")
    engines = [engine]
    try:
        engine.wait_serving()
        wait_status(front.url, 200, timeout_s=60)
        yield engines, front, tmp_path
    finally:
        front.stop()
        for each in engines:
            each.stop()


def wait_status(url: str, status: int, timeout_s: float) -> float:
    """Seconds until GET /health answers `status`; fails after timeout_s."""
    started = time.monotonic()
    while True:
        try:
            if requests.get(f"{url}/health", timeout=5).status_code == status:
                return time.monotonic() - started
        except requests.ConnectionError:
            pass
        assert time.monotonic() - started < timeout_s, f"/health never answered {status}"
        time.sleep(0.1)


def completion(url: str, **fields) -> requests.Response:
    body = {"prompt": "Hello", "max_tokens": 8, "ignore_eos": True, **fields}
    return requests.post(f"{url}/v1/completions", json=body, timeout=30, stream=fields.get("stream", False))


def test_engine_killed_mid_stream_then_restarted(engine_and_front):
    engines, front, tmp_path = engine_and_front
    with completion(front.url, stream=True, max_tokens=400) as response:
        events = stream_events(response)
        next(events), next(events)
        engines[0].proc.kill()
        killed = time.monotonic()
        rest = list(events)
    assert time.monotonic() - killed < 10
    assert "error" in rest[-1] or (rest[-1] == "[DONE]" and "error" in rest[-2]), rest[-2:]
    error = next(e for e in rest if isinstance(e, dict) and "error" in e)["error"]
    assert error["code"] == "engine_unavailable"

    down = completion(front.url)
    assert down.status_code == 503 and down.json()["error"]["code"] == "engine_unavailable"
    assert requests.get(f"{front.url}/health", timeout=5).status_code == 503

    engines.append(EngineProcess(port=engines[0].port, log_path=tmp_path / "engine-2.log"))
    engines[1].wait_serving()
    serving = time.monotonic()
    while True:
        answer = completion(front.url)
        if answer.status_code == 200:
            break
        assert answer.status_code == 503 and time.monotonic() - serving < RECOVERY_S
        time.sleep(0.2)
    print(f"front recovered {time.monotonic() - serving:.1f} s after the new engine was SERVING")
    assert answer.json()["choices"][0]["finish_reason"] == "length"
    assert requests.get(f"{front.url}/health", timeout=5).status_code == 200
