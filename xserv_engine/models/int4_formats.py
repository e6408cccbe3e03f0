"""4-bit checkpoints: which load, and how each format's tensors become layers/int4.py's Int4Weight.

Served, exactly as written (W = (q - z) * s per output channel and group of input channels):
- AWQ GEMM (AutoAWQ, Qwen's *-AWQ): `qweight` int32 [K, N / 8] packed along output channels,
  nibble i of column c holding channel 8c + AWQ_ORDER[i]; `qzeros` int32 [K / G, N / 8] the same;
  `scales` [K / G, N]. Config: `bits` 4, `version` gemm, `zero_point` true.
- GPTQ (AutoGPTQ / GPTQModel, Qwen's *-GPTQ-Int4): `qweight` int32 [K / 8, N] packed along input
  channels, nibble i of row r holding channel 8r + i; `qzeros` int32 [K / G, N / 8] along output
  channels; `scales` [K / G, N]; `g_idx` [K], each input channel's group. The v1 format
  (`checkpoint_format` gptq, the default) stores zero - 1: 0x11111111 is added to each packed
  int32 before unpacking, as transformers (GPTQModel's v1 -> v2 conversion) does. Act-order
  (`desc_act`, a g_idx not in order) is served: the input channels are permuted into group order.
- compressed-tensors `pack-quantized` W4A16 (llm-compressor): `weight_packed` int32 [N, K / 8]
  along input channels, values offset by 8; `weight_scale` [N, K / G] (group) or [N, 1] (channel);
  symmetric, or asymmetric with `weight_zero_point` packed along output channels; `weight_g_idx`
  (actorder group) as GPTQ's g_idx.
The group size is read from the tensors' shapes. Other versions, bit widths and schemes are
refused at start by name (ModelLoadError).
"""

from dataclasses import dataclass

import torch

from xserv_engine.errors import ModelLoadError
from xserv_engine.layers.int4 import Int4Weight, pack_nibbles, unpack_nibbles

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's: nibble i of a packed int32 holds channel AWQ_ORDER[i]
_AWQ_UNORDER = [AWQ_ORDER.index(c) for c in range(8)]  # channel c's nibble
_GPTQ_V1_ZERO_OFFSET = 0x11111111  # one added to each of the 8 packed zeros
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
# each format's tensors of one 4-bit module: (those it must have, those it may have)
_PARTS = {"awq": (("qweight", "qzeros", "scales"), ()),
          "gptq": (("qweight", "qzeros", "scales"), ("g_idx",)),
          "compressed-tensors": (("weight_packed", "weight_scale"), ("weight_zero_point", "weight_shape", "weight_g_idx"))}


@dataclass(frozen=True)
class Int4Checkpoint:
    method: str  # awq | gptq | compressed-tensors
    zeros_minus_one: bool = False  # GPTQ v1
    zero_points: bool = False  # compressed-tensors asymmetric: every module has a weight_zero_point

    @property
    def parts(self) -> tuple[str, ...]:
        return _PARTS[self.method][0] + _PARTS[self.method][1]

    def module_of(self, name: str) -> str | None:
        """The module a tensor is a 4-bit part of (its name without the part), None for another tensor."""
        module, _, part = name.rpartition(".")
        return module if part in self.parts else None

    @staticmethod
    def is_scale(name: str) -> bool:
        return False

    def weight(self, module: str, parts: dict[str, torch.Tensor]) -> Int4Weight:
        """One module's tensors (by part name) -> its Int4Weight."""
        missing = [p for p in _PARTS[self.method][0] if p not in parts]
        if self.zero_points and "weight_zero_point" not in parts:
            missing.append("weight_zero_point")
        if missing:
            raise ModelLoadError(f"{module}: 4-bit weight without its {', '.join(missing)}")
        if self.method == "awq":
            return _awq(module, parts)
        if self.method == "gptq":
            return _gptq(module, parts, self.zeros_minus_one)
        return _compressed(module, parts)


