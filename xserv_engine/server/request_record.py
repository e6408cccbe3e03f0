"""What one Generate or Embed call did, written once when it ends: one structured INFO line on
the `xserv.engine.requests` logger, the per-request metrics and, when traces are on, its spans."""

import logging
import time
from dataclasses import dataclass
from typing import Callable

from xserv_engine.outputs import RequestOutput
from xserv_engine.server.metrics import EngineMetrics

log = logging.getLogger("xserv.engine.requests")

REQUEST_ID_METADATA = "x-request-id"


@dataclass(frozen=True)
class CallTimeline:
    """One call's life in time.monotonic() seconds (None: it never got that far) and its counts."""

    request_id: str
    status: str
    started: float
    scheduled: float | None  # the first prefill of any of its choices began
    first_output: float | None
    ended: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reasons: tuple[str, ...]


class RequestRecord:
    def __init__(self, request_id: str, trace_id: str, peer: str, metrics: EngineMetrics, lora_name: str = "",
                 n: int = 1, max_tokens: int | None = None, trace: Callable[[CallTimeline], None] | None = None):
        self.request_id = request_id
        self._trace = trace  # makes the call's spans when it ends (traces on)
        self._scheduled: float | None = None
        self._n, self._max_tokens = n, max_tokens  # the call's own (vLLM's request_params_* histograms)
        self._lora_name = lora_name or "-"  # the LoRA adapter a Generate call named
        self._trace_id = trace_id or "-"
        self._peer = peer
        self._metrics = metrics
        self._started = time.monotonic()
        self._first_output_s: float | None = None
        self._last_output: dict[int, float] = {}  # choice index -> when its latest output came
        self._finish_reasons: list[str] = []
        self._prompt_tokens = self._completion_tokens = self._cached_tokens = 0
        self._draft_tokens = self._accepted_tokens = 0
        self._speculated = False  # the engine speculates: the line says its acceptance
        self._ended = False

    def observe(self, output: RequestOutput) -> None:
        now = time.monotonic()
        if self._first_output_s is None:
            self._first_output_s = now - self._started
        if self._trace is not None and output.scheduled_at is not None:
            self._scheduled = min(self._scheduled or output.scheduled_at, output.scheduled_at)
        vllm = self._metrics.vllm
        previous = self._last_output.get(output.index)
        self._last_output[output.index] = now
        # one gap per token after the choice's first; a first output that carries several (the
        # stream fell behind the engine and coalesced them) has gaps of nothing, to the caller
        gaps = len(output.token_ids) - (previous is None)
        if vllm is not None and gaps > 0:
            vllm.observe_gap(0.0 if previous is None else now - previous, gaps)
        if output.finished:
            self._finish_reasons.append(output.finish_reason)
            if output.spec_tokens is not None:
                self._speculated = True
                self._draft_tokens += output.spec_tokens[0]
                self._accepted_tokens += output.spec_tokens[1]
            if vllm is not None and output.usage is not None:
                vllm.observe_finished(output.finish_reason, output.usage.prompt_tokens, output.usage.completion_tokens)
            if output.usage is not None and output.embedding is not None:  # an Embed call: its inputs add up
                self._prompt_tokens += output.usage.prompt_tokens
                self._cached_tokens += output.usage.cached_prompt_tokens
            elif output.usage is not None:  # Generate: every choice has the same prompt
                self._prompt_tokens = output.usage.prompt_tokens
                self._cached_tokens = output.usage.cached_prompt_tokens
                self._completion_tokens += output.usage.completion_tokens

    def end(self, status: str) -> None:
        """Log and count the call; `status` is "OK" or a gRPC status code name. Once only."""
        if self._ended:
            return
        self._ended = True
        ended = time.monotonic()
        duration_s = ended - self._started
        if self._trace is not None:
            self._trace(self._timeline(status, ended))
        self._metrics.duration.observe(duration_s)
        if self._first_output_s is not None:
            self._metrics.ttft.observe(self._first_output_s)
        vllm = self._metrics.vllm
        if vllm is not None and self._finish_reasons:
            vllm.e2e.observe(duration_s)
            if self._first_output_s is not None:
                vllm.ttft.observe(self._first_output_s)
            vllm.params_n.observe(self._n)
            if self._max_tokens is not None:
                vllm.params_max_tokens.observe(self._max_tokens)
        for reason in self._finish_reasons:
            self._metrics.finished.labels(finish_reason=reason).inc()
        if status != "OK":
            self._metrics.errors.labels(code=status).inc()
        elif self._lora_name != "-":  # only names the engine had loaded: a label per adapter
            self._metrics.lora_requests.labels(lora_name=self._lora_name).inc()
        ttft_ms = "-" if self._first_output_s is None else f"{1000 * self._first_output_s:.0f}"
        spec = ""
        if self._speculated:  # accepted of the drafted tokens; "-" when nothing was drafted
            rate = f"{self._accepted_tokens / self._draft_tokens:.2f}" if self._draft_tokens else "-"
            spec = f" spec_acceptance={rate} spec_draft_tokens={self._draft_tokens}"
        log.info("request_id=%s trace_id=%s status=%s finish_reason=%s prompt_tokens=%d completion_tokens=%d "
                 "cached_tokens=%d ttft_ms=%s duration_ms=%.0f peer=%s lora=%s%s",
                 self.request_id, self._trace_id, status, ",".join(self._finish_reasons) or "-", self._prompt_tokens,
                 self._completion_tokens, self._cached_tokens, ttft_ms, 1000 * duration_s, self._peer, self._lora_name,
                 spec)


    def _timeline(self, status: str, ended: float) -> CallTimeline:
        first_output = None if self._first_output_s is None else self._started + self._first_output_s
        return CallTimeline(self.request_id, status, self._started, self._scheduled, first_output, ended,
                            self._prompt_tokens, self._completion_tokens, self._cached_tokens,
                            tuple(self._finish_reasons))


def metadata_request_id(context) -> str:
    """The caller's `x-request-id` metadata (e.g. the REST front's X-Request-Id), or "".
    Kept to a safe alphabet and length: it is written into log lines."""
    value = next((v for k, v in context.invocation_metadata() or () if k == REQUEST_ID_METADATA), "")
    return "".join(c for c in value[:128] if c.isalnum() or c in "._:-")
