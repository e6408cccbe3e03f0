"""Writes 4-bit copies of a full-precision checkpoint directory as AutoAWQ (GEMM), AutoGPTQ (v1)
and llm-compressor (compressed-tensors pack-quantized) write them, packed here by each format's
documented bit formula (not by xserv's unpacking code), and the same weights dequantized into an
ordinary fp32 checkpoint for transformers: W = (q - z) * s, per output channel and group.

Each linear is quantized by min/max per group with fp16 scales; then some groups' zero points are
set to 0 and some to 15 (and act-order shuffles the groups' channels), so that a misread nibble,
an off-by-one zero or a group read from the wrong channels changes the model's answers."""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# the hybrid models' Gated DeltaNet projections beside them (in_proj_b and in_proj_a have as many rows
# as value heads, too few for AWQ's and GPTQ's packing of output channels by 8)
HYBRID_LINEARS = LINEARS + ("in_proj_qkv", "in_proj_z", "out_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack order: nibble i holds output channel AWQ_ORDER[i] of 8


@dataclass
class Quantized:
    q: torch.Tensor  # int64 [N, K], 0..15
    z: torch.Tensor  # int64 [N, groups], 0..15
    s: torch.Tensor  # float16 [N, groups]
    g_idx: torch.Tensor  # int64 [K]: each input channel's group

    def dequantized(self) -> torch.Tensor:
        return (self.q - self.z[:, self.g_idx]).float() * self.s.float()[:, self.g_idx]


def quantize(w: torch.Tensor, group: int, gen: torch.Generator, order: torch.Tensor | None = None,
             symmetric: bool = False) -> Quantized:
    """order: act-order's input channels in the order GPTQ quantized them (groups are consecutive runs of it)."""
    n, k = w.shape
    order = torch.arange(k) if order is None else order
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // group
    groups = k // group
    members = [order[g * group : (g + 1) * group] for g in range(groups)]
    s, z = torch.empty(n, groups, dtype=torch.float16), torch.empty(n, groups, dtype=torch.int64)
    for g, cols in enumerate(members):
        block = w[:, cols].float()
        if symmetric:
            s[:, g] = (block.abs().amax(1) / 7).clamp(min=1e-4).half()
            z[:, g] = 8
        else:
            lo, hi = block.amin(1).clamp(max=0), block.amax(1).clamp(min=0)
            s[:, g] = ((hi - lo) / 15).clamp(min=1e-4).half()
            z[:, g] = torch.round(-lo / s[:, g].float()).clamp(0, 15).long()
    if not symmetric:  # the extreme zero points: nibbles 0x0 and 0xF
        pick = torch.rand(n, groups, generator=gen)
        z[pick < 0.1] = 0
        z[pick > 0.9] = 15
    q = torch.round(w.float() / s.float()[:, g_idx]) + z[:, g_idx]
    return Quantized(q.clamp(0, 15).long(), z, s, g_idx)


def pack_int32(values: torch.Tensor, dim: int) -> torch.Tensor:
    """int64 values 0..15 -> int32 with 8 of them per value along `dim`: value 8j + i of that dim
    in bits 4i..4i+3 of packed element j (the two's-complement int32 of the unsigned sum)."""
    v = values.movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, 8)
    packed = sum(v[..., i] << (4 * i) for i in range(8))
    return _int32(packed).movedim(-1, dim).contiguous()


def _int32(unsigned: torch.Tensor) -> torch.Tensor:
    return torch.where(unsigned >= 2**31, unsigned - 2**32, unsigned).to(torch.int32)


def awq_tensors(module: str, qt: Quantized) -> dict:
    """qweight [K, N / 8]: column c of row k packs output channels 8c + AWQ_ORDER[i] at nibble i."""
    order = torch.tensor(AWQ_ORDER)
    def pack_rows(t):  # [rows, N] -> [rows, N / 8], AWQ's order
        t = t.reshape(t.shape[0], -1, 8)[..., order]
        return _int32(sum(t[..., i] << (4 * i) for i in range(8))).contiguous()
    return {f"{module}.qweight": pack_rows(qt.q.t()), f"{module}.qzeros": pack_rows(qt.z.t()),
            f"{module}.scales": qt.s.t().contiguous()}


