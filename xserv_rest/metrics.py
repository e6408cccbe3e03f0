"""The front's Prometheus metrics, served at GET /metrics.

Under `xserv rest` every gunicorn worker writes its values to files in the multiprocess
directory the CLI made (prometheus-client's multiprocess mode), and /metrics, whichever worker
answers it, adds up all workers. Without that directory (tests, a bare WSGI server) it shows
this process only.
"""

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import multiprocess

# Seconds. TTFT spans a queued request on a busy engine; inter-token gaps are one decode step.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """One per app. `route` labels are URI templates ("unmatched" for unknown paths), so their
    number is bounded."""

    def __init__(self, multiprocess_dir: str | None = None):
        self.multiprocess_dir = multiprocess_dir
        self.registry = CollectorRegistry()
        self.requests = Counter("xserv_rest_requests", "HTTP requests answered, by route, method and status",
                                ["route", "method", "status"], registry=self.registry)
        self.in_flight = Gauge("xserv_rest_requests_in_flight", "HTTP requests being served (streams included)",
                               multiprocess_mode="livesum", registry=self.registry)
        self.duration = Histogram("xserv_rest_request_duration_seconds",
                                  "time from a request's arrival to the end of its answer (streams included)",
                                  ["route"], buckets=DURATION_BUCKETS, registry=self.registry)
        self.ttft = Histogram("xserv_rest_time_to_first_token_seconds",
                              "time from sending a Generate call to the engine's first output",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("xserv_rest_inter_token_latency_seconds",
                             "gap between consecutive engine outputs, per token they carry",
                             buckets=ITL_BUCKETS, registry=self.registry)
        self.stream_errors = Counter("xserv_rest_stream_errors",
                                     "streams that ended with an error event after they started, by error code",
                                     ["code"], registry=self.registry)

    def exposition(self) -> bytes:
        """The text format of every worker's metrics (or this process's, without a directory)."""
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=self.multiprocess_dir)
        return generate_latest(registry)
