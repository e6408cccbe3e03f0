"""Same weights, same answers as Hugging Face transformers' Qwen3 (fp32)."""

import functools
import random
import threading

import pytest
import torch

from tests.engine.conftest import Collector, generate, make_engine, wait_idle
from tests.support.hf_reference import greedy_tokens
from xserv_engine.engine.sequence import Sequence
from xserv_engine.sampling_params import SamplingParams

PROMPT_LENGTHS = [5, 17, 1, 33, 64, 8, 23, 40]


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 151643) for _ in range(n)] for n in PROMPT_LENGTHS]


@functools.cache  # the staggered batch is checked twice per model: transformers answers once
def hf_greedy(model, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    return greedy_tokens(model, prompt, max_new_tokens)


@pytest.fixture(scope="module")
def engine_and_hf(hf_model_dir):
    path, model = hf_model_dir
    engine = make_engine(path, max_num_seqs=8)
    yield engine, model
    engine.shutdown()


@pytest.mark.parametrize("lengths", [PROMPT_LENGTHS[:5], [16, 16, 16, 9, 9, 30, 16]],
                         ids=["all-different", "runs-of-equal-lengths"])
def test_prefill_logits_match_transformers_for_a_varlen_batch(engine_and_hf, lengths):
    engine, model = engine_and_hf
    rng = random.Random(1)
    batch = [[rng.randrange(0, 151643) for _ in range(n)] for n in lengths]
    seqs = [Sequence(p, SamplingParams(), engine.block_manager.block_size) for p in batch]
    for seq in seqs:
        engine.block_manager.allocate(seq)
        seq.num_scheduled_tokens = seq.num_uncomputed_tokens  # the whole prompt in this step
    try:
        input_ids, positions, meta, _ = engine.runner.prepare(seqs, [])
        with torch.inference_mode():
            ours = engine.runner.model.compute_logits(engine.runner.model(input_ids, positions, meta))
    finally:
        for seq in seqs:
            engine.block_manager.deallocate(seq)
    start = 0
    for prompt in batch:
        with torch.no_grad():
            ref = model(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(ours[start : start + len(prompt)], ref, atol=1e-4, rtol=1e-4)
        start += len(prompt)


def test_greedy_continuations_equal_transformers_generate(engine_and_hf):
    engine, model = engine_and_hf
    for prompt in prompts(2):
        got = generate(engine, prompt, max_tokens=32, temperature=0.0, ignore_eos=True).token_ids()
        assert got == hf_greedy(model, tuple(prompt), 32)


def test_continuous_batch_with_staggered_starts_and_ends_equals_transformers(engine_and_hf):
    _staggered_batch_equals_transformers(*engine_and_hf)


def test_prompts_prefilled_in_chunks_beside_running_streams_equal_transformers(hf_model_dir):
    # a 12-token budget: every prompt over 12 tokens is prefilled over several steps, while the
    # streams already running keep decoding in the same steps
    path, model = hf_model_dir
    engine = make_engine(path, max_num_seqs=8, max_num_batched_tokens=12)
    try:
        _staggered_batch_equals_transformers(engine, model)
        stats = engine.stats()
        assert stats.free_blocks == stats.total_blocks
    finally:
        engine.shutdown()


def _staggered_batch_equals_transformers(engine, model):
    batch = prompts(3)
    lengths = [32, 9, 20, 32, 3, 27, 14, 32]
    collectors = [Collector() for _ in batch]
    started = threading.Event()

    def first_token(collector):
        def on_output(out):
            collector(out)
            started.set()
        return on_output

    # half join at once; the rest join while the first ones are mid-generation
    for i in range(4):
        engine.add_request(f"stagger-{i}", batch[i], SamplingParams(max_tokens=lengths[i], temperature=0.0,
                           ignore_eos=True), first_token(collectors[i]))
    assert started.wait(30)
    for i in range(4, 8):
        engine.add_request(f"stagger-{i}", batch[i], SamplingParams(max_tokens=lengths[i], temperature=0.0,
                           ignore_eos=True), collectors[i])
    for i, collector in enumerate(collectors):
        collector.wait()
        assert collector.token_ids() == hf_greedy(model, tuple(batch[i]), lengths[i]), f"prompt {i}"
        assert collector.final().finish_reason == "length"
    wait_idle(engine)


def _hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, V]: log p(prompt[i + 1] | prompt[: i + 1]) rows, from transformers."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)


def _assert_prompt_logprobs(got, prompt: list[int], ref: torch.Tensor, top: int) -> None:
    assert [lp.token_id for lp in got] == prompt
    assert got[0].logprob is None and not got[0].top  # nothing predicts the first token
    for i, lp in enumerate(got[1:]):
        assert lp.logprob == pytest.approx(ref[i, prompt[i + 1]].item(), abs=1e-4), f"token {i + 1}"
        best = ref[i].topk(top)
        assert [t.token_id for t in lp.top] == best.indices.tolist()
        assert [t.logprob for t in lp.top] == pytest.approx(best.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("budget, head_rows", [(8192, 256), (12, 256), (8192, 5)],
                         ids=["whole-prompts", "prompts-in-12-token-chunks", "LM-head-5-rows-at-a-time"])
def test_prompt_logprobs_equal_transformers(hf_model_dir, budget, head_rows, monkeypatch):
    from xserv_engine.layers import sampler

    monkeypatch.setattr(sampler, "PROMPT_LOGPROB_ROWS", head_rows)
    path, model = hf_model_dir
    engine = make_engine(path, max_num_seqs=8, max_num_batched_tokens=budget)
    try:
        batch = prompts(5)[:6]
        collectors = [Collector() for _ in batch]
        for i, prompt in enumerate(batch):  # one step: decodes, whole prompts and chunks side by side
            params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=i % 3)
            engine.add_request(f"plp-{budget}-{head_rows}-{i}", prompt, params, collectors[i])
        for i, prompt in enumerate(batch):
            outputs = collectors[i].wait()
            assert sum(1 for out in outputs if out.prompt_logprobs) == 1  # once, on the first output
            _assert_prompt_logprobs(outputs[0].prompt_logprobs, prompt, _hf_prompt_logprobs(model, prompt), i % 3)
        wait_idle(engine)
    finally:
        engine.shutdown()


def test_prompt_logprobs_are_computed_even_when_the_prompt_is_cached(hf_models):
    tied_model_dir, model = hf_models(True)
    engine = make_engine(tied_model_dir)
    try:
        prompt = prompts(6)[4]  # 64 tokens: 3 full blocks a later request could reuse
        first = generate(engine, prompt, max_tokens=2, temperature=0.0)
        assert first.final().usage.cached_prompt_tokens == 0
        again = generate(engine, prompt, max_tokens=2, temperature=0.0, prompt_logprobs=1)
        assert again.final().usage.cached_prompt_tokens == 0  # computed, so that it has logprobs
        _assert_prompt_logprobs(again.outputs[0].prompt_logprobs, prompt, _hf_prompt_logprobs(model, prompt), 1)
        third = generate(engine, prompt, max_tokens=2, temperature=0.0)
        assert third.final().usage.cached_prompt_tokens == 48  # other requests still hit the cache
        assert not third.outputs[0].prompt_logprobs
    finally:
        engine.shutdown()
