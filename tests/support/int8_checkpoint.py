"""Writes an int8 copy of a full-precision checkpoint directory in the compressed-tensors W8A8
layout that llm-compressor writes and vLLM and SGLang serve (`*-quantized.w8a8`): each linear's
`weight` in int8 with a `weight_scale` [N, 1] per output channel, a config saying the activations
are quantized per token at run time, and the modules of `ignore` left in full precision."""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def int8_quantization_config(ignore: list[str], weights: dict | None = None) -> dict:
    """config.json's quantization_config, as llm-compressor's W8A8 int8 preset writes it."""
    return {
        "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": weights or {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                                   "dynamic": False, "group_size": None, "observer": "minmax"},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                  "dynamic": True, "group_size": None, "observer": None},
            "output_activations": None}},
        "ignore": ignore,
    }


def write_int8_checkpoint(src: Path, dst: Path, ignore: list[str], weights: dict | None = None) -> None:
    """Every decoder linear (and the LM head, unless `ignore` names it or the model ties it) in int8."""
    shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("model.safetensors"))  # written below
    tensors = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        module = name.removesuffix(".weight")
        linear = name.endswith(tuple(f"{p}.weight" for p in LINEARS)) or name == "lm_head.weight"
        if linear and module not in ignore:
            w = tensor.float()
            scale = w.abs().amax(dim=1, keepdim=True) / 127
            tensors[name] = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
            tensors[module + ".weight_scale"] = scale  # [N, 1], float32
        else:
            tensors[name] = tensor
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = int8_quantization_config(ignore, weights)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
