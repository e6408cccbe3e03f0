"""Quantized checkpoints: which load, and how their weights become the model's dtype.

FP8 checkpoints load, as Qwen publishes them (Qwen/Qwen3-8B-FP8: `quant_method: fp8`, e4m3
weights with one `weight_scale_inv` per 128x128 block, the format DeepSeek-V3 introduced) and as
AutoFP8 / vLLM write them (one `weight_scale` per tensor). Each weight is dequantized once at load,
w = q * scale, into the engine's dtype: the model then runs, and answers, as the full-precision
model with those weights (memory and speed as that model's; activations are not quantized).

Int8 checkpoints in the compressed-tensors W8A8 layout load as they are (what vLLM and SGLang
serve as `*-quantized.w8a8`, written by llm-compressor): `quant_method: compressed-tensors`,
format `int-quantized`, weights int8 with one `weight_scale` per output channel, activations
quantized per token at run time (dynamic); modules in its `ignore` list keep the checkpoint's
full-precision weights. They run as layers/int8.py's Int8Linear, as `--quantization int8` does.

4-bit checkpoints (AWQ GEMM, GPTQ, compressed-tensors pack-quantized W4A16) load as they are
written into layers/int4.py's Int4Linear: models/int4_formats.py. Other methods (bitsandbytes,
HQQ, EETQ, ...) and other compressed-tensors schemes are refused by name.
"""

from dataclasses import dataclass

import torch

from xserv_engine.errors import ModelLoadError
from xserv_engine.models.int4_formats import (Int4Checkpoint, awq_checkpoint, compressed_int4_checkpoint,
                                              gptq_checkpoint)

FP8_DTYPES = (torch.float8_e4m3fn,)
SCALE_SUFFIXES = ("_scale_inv", "_scale")  # weight_scale_inv (blocks), weight_scale (per tensor), input_scale


@dataclass(frozen=True)
class Fp8Checkpoint:
    block: tuple[int, int] | None  # (rows, columns) of the weight each scale covers; None: the whole tensor

    @property
    def scale_suffix(self) -> str:
        return "_scale_inv" if self.block else "_scale"

    @staticmethod
    def is_scale(name: str) -> bool:
        """A scale tensor: read with its weight (weight_*), or not needed (input_scale: activations
        stay in the model's dtype)."""
        return name.endswith(SCALE_SUFFIXES)

    def dequantize(self, name: str, weight: torch.Tensor, scale: torch.Tensor | None,
                   dtype: torch.dtype) -> torch.Tensor:
        """weight [N, K] in fp8, scale [ceil(N / rows), ceil(K / columns)] (or one value) -> [N, K]."""
        if scale is None:
            raise ModelLoadError(f"fp8 tensor {name} has no {name}{self.scale_suffix} beside it")
        scale = scale.float()
        if self.block is None:
            if scale.numel() != 1:
                raise ModelLoadError(f"{name}{self.scale_suffix}: one scale per tensor expected, got shape "
                                     f"{tuple(scale.shape)}")
            return (weight.float() * scale.reshape(())).to(dtype)
        rows, cols = self.block
        n, k = weight.shape
        expected = (-(-n // rows), -(-k // cols))
        if tuple(scale.shape) != expected:
            raise ModelLoadError(f"{name}{self.scale_suffix}: shape {tuple(scale.shape)}, expected {expected} for a "
                                 f"{n}x{k} weight in {rows}x{cols} blocks")
        per_element = scale.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]
        return (weight.float() * per_element).to(dtype)


@dataclass(frozen=True)
class Int8Checkpoint:
    """compressed-tensors W8A8 int8: int8 weights, per-channel weight_scale, dynamic per-token activations."""

    @staticmethod
    def is_scale(name: str) -> bool:
        return name.endswith(("weight_scale", "weight_zero_point", "input_scale", "input_zero_point"))


# what each config group of a W8A8 int8 checkpoint must say (compressed-tensors' QuantizationArgs)
_INT8_WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
_INT8_ACTIVATIONS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}


def _compressed_tensors(spec: dict, where: str) -> Int8Checkpoint:
    supported = ("xserv loads compressed-tensors W8A8 int8 checkpoints (int8 weights per channel, dynamic per-token "
                 "int8 activations) and pack-quantized W4A16 ones")
    if spec.get("format") not in ("int-quantized", None):
        raise ModelLoadError(f"{where}: compressed-tensors format {spec.get('format')!r} is not supported; {supported}")
    groups = spec.get("config_groups") or {}
    if not groups:
        raise ModelLoadError(f"{where}: compressed-tensors config has no config_groups; {supported}")
    for name, group in groups.items():
        for field, wanted in (("weights", _INT8_WEIGHTS), ("input_activations", _INT8_ACTIVATIONS)):
            args = group.get(field) or {}
            wrong = {k: args.get(k) for k, v in wanted.items() if args.get(k) != v}
            if wrong:
                raise ModelLoadError(f"{where}: config_groups.{name}.{field} has {wrong}, expected {wanted}; "
                                     f"{supported}")
    return Int8Checkpoint()


def checkpoint_quantization(hf_config: dict, where: str) -> Fp8Checkpoint | Int8Checkpoint | Int4Checkpoint | None:
    """config.json's quantization_config as a loader, None for a full-precision checkpoint;
    ModelLoadError for a method xserv cannot load."""
    spec = hf_config.get("quantization_config")
    if not spec:
        return None
    method = spec.get("quant_method")
    if method == "compressed-tensors":
        if spec.get("format") == "pack-quantized":
            return compressed_int4_checkpoint(spec, where)
        return _compressed_tensors(spec, where)
    if method == "awq":
        return awq_checkpoint(spec, where)
    if method == "gptq":
        return gptq_checkpoint(spec, where)
    if method != "fp8":
        raise ModelLoadError(f"{where}: quantization method {method!r} is not supported; xserv loads full-precision "
                             "checkpoints, fp8 ones (e.g. Qwen/Qwen3-8B-FP8), compressed-tensors W8A8 int8 and W4A16 "
                             "ones, AWQ and GPTQ 4-bit ones")
    if spec.get("fmt", "e4m3") != "e4m3":
        raise ModelLoadError(f"{where}: fp8 format {spec['fmt']!r} is not supported (only e4m3)")
    block = spec.get("weight_block_size")
    if block is not None and (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelLoadError(f"{where}: weight_block_size must be two positive integers, got {block!r}")
    return Fp8Checkpoint(tuple(block) if block else None)
