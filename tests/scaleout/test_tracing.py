"""A client's `traceparent` through the SGLang Model Gateway (`smg launch`, smg 1.13) to an engine
started with --otlp-traces-endpoint, received by a real OTLP collector service in the test.

smg passes a trace context to its workers only with its own tracing on (`--enable-trace
--otlp-traces-endpoint`): then the engine's spans are in the client's trace, beneath smg's. Without
it smg sends no `traceparent`, and each engine call starts a trace of its own (docs/scale-out.md).
"""

import pytest
import requests

from tests.scaleout.gateway import Gateway
from tests.server.engine_process import started_engines
from tests.support.otlp_receiver import ClientTrace

pytestmark = pytest.mark.e2e

MODEL = "xserv-demo-qwen3-random"


@pytest.fixture(scope="module")
def engine(otlp, tmp_path_factory):
    with started_engines(1, "--otlp-traces-endpoint", otlp.endpoint,
                         logs=tmp_path_factory.mktemp("engines")) as [engine]:
        yield engine


def engine_span_of_one_chat(engine, otlp, tmp_path, caller: ClientTrace, *smg_flags: str):
    """Send one chat with the caller's traceparent through a new smg; the engine's llm_request span
    of it."""
    smg = Gateway([engine.address], *smg_flags, log_path=tmp_path / "smg.log")
    try:
        smg.wait_ready(MODEL, workers=1)
        before = sum(span.name == "llm_request" for span in otlp.spans())
        resp = requests.post(f"{smg.url}/v1/chat/completions", timeout=60,
                             headers={"traceparent": caller.traceparent},
                             json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert resp.status_code == 200
        spans = otlp.wait_for(lambda spans: sum(span.name == "llm_request" for span in spans) > before)
    finally:
        smg.stop()
    return [span for span in spans if span.name == "llm_request"][before]


def test_smg_without_its_tracing_does_not_pass_the_client_trace_on(engine, otlp, tmp_path):
    caller = ClientTrace()
    request = engine_span_of_one_chat(engine, otlp, tmp_path, caller)
    assert request.trace_id != caller.trace_id and request.parent_span_id == ""  # a trace of its own


def test_smg_with_its_tracing_on_puts_the_engine_spans_in_the_clients_trace(engine, otlp, tmp_path):
    caller = ClientTrace()
    request = engine_span_of_one_chat(engine, otlp, tmp_path, caller, "--enable-trace",
                                      "--otlp-traces-endpoint", otlp.endpoint)
    assert request.trace_id == caller.trace_id
    spans = otlp.wait_for(lambda spans: any(s.service == "smg" and s.trace_id == caller.trace_id for s in spans))
    in_trace = [span for span in spans if span.trace_id == caller.trace_id]
    assert {span.service for span in in_trace} == {"smg", "xserv-engine"}
    smg_root = next(s for s in in_trace if s.service == "smg" and s.parent_span_id == caller.span_id)
    assert smg_root.name == "http_request" and request.parent_span_id != caller.span_id  # beneath smg's spans
