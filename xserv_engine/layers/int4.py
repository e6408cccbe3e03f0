"""4-bit weights: Int4Linear and Int4Experts, the one layout every 4-bit source loads into.

AWQ, GPTQ and compressed-tensors W4A16 checkpoints (models/int4_formats.py) and
`--quantization int4` (quantize_weight) all end as an Int4Weight:
- qweight uint8 [N, K / 2]: column j holds input channel 2j in the low nibble, 2j + 1 in the high one;
- scales float32 [N, K / G] and zeros uint8 [N, K / G] (values 0..15; 8 for symmetric formats),
  one per output channel and group of G consecutive input channels;
- W[n, k] = (q[n, k] - z[n, k // G]) * s[n, k // G]: the integer difference, then one multiply,
  so at fp32 the weight is the checkpoint's dequantized weight bit for bit;
- perm int64 [K] for GPTQ act-order (desc_act): the input channels in group order. The weight's
  columns are stored in that order, so groups are contiguous, and x[..., perm] is multiplied.
Int4Linear hands the parts to ops.prepare_int4 once (the native op's blocked layout where it runs:
the only form then held) and runs ops.int4_linear (fp32 activations: the exact weights; bf16 ones:
W4A8 natively, per-token int8 activations; the torch fallback dequantizes in x's dtype).
"""

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from xserv_engine.layers import int8, ops
from xserv_engine.layers.fused_moe import FusedExperts, looped_experts, sort_pairs

log = logging.getLogger(__name__)
GROUP_SIZE = 128  # input channels per scale of --quantization int4
# modules that stay in the checkpoint's precision under --quantization int4: the MoE router and the
# shared expert's gate pick and weigh (small, and their errors move whole experts); the LM head,
# which goes to int8 instead (_head_in_int8: the embedding it is often tied to reads from it)
_KEPT = (".mlp.gate", ".shared_expert_gate", "lm_head")
_HEAD_ROWS = 8192  # rows of the LM head quantized to int8 at a time


@dataclass
class Int4Weight:
    """One linear's (or one stack of experts') 4-bit weight in the layout of the module docstring."""

    qweight: torch.Tensor  # uint8 [..., N, K // 2]
    scales: torch.Tensor  # float32 [..., N, K // G]
    zeros: torch.Tensor  # uint8 [..., N, K // G]
    group_size: int
    perm: torch.Tensor | None = None  # int64 [K]: act-order's input channels in group order; None: in order

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the weight it stands for."""
        return self.qweight.shape[-2], 2 * self.qweight.shape[-1]


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Values 0..15 [..., K] -> uint8 [..., K // 2], even channels in the low nibbles."""
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K // 2] -> uint8 [..., K], values 0..15."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def dequantize(weight: Int4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., N, K] in dtype, the columns in stored (perm) order: (q - z) * s, computed in fp32."""
    return ops.dequantize_int4(weight.qweight, weight.scales, weight.zeros, weight.group_size, dtype)


