"""vLLM's metric names beside xserv's own, so that Grafana dashboards and alerts built for vLLM
(docs/grafana/) work on an xserv engine unchanged: the same names, the labels `model_name` (the
served model id) and `engine` ("0": one engine core per process), and vLLM's histogram buckets
(vllm/v1/metrics/loggers.py). Only metrics whose meaning xserv has are exported.

Engine state is read from engine.stats() at scrape time; the per-request ones are updated by
RequestRecord as a call's outputs arrive and when it ends.
"""

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LABELS = ("model_name", "engine")
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                  40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                 80.0)
REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                             240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)
# vLLM's engine knows no tool calls: a choice that ends in one stopped
FINISHED_REASONS = {"stop": "stop", "tool_calls": "stop", "length": "length", "abort": "abort"}


def one_two_five(most: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to `most`."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > most:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class VllmMetrics:
    """The per-request vLLM metrics of one engine, and the scrape-time ones registered beside them."""

    def __init__(self, registry: CollectorRegistry, engine, model_name: str, max_model_len: int):
        labels = (model_name, "0")
        registry.register(_VllmStatsCollector(engine, labels))

        def histogram(name, documentation, buckets):
            return Histogram(name, documentation, LABELS, buckets=buckets, registry=registry).labels(*labels)

        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*LABELS, "finished_reason"], registry=registry)
        self.success = {reason: success.labels(*labels, reason) for reason in sorted(set(FINISHED_REASONS.values()))}
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS_S)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS_S)
        self.tpot = histogram("vllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds (vLLM's older name of the "
                              "inter-token latency).", ITL_BUCKETS_S)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS_S)
        tokens = one_two_five(max_model_len)
        self.prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.generation_tokens = histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                           tokens)
        self.params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.params_max_tokens = histogram("vllm:request_params_max_tokens",
                                           "Histogram of the max_tokens request parameter.", tokens)

    def observe_gap(self, gap_s: float, tokens: int) -> None:
        """An output after the first of its choice: `tokens` tokens `gap_s` after the previous one."""
        per_token = gap_s / tokens
        for _ in range(tokens):
            self.itl.observe(per_token)
            self.tpot.observe(per_token)

    def observe_finished(self, reason: str, prompt_tokens: int, generation_tokens: int) -> None:
        """One choice ended (vLLM counts each of n choices as a request)."""
        self.success[FINISHED_REASONS[reason]].inc()
        self.prompt_tokens.observe(prompt_tokens)
        self.generation_tokens.observe(generation_tokens)


class _VllmStatsCollector(Collector):
    def __init__(self, engine, labels: tuple[str, str]):
        self.engine = engine
        self.labels = labels
        self.block_size = engine.model_info().block_size

    def collect(self):
        stats = self.engine.stats()
        used = (stats.total_blocks - stats.free_blocks) / stats.total_blocks if stats.total_blocks else 0.0
        yield self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                          stats.running)
        yield self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.waiting)
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", used)
        yield self._gauge("vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage. vLLM's older "
                          "name of vllm:kv_cache_usage_perc.", used)
        # xserv caches whole blocks: queried and hit tokens are the full prompt blocks' tokens
        yield self._counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried "
                            "tokens.", stats.prefix_cache_queries * self.block_size)
        yield self._counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                            stats.prefix_cache_hits * self.block_size)
        yield self._counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                            stats.preemptions)
        yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens)
        yield self._counter("vllm:generation_tokens", "Number of generation tokens processed.",
                            stats.generated_tokens)
        if stats.spec is not None:
            yield from self._spec_counters(stats.spec)

    def _spec_counters(self, spec):
        """vLLM's speculative-decoding counters (vllm/v1/spec_decode/metrics.py)."""
        yield self._counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", spec.num_drafts)
        yield self._counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", spec.num_draft_tokens)
        yield self._counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                            spec.num_accepted_tokens)
        family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted tokens per draft position.", labels=(*LABELS, "position"))
        for position, accepted in enumerate(spec.accepted_per_pos):
            family.add_metric((*self.labels, str(position)), accepted)
        yield family

    def _gauge(self, name: str, documentation: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, documentation, labels=LABELS)
        family.add_metric(self.labels, value)
        return family

    def _counter(self, name: str, documentation: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, documentation, labels=LABELS)  # exposed as name + "_total"
        family.add_metric(self.labels, value)
        return family
