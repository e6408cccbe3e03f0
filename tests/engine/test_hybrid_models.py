"""Hybrid models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): same weights, same greedy tokens as
transformers (fp32), whatever the batching does to them, and every state slot given back."""

import logging
import random
import threading

import pytest
import torch

from tests.engine.conftest import Collector, generate, make_engine, wait_idle
from tests.engine.test_fidelity import hf_greedy
from tests.support.hf_reference import greedy_tokens
from tests.support.hybrid_checkpoint import SHAPES, write_hybrid_checkpoint, write_vl_checkpoint
from xserv_engine.sampling_params import SamplingParams
from xserv_engine.server.convert import model_info_to_pb


@pytest.fixture(scope="module", params=list(SHAPES))
def hybrid(request, tmp_path_factory, demo_dir):
    """(directory, transformers model) of one shape, written once per module."""
    path = tmp_path_factory.mktemp(request.param.split(",")[0])
    return path, write_hybrid_checkpoint(path, demo_dir, request.param)


def prompts(seed: int, lengths=(5, 70, 1, 33, 130, 17)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 151643) for _ in range(n)] for n in lengths]


def assert_idle_with_every_slot_free(engine) -> None:
    wait_idle(engine)
    bm = engine.block_manager
    assert sorted(bm.free_state_slots) == list(range(bm.num_state_slots))


def staggered_batch(engine, model, batch: list[list[int]], lengths: list[int]) -> None:
    """Half the prompts start at once, the rest join while those decode; each must equal
    transformers' greedy continuation of its prompt alone."""
    collectors = [Collector() for _ in batch]
    started = threading.Event()

    def first_output(collector):
        def on_output(out):
            collector(out)
            started.set()
        return on_output

    half = len(batch) // 2
    for i, prompt in enumerate(batch):
        if i == half:
            assert started.wait(60)
        params = SamplingParams(max_tokens=lengths[i], temperature=0.0, ignore_eos=True)
        engine.add_request(f"s{i}", prompt, params, first_output(collectors[i]) if i < half else collectors[i])
    for i, collector in enumerate(collectors):
        collector.wait()
        assert collector.token_ids() == hf_greedy(model, tuple(batch[i]), lengths[i]), f"prompt {i}"


@pytest.mark.parametrize("budget", [8192, 12], ids=["whole-prompts", "prompts-in-12-token-chunks"])
def test_greedy_tokens_of_a_staggered_batch_equal_transformers(hybrid, budget):
    path, model = hybrid
    engine = make_engine(path, max_num_seqs=8, max_num_batched_tokens=budget)
    try:
        staggered_batch(engine, model, prompts(1), [12, 20, 8, 16, 10, 14])
        assert_idle_with_every_slot_free(engine)
    finally:
        engine.shutdown()


def test_preempted_sequences_start_their_states_over_and_answer_the_same(hybrid):
    path, model = hybrid
    batch = prompts(2, lengths=(20, 24, 18, 22))
    engine = make_engine(path, num_kv_blocks=8, max_model_len=128)  # 128 tokens of KV for 4 x ~50
    try:
        staggered_batch(engine, model, batch, [30, 30, 30, 30])
        assert engine.stats().preemptions > 0
        assert_idle_with_every_slot_free(engine)
    finally:
        engine.shutdown()


def test_aborts_give_their_state_slots_back(hybrid):
    path, _ = hybrid
    engine = make_engine(path, max_num_seqs=4)
    try:
        collectors = [Collector() for _ in range(4)]
        for i, c in enumerate(collectors):
            engine.add_request(f"a{i}", prompts(3)[i], SamplingParams(max_tokens=500, ignore_eos=True), c)
        for i in range(4):
            engine.abort(f"a{i}")
        assert [c.wait()[-1].finish_reason for c in collectors] == ["abort"] * 4
        assert_idle_with_every_slot_free(engine)
    finally:
        engine.shutdown()


