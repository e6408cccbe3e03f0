"""Mixture-of-experts: a top-k router and SwiGLU experts, computed grouped by expert.

Each token's top-k (token, expert) pairs are sorted by expert, so every expert's rows sit together;
then all experts run as two grouped matmuls over the sorted rows (torch._grouped_mm: one call for
every expert, on the CPU and on CUDA), and the weighted rows are summed back into their tokens.
No loop over tokens, none over experts on the hot path. `xserv::fused_experts` is a registered op,
so the model calls one op whatever runs under it; where torch has no grouped matmul (older
releases, or a dtype it refuses) the op loops over the experts that got rows, in plain torch.
"""

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


def route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts (in fp32), top_k of them per token, renormalized to sum to 1 when
    `normalize` (norm_topk_prob). Returns (weights [T, K] in the logits' dtype, expert ids [T, K])."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


@torch.library.custom_op("xserv::fused_experts", mutates_args=())
def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; topk_* [T, K] -> [T, H]."""
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    flat = topk_ids.flatten()  # [T*K]: pair p is token p // K
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    rows = x.index_select(0, order // top_k)  # [T*K, H], grouped by expert
    if _GROUPED.usable(x):
        out = _grouped_swiglu(rows, w13, w2, counts.cumsum(0).to(torch.int32))
    else:
        out = _looped_swiglu(rows, w13, w2, counts)
    out = out * topk_weights.flatten().index_select(0, order).unsqueeze(1)
    return torch.zeros_like(x).index_add_(0, order // top_k, out)


@fused_experts.register_fake
def _(x, w13, w2, topk_weights, topk_ids):
    return torch.empty_like(x)


def _grouped_swiglu(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    h = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offsets)  # [N, 2I]
    gate, up = h.chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offsets)  # [N, H]


def _looped_swiglu(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    out, start = torch.empty_like(rows), 0
    for expert, count in enumerate(counts.tolist()):  # host sync: the fallback only
        if count:
            gate, up = F.linear(rows[start : start + count], w13[expert]).chunk(2, dim=-1)
            out[start : start + count] = F.linear(F.silu(gate) * up, w2[expert])
            start += count
    return out


class _GroupedMatmul:
    """Whether torch._grouped_mm runs, and agrees with a plain matmul, for a device and dtype
    (probed once each)."""

    def __init__(self):
        self.forced_off = False
        self._probed: dict[tuple[str, torch.dtype], bool] = {}

    def usable(self, x: torch.Tensor) -> bool:
        if self.forced_off:
            return False
        key = (x.device.type, x.dtype)
        if key not in self._probed:
            self._probed[key] = _probe(x.device, x.dtype)
        return self._probed[key]


def _probe(device: torch.device, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(12, 64, generator=gen).to(device, dtype)
    weights = torch.randn(3, 32, 64, generator=gen).to(device, dtype)
    offsets = torch.tensor([5, 5, 12], dtype=torch.int32, device=device)  # the middle expert gets no row
    try:
        got = torch._grouped_mm(rows, weights.transpose(1, 2), offs=offsets)
    except (RuntimeError, NotImplementedError) as exc:
        log.info("grouped matmul unavailable on %s %s (%s): experts run one by one", device.type, dtype, exc)
        return False
    want = torch.cat([rows[:5] @ weights[0].T, rows[5:] @ weights[2].T])
    return torch.allclose(got.float(), want.float(), atol=1e-2, rtol=1e-2)


_GROUPED = _GroupedMatmul()


def use_grouped_matmul(enabled: bool) -> None:
    """Tests run both implementations of the op: the grouped one and the plain-torch fallback."""
    _GROUPED.forced_off = not enabled


class FusedExperts(nn.Module):
    """num_experts SwiGLU experts of width `intermediate`, held stacked as two parameters."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))  # [E, 2I, H]
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden, intermediate))  # [E, H, I]

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.xserv.fused_experts(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
