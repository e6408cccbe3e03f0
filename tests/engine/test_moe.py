"""Qwen3-MoE: same weights, same answers as transformers' Qwen3MoeForCausalLM (fp32), with the
experts run by the grouped matmul and by the op's plain-torch fallback."""

import json
import random
import shutil

import pytest
import torch

from tests.engine.conftest import Collector, make_engine, wait_idle
from tests.engine.test_fidelity import hf_greedy
from tests.support.fp8_checkpoint import write_fp8_checkpoint
from tests.support.hf_reference import greedy_tokens
from tests.support.moe_checkpoint import SHAPES, write_moe_checkpoint
from xserv_engine.errors import ModelLoadError
from xserv_engine.layers import fused_moe
from xserv_engine.models.loader import read_model_dir
from xserv_engine.sampling_params import SamplingParams

PROMPT_LENGTHS = [5, 17, 1, 33, 12, 40]


@pytest.fixture(scope="module", params=list(SHAPES), ids=list(SHAPES))
def moe_dir(request, tmp_path_factory, demo_dir):
    path = tmp_path_factory.mktemp("moe")
    return path, write_moe_checkpoint(path, demo_dir, request.param)


@pytest.fixture(params=["native", "grouped", "loop"])
def experts_impl(request):
    """Every step's experts through one implementation of the op (the CPU kernel, torch's grouped
    matmul, the plain-torch loop), whatever its size."""
    fused_moe.force_implementation(request.param)
    yield request.param
    fused_moe.force_implementation(None)


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 151643) for _ in range(n)] for n in PROMPT_LENGTHS]


def test_the_checkpoint_is_read_as_an_moe_model(moe_dir):
    path, model = moe_dir
    config = read_model_dir(str(path)).config
    assert config.num_experts == model.config.num_experts
    assert [config.is_moe_layer(i) for i in range(config.num_hidden_layers)] == [
        type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in model.model.layers]


