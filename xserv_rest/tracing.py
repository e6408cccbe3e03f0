"""The front's span of each HTTP request (--otlp-traces-endpoint; xserv_engine/tracing.py), as a
Falcon middleware added only when traces are on.

A client's W3C `traceparent` header makes the span its child; otherwise it starts a trace. The
span is the current context while the resource runs, so the engine calls it starts carry it in
their gRPC metadata (EngineClient, with current_trace_headers) and the engine's spans are its
children. It ends when the answer does (a stream's body closed), with the route, the status and
the tokens the engine reported.
"""

import falcon

from xserv_engine.tracing import TRACE_HEADERS, context_from, tracer_provider
from xserv_rest.access_log import ClosingBody

SERVICE_NAME = "xserv-rest"
API_PATHS = ("/v1/", "/v2/")


class Tracing:
    def __init__(self, endpoint: str):
        from opentelemetry import context, trace

        self._context, self._trace = context, trace
        self._tracer = tracer_provider(endpoint, SERVICE_NAME).get_tracer("xserv.rest")

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        if req.method == "GET" and not req.path.startswith(API_PATHS):
            return  # probes and pages (/health, /metrics, /openapi.json, the chat page): no trace
        parent = context_from({name: req.get_header(name) for name in TRACE_HEADERS if req.get_header(name)})
        span = self._tracer.start_span(f"{req.method} {req.path}", context=parent, kind=self._trace.SpanKind.SERVER,
                                       attributes={"http.request.method": req.method, "url.path": req.path})
        req.context.span = span
        req.context.span_token = self._context.attach(self._trace.set_span_in_context(span))

    def process_response(self, req: falcon.Request, resp: falcon.Response, resource, req_succeeded: bool) -> None:
        span = getattr(req.context, "span", None)
        if span is None:  # not traced, or a middleware before this one refused the request
            return
        self._context.detach(req.context.span_token)
        route = req.uri_template or "unmatched"
        span.update_name(f"{req.method} {route}")
        span.set_attributes({"http.route": route, "http.response.status_code": resp.status_code,
                             "xserv.request_id": req.context.request_id})
        if resp.status_code >= 500:
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR))
        generation = getattr(req.context, "generation", None)  # a resource that called Generate sets it

        def end() -> None:
            if generation is not None:
                usage = generation.usage
                span.set_attributes({"gen_ai.usage.prompt_tokens": usage.prompt_tokens,
                                     "gen_ai.usage.completion_tokens": usage.completion_tokens})
            span.end()

        if resp.stream is None:
            end()
        else:
            resp.stream = ClosingBody(resp.stream, end)
