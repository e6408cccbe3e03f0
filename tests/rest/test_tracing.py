"""The front's span of each API request, exported to a real OTLP receiver: its route, status
and tokens, its context sent to the engine in `traceparent` metadata, a client's `traceparent`
header honoured, and no trace headers at all with traces off."""

import json

import pytest

import xserv_rest.tracing
from tests.support.otlp_receiver import ClientTrace
from xserv_engine.tracing import tracer_provider

from .conftest import make_client


@pytest.fixture(scope="module")
def providers(otlp):
    """The tracer providers the traced app made; shut down (flushed) before the receiver stops."""
    made = []
    yield made
    for provider in made:
        provider.shutdown()


@pytest.fixture(scope="module")
def traced(fake, otlp, providers):
    """The app with traces on."""
    def kept(*args):
        providers.append(tracer_provider(*args))
        return providers[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(xserv_rest.tracing, "tracer_provider", kept)
        yield make_client(fake, otlp_traces_endpoint=otlp.endpoint)


def exported(otlp, providers, condition):
    """The spans the receiver holds once condition(spans) holds, the app's ended spans flushed
    first rather than waited for (the batch delay is a second)."""
    for provider in providers:
        provider.force_flush()
    return otlp.wait_for(condition)


def front_span(otlp, providers, request_id: str):
    spans = exported(otlp, providers, lambda spans: any(s.attributes.get("xserv.request_id") == request_id
                                                        for s in spans))
    return next(s for s in spans if s.attributes.get("xserv.request_id") == request_id)


def test_a_completion_span_has_route_status_and_tokens_and_is_the_engine_calls_parent(
        traced, fake, otlp, providers):
    resp = traced.simulate_post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                              "stream": True, "stream_options": {"include_usage": True}})
    assert resp.status_code == 200
    usage = json.loads(resp.text.split("data: ")[-2])["usage"]
    span = front_span(otlp, providers, resp.headers["X-Request-Id"])
    assert (span.service, span.name, span.parent_span_id) == ("xserv-rest", "POST /v1/chat/completions", "")
    assert span.attributes["http.route"] == "/v1/chat/completions"
    assert span.attributes["http.response.status_code"] == 200
    assert span.attributes["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"] > 0
    assert span.attributes["gen_ai.usage.completion_tokens"] == usage["completion_tokens"] > 0
    metadata = fake.engine.metadata[fake.engine.requests[-1].request_id]
    assert metadata["traceparent"].startswith(f"00-{span.trace_id}-{span.span_id}-")


def test_a_client_traceparent_header_makes_the_span_its_child(traced, fake, otlp, providers):
    caller = ClientTrace()
    resp = traced.simulate_post("/v1/completions", json={"prompt": "Hi"},
                                headers={"traceparent": caller.traceparent})
    span = front_span(otlp, providers, resp.headers["X-Request-Id"])
    assert (span.trace_id, span.parent_span_id) == (caller.trace_id, caller.span_id)
    assert fake.engine.metadata[resp.json["id"]]["traceparent"].startswith(f"00-{caller.trace_id}-{span.span_id}")


def test_an_error_answer_is_traced_with_its_status(traced, otlp, providers):
    resp = traced.simulate_post("/v1/completions", json={"prompt": "Hi", "top_p": 7})
    assert resp.status_code == 400
    assert front_span(otlp, providers, resp.headers["X-Request-Id"]).attributes["http.response.status_code"] == 400


def test_probes_are_not_traced(traced, otlp, providers):
    resp = traced.simulate_get("/health")
    traced.simulate_post("/v1/completions", json={"prompt": "Hi"})  # a span that is flushed with it
    spans = exported(otlp, providers, lambda spans: len(spans) >= 1)
    assert resp.headers["X-Request-Id"] not in {s.attributes.get("xserv.request_id") for s in spans}


def test_with_traces_off_no_trace_metadata_reaches_the_engine(client, fake):
    caller = ClientTrace()
    resp = client.simulate_post("/v1/completions", json={"prompt": "Hi"},
                                headers={"traceparent": caller.traceparent})
    assert "traceparent" not in fake.engine.metadata[resp.json["id"]]
