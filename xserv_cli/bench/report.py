"""The numbers of a benchmark run: throughput, latency percentiles, errors by kind."""

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass

from xserv_cli.bench.client import RequestResult
from xserv_cli.bench.config import BenchConfig

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Latency:
    """Milliseconds; all zero when there were no samples."""
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, samples_s: list[float]) -> "Latency":
        ms = sorted(s * 1000.0 for s in samples_s)
        if not ms:
            return cls(0.0, 0.0, 0.0, 0.0)
        return cls(sum(ms) / len(ms), *(percentile(ms, q) for q in PERCENTILES))


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    position = (len(sorted_values) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


@dataclass(frozen=True)
class Report:
    config: dict
    num_requests: int
    completed: int
    failed: int
    duration_s: float
    prompt_tokens: int  # from usage; completed requests whose server gave none count 0
    output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (prompt + output tokens) / s
    ttft_ms: Latency
    tpot_ms: Latency  # per request: (latency - TTFT) / (output tokens - 1)
    itl_ms: Latency  # every gap between text chunks, all requests pooled
    e2e_ms: Latency
    errors: dict[str, int]  # kind -> count
    error_examples: dict[str, str]  # kind -> first message

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def summarize(config: BenchConfig, input_len: int | None, results: list[RequestResult], duration_s: float) -> Report:
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    prompt_tokens = sum(r.prompt_tokens or 0 for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    examples: dict[str, str] = {}
    for r in failed:
        examples.setdefault(r.error_kind, r.error)
    rate = config.request_rate if math.isfinite(config.request_rate) else None  # JSON has no Infinity
    settings = asdict(config) | {"input_len": input_len, "request_rate": rate,
                                 "api_key": "***" if config.api_key else None}
    return Report(
        config=settings, num_requests=len(results), completed=len(done), failed=len(failed),
        duration_s=duration_s, prompt_tokens=prompt_tokens, output_tokens=output_tokens,
        request_throughput=len(done) * per_s, output_throughput=output_tokens * per_s,
        total_token_throughput=(prompt_tokens + output_tokens) * per_s,
        ttft_ms=Latency.of([r.ttft_s for r in done if r.chunk_times]),
        tpot_ms=Latency.of([(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]),
        itl_ms=Latency.of([gap for r in done for gap in r.itls_s]),
        e2e_ms=Latency.of([r.latency_s for r in done]),
        errors=dict(Counter(r.error_kind for r in failed).most_common()), error_examples=examples)


def _prompt_tokens_per_request(report: Report) -> str:
    """Per request, from usage; on /chat/completions, --input-len's share and the chat template's
    (its role markers: 8 more tokens per prompt on Qwen3's)."""
    c = report.config
    per_request = report.prompt_tokens / max(report.completed, 1)
    said = f"{per_request:.1f}/request, from usage"
    if c["endpoint"] == "chat" and c["input_len"] and report.prompt_tokens:
        said += f": {c['input_len']} of the prompt + {per_request - c['input_len']:.1f} of the chat template"
    return said


def format_report(report: Report) -> str:
    c = report.config
    load = f"concurrency {c['concurrency'] or 'unlimited'}"
    if c["request_rate"] is not None:
        load += f", {c['request_rate']:g} req/s (Poisson)"
    per_request = max(report.completed, 1)
    lines = [
        f"xserv bench: {c['endpoint']} {c['base_url']}  model {c['model']}",
        f"  {report.num_requests} requests, {load}, input {c['input_len'] or 'from file'} / output {c['output_len']} tokens",
        f"{'completed / failed':<24}{report.completed} / {report.failed}",
        f"{'duration':<24}{report.duration_s:.2f} s",
        f"{'requests/s':<24}{report.request_throughput:.2f}",
        f"{'output tok/s':<24}{report.output_throughput:.1f}",
        f"{'total tok/s':<24}{report.total_token_throughput:.1f}",
        f"{'prompt tokens':<24}{report.prompt_tokens} ({_prompt_tokens_per_request(report)})",
        f"{'output tokens':<24}{report.output_tokens} ({report.output_tokens / per_request:.1f}/request)",
        f"{'latency (ms)':<16}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for name, latency in (("TTFT", report.ttft_ms), ("TPOT", report.tpot_ms), ("ITL", report.itl_ms),
                          ("E2E", report.e2e_ms)):
        lines.append(f"  {name:<14}" + "".join(f"{v:>10.1f}" for v in asdict(latency).values()))
    if report.errors:
        lines.append("errors:")
        lines += [f"  {count:>5}  {kind}: {report.error_examples[kind][:160]}" for kind, count in report.errors.items()]
    else:
        lines.append("errors: none")
    return "\n".join(lines)
