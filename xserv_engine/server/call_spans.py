"""The engine's spans of one Generate call (--otlp-traces-endpoint; xserv_engine/tracing.py).

They are made once, when the call ends, from what its RequestRecord saw (CallTimeline), with
their real start and end times: nothing is added to the per-token path. The call's span is
vLLM's `llm_request` (with vLLM's `gen_ai.*` attributes), a child of the caller's W3C
`traceparent` metadata (the REST front's span, or a client's through SMG); beneath it `queued`
(arrival to the first prefill), `prefill` (to the first token; with the cached prompt tokens)
and `decode` (to the end; with the finish reasons), and the events `first_token` and `finished`.
"""

import time

import grpc

from xserv_engine.server.request_record import CallTimeline
from xserv_engine.tracing import TRACE_HEADERS, context_from, tracer_provider

SERVICE_NAME = "xserv-engine"
_NS = 1_000_000_000


class CallSpans:
    def __init__(self, endpoint: str):
        from opentelemetry import trace

        self._trace = trace
        self._provider = tracer_provider(endpoint, SERVICE_NAME)
        self._tracer = self._provider.get_tracer("xserv.engine")

    def parent_of(self, context: grpc.aio.ServicerContext):
        """The caller's trace context, from its gRPC metadata (a new trace without one)."""
        return context_from({k: v for k, v in context.invocation_metadata() or () if k in TRACE_HEADERS})

    def export(self, parent, call: CallTimeline) -> None:
        """The call's spans, queued for export."""
        at = _epoch_ns_of_monotonic()
        kind = self._trace.SpanKind.SERVER
        request = self._tracer.start_span("llm_request", context=parent, kind=kind, start_time=at(call.started),
                                          attributes=_request_attributes(call))
        if call.status not in ("OK", "CANCELLED"):
            request.set_status(self._trace.Status(self._trace.StatusCode.ERROR, call.status))
        inside = self._trace.set_span_in_context(request)
        for name, start, end, attributes in _phases(call):
            self._tracer.start_span(name, context=inside, start_time=at(start), attributes=attributes).end(at(end))
        if call.first_output is not None:
            request.add_event("first_token", timestamp=at(call.first_output))
        for reason in call.finish_reasons:
            request.add_event("finished", {"finish_reason": reason}, timestamp=at(call.ended))
        request.end(end_time=at(call.ended))

    def shutdown(self) -> None:
        """Export what is still queued, then stop."""
        self._provider.shutdown()


def _phases(call: CallTimeline) -> list[tuple[str, float, float, dict]]:
    """(name, start, end, attributes) of the phases the call went through: queued until its first
    prefill, prefill until its first token, decode until it ended; a call that ended earlier
    (cancelled while queued or prefilling) has the phase it ended in, cut there."""
    prefill = {"gen_ai.usage.prompt_tokens": call.prompt_tokens, "xserv.cached_prompt_tokens": call.cached_tokens}
    decode = {"gen_ai.usage.completion_tokens": call.completion_tokens,
              "gen_ai.response.finish_reasons": call.finish_reasons}
    if call.scheduled is None:
        return [("queued", call.started, call.ended, {})] if call.first_output is None else []
    phases = [("queued", call.started, call.scheduled, {})]
    if call.first_output is None:
        return [*phases, ("prefill", call.scheduled, call.ended, prefill)]
    return [*phases, ("prefill", call.scheduled, call.first_output, prefill),
            ("decode", call.first_output, call.ended, decode)]


def _request_attributes(call: CallTimeline) -> dict:
    attributes = {
        "gen_ai.request.id": call.request_id,
        "gen_ai.usage.prompt_tokens": call.prompt_tokens,
        "gen_ai.usage.completion_tokens": call.completion_tokens,
        "xserv.cached_prompt_tokens": call.cached_tokens,
        "gen_ai.response.finish_reasons": call.finish_reasons,
        "rpc.grpc.status_code": grpc.StatusCode[call.status].value[0],
        "gen_ai.latency.e2e": call.ended - call.started,
    }
    if call.scheduled is not None:
        attributes["gen_ai.latency.time_in_queue"] = call.scheduled - call.started
    if call.first_output is not None:
        attributes["gen_ai.latency.time_to_first_token"] = call.first_output - call.started
        if call.scheduled is not None:
            attributes["gen_ai.latency.time_in_model_prefill"] = call.first_output - call.scheduled
        attributes["gen_ai.latency.time_in_model_decode"] = call.ended - call.first_output
    return attributes


def _epoch_ns_of_monotonic():
    """time.monotonic() seconds -> Unix nanoseconds (what spans carry), by the clocks' offset now."""
    offset_ns = time.time_ns() - time.monotonic_ns()
    return lambda seconds: int(seconds * _NS) + offset_ns
