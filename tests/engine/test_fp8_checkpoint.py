"""FP8 checkpoints (Qwen/Qwen3-8B-FP8's layout, and AutoFP8's per-tensor one) load and answer as
transformers answers with the same checkpoint dequantized; other quantization methods are
refused by name."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engine.conftest import generate, make_engine
from tests.engine.test_fidelity import hf_greedy, prompts
from tests.engine.test_loader import load
from tests.support.fp8_checkpoint import write_fp8_checkpoint
from xserv_engine.errors import ModelLoadError
from xserv_engine.layers.attention import TorchAttentionBackend
from xserv_engine.models.loader import load_model, read_model_dir
from xserv_engine.models.quantization import Fp8Checkpoint
from xserv_engine.models.qwen3 import Qwen3ForCausalLM

BLOCK = (16, 32)  # not square, so that a scale read with its axes swapped cannot pass


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory, tied_model_dir):
    path = tmp_path_factory.mktemp("fp8-blocks")
    write_fp8_checkpoint(tied_model_dir, path, BLOCK)
    return path


@pytest.fixture(scope="module")
def hf_dequantized(fp8_dir):
    pytest.importorskip("accelerate", reason="transformers loads fp8 checkpoints only with accelerate (test extra)")
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    config = FineGrainedFP8Config(dequantize=True, weight_block_size=BLOCK)
    return AutoModelForCausalLM.from_pretrained(fp8_dir, quantization_config=config, dtype=torch.float32).eval()


def test_fp8_weights_are_what_transformers_dequantizes(fp8_dir, hf_dequantized, tied_model_dir):
    ours = load(fp8_dir).state_dict()
    hf = hf_dequantized.state_dict()
    layer = "model.layers.1."
    q, k, v = (hf[f"{layer}self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(ours[f"{layer}self_attn.qkv_proj.weight"], torch.cat([q, k, v]))
    gate, up = hf[f"{layer}mlp.gate_proj.weight"], hf[f"{layer}mlp.up_proj.weight"]
    assert torch.equal(ours[f"{layer}mlp.gate_up_proj.weight"], torch.cat([gate, up]))
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        assert torch.equal(ours[layer + name], hf[layer + name]), name
    original = load(tied_model_dir).state_dict()[f"{layer}mlp.down_proj.weight"]
    assert not torch.equal(original, ours[f"{layer}mlp.down_proj.weight"])  # the fp8 rounding is there
    torch.testing.assert_close(original, ours[f"{layer}mlp.down_proj.weight"], atol=0.1, rtol=0.07)


def test_engine_on_an_fp8_checkpoint_answers_as_transformers_with_it_dequantized(fp8_dir, hf_dequantized):
    engine = make_engine(fp8_dir)
    try:
        for prompt in prompts(3)[:4]:
            got = generate(engine, prompt, max_tokens=24, temperature=0.0, ignore_eos=True).token_ids()
            assert got == hf_greedy(hf_dequantized, tuple(prompt), 24)
    finally:
        engine.shutdown()


def test_bf16_engine_answers_as_on_a_checkpoint_of_the_dequantized_weights(fp8_dir, hf_dequantized, tmp_path):
    model_dir = read_model_dir(str(fp8_dir))
    model = Qwen3ForCausalLM(model_dir.config, TorchAttentionBackend()).to(torch.bfloat16)
    load_model(model_dir, model, progress=False)
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(model.state_dict()[name], hf_dequantized.state_dict()[name].bfloat16())  # rounded once

    plain = tmp_path / "dequantized"
    shutil.copytree(fp8_dir, plain)
    config = json.loads((plain / "config.json").read_text())
    del config["quantization_config"]
    (plain / "config.json").write_text(json.dumps(config))
    weights = {k: v.contiguous() for k, v in hf_dequantized.state_dict().items() if k != "lm_head.weight"}
    save_file(weights, plain / "model.safetensors", metadata={"format": "pt"})
    answers = []
    for path in (fp8_dir, plain):
        engine = make_engine(path, dtype="bfloat16")
        try:
            answers.append([generate(engine, p, max_tokens=16, temperature=0.0, ignore_eos=True).token_ids()
                            for p in prompts(4)[:3]])
        finally:
            engine.shutdown()
    assert answers[0] == answers[1]


def test_per_tensor_fp8_checkpoint_loads_and_ignores_activation_scales(tmp_path, tied_model_dir):
    write_fp8_checkpoint(tied_model_dir, tmp_path, block=None)
    stored = load_file(tmp_path / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.weight"
    assert stored[name].dtype == torch.float8_e4m3fn and "model.layers.0.self_attn.o_proj.input_scale" in stored
    ours = load(tmp_path).state_dict()[name]
    assert torch.equal(ours, stored[name].float() * stored[name + "_scale"])


def test_blocks_at_the_edges_of_a_weight_that_they_do_not_divide():
    torch.manual_seed(0)
    weight = (torch.randn(37, 50) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 2) + 0.5  # ceil(37 / 16), ceil(50 / 32)
    got = Fp8Checkpoint((16, 32)).dequantize("w", weight, scale, torch.float32)
    for i in range(37):
        for j in range(50):
            assert got[i, j] == weight[i, j].float() * scale[i // 16, j // 32]


def _quantized_config(path, spec):
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = spec
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("method", ["bitsandbytes", "hqq"])  # AWQ and GPTQ load: tests/engine/test_int4.py
def test_other_quantization_methods_are_refused_by_name(tmp_path, tied_model_dir, method):
    write_fp8_checkpoint(tied_model_dir, tmp_path, BLOCK)
    _quantized_config(tmp_path, {"quant_method": method, "bits": 4})
    with pytest.raises(ModelLoadError, match=f"quantization method '{method}' is not supported.*fp8"):
        read_model_dir(str(tmp_path))


def test_compressed_tensors_schemes_other_than_w8a8_int8_are_refused_by_name(tmp_path, tied_model_dir):
    # e.g. llm-compressor's NVFP4 (its int8 W8A8 and W4A16 load: tests/engine/test_int8.py, test_int4.py)
    write_fp8_checkpoint(tied_model_dir, tmp_path, BLOCK)
    _quantized_config(tmp_path, {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                                 "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float"}}}})
    with pytest.raises(ModelLoadError, match="format 'nvfp4-pack-quantized' is not supported.*W8A8 int8"):
        read_model_dir(str(tmp_path))


def test_broken_fp8_checkpoints_are_refused_clearly(tmp_path, tied_model_dir):
    write_fp8_checkpoint(tied_model_dir, tmp_path, BLOCK)
    _quantized_config(tmp_path, {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": list(BLOCK)})
    with pytest.raises(ModelLoadError, match="fp8 format 'e5m2' is not supported"):
        read_model_dir(str(tmp_path))
    _quantized_config(tmp_path, {"quant_method": "fp8", "weight_block_size": [BLOCK[1], BLOCK[0]]})
    with pytest.raises(ModelLoadError, match="expected"):  # the scales do not fit these blocks
        load(tmp_path)
    _quantized_config(tmp_path, {"quant_method": "fp8", "weight_block_size": list(BLOCK)})
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight_scale_inv"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="up_proj.weight has no .*weight_scale_inv"):
        load(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="is fp8 but config.json has no quantization_config"):
        load(tmp_path)
