"""8-bit weights: W8A8 int8 linears (--quantization int8, and compressed-tensors int8 checkpoints).

The scheme of SGLang's and vLLM's CPU `w8a8_int8`: each weight quantized per output channel,
symmetric (q = round(w / s), s = max|w| / 127), once at load; each activation row quantized per
token at run time, symmetric, inside the op; int32 sums, scaled back to the model's dtype. One
stream's decode step reads every weight once, so it is bound by memory bandwidth and half the
bytes are nearly half the time (docs/benchmarks.md, "8-bit weights").

Two implementations of the one operation, picked once per process (force_implementation in tests):
- "native": torch.ops.xserv_cpu.int8_linear (layers/cpu_ops.cpp), AVX512-VNNI, with the weight
  held in the blocked layout its instruction reads (int8_pack). Where the CPU has it.
- "torch": the same arithmetic with stock torch (torch._int_mm over a plain [N, K] int8 weight):
  everywhere else, and the reference the native op is tested against.
Only one layout is held, so the weights are in memory once.
"""

import logging
import torch
from torch import nn
from tqdm import tqdm

from xserv_engine.engine.device import empty_on_huge_pages, on_huge_pages
from xserv_engine.layers import native
from xserv_engine.layers.fused_moe import FusedExperts, looped_experts, sort_pairs

log = logging.getLogger(__name__)
IMPLEMENTATIONS = ("native", "torch")
_forced: str | None = None
_native: bool | None = None  # whether the native ops are loaded and this CPU runs them


def load_native_ops() -> bool:
    """Whether the native int8 op runs here: cpu_ops.cpp built and loaded, and AVX512-VNNI."""
    global _native
    if _native is None:
        _native = native.load_torch_ops() and bool(torch.ops.xserv_cpu.has_vnni())
        if native.load_torch_ops() and not _native:
            log.info("this CPU has no AVX512-VNNI: int8 linears run on stock torch")
    return _native


def force_implementation(name: str | None) -> None:
    """Tests: "native" or "torch" for every Int8Linear made from now on; None: the best one."""
    if name not in (None, *IMPLEMENTATIONS):
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {name!r}")
    global _forced
    _forced = name


def implementation(device: torch.device) -> str:
    if _forced is not None:
        return _forced
    return "native" if device.type == "cpu" and load_native_ops() else "torch"


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (int8 [N, K], float32 scales [N]), symmetric per output channel."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [B, K] -> (int8 [B, K], float32 scales [B, 1]), symmetric per token."""
    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(xf / scale).clamp_(-127, 127).to(torch.int8), scale


def w8a8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The torch path of one W8A8 product: x [B, K] times int8 q [N, K]^T with per-channel scales
    [N], in x's dtype."""
    xq, xs = quantize_rows(x)
    return (torch._int_mm(xq, q.t()).float() * xs * scale).to(x.dtype)


