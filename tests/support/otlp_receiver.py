"""A real OTLP trace receiver for tests: opentelemetry-proto's collector TraceService on a free
loopback port, keeping every span exported to it (what an OpenTelemetry Collector or Jaeger
would be handed), with the service.name of the process that sent it."""

import secrets
import threading
import time
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tests.support.processes import free_port


@dataclass(frozen=True)
class ClientTrace:
    """A trace a client started: a test sends it as the `traceparent` header or metadata."""

    trace_id: str = field(default_factory=lambda: secrets.token_hex(16))
    span_id: str = field(default_factory=lambda: secrets.token_hex(8))

    @property
    def traceparent(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-01"


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str  # 32 hex digits, as in a traceparent
    span_id: str
    parent_span_id: str  # "" for a trace's root
    start_ns: int
    end_ns: int
    attributes: dict
    events: tuple[str, ...]


class _Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self):
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        received = [_span(service, span) for resource_spans in request.resource_spans
                    for service in [_service(resource_spans.resource)]
                    for scope_spans in resource_spans.scope_spans for span in scope_spans.spans]
        with self.lock:
            self.spans += received
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    def __init__(self, collector: _Collector, endpoint: str):
        self._collector = collector
        self.endpoint = endpoint  # HOST:PORT, what --otlp-traces-endpoint takes

    def spans(self) -> list[ReceivedSpan]:
        with self._collector.lock:
            return list(self._collector.spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [span for span in self.spans() if span.trace_id == trace_id]

    def wait_for(self, condition, timeout_s: float = 20) -> list[ReceivedSpan]:
        """The spans once condition(spans) holds; the spans so far when the time is up."""
        deadline = time.monotonic() + timeout_s
        while not condition(self.spans()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.spans()


@contextmanager
def otlp_receiver() -> Iterator[OtlpReceiver]:
    collector = _Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    endpoint = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(endpoint)
    server.start()
    try:
        yield OtlpReceiver(collector, endpoint)
    finally:
        server.stop(grace=None)


def _service(resource) -> str:
    return next((a.value.string_value for a in resource.attributes if a.key == "service.name"), "")


def _span(service: str, span) -> ReceivedSpan:
    return ReceivedSpan(service, span.name, span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(),
                        span.start_time_unix_nano, span.end_time_unix_nano,
                        {a.key: _value(a.value) for a in span.attributes}, tuple(e.name for e in span.events))


def _value(value):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(v) for v in value.array_value.values)
    return getattr(value, kind) if kind else None
