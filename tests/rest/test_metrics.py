"""GET /metrics: request counts, in-flight requests, TTFT and inter-token latency histograms and
stream errors, added up over every gunicorn worker of `xserv rest`."""

import os
import threading

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.support.processes import served

from .conftest import make_client
from .test_errors import chat


def samples(text: str) -> dict[tuple, float]:
    """{(sample name, sorted label items): value}"""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(found: dict, name: str, **labels) -> float:
    return found.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_after_some_requests(fake):
    client = make_client(fake)
    client.simulate_post("/v1/chat/completions", json=chat("hi"))
    client.simulate_post("/v1/chat/completions", json=chat("hi", stream=True))
    client.simulate_post("/v1/completions", json={"prompt": "midstream", "stream": True})
    client.simulate_post("/v1/completions", json={"prompt": "hi", "n": 99})
    resp = client.simulate_get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    found = samples(resp.text)
    chat_ok = dict(route="/v1/chat/completions", method="POST", status="200")
    assert value(found, "xserv_rest_requests_total", **chat_ok) == 2
    assert value(found, "xserv_rest_requests_total", route="/v1/completions", method="POST", status="400") == 1
    assert value(found, "xserv_rest_requests_in_flight") == 1  # this /metrics request
    assert value(found, "xserv_rest_time_to_first_token_seconds_count") == 3
    assert value(found, "xserv_rest_inter_token_latency_seconds_count") == 2 * 3  # HELLO: 4 tokens, 3 gaps
    assert value(found, "xserv_rest_stream_errors_total", code="engine_unavailable") == 1
    assert value(found, "xserv_rest_request_duration_seconds_count", route="/v1/chat/completions") == 2


def front_with_tmpdir(fake, tmp_path, workers: int):
    """`xserv rest --workers N --threads 2` (a worker takes at most 2 connections at once), with
    the test's own TMPDIR, to see the metrics directory come and go."""
    return served("rest", "--engine", fake.address, "--workers", str(workers), "--threads", "2",
                  "--log-level", "warning", timeout_s=30, env=dict(os.environ, TMPDIR=str(tmp_path)))


@pytest.fixture
def two_worker_front(fake, tmp_path):
    with front_with_tmpdir(fake, tmp_path, workers=2) as front:
        yield front.url


def test_metrics_add_up_all_workers(two_worker_front, tmp_path):
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("xserv-rest-metrics-")]
    replies = []

    def one() -> None:  # ~1 s each: 4 at once need both workers
        replies.append(requests.post(two_worker_front + "/v1/chat/completions", json=chat("pause"), timeout=30))

    threads = [threading.Thread(target=one) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [r.status_code for r in replies] == [200] * 4
    for _ in range(4):  # whichever worker answers, it reports both
        found = samples(requests.get(two_worker_front + "/metrics", timeout=10).text)
        assert value(found, "xserv_rest_requests_total", route="/v1/chat/completions", method="POST",
                     status="200") == 4
        assert value(found, "xserv_rest_time_to_first_token_seconds_count") == 4
        assert value(found, "xserv_rest_time_to_first_token_seconds_bucket", le="0.75") == 0  # the fake paused 1 s
        assert value(found, "xserv_rest_requests_in_flight") == 1


@pytest.mark.e2e
def test_the_metrics_directory_is_removed_on_exit(fake, tmp_path):
    with front_with_tmpdir(fake, tmp_path, workers=1) as front:
        assert len(list(tmp_path.iterdir())) == 1
    assert front.process.returncode == 0 and list(tmp_path.iterdir()) == []
