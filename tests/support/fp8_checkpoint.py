"""Writes an fp8 copy of a full-precision checkpoint directory in the layout Qwen publishes
(Qwen/Qwen3-8B-FP8: every decoder-layer projection in e4m3 with a `weight_scale_inv` per block,
embeddings, norms and the LM head as they were), or, with block=None, AutoFP8's (one
`weight_scale` per tensor, plus an `input_scale`)."""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# a hybrid model's Gated DeltaNet projections beside them (its small in_proj_b / in_proj_a stay as they are)
HYBRID_PROJECTIONS = PROJECTIONS + ("in_proj_qkv", "in_proj_z", "out_proj")
E4M3_MAX = 448.0


def write_fp8_checkpoint(src: Path, dst: Path, block: tuple[int, int] | None, projections=PROJECTIONS) -> None:
    shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("model.safetensors"))  # written below
    weights = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        if name.startswith("model.layers.") and name.endswith(tuple(f".{p}.weight" for p in projections)):
            weights[name], scale = quantize(tensor, block)
            weights[name + ("_scale_inv" if block else "_scale")] = scale
            if block is None:
                weights[name.removesuffix("weight") + "input_scale"] = torch.tensor(0.5)
        else:
            weights[name] = tensor
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "static" if block is None else "dynamic",
                                     "fmt": "e4m3", "quant_method": "fp8"}
    if block is not None:
        config["quantization_config"]["weight_block_size"] = list(block)
    (dst / "config.json").write_text(json.dumps(config, indent=2))


def quantize(weight: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, scale): per block as Qwen's bf16 scales, or one float32 scale."""
    w = weight.float()
    if block is None:
        scale = w.abs().max() / E4M3_MAX
        return (w / scale).to(torch.float8_e4m3fn), scale.reshape(1)
    rows, cols = block
    n, k = w.shape
    blocks = w.reshape(n // rows, rows, k // cols, cols)  # shapes divide the block, as in Qwen's releases
    scale = (blocks.abs().amax(dim=(1, 3)) / E4M3_MAX).to(torch.bfloat16)
    per_element = scale.float().repeat_interleave(rows, 0).repeat_interleave(cols, 1)
    return (w / per_element).to(torch.float8_e4m3fn), scale