def test_the_state_pool_caps_max_num_seqs_and_queues_the_rest(hybrid, caplog):
    path, model = hybrid
    with caplog.at_level(logging.INFO, logger="xserv_engine"):
        engine = make_engine(path, max_num_seqs=8, kv_cache_memory_gb=2.5 * engine_slot_bytes(path) / 2**30)
    try:
        assert "max_num_seqs lowered from 8 to 2" in caplog.text
        assert engine.model_info().state_slot_bytes == engine_slot_bytes(path)
        stats = engine.stats()
        assert (stats.total_state_slots, stats.free_state_slots) == (2, 2)
        pb = model_info_to_pb(engine.model_info(), stats)  # what GetModelInfo answers
        assert (pb.state_slots_total, pb.state_slots_free, pb.state_slot_bytes) == (2, 2, engine_slot_bytes(path))
        staggered_batch(engine, model, prompts(4, lengths=(9, 3, 12, 7)), [6, 6, 6, 6])
        assert_idle_with_every_slot_free(engine)
    finally:
        engine.shutdown()


def engine_slot_bytes(path) -> int:
    """One sequence's states over all linear layers, counted from the checkpoint's config.json."""
    from xserv_engine.models.loader import read_model_dir

    cfg = read_model_dir(str(path)).config
    return sum(cfg.linear.state_bytes(torch.float32) for i in range(cfg.num_hidden_layers) if cfg.is_linear_layer(i))


NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "disable_when_slower": false}'


def test_speculation_keeps_the_states_of_the_drafts_that_stood(hybrid, monkeypatch):
    """A verification runs each drafted sequence's rows through its linear-attention states;
    after a rejection they must be the states after the accepted drafts only. The n-gram lookup
    is replaced by an oracle that proposes the true continuation with every other step's third
    draft wrong, so full and partial acceptances both happen, beside a plain decode."""
    from xserv_engine.engine import speculative

    path, model = hybrid
    batch = prompts(6, lengths=(40, 9, 23))
    want = {tuple(p): hf_greedy(model, tuple(p), 24) for p in batch}

    def oracle(token_ids, k, lookup_min, lookup_max):
        for prompt, continuation in want.items():
            if tuple(token_ids[: len(prompt)]) == prompt and prompt != tuple(batch[1]):  # batch[1] decodes plainly
                done = len(token_ids) - len(prompt)
                drafts = list(continuation[done : done + k])
                if done % 2 and len(drafts) > 2:
                    drafts[2] = (drafts[2] + 1) % 151643
                return drafts
        return []

    monkeypatch.setattr(speculative, "ngram_propose", oracle)
    engine = make_engine(path, speculative_config=NGRAM)
    try:
        collectors = [Collector() for _ in batch]
        for i, (prompt, collector) in enumerate(zip(batch, collectors)):
            engine.add_request(f"spec-{i}", prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                               collector)
        for prompt, collector in zip(batch, collectors):
            collector.wait()
            assert collector.token_ids() == want[tuple(prompt)]
        spec = engine.stats().spec
        assert spec.num_accepted_tokens > 0 and spec.num_draft_tokens > spec.num_accepted_tokens  # both paths ran
        assert_idle_with_every_slot_free(engine)
    finally:
        engine.shutdown()


def test_a_qwen3_draft_model_speeds_a_hybrid_target_and_a_hybrid_draft_is_refused(hybrid, demo_dir):
    import json

    from xserv_engine.errors import InvalidRequest

    path, model = hybrid
    config = {"model": str(demo_dir), "num_speculative_tokens": 3, "disable_when_slower": False}
    engine = make_engine(path, speculative_config=json.dumps(config))
    try:
        prompt = prompts(8, lengths=(30,))[0]
        assert generate(engine, prompt, max_tokens=12, temperature=0.0, ignore_eos=True).token_ids() == \
            hf_greedy(model, tuple(prompt), 12)
        assert engine.stats().spec.num_draft_tokens > 0
    finally:
        engine.shutdown()
    with pytest.raises(InvalidRequest, match="linear-attention layers; a draft model must be"):
        make_engine(path, speculative_config=json.dumps({**config, "model": str(path)}))


