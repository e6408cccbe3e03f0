"""X-Request-Id: honoured or generated, returned on every response, sent to the engine, logged."""

import logging

import pytest

from .conftest import make_client
from .test_errors import chat
from .test_metrics import samples, value


def test_a_given_id_is_returned_and_reaches_the_engine(client, fake):
    resp = client.simulate_post("/v1/chat/completions", json=chat("hi"), headers={"X-Request-Id": "trace-42"})
    assert resp.status_code == 200 and resp.headers["x-request-id"] == "trace-42"
    assert fake.engine.metadata[resp.json["id"]]["x-request-id"] == "trace-42"
    resp = client.simulate_post("/v1/completions", json={"prompt": "hi", "stream": True},
                                headers={"X-Request-Id": "trace-43"})
    assert resp.headers["x-request-id"] == "trace-43"
    assert fake.engine.metadata[fake.engine.requests[-1].request_id]["x-request-id"] == "trace-43"


def test_an_id_is_generated_when_absent_or_unusable(client, fake):
    ids = set()
    for header in ({}, {"X-Request-Id": "x" * 129}, {"X-Request-Id": "has space"}, {"X-Request-Id": "é"}):
        resp = client.simulate_post("/v1/chat/completions", json=chat("hi"), headers=header)
        generated = resp.headers["x-request-id"]
        assert len(generated) == 32 and generated not in ids
        assert fake.engine.metadata[resp.json["id"]]["x-request-id"] == generated
        ids.add(generated)


@pytest.mark.parametrize("method, path, body, status", [
    ("GET", "/nope", None, 404),
    ("POST", "/v1/chat/completions", {"messages": []}, 400),
    ("POST", "/v1/completions", {"prompt": "error:overloaded"}, 429),
    ("GET", "/health", None, 200),
])
def test_every_response_carries_the_id(client, method, path, body, status):
    resp = client.simulate_request(method, path, json=body, headers={"X-Request-Id": "abc-1"})
    assert resp.status_code == status and resp.headers["x-request-id"] == "abc-1"


def test_401_carries_the_id(fake):
    locked = make_client(fake, api_keys=("k",))
    resp = locked.simulate_get("/v1/models", headers={"X-Request-Id": "denied-1"})
    assert resp.status_code == 401 and resp.headers["x-request-id"] == "denied-1"


def test_one_access_log_line_per_request(client, caplog):
    with caplog.at_level(logging.INFO, logger="xserv.rest.access"):
        client.simulate_post("/v1/chat/completions", json=chat("hi", stream=True), headers={"X-Request-Id": "log-1"})
        client.simulate_get("/nope", headers={"X-Request-Id": "log-2"})
    lines = [r.getMessage().split() for r in caplog.records if r.name == "xserv.rest.access"]
    assert len(lines) == 2
    assert lines[0][:4] == ["request_id=log-1", "method=POST", "route=/v1/chat/completions", "status=200"]
    assert lines[0][4].startswith("duration_ms=") and lines[0][5].startswith("engine_request_id=chatcmpl-")
    assert lines[1][:4] == ["request_id=log-2", "method=GET", "route=unmatched", "status=404"]
    assert lines[1][5] == "engine_request_id=-"


def test_probes_are_counted_but_logged_only_at_debug(client, caplog):
    """`xserv up` polls /health while it starts; load balancers and Prometheus poll for ever."""
    def counted() -> float:
        found = samples(client.simulate_get("/metrics").text)
        return value(found, "xserv_rest_requests_total", route="/health", method="GET", status="200")

    before = counted()
    with caplog.at_level(logging.INFO, logger="xserv.rest.access"):
        for _ in range(3):
            assert client.simulate_get("/health").status_code == 200
        client.simulate_get("/metrics")
    assert [r for r in caplog.records if r.name == "xserv.rest.access"] == []
    assert counted() == before + 3
    with caplog.at_level(logging.DEBUG, logger="xserv.rest.access"):
        client.simulate_get("/health", headers={"X-Request-Id": "probe-1"})
    assert [r.getMessage().split()[:4] for r in caplog.records if r.name == "xserv.rest.access"] == [
        ["request_id=probe-1", "method=GET", "route=/health", "status=200"]]
