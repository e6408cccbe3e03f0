"""Linear layers with their weight packed once for oneDNN, on the CPU.

F.linear on the CPU hands oneDNN a plain [out, in] weight and lets it reorder the weight into its
blocked layout on every call. Packing it once at load time (what torch.compile's freezing and
IPEX do) makes the same matmul faster, bit-identical in bf16 and within 1e-4 in fp32 (timings
in docs/benchmarks-log.md).
"""

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

BATCH_HINT = 64  # the batch oneDNN picks the layout for; any batch runs with it


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


def pack_cpu_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """Swap every bias-free nn.Linear of a CPU model for a PackedLinear; returns how many.
    Does nothing where oneDNN cannot do it or gives a different answer on a probe."""
    if not _packing_works(dtype):
        return 0
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and child.bias is None and child.weight.device.type == "cpu":
                setattr(module, name, PackedLinear(child.weight))
                swapped += 1
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
