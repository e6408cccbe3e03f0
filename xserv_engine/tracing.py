"""OpenTelemetry traces, shared by `xserv engine` and `xserv rest`: off unless
--otlp-traces-endpoint is given, and opentelemetry is imported only then (it is the optional
extra `xserv[otel]`, as in vLLM). Spans go in batches to an OTLP gRPC collector; the trace
context crosses every hop in W3C `traceparent` (HTTP headers, gRPC metadata). Torch-free.
"""

import importlib.util

OTEL_PACKAGES = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.grpc")
INSTALL_HINT = "pip install 'xserv[otel]'"
# Spans leave at most this long after they end: soon enough to read a trace while it is fresh,
# one export call per second at most under load.
EXPORT_DELAY_MS = 1000
TRACE_HEADERS = ("traceparent", "tracestate")


class TracingUnavailable(RuntimeError):
    """--otlp-traces-endpoint without the OpenTelemetry packages."""


def check_available() -> None:
    """Raise TracingUnavailable, naming the extra to install, if the SDK or exporter is missing."""
    if not all(_installed(name) for name in OTEL_PACKAGES):
        raise TracingUnavailable(f"--otlp-traces-endpoint needs the OpenTelemetry SDK and its OTLP exporter: "
                                 f"{INSTALL_HINT}")


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def tracer_provider(endpoint: str, service_name: str):
    """A TracerProvider whose spans are exported to the OTLP gRPC collector at `endpoint`
    (HOST:PORT or http://HOST:PORT: plaintext; https://HOST:PORT: TLS); its shutdown() flushes."""
    check_available()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if "://" not in endpoint:
        endpoint = f"http://{endpoint}"
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"))
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=EXPORT_DELAY_MS))
    return provider


def context_from(carrier: dict[str, str]):
    """The parent context a W3C `traceparent` (and `tracestate`) in `carrier` names; an empty
    context (a new trace) without one."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(carrier)


def current_trace_headers() -> tuple[tuple[str, str], ...]:
    """The current span's context as W3C trace headers (gRPC metadata), () without one."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return tuple(carrier.items())
