import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate_half) with a cos/sin table precomputed for every position.

    `cos_sin` runs once per forward; every layer then applies the same tables with `apply_one`.

    Vision-language models (Qwen3-VL, Qwen3.5) rotate by three positions per token (temporal,
    height, width: MRoPE, models/mrope.py), interleaved: frequency f turns with the height for
    f = 1, 4, 7, ... below 3 * mrope_section[1], with the width for f = 2, 5, 8, ... below
    3 * mrope_section[2], with the temporal position otherwise. A text token's three are equal.
    """

    def __init__(self, head_dim: int, max_position: int, theta: float, mrope_section: tuple[int, ...] = ()):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.register_buffer("cos", emb.cos(), persistent=False)
        half = head_dim // 2
        self.register_buffer("signed_sin", torch.cat((-emb[:, :half].sin(), emb[:, half:].sin()), dim=-1),
                             persistent=False)
        self.register_buffer("axis", _mrope_axes(head_dim // 2, mrope_section).repeat(2), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # [T] (or MRoPE's [3, T]) -> two [T, 1, D] tables, broadcast over heads; the sine's first
        # half is negated so that rotate_half(x) * sin == x.roll(D/2) * signed_sin (one op instead of three)
        if positions.dim() == 2:
            return self._mrope(self.cos, positions).to(dtype), self._mrope(self.signed_sin, positions).to(dtype)
        return self.cos[positions].unsqueeze(1).to(dtype), self.signed_sin[positions].unsqueeze(1).to(dtype)

    def _mrope(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Column d of each row from the table row of the position on d's axis: [T, 1, D]."""
        rows = table[positions]  # [3, T, D]
        return rows.gather(0, self.axis.expand(1, *rows.shape[1:])).squeeze(0).unsqueeze(1)

    @staticmethod
    def apply_one(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        # x [T, H, D]; bit-identical to x * cos + rotate_half(x) * sin
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def _mrope_axes(num_freqs: int, section: tuple[int, ...]) -> torch.Tensor:
    """[num_freqs]: 0 (temporal), 1 (height) or 2 (width) for each frequency, interleaved."""
    axis = torch.zeros(num_freqs, dtype=torch.int64)
    if section:
        axis[1 : 3 * section[1] : 3] = 1
        axis[2 : 3 * section[2] : 3] = 2
    return axis
