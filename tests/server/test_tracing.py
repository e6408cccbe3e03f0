"""The engine's spans (xserv_engine/server/call_spans.py), exported to a real OTLP receiver, and
--otlp-traces-endpoint without the OpenTelemetry packages: a clear message naming the extra."""

import argparse
import subprocess
import sys

import pytest

from tests.support.otlp_receiver import ClientTrace, otlp_receiver
from xserv_cli import up
from xserv_engine import tracing
from xserv_engine.server import cli as engine_cli
from xserv_engine.server.call_spans import CallSpans
from xserv_engine.server.request_record import CallTimeline
from xserv_rest import cli as rest_cli


def timeline(**changes) -> CallTimeline:
    fields = dict(request_id="req-1", status="OK", started=100.0, scheduled=100.5, first_output=101.0, ended=103.0,
                  prompt_tokens=70, completion_tokens=12, cached_tokens=64, finish_reasons=("length", "stop"))
    return CallTimeline(**{**fields, **changes})


def exported(*calls: CallTimeline, traceparent: str | None = None):
    with otlp_receiver() as otlp:
        spans = CallSpans(otlp.endpoint)
        carrier = {"traceparent": traceparent} if traceparent else {}
        for call in calls:
            spans.export(tracing.context_from(carrier), call)
        spans.shutdown()  # flushes: no waiting for the batch delay
        return otlp.spans()


def test_a_call_is_an_llm_request_span_with_its_phases_beneath_in_the_callers_trace():
    caller = ClientTrace()
    spans = exported(timeline(), traceparent=caller.traceparent)
    by_name = {span.name: span for span in spans}
    assert sorted(by_name) == ["decode", "llm_request", "prefill", "queued"]
    request = by_name["llm_request"]
    assert {span.trace_id for span in spans} == {caller.trace_id} and request.parent_span_id == caller.span_id
    assert {span.service for span in spans} == {"xserv-engine"}
    assert all(by_name[name].parent_span_id == request.span_id for name in ("queued", "prefill", "decode"))
    ms = lambda span: ((span.start_ns - request.start_ns) // 1_000_000, (span.end_ns - request.start_ns) // 1_000_000)
    assert ms(request) == (0, 3000)
    assert (ms(by_name["queued"]), ms(by_name["prefill"]), ms(by_name["decode"])) == ((0, 500), (500, 1000), (1000, 3000))
    assert by_name["prefill"].attributes == {"gen_ai.usage.prompt_tokens": 70, "xserv.cached_prompt_tokens": 64}
    assert by_name["decode"].attributes["gen_ai.response.finish_reasons"] == ("length", "stop")
    assert request.attributes["gen_ai.latency.time_in_queue"] == 0.5
    assert request.attributes["gen_ai.latency.time_to_first_token"] == 1.0
    assert request.attributes["gen_ai.usage.completion_tokens"] == 12 and request.attributes["rpc.grpc.status_code"] == 0
    assert request.events == ("first_token", "finished", "finished")


def test_without_a_traceparent_a_call_starts_its_own_trace():
    [a, b] = [span for span in exported(timeline(), timeline(request_id="req-2")) if span.name == "llm_request"]
    assert a.parent_span_id == b.parent_span_id == "" and a.trace_id != b.trace_id


def test_a_call_cancelled_while_queued_has_only_its_queue_time():
    spans = exported(timeline(status="CANCELLED", scheduled=None, first_output=None, completion_tokens=0,
                              finish_reasons=()))
    queued = next(span for span in spans if span.name == "queued")
    assert sorted(span.name for span in spans) == ["llm_request", "queued"]
    assert queued.end_ns - queued.start_ns == 3_000_000_000


def test_a_call_cut_during_prefill_ends_in_prefill():
    spans = exported(timeline(status="DEADLINE_EXCEEDED", first_output=None, finish_reasons=()))
    assert sorted(span.name for span in spans) == ["llm_request", "prefill", "queued"]


def parser_of(add_arguments) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


@pytest.fixture
def otel_missing(monkeypatch):
    monkeypatch.setattr(tracing, "_installed", lambda name: False)


def test_the_engine_without_the_packages_says_which_extra_to_install(otel_missing, caplog):
    args = parser_of(engine_cli.add_arguments).parse_args(["--otlp-traces-endpoint", "127.0.0.1:4317"])
    assert engine_cli.run(args) == 1
    assert "pip install 'xserv[otel]'" in caplog.text


def test_the_front_and_up_without_the_packages_say_which_extra_to_install(otel_missing):
    args = parser_of(rest_cli.add_arguments).parse_args(["--otlp-traces-endpoint", "127.0.0.1:4317"])
    with pytest.raises(SystemExit, match=r"xserv rest: --otlp-traces-endpoint needs .* pip install 'xserv\[otel\]'"):
        rest_cli.run(args)
    args = parser_of(up.add_arguments).parse_args(["--otlp-traces-endpoint", "127.0.0.1:4317"])
    with pytest.raises(SystemExit, match=r"xserv up: .* pip install 'xserv\[otel\]'"):
        up.run(args)


def test_up_hands_the_endpoint_to_both_processes():
    engine, rest = up.child_commands(parser_of(up.add_arguments).parse_args(["--otlp-traces-endpoint", "h:4317"]))
    assert engine[-2:] == rest[-2:] == ["--otlp-traces-endpoint", "h:4317"]


def test_with_traces_off_nothing_imports_opentelemetry():
    code = ("import sys; from xserv_rest.app import create_app; from xserv_rest.config import RestConfig; "
            "from xserv_rest.engine_client import EngineClient; import xserv_engine.server.serve, xserv_cli.up; "
            "c = RestConfig(responses_store=None); create_app(c, EngineClient.from_config(c)); "
            "sys.exit(any(m.startswith('opentelemetry') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
