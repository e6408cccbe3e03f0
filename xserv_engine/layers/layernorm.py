import torch
from torch import nn


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm: normalised in float32, scaled in the input dtype (as transformers does)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalised in float32 over the last dim, scaled in the input dtype (as transformers does)."""
    xf = x.float()
    inv_rms = torch.rsqrt(xf.square().mean(-1, keepdim=True).add_(eps))
    # scale the float32 copy in place (one pass fewer); an fp32 x has no copy, so leave it be
    normed = xf * inv_rms if xf is x else xf.mul_(inv_rms)
    return weight * normed.to(x.dtype)