def test_language_model_only_serves_the_text_model_and_skips_the_tower(tmp_path, demo_dir, caplog):
    model = write_vl_checkpoint(tmp_path, demo_dir)
    with caplog.at_level(logging.INFO, logger="xserv_engine"):
        engine = make_engine(tmp_path, language_model_only=True)
    try:
        assert "the vision tower's weights are not loaded" in caplog.text
        assert not any("visual" in name for name, _ in engine.runner.model.named_parameters())
        for prompt in prompts(7, lengths=(9, 66)):
            ref = greedy_tokens(model, prompt, 8)
            assert generate(engine, prompt, max_tokens=8, temperature=0.0, ignore_eos=True).token_ids() == ref
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def grouped(tmp_path_factory, demo_dir):
    path = tmp_path_factory.mktemp("grouped")
    return path, write_hybrid_checkpoint(path, demo_dir, "qwen3_5,v4-over-k2,tied")


def _greedy_of(path, prompt, **config):
    engine = make_engine(path, **config)
    try:
        return generate(engine, prompt, max_tokens=8, temperature=0.0, ignore_eos=True).token_ids()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("shape", ["qwen3", "qwen3_5"])
def test_the_greedy_reference_returns_what_transformers_generate_returns(shape, grouped, hf_models):
    """tests/support/hf_reference.py, which most engine tests compare with: generate()'s tokens,
    the end-of-sequence ids kept out where they would win too."""
    model = hf_models(True)[1] if shape == "qwen3" else grouped[1]
    prompt = prompts(12, lengths=(9,))[0]

    def generated() -> list[int]:
        with torch.no_grad():
            return model.generate(torch.tensor([prompt]), max_new_tokens=4, min_new_tokens=4, do_sample=False,
                                  pad_token_id=0)[0, len(prompt):].tolist()

    unmasked = generated()
    assert greedy_tokens(model, prompt, 4) == unmasked
    eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [eos, unmasked[0], unmasked[2]]  # the winners become eos ids
    try:
        masked = generated()
        assert masked[0] != unmasked[0]
        assert greedy_tokens(model, prompt, 4) == masked
    finally:
        model.generation_config.eos_token_id = eos


@pytest.mark.parametrize("mistake", ["value heads grouped by repeat, not repeat_interleave",
                                     "the state dropped between prompt chunks",
                                     "the norms as x * w, not x * (1 + w)"])
def test_the_test_checkpoints_make_a_deliberately_wrong_layer_visible(grouped, mistake, monkeypatch):
    """The checkpoints above would let these mistakes through if their weights hid them."""
    from xserv_engine.engine.model_runner import ModelRunner
    from xserv_engine.layers import gated_delta_rule
    from xserv_engine.models import hybrid_weights

    path, model = grouped
    prompt = prompts(8, lengths=(40,))[0]
    assert _greedy_of(path, prompt, max_num_batched_tokens=12) == hf_greedy(model, tuple(prompt), 8)
    if mistake.startswith("value heads"):
        monkeypatch.setattr(gated_delta_rule, "expand_key_heads",
                            lambda x, group: x.repeat(*[1] * (x.dim() - 2), group, 1))
    elif mistake.startswith("the state dropped"):
        real_metadata = ModelRunner.state_metadata

        def fresh_chunks(self, prefills, decodes):
            states = real_metadata(self, prefills, decodes)
            states.prefill_fresh = [True] * len(prefills)
            return states
        monkeypatch.setattr(ModelRunner, "state_metadata", fresh_chunks)
    else:
        monkeypatch.setattr(hybrid_weights, "_ZERO_CENTRED", ())
    assert _greedy_of(path, prompt, max_num_batched_tokens=12) != hf_greedy(model, tuple(prompt), 8)


