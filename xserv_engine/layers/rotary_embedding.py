import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate_half) with a cos/sin table precomputed for every position.

    `cos_sin` runs once per forward; every layer then applies the same tables with `apply_one`.
    """

    def __init__(self, head_dim: int, max_position: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.register_buffer("cos", emb.cos(), persistent=False)
        half = head_dim // 2
        self.register_buffer("signed_sin", torch.cat((-emb[:, :half].sin(), emb[:, half:].sin()), dim=-1),
                             persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # [T] -> two [T, 1, D] tables, broadcast over heads; the sine's first half is negated
        # so that rotate_half(x) * sin == x.roll(D/2) * signed_sin (one op instead of three)
        return self.cos[positions].unsqueeze(1).to(dtype), self.signed_sin[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def apply_one(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        # x [T, H, D]; bit-identical to x * cos + rotate_half(x) * sin
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
