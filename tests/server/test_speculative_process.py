"""End to end: `xserv engine --speculative-config` as a process, with the n-gram lookup and with a
draft model (the model drafting for itself). GetModelInfo says what is configured, /metrics has
vLLM's spec-decode counters, the request's log line its acceptance, and a bad configuration stops
the start with a line naming the field."""

import json
import re

import pytest

from .engine_process import EngineProcess, start_engine
from .test_engine_observability import logged, scrape

pytestmark = pytest.mark.e2e

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3}'


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def engine(request, tmp_path_factory, demo_dir):
    config = NGRAM if request.param == "ngram" else json.dumps({"model": str(demo_dir), "num_speculative_tokens": 3})
    process = start_engine(tmp_path_factory, "--model", str(demo_dir), "--speculative-config", config,
                           "--metrics-port", "0", "--log-level", "info")
    process.method = request.param
    port = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", process.log_text()).group(1)
    process.metrics_url = f"http://127.0.0.1:{port}/metrics"
    yield process
    assert process.stop() == 0


def counter(samples: dict, name: str, **labels) -> float:
    """A counter's value whatever the model_name label says."""
    for key, value in samples.items():
        if key.startswith(name + "{") and all(f'{k}="{v}"' in key for k, v in labels.items()):
            return value
    return 0.0


def test_model_info_metrics_and_log_line_show_the_speculation(engine):
    config = json.loads(engine.model_info().speculative_config)
    assert (config["method"], config["num_speculative_tokens"]) == (engine.method, 3)
    outputs = list(engine.generate(text="one two one two one two one two", max_tokens=48, ignore_eos=True,
                                   request_id="spec-log-1"))
    assert sum(len(o.token_ids) for o in outputs) == 48
    samples = scrape(engine)
    drafted = counter(samples, "vllm:spec_decode_num_draft_tokens_total")
    kept = counter(samples, "vllm:spec_decode_num_accepted_tokens_total")
    assert 0 < kept <= drafted
    assert counter(samples, "vllm:spec_decode_num_drafts_total") > 0
    per_position = [counter(samples, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=p)
                    for p in range(3)]
    assert sum(per_position) == kept and per_position[0] >= per_position[2]
    assert logged(engine, "request_id=spec-log-1 ")
    line = next(x for x in engine.log_text().splitlines() if "request_id=spec-log-1 " in x)
    rate = float(re.search(r"spec_acceptance=([0-9.]+) spec_draft_tokens=(\d+)", line).group(1))
    assert 0 < rate <= 1
    assert engine.wait_all_blocks_free().kv_blocks_free == engine.model_info().kv_blocks_total


def test_a_bad_configuration_exits_1_naming_the_field(tmp_path):
    engine = EngineProcess("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}',
                           log_path=tmp_path / "engine.log")
    try:
        assert engine.proc.wait(timeout=60) == 1
        assert "speculative_config.num_speculative_tokens" in engine.log_text()
        assert "Traceback" not in engine.log_text()
    finally:
        engine.stop()
