"""Mixture-of-experts: a top-k router and SwiGLU experts, computed grouped by expert.

Each token's top-k (token, expert) pairs are sorted by expert, so every expert's rows sit together,
and the experts that got rows run over them; the weighted rows are summed back into their tokens.
No loop over tokens. `xserv::fused_experts` is a registered op, so the model calls one op whatever
runs under it, picked per call by the device and the number of pairs:
- "native": on the CPU with the native ops on (layers/ops.py), decode steps and short prefills
  run in torch.ops.xserv_cpu.moe_experts (layers/cpu_ops.cpp): each expert's weights read once
  for all its rows, at memory speed, where torch's matmuls reorder the weight on every call;
- "grouped": otherwise (prefills, CUDA), two torch._grouped_mm calls run every expert at once;
- "loop": where torch has no grouped matmul (older releases, a dtype it refuses), a loop over the
  experts that got rows, in plain torch.
"""

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from xserv_engine.layers import native, ops

log = logging.getLogger(__name__)

# The native op takes steps of up to this many (token, expert) pairs: 128 tokens of a top-8 model.
# On Qwen3-30B-A3B's layer (2 cores) it was 1.7-2.5x the grouped matmul at 1-16 tokens, 1.4-1.7x at
# 64, 0.9-1.3x at 128, and 0.6x at 192-384 and 0.5-1.0x at 512 (benchmarks/moe_experts.py on two
# days; docs/benchmarks-log.md, "The experts op, by step size" and 2026-12-05): a 190-token
# prompt's prefill took 640-680 ms with 4096 here, 360-420 ms with 1024.
NATIVE_MAX_PAIRS = 1024
_NATIVE_DTYPES = (torch.bfloat16, torch.float32)
ExpertMatmul = Callable[[torch.Tensor, int], torch.Tensor]  # (rows, expert) -> rows times its weight^T


def route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts (in fp32), top_k of them per token, renormalized to sum to 1 when
    `normalize` (norm_topk_prob). Returns (weights [T, K] in the logits' dtype, expert ids [T, K])."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def sort_pairs(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The T*K (token, expert) pairs grouped by expert: (order [T*K]: each sorted pair's index
    t*K+k, stable; counts [E]: each expert's pairs)."""
    flat = topk_ids.flatten()  # pair p is token p // K
    return flat.argsort(stable=True), torch.bincount(flat, minlength=num_experts)


@torch.library.custom_op("xserv::fused_experts", mutates_args=())
def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; topk_* [T, K] -> [T, H]."""
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    order, counts = sort_pairs(topk_ids, num_experts)
    impl = _IMPLS.pick(x, order.numel())
    if impl == "native":
        return torch.ops.xserv_cpu.moe_experts(x, w13, w2, topk_weights, order, counts)
    if impl == "loop":
        return looped_experts(x, topk_weights, order, counts,
                              lambda rows, e: F.linear(rows, w13[e]), lambda act, e: F.linear(act, w2[e]))
    tokens = order // top_k  # each sorted pair's token
    out = _grouped_swiglu(x.index_select(0, tokens), w13, w2, counts.cumsum(0).to(torch.int32))
    return _weighted_sum(x, out, topk_weights, order, tokens)


@fused_experts.register_fake
def _(x, w13, w2, topk_weights, topk_ids):
    return torch.empty_like(x)


def _grouped_swiglu(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    h = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offsets)  # [N, 2I]
    gate, up = h.chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offsets)  # [N, H]


def looped_experts(x: torch.Tensor, topk_weights: torch.Tensor, order: torch.Tensor, counts: torch.Tensor,
                   gate_up: ExpertMatmul, down: ExpertMatmul) -> torch.Tensor:
    """SwiGLU experts one by one in plain torch, over the pairs as sort_pairs groups them (order,
    counts): x [T, H], topk_weights [T, K] -> [T, H]. The caller gives each expert's two products,
    gate_up(rows [n, H], expert) -> [n, 2I] and down(act [n, I], expert) -> [n, H], so bf16 and
    int8 weights share the loop."""
    tokens = order // topk_weights.shape[1]  # each sorted pair's token
    rows = x.index_select(0, tokens)  # [T*K, H], grouped by expert
    out, start = torch.empty_like(rows), 0
    for expert, count in enumerate(counts.tolist()):  # host sync: the fallback only
        if count:
            gate, up = gate_up(rows[start : start + count], expert).chunk(2, dim=-1)
            out[start : start + count] = down(F.silu(gate) * up, expert)
            start += count
    return _weighted_sum(x, out, topk_weights, order, tokens)


def _weighted_sum(x: torch.Tensor, out: torch.Tensor, topk_weights: torch.Tensor, order: torch.Tensor,
                  tokens: torch.Tensor) -> torch.Tensor:
    """Each sorted pair's expert output [T*K, H] times its router weight, summed into its token: [T, H]."""
    out = out * topk_weights.flatten().index_select(0, order).unsqueeze(1)
    return torch.zeros_like(x).index_add_(0, tokens, out)


class _Implementations:
    """Which implementation a call takes: what can run here (the native ops, on where engine_setup
    turned them on; the grouped matmul probed once per device and dtype) and, for tests, one forced."""

    def __init__(self):
        self.forced: str | None = None
        self._grouped: dict[tuple[str, torch.dtype], bool] = {}

    def pick(self, x: torch.Tensor, pairs: int) -> str:
        if x.device.type == "cpu" and x.dtype in _NATIVE_DTYPES:
            if self.forced == "native" and native.load_torch_ops():
                return "native"
            if self.forced is None and pairs <= NATIVE_MAX_PAIRS and ops.native(x):
                return "native"
        return "grouped" if self.forced != "loop" and self.grouped_works(x) else "loop"

    def grouped_works(self, x: torch.Tensor) -> bool:
        key = (x.device.type, x.dtype)
        if key not in self._grouped:
            self._grouped[key] = _probe(x.device, x.dtype)
        return self._grouped[key]


def _probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs here and agrees with a plain matmul."""
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


_IMPLS = _Implementations()


def prepare(device: torch.device, dtype: torch.dtype) -> None:
    """At engine start, after the route is chosen: probe the grouped matmul now, not in the first
    request's step, and log which implementation steps of each size take."""
    x = torch.empty(0, device=device, dtype=dtype)
    grouped = "torch._grouped_mm" if _IMPLS.grouped_works(x) else "a loop over the experts (no grouped matmul)"
    if _IMPLS.pick(x, 1) == "native":
        log.info("MoE experts: the native op for steps of up to %d (token, expert) pairs, %s above",
                 NATIVE_MAX_PAIRS, grouped)
    else:
        log.info("MoE experts: %s", grouped)


def force_implementation(name: str | None) -> None:
    """Tests run each implementation of the op: "native", "grouped", "loop"; None: by the pairs."""
    assert name in (None, "native", "grouped", "loop")
    _IMPLS.forced = name


class FusedExperts(nn.Module):
    """num_experts SwiGLU experts of width `intermediate`, held stacked as two parameters."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))  # [E, 2I, H]
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden, intermediate))  # [E, H, I]

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return torch.ops.xserv.fused_experts(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
