"""A soak of about two minutes through the real `xserv up`: a few threads send mixed streamed and
non-streamed completions, a third of them abandoned at a random point (seeded). Afterwards every
KV block is free, every request completed or got a clear error, and the engine's RSS growth is
printed (and bounded generously)."""

import collections
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from .processes import completion, rss_mb, running_up, stream_events, wait_blocks_free

pytestmark = [pytest.mark.e2e, pytest.mark.soak]

SOAK_S = 120.0
SOAK_THREADS = 6
SOAK_SEED = 20261130
MAX_NUM_SEQS = 4  # fewer than the threads: some requests wait, and some are abandoned while waiting
RSS_GROWTH_LIMIT_MB = 500
RSS_SAMPLE_S = 10.0


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    with running_up(tmp_path_factory.mktemp("up") / "up.log", "--max-num-seqs", str(MAX_NUM_SEQS)) as process:
        yield process


def soak_one(url: str, rng: random.Random) -> str:
    """One request; returns its outcome: completed, abandoned (by us, on purpose) or http_<status>."""
    stream = rng.random() < 0.5
    abandon = rng.random() < 1 / 3
    max_tokens = rng.randint(4, 48)
    prompt = " ".join(rng.choice(("red", "sky", "tree", "zebra", "noon", "42")) for _ in range(rng.randint(1, 40)))
    fields = {"prompt": prompt, "max_tokens": max_tokens, "temperature": rng.choice((0, 0.8)), "seed": rng.randint(0, 99)}
    if not stream:
        try:
            response = completion(url, timeout=rng.uniform(0.05, 1.0) if abandon else 120, **fields)
        except requests.ReadTimeout:
            return "abandoned"
        if response.status_code != 200:
            return f"http_{response.status_code}"
        assert response.json()["choices"][0]["finish_reason"] == "length"
        return "completed"
    cut_after = rng.randint(1, max_tokens) if abandon else None
    with completion(url, stream=True, **fields) as response:
        if response.status_code != 200:
            return f"http_{response.status_code}"
        events = []
        for event in stream_events(response):
            events.append(event)
            if cut_after is not None and len(events) >= cut_after:
                return "abandoned"  # leaving the `with` closes the connection mid-stream
    assert events[-1] == "[DONE]", events[-3:]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    return "completed"


def test_soak_mixed_and_abandoned_requests_leak_nothing(up):
    completion(up.url)  # warm every path before measuring memory
    engine_pid = up.engine_pid()
    rss_before = rss_mb(engine_pid)
    outcomes = collections.Counter()
    lock = threading.Lock()
    end = time.monotonic() + SOAK_S

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < end:
            outcome = soak_one(up.url, rng)
            with lock:
                outcomes[outcome] += 1
            if outcome == "http_429":
                time.sleep(1)  # as Retry-After says

    started = time.monotonic()
    rss_samples = []  # every RSS_SAMPLE_S: a plateau is warm-up, a steady climb a leak
    with ThreadPoolExecutor(SOAK_THREADS) as pool:
        futures = [pool.submit(worker, SOAK_SEED + i) for i in range(SOAK_THREADS)]
        while not all(f.done() for f in futures) and time.monotonic() - started < SOAK_S + 180:
            rss_samples.append(round(rss_mb(engine_pid)))
            time.sleep(RSS_SAMPLE_S)
        for future in futures:
            future.result(timeout=1)
    elapsed = time.monotonic() - started
    info = wait_blocks_free(up.engine, timeout_s=5)
    rss_after = rss_mb(engine_pid)
    print(f"soak {elapsed:.0f} s x {SOAK_THREADS} threads: {sum(outcomes.values())} requests {dict(outcomes)}; "
          f"engine RSS {rss_before:.0f} -> {rss_after:.0f} MB ({rss_after - rss_before:+.0f} MB); "
          f"kv blocks free {info.kv_blocks_free}/{info.kv_blocks_total}; RSS every {RSS_SAMPLE_S:.0f} s: {rss_samples}")
    assert info.kv_blocks_free == info.kv_blocks_total and info.num_running == info.num_waiting == 0
    assert set(outcomes) <= {"completed", "abandoned", "http_429"}, outcomes
    assert outcomes["completed"] >= 10 and outcomes["abandoned"] >= 3
    assert rss_after - rss_before < RSS_GROWTH_LIMIT_MB
    assert "xserv.engine.requests" not in up.log_text()  # the engine is quiet at its default log level