def unpack_int32(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., M] -> uint8 [..., M, 8]: nibble i (bits 4i..4i+3) of each value at index i."""
    return ((packed.to(torch.int32).unsqueeze(-1) >> _SHIFTS) & 15).to(torch.uint8)


def _awq(module: str, parts: dict) -> Int4Weight:
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    k = qweight.shape[0]
    q = unpack_int32(qweight)[..., _AWQ_UNORDER].flatten(-2)  # [K, N]
    z = unpack_int32(qzeros)[..., _AWQ_UNORDER].flatten(-2)  # [K / G, N]
    return Int4Weight(pack_nibbles(q.t()), scales.t().float().contiguous(), z.t().contiguous(),
                      _group_size(module, k, scales.shape[0]))


def _gptq(module: str, parts: dict, zeros_minus_one: bool) -> Int4Weight:
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    k = qweight.shape[0] * 8
    q = unpack_int32(qweight).transpose(1, 2).reshape(k, -1)  # [K / 8, N, 8] -> [K, N]
    if zeros_minus_one:  # int32 arithmetic wraps, as in transformers
        qzeros = qzeros.to(torch.int32) + _GPTQ_V1_ZERO_OFFSET
    z = unpack_int32(qzeros).flatten(-2)  # [K / G, N]
    group = _group_size(module, k, scales.shape[0])
    weight = Int4Weight(pack_nibbles(q.t()), scales.t().float().contiguous(), z.t().contiguous(), group)
    return _act_order(module, weight, parts.get("g_idx"), "g_idx")


def _compressed(module: str, parts: dict) -> Int4Weight:
    packed, scales = parts["weight_packed"], parts["weight_scale"]
    n, k = (int(d) for d in parts["weight_shape"]) if "weight_shape" in parts else (packed.shape[0], packed.shape[1] * 8)
    q = unpack_int32(packed).flatten(-2)[:n, :k]  # [N, K], unsigned (the signed value + 8)
    group = _group_size(module, k, scales.shape[1])
    if "weight_zero_point" in parts:
        zero_point = parts["weight_zero_point"]
        if zero_point.dtype == torch.int32:  # packed along output channels: [ceil(N / 8), K / G]
            z = unpack_int32(zero_point).transpose(1, 2).reshape(-1, scales.shape[1])[:n]
        else:  # unpacked, signed
            z = (zero_point.to(torch.int16) + 8).to(torch.uint8)
    else:
        z = torch.full(scales.shape, 8, dtype=torch.uint8)
    weight = Int4Weight(pack_nibbles(q), scales.float().contiguous(), z.reshape(scales.shape).contiguous(), group)
    return _act_order(module, weight, parts.get("weight_g_idx"), "weight_g_idx")


def _group_size(module: str, k: int, groups: int) -> int:
    if groups <= 0 or k % groups:
        raise ModelLoadError(f"{module}: {groups} groups of scales do not divide its {k} input channels")
    return k // groups


def _act_order(module: str, weight: Int4Weight, g_idx: torch.Tensor | None, field: str) -> Int4Weight:
    """The weight with its input channels in group order if g_idx (each channel's group) is not
    in order already; refused by name if a group has not exactly group_size channels."""
    if g_idx is None:
        return weight
    n, k = weight.shape
    g_idx = g_idx.long()
    if torch.equal(g_idx, torch.arange(k) // weight.group_size):
        return weight
    groups = k // weight.group_size
    if g_idx.min() < 0 or g_idx.max() >= groups or not bool((torch.bincount(g_idx, minlength=groups)
                                                              == weight.group_size).all()):
        raise ModelLoadError(f"{module}.{field}: groups of unequal sizes are not supported (each of the {groups} "
                             f"groups must hold {weight.group_size} input channels)")
    perm = torch.argsort(g_idx, stable=True)
    q = unpack_nibbles(weight.qweight)[:, perm]
    return Int4Weight(pack_nibbles(q), weight.scales, weight.zeros, weight.group_size, perm)


# -- config.json's quantization_config --------------------------------------------------------

_SERVED = ("xserv loads 4-bit AWQ (GEMM), GPTQ (v1 and v2) and compressed-tensors pack-quantized W4A16 checkpoints")


def awq_checkpoint(spec: dict, where: str) -> Int4Checkpoint:
    bits = spec.get("bits", spec.get("w_bit"))
    if bits != 4:
        raise ModelLoadError(f"{where}: awq bits {bits!r} is not supported; {_SERVED}")
    version = str(spec.get("version", "gemm")).lower()
    if version != "gemm":
        raise ModelLoadError(f"{where}: awq version {spec.get('version')!r} is not supported (its packing differs); "
                             f"{_SERVED}")
    if spec.get("zero_point", True) is not True:
        raise ModelLoadError(f"{where}: awq zero_point {spec.get('zero_point')!r} is not supported; {_SERVED}")
    return Int4Checkpoint("awq")


def gptq_checkpoint(spec: dict, where: str) -> Int4Checkpoint:
    if spec.get("bits") != 4:
        raise ModelLoadError(f"{where}: gptq bits {spec.get('bits')!r} is not supported; {_SERVED}")
    # GPTQModel writes checkpoint_format (newer releases: format too); AutoGPTQ's oldest, neither
    fmt = spec.get("checkpoint_format") or spec.get("format") or ("marlin" if spec.get("is_marlin_format") else "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ModelLoadError(f"{where}: gptq checkpoint_format {fmt!r} is not supported; {_SERVED}")
    if spec.get("dynamic"):
        raise ModelLoadError(f"{where}: gptq dynamic (per-module bits and group sizes) is not supported; {_SERVED}")
    if spec.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
        raise ModelLoadError(f"{where}: gptq pack_dtype {spec['pack_dtype']!r} is not supported (only int32)")
    return Int4Checkpoint("gptq", zeros_minus_one=fmt == "gptq")


_W4A16 = {"num_bits": 4, "type": "int"}


def compressed_int4_checkpoint(spec: dict, where: str) -> Int4Checkpoint:
    """compressed-tensors `pack-quantized`: every config group W4A16 (int4 weights per group or
    channel, activations not quantized)."""
    supported = "xserv loads compressed-tensors pack-quantized W4A16 (int4 weights per group or channel)"
    for name, group in (spec.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        wrong = {k: weights.get(k) for k, v in _W4A16.items() if weights.get(k) != v}
        if weights.get("strategy") not in ("group", "channel"):
            wrong["strategy"] = weights.get("strategy")
        if weights.get("dynamic"):
            wrong["dynamic"] = weights.get("dynamic")
        if weights.get("actorder") not in (None, "weight", "group", "static"):
            wrong["actorder"] = weights.get("actorder")
        if group.get("format") not in (None, "pack-quantized"):
            wrong["format"] = group.get("format")
        if wrong:
            raise ModelLoadError(f"{where}: config_groups.{name}.weights has {wrong}; {supported}")
        if group.get("input_activations"):
            raise ModelLoadError(f"{where}: config_groups.{name}.input_activations is set (W4A8); {supported}")
    if not spec.get("config_groups"):
        raise ModelLoadError(f"{where}: compressed-tensors config has no config_groups; {supported}")
    asymmetric = any((g.get("weights") or {}).get("symmetric") is False for g in spec["config_groups"].values())
    return Int4Checkpoint("compressed-tensors", zero_points=asymmetric)