def test_prefill_logits_match_transformers(moe_dir, experts_impl):
    path, model = moe_dir
    engine = make_engine(path, max_num_seqs=8)
    try:
        for prompt in prompts(1)[:3]:
            collector = Collector()
            engine.add_request(f"plp-{experts_impl}-{len(prompt)}", prompt,
                               SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1), collector)
            got = [lp.logprob for lp in collector.wait()[0].prompt_logprobs[1:]]
            with torch.no_grad():
                ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1], dim=-1)
            want = [ref[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
            assert got == pytest.approx(want, abs=1e-4)
    finally:
        engine.shutdown()


def test_greedy_batch_with_chunked_prefill_equals_transformers_generate(moe_dir, experts_impl):
    # several prompts at once, a 16-token budget: long prompts are prefilled in chunks beside decodes
    path, model = moe_dir
    engine = make_engine(path, max_num_seqs=8, max_num_batched_tokens=16)
    try:
        batch = prompts(2)
        collectors = [Collector() for _ in batch]
        for i, prompt in enumerate(batch):
            engine.add_request(f"moe-{experts_impl}-{i}", prompt,
                               SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), collectors[i])
        for i, prompt in enumerate(batch):
            collectors[i].wait()
            assert collectors[i].token_ids() == hf_greedy(model, tuple(prompt), 12), f"prompt {i}"
        wait_idle(engine)
        stats = engine.stats()
        assert stats.free_blocks == stats.total_blocks
    finally:
        engine.shutdown()


def test_prefix_cache_hit_gives_the_same_greedy_tokens(moe_dir):
    path, model = moe_dir
    engine = make_engine(path)
    try:
        prompt = prompts(3)[5]  # 40 tokens: two full 16-token blocks to reuse
        first, again = Collector(), Collector()
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        engine.add_request("moe-cache-1", prompt, params, first)
        first.wait()
        engine.add_request("moe-cache-2", prompt, params, again)
        again.wait()
        assert again.final().usage.cached_prompt_tokens == 32
        assert again.token_ids() == first.token_ids() == hf_greedy(model, tuple(prompt), 8)
    finally:
        engine.shutdown()


def test_block_scaled_fp8_moe_checkpoint_loads(moe_dir, tmp_path):
    # Qwen's FP8 MoE releases: every expert projection block-scaled, the router left in bf16
    path, _ = moe_dir
    write_fp8_checkpoint_any_layout(path, tmp_path)
    engine = make_engine(tmp_path)
    try:
        collector = Collector()
        engine.add_request("moe-fp8", prompts(4)[1], SamplingParams(max_tokens=4, temperature=0.0), collector)
        assert len(collector.wait() and collector.token_ids()) == 4
    finally:
        engine.shutdown()


def write_fp8_checkpoint_any_layout(src, dst):
    """write_fp8_checkpoint reads one model.safetensors: join a sharded checkpoint first."""
    from safetensors.torch import load_file, save_file

    index = src / "model.safetensors.index.json"
    if not index.is_file():
        write_fp8_checkpoint(src, dst, (16, 16))
        return
    joined = dst / "joined"
    shutil.copytree(src, joined)
    tensors = {}
    for file in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        tensors.update(load_file(joined / file))
        (joined / file).unlink()
    (joined / "model.safetensors.index.json").unlink()
    save_file(tensors, joined / "model.safetensors", metadata={"format": "pt"})
    write_fp8_checkpoint(joined, dst, (16, 16))
    shutil.rmtree(joined)


def test_a_checkpoint_missing_an_expert_is_refused_by_name(moe_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = moe_dir
    write_fp8_checkpoint_any_layout(path, tmp_path)  # one file, whatever the source layout
    config = read_model_dir(str(path)).config
    layer = next(i for i in range(config.num_hidden_layers) if config.is_moe_layer(i))
    weights = load_file(tmp_path / "model.safetensors")
    name = f"model.layers.{layer}.mlp.experts.1.up_proj.weight"
    del weights[name], weights[name + "_scale_inv"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=rf"model\.layers\.{layer}\.mlp\.experts\.w13_weight#1\.up_proj"):
        make_engine(tmp_path)


def test_fused_experts_op_equals_a_loop_over_tokens():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 16, generator=gen)
    w13, w2 = torch.randn(5, 2 * 8, 16, generator=gen), torch.randn(5, 16, 8, generator=gen)
    weights, ids = fused_moe.route(torch.randn(9, 5, generator=gen), top_k=2, normalize=True)
    want = torch.zeros_like(x)
    for t in range(9):
        for k in range(2):
            gate, up = (w13[ids[t, k]] @ x[t]).chunk(2)
            want[t] += weights[t, k] * (w2[ids[t, k]] @ (torch.nn.functional.silu(gate) * up))
    for impl in ("native", "grouped", "loop"):
        fused_moe.force_implementation(impl)
        torch.testing.assert_close(torch.ops.xserv.fused_experts(x, w13, w2, weights, ids), want,
                                   atol=1e-4, rtol=1e-4, msg=impl)
    fused_moe.force_implementation(None)


@pytest.mark.parametrize("tokens", [1, 3, 8, 40])
def test_bf16_kernel_agrees_with_the_grouped_matmul(tokens):
    # the CPU kernel rounds as torch does up to the final weighted sum, which it adds in fp32
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 128, generator=gen).bfloat16()
    w13 = (torch.randn(16, 2 * 48, 128, generator=gen) * 0.1).bfloat16()
    w2 = (torch.randn(16, 128, 48, generator=gen) * 0.1).bfloat16()
    weights, ids = fused_moe.route(torch.randn(tokens, 16, generator=gen).bfloat16(), top_k=4, normalize=True)
    results = {}
    for impl in ("native", "grouped"):
        fused_moe.force_implementation(impl)
        results[impl] = torch.ops.xserv.fused_experts(x, w13, w2, weights, ids).float()
    fused_moe.force_implementation(None)
    torch.testing.assert_close(results["native"], results["grouped"], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows_per_expert", ["one", "many"])
def test_the_cpu_kernel_agrees_with_the_torch_loop_on_uneven_shapes(dtype, rows_per_expert):
    # hidden 100, intermediate 42: no multiple of the kernel's 32-wide loads, 4-row weight tiles or
    # 16- and 32-channel work items; "one": each expert one row, "many": 13 tokens on the same 3
    # experts (tiles of 4 rows of x, then the rest)
    gen = torch.Generator().manual_seed(7)
    if rows_per_expert == "one":
        tokens, experts = 5, 40
        ids = torch.randperm(experts, generator=gen).view(tokens, 8)
    else:
        tokens, experts = 13, 8
        ids = torch.stack([torch.randperm(3, generator=gen) for _ in range(tokens)])
    weights = torch.softmax(torch.randn(ids.shape, generator=gen), dim=-1).to(dtype)
    x = torch.randn(tokens, 100, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * 42, 100, generator=gen) * 0.1).to(dtype)
    w2 = (torch.randn(experts, 100, 42, generator=gen) * 0.1).to(dtype)
    results = {}
    for impl in ("native", "loop"):
        fused_moe.force_implementation(impl)
        results[impl] = torch.ops.xserv.fused_experts(x, w13, w2, weights, ids).float()
    fused_moe.force_implementation(None)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(results["native"], results["loop"], atol=tolerance, rtol=tolerance)


def test_attention_lora_is_served_and_expert_adapters_are_refused_by_name(moe_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from tests.support.lora_adapter import write_lora_adapter
    from xserv_engine.errors import InvalidRequest

    path, _ = moe_dir
    peft_model = write_lora_adapter(path, tmp_path / "qv", targets=("q_proj", "v_proj"), rank=4, alpha=8, seed=3)
    engine = make_engine(path, enable_lora=True, lora_modules=(("qv", str(tmp_path / "qv")),))
    try:
        prompt = prompts(5)[1]
        collector = Collector()
        engine.add_request("moe-lora", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                           collector, lora_name="qv")
        collector.wait()
        assert collector.token_ids() == greedy_tokens(peft_model, prompt, 8)
        config = read_model_dir(str(path)).config
        layer = next(i for i in range(config.num_hidden_layers) if config.is_moe_layer(i))
        tensors = load_file(tmp_path / "qv" / "adapter_model.safetensors")
        prefix = f"base_model.model.model.layers.{layer}.mlp.experts.0.gate_proj"
        tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = torch.zeros(4, 64), torch.zeros(32, 4)
        save_file(tensors, tmp_path / "qv" / "adapter_model.safetensors")
        with pytest.raises(InvalidRequest, match=f"layers.{layer}.mlp.experts.0.gate_proj.* mixture-of-experts"):
            engine.load_lora("experts", str(tmp_path / "qv"))
    finally:
        engine.shutdown()