def test_lora_on_full_attention_and_mlp_projections_equals_peft_and_linear_attention_is_refused(grouped, tmp_path):
    from tests.support.lora_adapter import ALL_LINEARS, write_lora_adapter
    from xserv_engine.errors import InvalidRequest

    path, _ = grouped
    peft_model = write_lora_adapter(path, tmp_path / "all", targets=ALL_LINEARS, rank=4, alpha=8, seed=3)
    write_lora_adapter(path, tmp_path / "gdn", targets=("in_proj_qkv", "out_proj"), rank=4, alpha=8, seed=4)
    engine = make_engine(path, enable_lora=True, lora_modules=(("all", str(tmp_path / "all")),))
    try:
        prompt = prompts(9, lengths=(30,))[0]
        expected = greedy_tokens(peft_model, prompt, 8)
        with peft_model.disable_adapter():
            base = greedy_tokens(peft_model, prompt, 8)
        assert expected != base  # the adapter (a gated q_proj's query and gate rows included) shows
        collectors = {name: Collector() for name in ("all", None)}
        for name, collector in collectors.items():
            engine.add_request(f"lora-{name}", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                               collector, lora_name=name)
        assert collectors["all"].wait() and collectors["all"].token_ids() == expected
        assert collectors[None].wait() and collectors[None].token_ids() == base
        with pytest.raises(InvalidRequest, match="Gated DeltaNet"):
            engine.load_lora("gdn", str(tmp_path / "gdn"))
    finally:
        engine.shutdown()


def test_traced_decode_steps_read_each_rows_state_slot_as_op_by_op_steps_do(grouped):
    """cpu-traced (int8 linears trace on any CPU): decode steps of 1-4 sequences replay a trace
    whose state slots are a buffer; the same steps op by op must give the same tokens."""
    from xserv_engine.layers import native

    if not native.load_torch_ops():
        pytest.skip("the native CPU ops need a C++ compiler (g++ or $CXX); the cpu-traced route needs them")
    path, _ = grouped
    batch = prompts(10, lengths=(9, 40, 3, 25))
    engine = make_engine(path, quantization="int8", max_num_seqs=4)
    try:
        assert engine.model_info().decode_route == "cpu-traced"

        def run_all():
            collectors = [Collector() for _ in batch]
            for i, (prompt, c) in enumerate(zip(batch, collectors)):  # later ones join mid-stream
                engine.add_request(f"t{run_all.round}-{i}", prompt,
                                   SamplingParams(max_tokens=10 + 3 * i, temperature=0.0, ignore_eos=True), c)
            run_all.round += 1
            return [c.wait() and c.token_ids() for c in collectors]
        run_all.round = 0
        traced = run_all()
        engine.runner.decode_buckets = None  # every step op by op from here on
        assert run_all() == traced
        assert_idle_with_every_slot_free(engine)
    finally:
        engine.shutdown()


def test_an_fp8_checkpoint_answers_as_transformers_with_it_dequantized(grouped, tmp_path):
    """Qwen's FP8 layout (e4m3 blocks with weight_scale_inv) on a hybrid model: the gated q_proj
    and the Gated DeltaNet's projections dequantized before they are split and packed."""
    pytest.importorskip("accelerate", reason="transformers loads fp8 checkpoints only with accelerate (test extra)")
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    from tests.support.fp8_checkpoint import HYBRID_PROJECTIONS, write_fp8_checkpoint

    path, _ = grouped
    write_fp8_checkpoint(path, tmp_path, (16, 32), HYBRID_PROJECTIONS)
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=FineGrainedFP8Config(dequantize=True, weight_block_size=(16, 32)),
        dtype=torch.float32).eval()
    engine = make_engine(tmp_path)
    try:
        for prompt in prompts(11, lengths=(12, 45)):
            assert generate(engine, prompt, max_tokens=10, temperature=0.0, ignore_eos=True).token_ids() == \
                hf_greedy(reference, tuple(prompt), 10)
    finally:
        engine.shutdown()
