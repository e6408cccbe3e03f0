"""Traces through the real `xserv up --otlp-traces-endpoint` on the demo model, received by a real
OTLP collector service in the test: one request is one trace across both processes, the front's
span the parent of the engine's, and a client's `traceparent` header puts it in the client's trace."""

import json

import pytest
import requests

from tests.support.otlp_receiver import ClientTrace
from tests.support.processes import served

pytestmark = pytest.mark.e2e

PHASES = ("queued", "prefill", "decode")


@pytest.fixture(scope="module")
def up(otlp):
    with served("up", "--otlp-traces-endpoint", otlp.endpoint, "--workers", "1", "--num-kv-blocks", "64",
                "--max-model-len", "256") as up:
        yield up


def whole_trace(otlp, http_request_id: str) -> list:
    """The spans of the trace the front's span for this request is in, once the engine's have come."""
    def front(spans):
        return next((s for s in spans if s.attributes.get("xserv.request_id") == http_request_id), None)

    def complete(spans):
        span = front(spans)
        return span is not None and {"llm_request", *PHASES} <= {s.name for s in spans if s.trace_id == span.trace_id}

    return otlp.trace(front(otlp.wait_for(complete)).trace_id)


def test_one_streamed_request_is_one_trace_with_spans_from_both_processes(up, otlp):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True}}
    resp = requests.post(f"{up.url}/v1/chat/completions", json=body, timeout=60)
    usage = json.loads(resp.text.split("data: ")[-2])["usage"]
    spans = {span.name: span for span in whole_trace(otlp, resp.headers["X-Request-Id"])}
    front, engine = spans["POST /v1/chat/completions"], spans["llm_request"]
    assert sorted(spans) == ["POST /v1/chat/completions", "decode", "llm_request", "prefill", "queued"]
    assert (front.service, engine.service) == ("xserv-rest", "xserv-engine")
    assert front.parent_span_id == "" and engine.parent_span_id == front.span_id
    assert all(spans[phase].parent_span_id == engine.span_id for phase in PHASES)
    assert front.attributes["http.response.status_code"] == 200
    assert front.attributes["gen_ai.usage.prompt_tokens"] == engine.attributes["gen_ai.usage.prompt_tokens"] \
        == usage["prompt_tokens"]
    assert front.attributes["gen_ai.usage.completion_tokens"] == usage["completion_tokens"] == 6
    assert engine.attributes["gen_ai.response.finish_reasons"] == ("length",)
    # where the time went, in order, inside the front's span
    queued, prefill, decode = (spans[phase] for phase in PHASES)
    assert front.start_ns <= engine.start_ns <= queued.start_ns <= queued.end_ns <= prefill.start_ns
    assert prefill.end_ns <= decode.start_ns <= decode.end_ns <= engine.end_ns <= front.end_ns
    assert engine.events == ("first_token", "finished")


def test_a_client_traceparent_puts_both_processes_spans_in_the_clients_trace(up, otlp):
    caller = ClientTrace()
    resp = requests.post(f"{up.url}/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4},
                         headers={"traceparent": caller.traceparent}, timeout=60)
    assert resp.status_code == 200
    spans = whole_trace(otlp, resp.headers["X-Request-Id"])
    front = next(span for span in spans if span.name == "POST /v1/completions")
    assert {span.trace_id for span in spans} == {caller.trace_id}
    assert front.parent_span_id == caller.span_id
    assert {span.service for span in spans} == {"xserv-rest", "xserv-engine"}
