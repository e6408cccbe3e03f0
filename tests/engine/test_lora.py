"""LoRA adapters written by PEFT, served beside the base model: the same logits and tokens as
PEFT's own model (transformers, fp32), alone and mixed in one batch with the base model and other
adapters, through the prefix cache and the CPU decode kernel's batch sizes."""

import json
import random

import pytest
import torch

from tests.engine.conftest import Collector, generate, make_engine, wait_idle
from tests.support.hf_reference import greedy_tokens
from tests.support.lora_adapter import write_lora_adapter
from xserv_engine.engine.sequence import Sequence
from xserv_engine.errors import InvalidRequest, NotFound, Unsupported
from xserv_engine.sampling_params import SamplingParams

ATTENTION = ("q_proj", "v_proj")  # PEFT's usual default for Qwen models


@pytest.fixture(scope="module")
def adapters(tied_model_dir, tmp_path_factory):
    """name -> (directory, PEFT model): every linear at rank 8; q/v only at rank 4 with rsLoRA."""
    root = tmp_path_factory.mktemp("lora")
    return {
        "all": (root / "all", write_lora_adapter(tied_model_dir, root / "all", rank=8, alpha=16, seed=1)),
        "qv": (root / "qv", write_lora_adapter(tied_model_dir, root / "qv", targets=ATTENTION, rank=4, alpha=8,
                                               seed=2, use_rslora=True)),
    }


@pytest.fixture(scope="module")
def engine(tied_model_dir, adapters):
    engine = make_engine(tied_model_dir, max_num_seqs=16, enable_lora=True,
                         lora_modules=tuple((name, str(path)) for name, (path, _) in adapters.items()))
    yield engine
    engine.shutdown()


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 151643) for _ in range(length)]


def peft_greedy(model, ids: list[int], n: int, base: bool = False) -> list[int]:
    if base:
        with model.disable_adapter():
            return greedy_tokens(model, ids, n)
    return greedy_tokens(model, ids, n)


def test_prefill_logits_of_a_mixed_batch_match_peft(engine, adapters):
    """One forward over the base model's, each adapter's rows: each block of logits equals that
    model's in PEFT (or the bare base model's)."""
    cases = [(None, 9), ("all", 17), ("qv", 5), ("all", 3), (None, 12)]
    seqs = [Sequence(prompt(i, n), SamplingParams(), engine.block_manager.block_size,
                     lora=engine.loras[name] if name else None) for i, (name, n) in enumerate(cases)]
    for seq in seqs:
        engine.block_manager.allocate(seq)
        seq.num_scheduled_tokens = seq.num_uncomputed_tokens
    try:
        input_ids, positions, meta, _ = engine.runner.prepare(seqs, [])
        with torch.inference_mode():
            hidden = engine.runner._forward(input_ids, positions, meta, seqs)
            ours = engine.runner.model.compute_logits(hidden)
    finally:
        for seq in seqs:
            engine.block_manager.deallocate(seq)
    start = 0
    for (name, _), seq in zip(cases, seqs):
        model = adapters[name or "all"][1]
        with torch.no_grad():
            if name is None:
                with model.disable_adapter():
                    ref = model(torch.tensor([seq.token_ids])).logits[0]
            else:
                ref = model(torch.tensor([seq.token_ids])).logits[0]
        torch.testing.assert_close(ours[start : start + len(seq)], ref, atol=1e-4, rtol=1e-4)
        start += len(seq)


def test_each_adapter_generates_what_peft_does_alone_and_side_by_side(engine, adapters):
    """Greedy tokens: each request alone (a one-sequence decode, which the CPU kernel would take
    for the bare model), then all of them at once with the base model between them."""
    ids = prompt(7, 21)
    expected = {name: peft_greedy(model, ids, 12) for name, (_, model) in adapters.items()}
    expected[None] = peft_greedy(adapters["all"][1], ids, 12, base=True)
    assert len({tuple(tokens) for tokens in expected.values()}) == 3  # the adapters change the answer
    for name, tokens in expected.items():
        assert _generate(engine, ids, name).token_ids() == tokens, name
    collectors = {}
    for i, name in enumerate([None, "all", "qv", None, "qv", "all"]):
        collectors[(i, name)] = Collector()
        engine.add_request(f"mixed-{i}", ids, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                           collectors[(i, name)], lora_name=name)
    for (_, name), collector in collectors.items():
        collector.wait()
        assert collector.token_ids() == expected[name], name


def _generate(engine, ids, lora_name, **params):
    collector = Collector()
    _generate.counter += 1
    engine.add_request(f"lora-{_generate.counter}", ids, SamplingParams(
        **{"max_tokens": 12, "temperature": 0.0, "ignore_eos": True, **params}), collector, lora_name=lora_name)
    collector.wait()
    return collector


_generate.counter = 0


