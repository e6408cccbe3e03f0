"""docs/grafana/xserv-vllm.json, the dashboard built on vLLM's metric names: every metric its
queries name is exported by a real `xserv engine` on the demo model, at /metrics on --metrics-port,
with the label the dashboard selects on (model_name) and vLLM's histogram buckets."""

import json
import re
from pathlib import Path

import pytest
import requests

from tests.support.processes import REPO, free_port
from xserv_engine.server.vllm_metrics import TTFT_BUCKETS_S

from .engine_process import start_engine

pytestmark = pytest.mark.e2e

DASHBOARD = Path(REPO) / "docs" / "grafana" / "xserv-vllm.json"
SELECTED = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{")  # a metric with a label selector
WITH_COLON = re.compile(r"(?<![\w$])([a-zA-Z_][a-zA-Z0-9_]*:[a-zA-Z0-9_:]+)")  # vllm:..., bare or not


def queries(dashboard: dict) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and template-variable queries."""
    found = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", ())]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            found.append(variable["query"]["query"])
    return found


def metric_names(expr: str) -> set[str]:
    return set(SELECTED.findall(expr)) | set(WITH_COLON.findall(expr))


def exported(text: str) -> dict[str, list[str]]:
    """Sample name -> the sample lines of the Prometheus text format."""
    samples: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            samples.setdefault(re.split(r"[{ ]", line, maxsplit=1)[0], []).append(line)
    return samples


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    port = free_port()
    engine = start_engine(tmp_path_factory, "--metrics-port", str(port))
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        before = exported(requests.get(url, timeout=5).text)  # after the engine's warm-up
        for _ in range(2):  # the same prompt twice: a prefix-cache hit the second time
            list(engine.generate(text="The dashboard reads these metrics " * 30, max_tokens=4, ignore_eos=True))
        yield before, exported(requests.get(url, timeout=5).text)
    finally:
        assert engine.stop() == 0


def test_every_metric_the_dashboard_queries_is_exported_with_its_model_name(scraped):
    _, scraped = scraped
    dashboard = json.loads(DASHBOARD.read_text())
    names = set().union(*map(metric_names, queries(dashboard)))
    assert len(names) >= 15 and all(name.startswith("vllm:") for name in names), names
    missing = sorted(name for name in names if name not in scraped)
    assert not missing, f"the dashboard queries metrics no engine exports: {missing}"
    for name in names:
        assert all('model_name="xserv-demo-qwen3-random"' in line for line in scraped[name]), scraped[name]


def test_the_metrics_count_what_the_engine_did(scraped):
    before, after = scraped

    def value(samples, name: str, **labels) -> float:
        [line] = [line for line in samples[name] if all(f'{k}="{v}"' in line for k, v in labels.items())]
        return float(line.rsplit(" ", 1)[1])

    def grew(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("vllm:request_success_total", finished_reason="length") == 2
    assert grew("vllm:generation_tokens_total") == 8
    assert grew("vllm:prompt_tokens_total") == grew("vllm:request_prompt_tokens_sum") > 0
    assert grew("vllm:prefix_cache_hits_total") > 0
    assert grew("vllm:inter_token_latency_seconds_count") == 2 * 3  # the gaps between 4 tokens, twice
    assert value(after, "vllm:kv_cache_usage_perc") == 0 and value(after, "vllm:num_requests_running") == 0
    buckets = after["vllm:time_to_first_token_seconds_bucket"]
    assert [float(re.search(r'le="([^"]+)"', line).group(1)) for line in buckets] == [*TTFT_BUCKETS_S, float("inf")]
