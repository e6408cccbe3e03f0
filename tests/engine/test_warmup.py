"""The CPU warm-up: at start, dummy prefills of the largest batch the scheduler may send, written
to cache slots no request owns yet. A user sees nothing of it but a faster first burst."""

import json

import pytest

from xserv_engine.engine import engine_setup
from xserv_engine.engine.model_runner import ModelRunner
from xserv_engine.models.loader import read_model_dir
from xserv_engine.models.qwen3 import Qwen3Config
from xserv_engine.sampling_params import SamplingParams

from tests.engine.conftest import Collector, make_engine, wait_idle
from tests.support.reference import QWEN3

QWEN3_0_6B = QWEN3 / "config-Qwen3-0.6B.json"


def _greedy_tokens(engine, prompts) -> list[list[int]]:
    collectors = []
    for i, prompt in enumerate(prompts):
        collector = Collector()
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), collector)
        collectors.append(collector)
    return [[t for out in c.wait() for t in out.token_ids] for c in collectors]


def test_warmup_changes_no_output_and_leaves_every_block_free(tied_model_dir, cpu_warmup, monkeypatch):
    prompts = [[(7 * i + j) % 5000 + 10 for j in range(20 + 9 * i)] for i in range(6)]
    calls = []
    real_warmup = ModelRunner.warmup
    monkeypatch.setattr(ModelRunner, "warmup", lambda self, *args: calls.append(args) or real_warmup(self, *args))
    warmed = make_engine(tied_model_dir, max_num_seqs=8)
    try:
        # the scheduler's whole budget (max_num_batched_tokens 8192 by default) over max_num_seqs
        # prompts; the dummy tokens overwrote the slots the first requests are then given
        assert calls == [(8192, 8)]
        assert warmed.stats().free_blocks == warmed.stats().total_blocks
        warm_tokens = _greedy_tokens(warmed, prompts)
        wait_idle(warmed)  # every block free again
        assert warmed.stats().prefix_cache_hits == 0
    finally:
        warmed.shutdown()
    monkeypatch.setattr(ModelRunner, "warmup", lambda self, *args: None)
    cold = make_engine(tied_model_dir, max_num_seqs=8)
    try:
        assert _greedy_tokens(cold, prompts) == warm_tokens
    finally:
        cold.shutdown()


def test_the_demo_model_warms_with_its_whole_budget(demo_dir):
    assert engine_setup.warmup_tokens(read_model_dir(str(demo_dir)).config, 8192) == 8192


@pytest.mark.reference
def test_warmup_work_is_capped_for_large_models():
    # a model of the real Qwen3-0.6B shape warms with a few hundred tokens, a few seconds on a
    # 2-core CPU instead of a minute
    config = Qwen3Config.from_hf(json.loads(QWEN3_0_6B.read_text()))
    assert 300 < engine_setup.warmup_tokens(config, 8192) < 450
