"""Linear layers with their weight packed once, on the CPU.

F.linear on the CPU hands oneDNN a plain [out, in] weight and lets it reorder the weight into its
blocked layout on every call. Packing it once at load time (what torch.compile's freezing and
IPEX do) makes the same matmul faster, bit-identical in bf16 and within 1e-4 in fp32 (timings
in docs/benchmarks-log.md): PackedLinear.

bf16 weights on a CPU with AVX512-BF16 but no AMX are packed for the native kernel instead
(Bf16Linear: torch.ops.xserv_cpu.bf16_linear, the int8 kernel's blocked layout and tiles with
vdpbf16ps). oneDNN's bf16 linear costs 12-15 us a call even for a small cached weight and read a
decode step's weights at ~0.8 of this kernel's rate here (docs/benchmarks-log.md, 2026-12-05,
night); with AMX, oneDNN's tiles run the prompts and it stays.
"""

import logging

import torch
from torch import nn

from xserv_engine.engine.device import on_huge_pages
from xserv_engine.layers import native

log = logging.getLogger(__name__)

BATCH_HINT = 64  # the batch oneDNN picks the layout for; any batch runs with it


def uninitialized_linear(in_features: int, out_features: int, bias: bool = False) -> nn.Linear:
    """An nn.Linear on the current default device, its tensors uninitialized: the loaders fill
    every one, so a random init would be CPU thrown away at every start."""
    return nn.utils.skip_init(nn.Linear, in_features, out_features, bias=bias, device=torch.get_default_device())


def uninitialized_embedding(num_embeddings: int, embedding_dim: int) -> nn.Embedding:
    """An nn.Embedding on the current default device, its weight uninitialized. Not skip_init: that
    builds the module on the meta device, whose normal_ imports torch._dynamo (a second of CPU at a
    process's first start)."""
    return nn.Embedding(num_embeddings, embedding_dim, _weight=torch.empty(
        num_embeddings, embedding_dim, device=torch.get_default_device()))


class PackedLinear(nn.Module):
    """A bias-free nn.Linear whose weight is held only in oneDNN's packed layout."""

    def __init__(self, weight: torch.Tensor, batch_hint: int = BATCH_HINT):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for oneDNN"


class Bf16Linear(nn.Module):
    """A bias-free bf16 nn.Linear whose weight is held only in the native kernel's blocked layout."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        native.load_torch_ops()
        self.packed = on_huge_pages(torch.ops.xserv_cpu.bf16_pack(weight.detach()))  # streamed whole each decode step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # the model's are [T, K] already
        y = torch.ops.xserv_cpu.bf16_linear(rows, self.packed, self.out_features)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for the native bf16 kernel"


_forced: str | None = None


def force_packing(name: str | None) -> None:
    """Tests: "native" (Bf16Linear, where the CPU runs it) or "onednn" for bf16 linears packed from
    now on; None: by the CPU."""
    if name not in (None, "native", "onednn"):
        raise ValueError(f"packing must be native or onednn, got {name!r}")
    global _forced
    _forced = name


def native_bf16() -> bool:
    """Whether bf16 linears are packed for the native kernel here: AVX512-BF16 built in, no AMX."""
    runs = native.load_torch_ops() and bool(torch.ops.xserv_cpu.has_bf16_linear())
    if _forced is not None:
        return runs and _forced == "native"
    return runs and not getattr(torch._C._cpu, "_is_amx_tile_supported", lambda: False)()


def pack_cpu_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """Swap every bias-free nn.Linear of a CPU model for a Bf16Linear (bf16, where native_bf16) or
    a PackedLinear; returns how many. Leaves them be where oneDNN cannot pack them or gives a
    different answer on a probe."""
    ours = dtype == torch.bfloat16 and native_bf16()
    if not ours and not _packing_works(dtype):
        return 0
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and child.bias is None and child.weight.device.type == "cpu":
                setattr(module, name, Bf16Linear(child.weight) if ours else PackedLinear(child.weight))
                swapped += 1
    log.info("%d linears packed for %s", swapped, "the native bf16 kernel" if ours else "oneDNN")
    return swapped


def _packing_works(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(96, 64, generator=gen).to(dtype)
        x = torch.randn(5, 64, generator=gen).to(dtype)
        ok = torch.allclose(PackedLinear(weight)(x).float(), nn.functional.linear(x, weight).float(),
                            atol=1e-2, rtol=1e-2)
    except (RuntimeError, AttributeError) as exc:  # an op this torch build lacks
        log.info("oneDNN weight packing unavailable (%s); using F.linear", exc)
        return False
    if not ok:
        log.warning("oneDNN packed linear disagrees with F.linear on a probe; using F.linear")
    return ok