def gptq_tensors(module: str, qt: Quantized) -> dict:
    """AutoGPTQ v1: qweight [K / 8, N] along input channels; qzeros [groups, N / 8] hold zero - 1,
    packed as the int32 sum (so zero 0 borrows from the next nibble, which adding 0x11111111 undoes)."""
    zeros = sum(qt.z.t().reshape(qt.z.shape[1], -1, 8)[..., i] << (4 * i) for i in range(8))
    return {f"{module}.qweight": pack_int32(qt.q.t(), 0), f"{module}.qzeros": _int32((zeros - 0x11111111) % 2**32),
            f"{module}.scales": qt.s.t().contiguous(), f"{module}.g_idx": qt.g_idx.to(torch.int32)}


def compressed_tensors(module: str, qt: Quantized, symmetric: bool) -> dict:
    """weight_packed [N, K / 8] (values offset by 8: stored = signed + 8); asymmetric zero points
    packed along output channels [N / 8, groups]."""
    out = {f"{module}.weight_packed": pack_int32(qt.q, 1), f"{module}.weight_scale": qt.s.clone(),
           f"{module}.weight_shape": torch.tensor(list(qt.q.shape), dtype=torch.int32)}
    if not symmetric:
        out[f"{module}.weight_zero_point"] = pack_int32(qt.z, 0)
    return out


def quantization_config(fmt: str, group: int, ignore: list[str], symmetric: bool, act_order: bool) -> dict:
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": ignore or None}
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order, "sym": symmetric,
                "checkpoint_format": "gptq", "static_groups": False, "true_sequential": True, "lm_head": False}
    strategy = "group" if group else "channel"
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                          "weights": {"num_bits": 4, "type": "int", "symmetric": symmetric,
                                                      "strategy": strategy, "group_size": group or None,
                                                      "dynamic": False, "actorder": None, "observer": "minmax"}}},
            "ignore": ignore}


def write_int4_checkpoint(src: Path, dst: Path, dequantized: Path, fmt: str, group: int = 32,
                          ignore: list[str] = (), symmetric: bool = False, act_order: bool = False,
                          seed: int = 0, linears: tuple[str, ...] = LINEARS) -> None:
    """fmt: awq | gptq | compressed-tensors (group 0: its channel strategy). Every decoder linear
    (and each expert's) not in `ignore` in 4 bits into dst; the same model, dequantized, into
    `dequantized` (fp32, for transformers)."""
    gen = torch.Generator().manual_seed(seed)
    orders = {}  # act-order: one permutation per input, as GPTQ's Hessian is (q, k, v share one)
    for path in (dst, dequantized):  # all but the weights, written below
        shutil.copytree(src, path, dirs_exist_ok=True, ignore=shutil.ignore_patterns("model*.safetensors*"))
    packed, plain = {}, {}
    for file in sorted(src.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            module = name.removesuffix(".weight")
            if name.endswith(tuple(f"{p}.weight" for p in linears)) and module not in ignore:
                n, k = tensor.shape
                key = (module.rsplit(".", 1)[0], k, module.endswith(("down_proj", "o_proj", "out_proj")))
                if act_order and key not in orders:
                    orders[key] = torch.randperm(k, generator=gen)
                qt = quantize(tensor, group or k, gen, orders.get(key), symmetric)
                plain[name] = qt.dequantized()
                packed |= (awq_tensors(module, qt) if fmt == "awq" else gptq_tensors(module, qt) if fmt == "gptq"
                           else compressed_tensors(module, qt, symmetric))
            else:
                packed[name] = plain[name] = tensor
    save_file({k: v.contiguous() for k, v in packed.items()}, dst / "model.safetensors", metadata={"format": "pt"})
    save_file(plain, dequantized / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt, group, list(ignore), symmetric, act_order)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