class Int8Linear(nn.Module):
    """A bias-free linear with int8 weights and per-channel scales, W8A8 (module docstring)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, impl: str):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.impl = impl
        self.scale = scale.detach().float().contiguous()  # [N]
        if impl == "native":
            load_native_ops()
            self.packed, self.comp = torch.ops.xserv_cpu.int8_pack(q.contiguous())
            self.packed = on_huge_pages(self.packed)  # streamed whole each decode step
            self.q = None
        else:
            self.q, self.packed, self.comp = q.contiguous(), None, None

    @classmethod
    def from_weight(cls, weight: torch.Tensor, impl: str) -> "Int8Linear":
        return cls(*quantize_weight(weight), impl)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # the model's are [T, K] already
        if self.impl == "native":
            y = torch.ops.xserv_cpu.int8_linear(rows, self.packed, self.comp, self.scale, self.out_features)
        else:
            y = w8a8_matmul(rows, self.q, self.scale)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the dequantized weight [len(ids), K]: a tied embedding read from the head."""
        if self.impl == "native":  # packed [N / 16, K / 4, 16, 4]: row r is block r // 16, lane r % 16
            q = self.packed[ids // 16, :, ids % 16, :].reshape(*ids.shape, -1)[..., : self.in_features]
        else:
            q = self.q[ids]
        return (q.float() * self.scale[ids].unsqueeze(-1)).to(dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 W8A8 ({self.impl})"


class Int8Experts(nn.Module):
    """An MoE layer's experts (FusedExperts' w13 [E, 2I, H] and w2 [E, H, I]) in int8, per expert
    and output channel, W8A8 as Int8Linear: natively one op for the whole layer
    (torch.ops.xserv_cpu.moe_experts_int8: each expert's pairs as one int8 matmul per projection),
    on torch a loop over the experts that got pairs."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, impl: str):
        super().__init__()
        self.impl, self.num_experts = impl, w13.shape[0]
        if impl == "native":
            load_native_ops()
        self.s13, self.q13, self.p13, self.c13 = _quantize_experts(w13, impl)  # s13 [E, 2I]
        self.s2, self.q2, self.p2, self.c2 = _quantize_experts(w2, impl)  # s2 [E, H]

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        order, counts = sort_pairs(topk_ids, self.num_experts)
        if self.impl == "native":
            return torch.ops.xserv_cpu.moe_experts_int8(x, self.p13, self.c13, self.s13, self.p2, self.c2, self.s2,
                                                        topk_weights, order, counts)
        return looped_experts(x, topk_weights, order, counts,
                              lambda rows, e: w8a8_matmul(rows, self.q13[e], self.s13[e]),
                              lambda act, e: w8a8_matmul(act, self.q2[e], self.s2[e]))

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, int8 W8A8 ({self.impl})"


def _quantize_experts(weights: torch.Tensor, impl: str) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                   torch.Tensor | None, torch.Tensor | None]:
    """Stacked expert weights [E, N, K] -> (scales [E, N], int8 [E, N, K] on torch, and natively
    int8_pack's packed weights and column sums per expert), written one expert at a time into
    stacks allocated once, so a layer's experts are held in int8 once, not three times."""
    stacks: list[torch.Tensor] = []
    for e, w in enumerate(weights):
        q, s = quantize_weight(w)
        parts = (s, *torch.ops.xserv_cpu.int8_pack(q)) if impl == "native" else (s, q)
        if not stacks:
            stacks = [empty_on_huge_pages((len(weights), *p.shape), p.dtype, p.device) for p in parts]
        for stack, part in zip(stacks, parts):
            stack[e] = part
    if impl == "native":
        return stacks[0], None, stacks[1], stacks[2]
    return stacks[0], stacks[1], None, None


class Int8Embedding(nn.Module):
    """The token embedding of a tied model whose LM head is int8: rows of the head's weight, so
    the table is held once, in 8 bits (as llama.cpp's Q8_0 holds token_embd)."""

    def __init__(self, head: Int8Linear, dtype: torch.dtype):
        super().__init__()
        self.head, self.dtype = head, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.rows(ids, self.dtype)


def quantize_model(model: nn.Module, dtype: torch.dtype, prequantized: dict | None = None,
                   quantize_rest: bool = True, progress: bool = True) -> int:
    """Replace the model's bias-free linears (not an MoE router: it picks the experts) with
    Int8Linears: those in `prequantized` ({module name: (int8 weight, scales)}, a
    compressed-tensors checkpoint's) as they are, the others quantized from their weights if
    quantize_rest, and then each MoE layer's stacked experts with Int8Experts. A tied model whose
    head is int8 reads its embedding from the head. Returns how many linears were replaced."""
    prequantized = dict(prequantized or {})
    impl = implementation(next(model.parameters()).device)
    # names, not modules: a list of modules would keep every full-precision weight alive until the
    # last one is quantized, so the peak would be the whole model twice (once in int8)
    targets = [name for name, module in model.named_modules()
               if type(module) is nn.Linear and module.bias is None and not name.endswith(".mlp.gate")
               and (quantize_rest or name in prequantized)]
    tied = getattr(model.config, "tie_word_embeddings", False)
    for name in tqdm(targets, desc="Quantizing to int8", unit="linear", disable=not progress):
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        if name in prequantized:
            linear = Int8Linear(*prequantized.pop(name), impl)
        else:
            linear = Int8Linear.from_weight(getattr(owner, attr).weight, impl)
        setattr(owner, attr, linear)
        if name == "lm_head" and tied:
            model.model.embed_tokens = Int8Embedding(linear, dtype)
    experts = [name for name, module in model.named_modules() if type(module) is FusedExperts and quantize_rest]
    for name in tqdm(experts, desc="Quantizing experts to int8", unit="layer", disable=not progress or not experts):
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        module = getattr(owner, attr)
        setattr(owner, attr, Int8Experts(module.w13_weight, module.w2_weight, impl))
        del module
    log.info("int8 weights: %d linears%s, per output channel; activations per token at run time (%s)",
             len(targets), f" and {len(experts)} layers of experts" if experts else "", impl)
    return len(targets)