def quantize_weight(w: torch.Tensor, group_size: int = GROUP_SIZE) -> Int4Weight:
    """[N, K] -> Int4Weight, asymmetric per group: the group's range, widened to hold 0, in 16
    steps (min/max; it was 16 % more accurate than symmetric absmax / 7 on Gaussian weights, and a
    search over clipped ranges gained 5 % more for 4x the time). A K that is not a multiple of
    group_size gets one group per row."""
    n, k = w.shape
    group = group_size if k % group_size == 0 else k
    g = w.detach().float().reshape(n, k // group, group)
    lo, hi = g.aminmax(dim=-1)
    lo, hi = lo.clamp_(max=0), hi.clamp_(min=0)
    scales = (hi - lo) / 15
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    zeros = torch.round(-lo / scales).clamp_(0, 15)
    q = (g / scales.unsqueeze(-1)).round_().add_(zeros.unsqueeze(-1)).clamp_(0, 15)
    return Int4Weight(pack_nibbles(q.reshape(n, k)), scales, zeros.to(torch.uint8), group)


def int4_matmul(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """x [T, K] (in stored column order) times the dequantized weight^T -> [T, N] in x's dtype."""
    return F.linear(x, dequantize(weight, x.dtype))


class Int4Linear(nn.Module):
    """A bias-free linear with 4-bit weights (module docstring), weight-only."""

    def __init__(self, weight: Int4Weight):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.group_size, self.perm = weight.group_size, weight.perm
        self.qweight, self.scales, self.zeros = ops.prepare_int4(weight.qweight, weight.scales, weight.zeros,
                                                                 weight.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # the model's are [T, K] already
        if self.perm is not None:
            rows = rows.index_select(1, self.perm)
        y = ops.int4_linear(rows, self.qweight, self.scales, self.zeros, self.group_size, self.out_features)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        act_order = ", act-order" if self.perm is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, int4 weights in groups of "
                f"{self.group_size}{act_order}")


class Int4Experts(nn.Module):
    """An MoE layer's experts (FusedExperts' w13 [E, 2I, H] and w2 [E, H, I]) in 4 bits, each
    stack an Int4Weight with a leading expert dimension: natively one op for the whole layer
    (ops.moe_experts_int4, on prepare_int4_experts' packs), else a loop over the experts that got
    pairs (xserv::int4_experts)."""

    def __init__(self, w13: Int4Weight, w2: Int4Weight):
        super().__init__()
        if w13.perm is not None or w2.perm is not None:
            raise ValueError("act-order experts are not supported")  # the loader refuses them by name first
        self.num_experts, self.group_sizes = w13.qweight.shape[0], (w13.group_size, w2.group_size)
        self.native = (w13.qweight.device.type == "cpu" and ops.int4_native()
                       and all(g % 8 == 0 and w.shape[1] % g == 0 for w, g in ((w13, w13.group_size),
                                                                              (w2, w2.group_size))))
        self.w13 = ops.prepare_int4_experts(w13.qweight, w13.scales, w13.zeros, w13.group_size, self.native)
        self.w2 = ops.prepare_int4_experts(w2.qweight, w2.scales, w2.zeros, w2.group_size, self.native)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.native:
            order, counts = sort_pairs(topk_ids, self.num_experts)
            return ops.moe_experts_int4(x, self.w13, self.w2, topk_weights, order, counts)
        g13, g2 = self.group_sizes
        return torch.ops.xserv.int4_experts(x, *self.w13, g13, *self.w2, g2, topk_weights, topk_ids)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, int4 weights in groups of {self.group_sizes[0]}"
                f"{' (native)' if self.native else ''}")


# one registered op, so a traced decode step records the call, not one trip through the loop
@torch.library.custom_op("xserv::int4_experts", mutates_args=())
def int4_experts(x: torch.Tensor, q13: torch.Tensor, s13: torch.Tensor, z13: torch.Tensor, g13: int,
                 q2: torch.Tensor, s2: torch.Tensor, z2: torch.Tensor, g2: int, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H]; w13's parts [E, 2I, ...], w2's [E, H, ...] (Int4Weight's); topk_* [T, K] -> [T, H]."""
    order, counts = sort_pairs(topk_ids, q13.shape[0])
    return looped_experts(x, topk_weights, order, counts,
                          lambda rows, e: int4_matmul(rows, Int4Weight(q13[e], s13[e], z13[e], g13)),
                          lambda act, e: int4_matmul(act, Int4Weight(q2[e], s2[e], z2[e], g2)))


@int4_experts.register_fake
def _(x, q13, s13, z13, g13, q2, s2, z2, g2, topk_weights, topk_ids):
    return torch.empty_like(x)


def quantize_experts(weights: torch.Tensor, group_size: int = GROUP_SIZE) -> Int4Weight:
    """Stacked expert weights [E, N, K] -> one Int4Weight with a leading expert dimension, written
    one expert at a time into stacks allocated once."""
    stack: Int4Weight | None = None
    for e, w in enumerate(weights):
        one = quantize_weight(w, group_size)
        if stack is None:
            stack = Int4Weight(*(t.new_empty((len(weights), *t.shape)) for t in
                                 (one.qweight, one.scales, one.zeros)), one.group_size)
        stack.qweight[e], stack.scales[e], stack.zeros[e] = one.qweight, one.scales, one.zeros
    return stack


def quantize_model(model: nn.Module, prequantized: dict | None = None, quantize_rest: bool = True,
                   progress: bool = True) -> int:
    """Replace the model's bias-free linears with Int4Linears: those in `prequantized` (a 4-bit
    checkpoint's: {module name: Int4Weight, or for a layer's experts (w13, w2)}) as they are, the
    others quantized from their weights if quantize_rest (not the router, the shared expert's gate
    nor the LM head: _KEPT); then each MoE layer's experts with Int4Experts, likewise. One module
    at a time, by name, so each full-precision weight is freed as its 4-bit one is made; the
    entries of `prequantized` are popped as they are installed, so the checkpoint's parts are not
    held beside the forms Int4Linear keeps. Returns how many linears were replaced."""
    prequantized = prequantized if prequantized is not None else {}
    targets = [name for name, module in model.named_modules()
               if type(module) is nn.Linear and module.bias is None
               and (name in prequantized or (quantize_rest and not name.endswith(_KEPT)))]
    for name in tqdm(targets, desc="Quantizing to int4", unit="linear", disable=not progress or not targets):
        owner, attr = _owner(model, name)
        weight = prequantized.pop(name) if name in prequantized else quantize_weight(getattr(owner, attr).weight)
        setattr(owner, attr, Int4Linear(weight))
    experts = [name for name, module in model.named_modules() if type(module) is FusedExperts
               and (name in prequantized or quantize_rest)]
    for name in tqdm(experts, desc="Quantizing experts to int4", unit="layer", disable=not progress or not experts):
        owner, attr = _owner(model, name)
        stacks = prequantized.pop(name, None)
        if stacks is None:
            module = getattr(owner, attr)
            stacks = quantize_experts(module.w13_weight), quantize_experts(module.w2_weight)
            del module
        setattr(owner, attr, Int4Experts(*stacks))
    assert not prequantized, "4-bit weights with no module to take them"
    head = quantize_rest and _head_in_int8(model)
    log.info("int4 weights: %d linears%s, weight-only%s", len(targets),
             f" and {len(experts)} layers of experts" if experts else "", "; the LM head int8 (W8A8)" if head else "")
    return len(targets)


def _head_in_int8(model: nn.Module) -> bool:
    """--quantization int4's LM head: int8 (W8A8, int8.Int8Linear), as llama.cpp's 4-bit types hold
    theirs in 6 bits. Kept in bf16 it would be most of a small model's decode step: Qwen3-0.6B's
    head (151936 x 1024) is 311 MB in bf16, more than all its int4 decoder linears together
    (~237 MB); in int8 it is 156 MB. A tied model's embedding reads its rows from the int8 head, so
    the table is held once."""
    head = getattr(model, "lm_head", None)
    if type(head) is not nn.Linear or head.bias is not None:
        return False
    weight, dtype = head.weight.detach(), head.weight.dtype
    # in row chunks: int8.quantize_weight holds three float32 copies of what it is given (3.7 GB
    # for Qwen3-8B's head at once; RSS rose 1.65 -> 3.46 GB on Qwen3-0.6B's)
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(weight.shape[0], device=weight.device)
    for start in range(0, weight.shape[0], _HEAD_ROWS):
        q[start : start + _HEAD_ROWS], scale[start : start + _HEAD_ROWS] = int8.quantize_weight(
            weight[start : start + _HEAD_ROWS])
    del head, weight
    model.lm_head = linear = int8.Int8Linear(q, scale, int8.implementation(q.device))
    if getattr(model.config, "tie_word_embeddings", False):
        model.model.embed_tokens = int8.Int8Embedding(linear, dtype)
    return True


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    owner_name, _, attr = name.rpartition(".")
    return (model.get_submodule(owner_name) if owner_name else model), attr
