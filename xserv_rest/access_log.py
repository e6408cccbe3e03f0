"""Per-request bookkeeping, as the first middleware: the request id, the access log line and the
request metrics.

The id is the client's X-Request-Id when it is 1-128 printable ASCII characters (no spaces),
else a fresh one; it is returned in X-Request-Id on every response and sent to the engine as
x-request-id. The line names the engine's request id too (the answer's "id", which the engine
logs), when there was an engine call. A streamed answer is logged and counted when its body
closes, so its duration covers the whole stream. Probes (GET /health, /metrics: load balancers,
`xserv up`'s readiness checks, Prometheus) are counted like any request but logged at debug, so
that they do not bury the requests in the log.
"""

import logging
import re
import time
import uuid

import falcon

from xserv_rest.metrics import Metrics

log = logging.getLogger("xserv.rest.access")
REQUEST_ID = re.compile(r"^[\x21-\x7e]{1,128}$")
HEADER = "X-Request-Id"
PROBES = frozenset({"/health", "/metrics"})  # routes logged at debug


def request_id_of(req: falcon.Request) -> str:
    given = req.get_header(HEADER)
    return given if given and REQUEST_ID.match(given) else uuid.uuid4().hex


class AccessLog:
    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        req.context.request_id = request_id_of(req)
        req.context.engine_request_id = "-"
        req.context.started = time.monotonic()
        self.metrics.in_flight.inc()

    def process_response(self, req: falcon.Request, resp: falcon.Response, resource, req_succeeded: bool) -> None:
        resp.set_header(HEADER, req.context.request_id)
        record = _Record(self.metrics, req, resp.status_code)
        if resp.stream is None:
            record.finish()
        else:
            resp.stream = ClosingBody(resp.stream, record.finish)


class _Record:
    def __init__(self, metrics: Metrics, req: falcon.Request, status: int):
        self.metrics = metrics
        self.request_id = req.context.request_id
        self.engine_request_id = req.context.engine_request_id
        self.started = req.context.started
        self.method = req.method
        self.route = req.uri_template or "unmatched"
        self.status = status
        self.finished = False

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        duration = time.monotonic() - self.started
        self.metrics.in_flight.dec()
        self.metrics.requests.labels(self.route, self.method, str(self.status)).inc()
        self.metrics.duration.labels(self.route).observe(duration)
        log.log(logging.DEBUG if self.route in PROBES else logging.INFO,
                "request_id=%s method=%s route=%s status=%d duration_ms=%.1f engine_request_id=%s", self.request_id,
                self.method, self.route, self.status, duration * 1000, self.engine_request_id)


class ClosingBody:
    """A WSGI body that calls on_close() when the server closes it (a stream ended or was cut)."""

    def __init__(self, body, on_close):
        self.body = body
        self.on_close = on_close

    def __iter__(self):
        return iter(self.body)

    def close(self) -> None:
        try:
            close = getattr(self.body, "close", None)
            if close is not None:
                close()
        finally:
            self.on_close()
