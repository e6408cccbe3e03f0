"""Priority scheduling end to end: a real `xserv engine --scheduling-policy priority` on the demo
model, flooded with low-priority streams (more than its batch holds), serves a high-priority
request's first token within a small multiple of an idle engine's time to first token, while a
request of the flood's own priority, sent at the same moment, waits its turn behind the flood."""

import statistics
import threading
import time

import grpc
import pytest
from xserv.v1 import engine_pb2

from .engine_process import start_engine

pytestmark = pytest.mark.e2e

SLOTS = 4  # --max-num-seqs
FLOOD = 16  # low-priority streams: four batches' worth
FLOOD_TOKENS = 48
LOW, HIGH = 10, -1


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    process = start_engine(tmp_path_factory, "--scheduling-policy", "priority", "--max-num-seqs", str(SLOTS))
    yield process
    assert process.stop() == 0


def request(priority: int, max_tokens: int) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(text="Tell me about priority scheduling.", priority=priority,
                                      params=engine_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                       temperature=0))


def ttft(engine, priority: int, max_tokens: int = 4) -> float:
    """Seconds from the call to its first message; the rest of the stream is read too."""
    start = time.monotonic()
    call = engine.stub.Generate(request(priority, max_tokens), timeout=120)
    next(call)
    first = time.monotonic() - start
    for _ in call:
        pass
    return first


def wait_until(predicate, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_high_priority_request_jumps_a_flood_of_low_priority_streams(engine):
    idle = statistics.median(ttft(engine, HIGH) for _ in range(3))
    finished = []
    flood = [threading.Thread(target=lambda: finished.append(ttft(engine, LOW, FLOOD_TOKENS)), daemon=True)
             for _ in range(FLOOD)]
    try:
        for thread in flood:
            thread.start()
        wait_until(lambda: engine.model_info().num_waiting >= FLOOD - SLOTS - 2, timeout_s=30)
        results: dict[str, float] = {}
        same = threading.Thread(target=lambda: results.update(same=ttft(engine, LOW)), daemon=True)
        same.start()  # arrives with the high one, after the whole flood
        results["high"] = ttft(engine, HIGH)
        same.join(timeout=120)
    finally:
        for thread in flood:
            thread.join(timeout=120)
    assert len(finished) == FLOOD and not same.is_alive()  # every stream ended; nothing hangs
    print(f"TTFT idle {idle * 1000:.0f} ms, high priority under the flood {results['high'] * 1000:.0f} ms, "
          f"the flood's own priority {results['same'] * 1000:.0f} ms")
    assert results["high"] < 4 * idle + 0.1  # a step or two more than idle, not the queue's length
    assert results["same"] > 5 * results["high"]  # the flood was real: its own priority waited behind it
    assert engine.wait_all_blocks_free().kv_blocks_free == engine.model_info().kv_blocks_total
