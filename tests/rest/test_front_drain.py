"""SIGTERM to `xserv rest` while a stream runs: the stream gets --drain-grace seconds to finish
(gunicorn's graceful timeout), the same grace `xserv up` gives the engine."""

import signal
import time

import pytest
import requests

from tests.support.processes import served

from .fake_grpc_engine import MODEL_ID, FakeEngineServer

pytestmark = pytest.mark.e2e

STREAM_S = 6.0  # the fake engine's "slow" stream: 300 tokens, one every 20 ms


@pytest.fixture(scope="module")
def fake():
    server = FakeEngineServer()
    server.engine.slow_interval_s = STREAM_S / 300
    yield server
    server.stop()


def stream_through_a_drain(fake: FakeEngineServer, drain_grace_s: float) -> tuple[bytes, float]:
    """A stream of STREAM_S seconds, the front signalled after its first chunk: the body the
    client got, and how long after the signal it ended."""
    with served("rest", "--engine", fake.address, "--workers", "1", "--drain-grace", str(drain_grace_s),
                "--log-level", "warning", timeout_s=30) as front:
        body = {"model": MODEL_ID, "prompt": "slow", "stream": True}
        with requests.post(f"{front.url}/v1/completions", json=body, stream=True, timeout=60) as response:
            chunks = response.iter_content(None)
            received = next(chunks)
            front.process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            try:
                for chunk in chunks:
                    received += chunk
            except requests.exceptions.ChunkedEncodingError:  # cut off mid-stream
                pass
            return received, time.monotonic() - signalled


def test_a_stream_finishes_within_the_drain_grace(fake):
    received, _ = stream_through_a_drain(fake, drain_grace_s=3 * STREAM_S)
    assert received.endswith(b"data: [DONE]\n\n"), received[-200:]


def test_a_stream_past_the_drain_grace_is_cut_at_it(fake):
    received, took_s = stream_through_a_drain(fake, drain_grace_s=1)
    assert not received.endswith(b"data: [DONE]\n\n")
    assert took_s < STREAM_S / 2
