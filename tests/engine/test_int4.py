"""4-bit weights: AWQ, GPTQ and compressed-tensors W4A16 checkpoints answer, at fp32, exactly as
transformers does on the same weights dequantized; each format's bits read as its spec writes
them; `--quantization int4` close to the full-precision model; refusals by name."""

import functools
import json
import random

import pytest
import torch

from tests.engine.conftest import generate, make_engine
from tests.support.hf_reference import greedy_tokens
from tests.support.hybrid_checkpoint import write_hybrid_checkpoint
from tests.support.int4_checkpoint import HYBRID_LINEARS, write_int4_checkpoint
from tests.support.moe_checkpoint import write_moe_checkpoint
from xserv_engine.engine.engine_setup import _check_quantization
from xserv_engine.errors import InvalidRequest, ModelLoadError
from xserv_engine.layers import int4
from xserv_engine.models.int4_formats import Int4Checkpoint
from xserv_engine.models.loader import read_model_dir

PROMPTS = [[random.Random(n).randrange(0, 151643) for _ in range(n)] for n in (7, 30, 1)]


@functools.lru_cache(maxsize=1)  # the tests ask for several prompts of one checkpoint in a row
def _hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path, prompt: list[int], max_new_tokens: int = 12) -> list[int]:
    return greedy_tokens(_hf_model(path), prompt, max_new_tokens)


def greedy(engine, prompt: list[int], max_new_tokens: int = 12) -> list[int]:
    return generate(engine, prompt, max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True).token_ids()


# -- each format's bits, against its spec ---------------------------------------------------------

def _dequantized(fmt: str, parts: dict) -> torch.Tensor:
    return int4.dequantize(Int4Checkpoint(fmt, zeros_minus_one=fmt == "gptq").weight("m", parts))


def test_awq_nibbles_hold_output_channels_in_its_interleaved_order():
    # AutoAWQ packs channels 0, 2, 4, 6, 1, 3, 5, 7 of each 8 into nibbles 0..7
    qweight = torch.tensor([[0x76543210]], dtype=torch.int32).expand(8, 1).contiguous()  # K=8, N=8
    qzeros = torch.zeros(1, 1, dtype=torch.int32)
    w = _dequantized("awq", {"qweight": qweight, "qzeros": qzeros, "scales": torch.ones(1, 8, dtype=torch.float16)})
    assert w[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]  # channel n's value: the nibble that holds it


def test_gptq_v1_zeros_are_stored_minus_one_and_read_as_transformers_does():
    # zeros 0..7, stored as their packed sum minus 0x11111111 (zero 0 borrows from its neighbour)
    qzeros = torch.tensor([[0x654320FF]], dtype=torch.int32)
    qweight = torch.full((1, 8), 0x00000009, dtype=torch.int32)  # K=8: input channel 0 is 9, the rest 0
    scales = torch.full((1, 8), 0.5, dtype=torch.float16)
    w = _dequantized("gptq", {"qweight": qweight, "qzeros": qzeros, "scales": scales})
    assert w[:, 0].tolist() == [(9 - z) * 0.5 for z in range(8)]
    assert w[:, 1].tolist() == [-z * 0.5 for z in range(8)]


def test_compressed_tensors_values_are_offset_by_8_along_input_channels():
    packed = torch.tensor([[0x76543210], [0xFEDCBA98 - 2**32]], dtype=torch.int32)  # N=2, K=8
    scale = torch.tensor([[1.0], [2.0]], dtype=torch.bfloat16)
    w = _dequantized("compressed-tensors", {"weight_packed": packed, "weight_scale": scale,
                                            "weight_shape": torch.tensor([2, 8])})
    assert w.tolist() == [[float(i - 8) for i in range(8)], [2.0 * i for i in range(8)]]


def test_quantizing_at_load_keeps_each_weight_within_half_a_step():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 256, generator=gen) * torch.linspace(0.01, 1, 48)[:, None]
    q = int4.quantize_weight(w)
    assert q.group_size == 128 and q.scales.shape == (48, 2)
    err = (int4.dequantize(q) - w).abs().reshape(48, 2, 128)
    assert bool((err <= q.scales.unsqueeze(-1) / 2 * 1.0001).all())
    assert (int4.dequantize(q) - w).norm() / w.norm() < 0.1


# -- checkpoints against transformers --------------------------------------------------------------

FORMATS = {  # name -> write_int4_checkpoint arguments
    "awq": dict(fmt="awq"),
    "gptq-v1-asymmetric-act-order": dict(fmt="gptq", act_order=True),
    "gptq-v1-symmetric": dict(fmt="gptq", symmetric=True),
    "compressed-tensors-group": dict(fmt="compressed-tensors", symmetric=True),
    "compressed-tensors-channel-asymmetric": dict(fmt="compressed-tensors", group=0),
}


