import torch
from torch import nn

from xserv_engine.layers import ops


class SiluAndMul(nn.Module):
    """SwiGLU: silu(gate) * up, with gate and up concatenated on the last dim."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(x)