def test_the_prefix_cache_is_per_adapter(engine, adapters):
    """The same 70-token prompt through the base model, then an adapter: the adapter's answer is
    its own (the base model's cached blocks are not its keys and values); asked again through the
    same adapter, its prompt comes from the cache."""
    ids = prompt(11, 70)
    generate(engine, ids, max_tokens=4, temperature=0.0, ignore_eos=True)
    first = _generate(engine, ids, "all")
    assert first.token_ids() == peft_greedy(adapters["all"][1], ids, 12)
    assert first.final().usage.cached_prompt_tokens == 0
    again = _generate(engine, ids, "all")
    assert again.token_ids() == first.token_ids()
    assert again.final().usage.cached_prompt_tokens == 64  # 4 blocks of 16; the last token is always computed
    assert _generate(engine, ids, "qv").final().usage.cached_prompt_tokens == 0
    wait_idle(engine)


def test_an_adapter_not_loaded_is_not_found_and_loads_at_runtime(engine, adapters, tmp_path):
    with pytest.raises(NotFound, match="'extra' is not loaded"):
        _generate(engine, prompt(1, 5), "extra")
    path = adapters["qv"][0]
    engine.load_lora("extra", str(path))
    try:
        assert [a.name for a in engine.model_info().lora_adapters] == ["all", "qv", "extra"]
        assert _generate(engine, prompt(3, 9), "extra").token_ids() == peft_greedy(adapters["qv"][1], prompt(3, 9), 12)
        with pytest.raises(InvalidRequest, match="already the name of a loaded adapter"):
            engine.load_lora("extra", str(path))
    finally:
        engine.unload_lora("extra")
    with pytest.raises(NotFound):
        _generate(engine, prompt(1, 5), "extra")
    with pytest.raises(NotFound):
        engine.unload_lora("extra")
    wait_idle(engine)


def test_unloading_lets_running_requests_finish_with_their_adapter(engine, adapters):
    ids = prompt(5, 13)
    engine.load_lora("brief", str(adapters["all"][0]))
    collector = Collector()
    engine.add_request("unloaded-meanwhile", ids, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                       collector, lora_name="brief")
    engine.unload_lora("brief")
    collector.wait()
    assert collector.token_ids() == peft_greedy(adapters["all"][1], ids, 40)
    wait_idle(engine)


def _adapter_dir(tmp_path, base, **config_changes):
    """A copy of the adapter `base` with its adapter_config.json changed."""
    import shutil

    shutil.copytree(base, tmp_path / "copy")
    config = json.loads((tmp_path / "copy" / "adapter_config.json").read_text())
    config.update(config_changes)
    (tmp_path / "copy" / "adapter_config.json").write_text(json.dumps(config))
    return tmp_path / "copy"


@pytest.mark.parametrize("change, message", [
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "trained biases"),
    ({"alpha_pattern": {"q_proj": 4}}, "alpha_pattern"),
    ({"peft_type": "IA3"}, "peft_type 'IA3'"),
])
def test_adapters_it_cannot_serve_exactly_are_refused_by_name(engine, adapters, tmp_path, change, message):
    with pytest.raises(InvalidRequest, match=message) as caught:
        engine.load_lora("odd", str(_adapter_dir(tmp_path, adapters["qv"][0], **change)))
    assert caught.value.field == "lora_path"
    assert "odd" not in engine.loras


def test_a_missing_directory_an_oversized_rank_and_another_models_adapter_are_refused(engine, adapters, tmp_path,
                                                                                       tied_model_dir):
    with pytest.raises(InvalidRequest, match="no adapter_config.json"):
        engine.load_lora("gone", str(tmp_path / "nowhere"))
    big = write_lora_adapter(tied_model_dir, tmp_path / "big", targets=ATTENTION, rank=80, alpha=16)
    del big
    with pytest.raises(InvalidRequest, match="rank 80 is above --max-lora-rank 64"):
        engine.load_lora("big", str(tmp_path / "big"))
    from safetensors.torch import load_file, save_file

    tensors = load_file(adapters["qv"][0] / "adapter_model.safetensors")
    wide = {key: torch.zeros(t.shape[0], 2 * t.shape[1]) if "lora_A" in key else t for key, t in tensors.items()}
    (tmp_path / "wide").mkdir()
    (tmp_path / "wide" / "adapter_config.json").write_text((adapters["qv"][0] / "adapter_config.json").read_text())
    save_file(wide, tmp_path / "wide" / "adapter_model.safetensors")
    with pytest.raises(InvalidRequest, match=r"this model needs \[r, 64\]"):
        engine.load_lora("wide", str(tmp_path / "wide"))
    assert set(engine.loras) == {"all", "qv"}


def test_an_engine_without_lora_refuses_to_load_one(tied_model_dir, adapters):
    engine = make_engine(tied_model_dir)
    try:
        with pytest.raises(Unsupported, match="--enable-lora"):
            engine.load_lora("all", str(adapters["all"][0]))
        with pytest.raises(NotFound):
            _generate(engine, prompt(1, 5), "all")
        assert not engine.model_info().lora_enabled
    finally:
        engine.shutdown()


def test_an_embedding_or_score_runner_refuses_lora_at_start(embedding_checkpoint, tied_model_dir):
    for model, runner in ((embedding_checkpoint[0], "auto"), (tied_model_dir, "score")):
        with pytest.raises(InvalidRequest, match="generate runner only"):
            make_engine(model, runner=runner, enable_lora=True)