@pytest.fixture(scope="module", params=list(FORMATS))
def int4_dirs(request, tmp_path_factory, hf_models):
    src, _ = hf_models(False)  # untied: the LM head stays in full precision beside 4-bit layers
    root = tmp_path_factory.mktemp(request.param)
    write_int4_checkpoint(src, root / "int4", root / "dequantized", **FORMATS[request.param])
    return root / "int4", root / "dequantized"


def test_a_4bit_checkpoint_answers_as_transformers_on_its_dequantized_weights(int4_dirs):
    path, dequantized = int4_dirs
    engine = make_engine(path)
    try:
        model = engine.runner.model
        assert type(model.model.layers[0].self_attn.qkv_proj).__name__ == "Int4Linear"
        assert type(model.model.layers[1].mlp.down_proj).__name__ == "Int4Linear"
        assert type(model.lm_head).__name__ != "Int4Linear"
        assert engine.model_info().quantization == "int4"
        for prompt in PROMPTS:
            assert greedy(engine, prompt) == hf_greedy(dequantized, prompt)
    finally:
        engine.shutdown()


def test_modules_not_converted_stay_in_full_precision(tmp_path, hf_models):
    # k_proj alone in full precision: qkv_proj mixes both, and is served with its 4-bit parts dequantized
    src, _ = hf_models(False)
    ignore = ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.k_proj"]
    write_int4_checkpoint(src, tmp_path / "int4", tmp_path / "dequantized", fmt="awq", ignore=ignore)
    assert json.loads((tmp_path / "int4/config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    engine = make_engine(tmp_path / "int4")
    try:
        layers = engine.runner.model.model.layers
        assert type(layers[0].mlp.down_proj).__name__ != "Int4Linear"
        assert type(layers[1].self_attn.qkv_proj).__name__ != "Int4Linear"
        assert type(layers[0].self_attn.qkv_proj).__name__ == "Int4Linear"
        assert greedy(engine, PROMPTS[1]) == hf_greedy(tmp_path / "dequantized", PROMPTS[1])
    finally:
        engine.shutdown()


def test_4bit_moe_experts_answer_as_transformers(tmp_path, demo_dir):
    write_moe_checkpoint(tmp_path / "src", demo_dir, "mlp-only-layer-1,normalized,untied,sharded")
    write_int4_checkpoint(tmp_path / "src", tmp_path / "int4", tmp_path / "dequantized", fmt="gptq", symmetric=True)
    engine = make_engine(tmp_path / "int4")
    try:
        mlp = engine.runner.model.model.layers[0].mlp
        assert type(mlp.experts).__name__ == "Int4Experts"
        assert type(mlp.gate).__name__ != "Int4Linear"  # the router stays as the checkpoint has it
        for prompt in PROMPTS[:2]:
            assert greedy(engine, prompt) == hf_greedy(tmp_path / "dequantized", prompt)
    finally:
        engine.shutdown()


def test_act_order_experts_are_refused_by_name(tmp_path, demo_dir):
    write_moe_checkpoint(tmp_path / "src", demo_dir, "mlp-only-layer-1,normalized,untied,sharded")
    write_int4_checkpoint(tmp_path / "src", tmp_path / "int4", tmp_path / "dequantized", fmt="gptq", act_order=True)
    with pytest.raises(ModelLoadError, match="experts.0.gate_proj.weight: act-order \\(desc_act\\) experts"):
        make_engine(tmp_path / "int4")


def test_quantization_int4_quantizes_moe_experts_as_it_says(tmp_path, demo_dir):
    # These random MoE models are chaotic (a tenth of noise on their linears flips the routing and
    # every top token), so the reference is transformers on the weights --quantization int4 says
    # it makes: each linear and each expert through quantize_weight, the LM head (tied: and the
    # embedding) through int8's. Only the head's W8A8 activations differ.
    from transformers import AutoModelForCausalLM

    from xserv_engine.layers import int8

    write_moe_checkpoint(tmp_path, demo_dir, "every-2nd-layer-sparse,unnormalized,tied")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("proj.weight", "experts.gate_up_proj", "experts.down_proj")):
                for w in (p if p.dim() == 3 else [p]):
                    w.copy_(int4.dequantize(int4.quantize_weight(w)))
            elif name == "lm_head.weight" or (name.endswith("embed_tokens.weight") and model.config.tie_word_embeddings):
                q, scale = int8.quantize_weight(p)
                p.copy_(q.float() * scale[:, None])
        reference = model(torch.tensor([PROMPTS[1]])).logits[0]
    engine = make_engine(tmp_path, quantization="int4", enable_prefix_caching=False)
    try:
        mlp = engine.runner.model.model.layers[1].mlp
        assert type(mlp.experts).__name__ == "Int4Experts"
        assert type(mlp.gate).__name__ not in ("Int4Linear", "Int8Linear")  # the router as it was
        logits = engine.engine.runner.prompt_logits(engine.engine.block_manager, [PROMPTS[1]])
    finally:
        engine.shutdown()
    assert (reference.argmax(-1) == logits.argmax(-1)).double().mean().item() >= 0.9


@pytest.mark.parametrize("fmt,in_proj", [("awq", "full precision"), ("compressed-tensors", "int4")])
def test_a_4bit_hybrid_checkpoint_answers_as_transformers(tmp_path, demo_dir, fmt, in_proj):
    # Qwen3.5: the gated q_proj split into q and gate rows, the Gated DeltaNet's projections. AWQ
    # cannot pack in_proj_b / in_proj_a (4 rows), so the fused in_proj mixes precisions and is
    # served dequantized; compressed-tensors packs along input channels and holds it in 4 bits.
    write_hybrid_checkpoint(tmp_path / "src", demo_dir, "qwen3_5,v4-over-k2,tied")
    linears = HYBRID_LINEARS + (("in_proj_b", "in_proj_a") if in_proj == "int4" else ())
    write_int4_checkpoint(tmp_path / "src", tmp_path / "int4", tmp_path / "dequantized", fmt=fmt, symmetric=True,
                          linears=linears)
    engine = make_engine(tmp_path / "int4")
    try:
        layers = engine.runner.model.model.layers
        assert type(layers[1].self_attn.qkv_proj).__name__ == "Int4Linear"
        assert type(layers[0].linear_attn.out_proj).__name__ == "Int4Linear"
        assert (type(layers[0].linear_attn.in_proj).__name__ == "Int4Linear") == (in_proj == "int4")
        for prompt in PROMPTS[:2]:
            assert greedy(engine, prompt) == hf_greedy(tmp_path / "dequantized", prompt)
    finally:
        engine.shutdown()


def test_quantization_int4_predicts_what_the_full_precision_model_predicts(hf_models):
    path, model = hf_models(False)
    prompt = [random.Random(5).randrange(0, 151643) for _ in range(60)]
    with torch.no_grad():
        reference = model(torch.tensor([prompt])).logits[0].double().log_softmax(-1)
    engine = make_engine(path, quantization="int4", enable_prefix_caching=False)
    try:
        assert type(engine.runner.model.model.layers[0].self_attn.qkv_proj).__name__ == "Int4Linear"
        assert type(engine.runner.model.lm_head).__name__ != "Int4Linear"
        assert engine.model_info().quantization == "int4"
        logits = engine.engine.runner.prompt_logits(engine.engine.block_manager, [prompt]).double().log_softmax(-1)
    finally:
        engine.shutdown()
    kl = (reference.exp() * (reference - logits)).sum(-1).mean().item()
    agree = (reference.argmax(-1) == logits.argmax(-1)).double().mean().item()
    # measured on this random model (K = 64: one group per row; logits of a few units): KL 0.27,
    # every top token the same; int8's KL on it is 0.004-0.008
    assert 1e-3 < kl < 0.5 and agree >= 0.9, (kl, agree)


# -- refusals --------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,change,says", [
    ("awq", {"version": "gemv"}, "awq version 'gemv'"),
    ("awq", {"bits": 8}, "awq bits 8"),
    ("awq", {"zero_point": False}, "awq zero_point False"),
    ("gptq", {"checkpoint_format": "marlin"}, "gptq checkpoint_format 'marlin'"),
    ("gptq", {"bits": 3}, "gptq bits 3"),
    ("gptq", {"dynamic": {"-:.*down_proj": {}}}, "gptq dynamic"),
    ("compressed-tensors", {"weights": {"num_bits": 8}}, "'num_bits': 8"),
    ("compressed-tensors", {"weights": {"strategy": "tensor"}}, "'strategy': 'tensor'"),
    ("compressed-tensors", {"input_activations": {"num_bits": 8, "type": "int"}}, "input_activations"),
])
def test_other_4bit_variants_are_refused_by_name(tmp_path, hf_models, fmt, change, says):
    src, _ = hf_models(False)
    write_int4_checkpoint(src, tmp_path / "int4", tmp_path / "dequantized", fmt=fmt)
    config = json.loads((tmp_path / "int4/config.json").read_text())
    spec = config["quantization_config"]
    if fmt == "compressed-tensors":
        group = spec["config_groups"]["group_0"]
        for key, value in change.items():
            group[key] = {**group[key], **value} if isinstance(group[key], dict) else value
    else:
        spec.update(change)
    (tmp_path / "int4/config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=says):
        read_model_dir(str(tmp_path / "int4"))


def test_int4_is_refused_on_cuda_and_beside_another_format(tmp_path, hf_models):
    src, _ = hf_models(False)
    write_int4_checkpoint(src, tmp_path / "int4", tmp_path / "dequantized", fmt="gptq")
    model_dir = read_model_dir(str(tmp_path / "int4"))
    with pytest.raises(InvalidRequest, match="int4 weights run on the CPU only"):
        _check_quantization(None, model_dir, torch.device("cuda"))
    with pytest.raises(InvalidRequest, match="int8 asked for, but the checkpoint's weights are int4 \\(gptq\\)"):
        _check_quantization("int8", model_dir, torch.device("cpu"))
