"""`xserv rest` with its default workers and threads holds 256 streams at once: none of them
waits in the front for another to finish."""

import json
import socket
import threading
import time

import pytest

from tests.support.processes import served

pytestmark = pytest.mark.e2e

STREAMS = 256
HOLD_FRAMES = 30  # each stream is read for ~3 s (the fake sends a frame every 0.1 s)


@pytest.fixture(scope="module")
def default_front(fake):
    fake.engine.slow_interval_s = 0.1
    with served("rest", "--engine", fake.address, "--log-level", "error", timeout_s=30) as front:
        yield front.port


def hold_stream(port: int, ttfts: list, index: int) -> None:
    body = json.dumps({"prompt": "slow", "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        start = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        data = b""
        while b"data: " not in data:
            data += sock.recv(65536)
        ttfts[index] = time.monotonic() - start
        while data.count(b"data: ") < HOLD_FRAMES:
            data += sock.recv(65536)


def test_default_front_holds_256_streams_at_once(default_front):
    ttfts = [None] * STREAMS
    threads = [threading.Thread(target=hold_stream, args=(default_front, ttfts, i)) for i in range(STREAMS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # A stream that had to wait for another to end would see its first frame after >= 3 s.
    assert None not in ttfts and max(ttfts) < 2.5, sorted(ttfts)[-5:]
