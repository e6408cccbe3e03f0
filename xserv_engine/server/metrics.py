"""Prometheus metrics of one engine process, served on `--metrics-port` at /metrics.

Engine state (sequences, KV blocks, prefix cache, generated tokens, preemptions) is read from
engine.stats() when Prometheus scrapes, by a custom collector: nothing runs per token. The
per-request counters and histograms are updated once when a Generate call ends. vLLM's names are
exported beside these once the engine is attached (vllm_metrics.py).
"""

import logging

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from xserv_engine.server.vllm_metrics import VllmMetrics

log = logging.getLogger("xserv.engine.server")

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class EngineMetrics:
    """The registry of one engine server; attach() the engine once it is loaded."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self._stats = _EngineStatsCollector()
        self.registry.register(self._stats)
        self.finished = Counter("xserv_request_finished", "Finished choices by finish reason",
                                ["finish_reason"], registry=self.registry)
        self.errors = Counter("xserv_request_errors", "Generate calls that ended without finishing, by gRPC status",
                              ["code"], registry=self.registry)
        self.ttft = Histogram("xserv_time_to_first_token_seconds", "Time from the call to its first output",
                              buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.duration = Histogram("xserv_request_duration_seconds", "Time from the call to its end",
                                  buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.lora_requests = Counter("xserv_lora_requests", "Generate calls that ended OK, by the LoRA adapter "
                                     "they named", ["lora_name"], registry=self.registry)
        self.vllm: VllmMetrics | None = None  # labelled with the model's name: made by attach()
        self._http = None

    def attach(self, engine) -> None:
        self._stats.engine = engine
        if self.vllm is None:
            info = engine.model_info()
            self.vllm = VllmMetrics(self.registry, engine, info.model_id, info.max_model_len)

    def serve(self, host: str, port: int) -> int:
        """Serve /metrics on host:port (0 picks a free port) from a daemon thread; the port."""
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        bound = self._http.server_port
        log.info("metrics on http://%s:%d/metrics", f"[{host}]" if ":" in host else host, bound)
        return bound

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()


class _EngineStatsCollector(Collector):
    """Reads engine.stats() at scrape time; yields nothing while the model loads."""

    def __init__(self):
        self.engine = None

    def collect(self):
        if self.engine is None:
            return
        stats = self.engine.stats()
        yield _gauge("xserv_num_requests_running", "Sequences in the running batch", stats.running)
        yield _gauge("xserv_num_requests_waiting", "Sequences waiting to be scheduled", stats.waiting)
        yield _gauge("xserv_kv_cache_blocks_used", "KV-cache blocks in use", stats.total_blocks - stats.free_blocks)
        yield _gauge("xserv_kv_cache_blocks_total", "KV-cache blocks in all", stats.total_blocks)
        yield _counter("xserv_prefix_cache_queries", "Full prompt blocks looked up in the prefix cache",
                       stats.prefix_cache_queries)
        yield _counter("xserv_prefix_cache_hits", "Full prompt blocks found in the prefix cache",
                       stats.prefix_cache_hits)
        yield _counter("xserv_generation_tokens", "Tokens generated", stats.generated_tokens)
        yield _counter("xserv_preemptions", "Sequences preempted for lack of KV blocks", stats.preemptions)
        yield _gauge("xserv_lora_adapters_loaded", "LoRA adapters loaded", len(getattr(self.engine, "loras", ())))


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)  # exposed as name + "_total"
