"""The Gated DeltaNet (linear attention) layer of the hybrid Qwen3.5 / Qwen3-Next models.

Per token: in_proj gives the conv input (q, k, v side by side), the output gate z and the
per-value-head b and a; q, k, v go through the depthwise causal conv and SiLU; the gated delta
rule (layers/gated_delta_rule.py) mixes them over the sequence's state; a gated RMSNorm
(rmsnorm(o) * w * silu(z)) and out_proj close it. A sequence's past is its two states, held in
the pool the runner gives this layer (conv_state, ssm_state, indexed by the step's slots).

The checkpoint's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a (Qwen3.5) or in_proj_qkvz,
in_proj_ba (Qwen3-Next, grouped per key head; the loader reorders them) are one fused linear.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from xserv_engine.layers import gated_delta_rule as rule
from xserv_engine.layers import ops
from xserv_engine.layers.attention.metadata import StateMetadata


@dataclass(frozen=True)
class LinearAttentionShape:
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def state_bytes(self, dtype: torch.dtype) -> int:
        """One sequence's states in one layer: conv (the model's dtype) and recurrent (fp32)."""
        conv = self.conv_dim * (self.conv_kernel - 1) * dtype.itemsize
        return conv + self.num_value_heads * self.key_head_dim * self.value_head_dim * 4


class GatedDeltaNet(nn.Module):
    def __init__(self, shape: LinearAttentionShape, hidden_size: int, eps: float, linear):
        super().__init__()
        self.shape, self.eps = shape, eps
        s = shape
        self.in_proj = linear(hidden_size, s.conv_dim + s.value_dim + 2 * s.num_value_heads)
        self.conv1d_weight = nn.Parameter(torch.empty(s.conv_dim, s.conv_kernel))  # depthwise: [C, K]
        self.dt_bias = nn.Parameter(torch.empty(s.num_value_heads))
        self.A_log = nn.Parameter(torch.empty(s.num_value_heads))
        self.norm_weight = nn.Parameter(torch.empty(s.value_head_dim))
        self.out_proj = linear(s.value_dim, hidden_size)
        self.conv_state: torch.Tensor | None = None  # [slots, C, K-1], set by the runner
        self.ssm_state: torch.Tensor | None = None  # [slots, Hv, Dk, Dv] fp32
        self.verified: list = []  # a verification step's states before its rows and their inputs (_verify)

    def forward(self, x: torch.Tensor, states: StateMetadata) -> torch.Tensor:
        s = self.shape
        mixed, z, b, a = self.in_proj(x).split([s.conv_dim, s.value_dim, s.num_value_heads, s.num_value_heads], dim=-1)
        beta = b.sigmoid()
        g = self._decay(a)  # [T, Hv], log of the decay
        out = torch.empty(x.shape[0], s.num_value_heads, s.value_head_dim, dtype=x.dtype, device=x.device)
        for slot, source in zip(states.prefill_slots, states.prefill_restore):
            if source >= 0:  # a prefix-cache hit: all restored before any chunk writes a snapshot
                self.conv_state[slot], self.ssm_state[slot] = self.conv_state[source], self.ssm_state[source]
        start = 0
        snapshots = states.prefill_snapshots or [[]] * len(states.prefill_slots)
        for slot, n, fresh, taken in zip(states.prefill_slots, states.prefill_lens, states.prefill_fresh, snapshots):
            rows = slice(start, start + n)
            out[rows] = self._prefill(mixed[rows], g[rows], beta[rows], slot, fresh, taken)
            start += n
        if states.verify_groups:
            self.verified = []
            if states.decode_slots is not None:
                rows = states.decode_rows + start
                out[rows] = self._decode(mixed[rows], g[rows], beta[rows], states.decode_slots)
            for first, n, slot in states.verify_groups:
                rows = slice(start + first, start + first + n)
                out[rows] = self._verify(mixed[rows], a[rows], beta[rows], slot)
        elif states.decode_slots is not None:
            out[start:] = self._decode(mixed[start:], g[start:], beta[start:], states.decode_slots)
        normed = ops.gated_rms_norm(out.view(-1, s.value_head_dim), z.reshape(-1, s.value_head_dim),
                                    self.norm_weight, self.eps)
        return self.out_proj(normed.view(x.shape[0], -1))

    def _split(self, mixed: torch.Tensor):
        s = self.shape
        q, k, v = mixed.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        return (q.view(-1, s.num_key_heads, s.key_head_dim), k.view(-1, s.num_key_heads, s.key_head_dim),
                v.view(-1, s.num_value_heads, s.value_head_dim))

    def _prefill(self, mixed, g, beta, slot: int, fresh: bool, snapshots: list[tuple[int, int]]) -> torch.Tensor:
        """One sequence's prompt chunk, from its states (zeros when fresh); writes them back, and
        into each snapshot slot the states after its number of the chunk's tokens."""
        o, taken = self._chunk(mixed, g, beta, slot, fresh, tuple(at for at, _ in snapshots))
        for (_, target), (conv, ssm) in zip(snapshots, taken):
            self.conv_state[target], self.ssm_state[target] = conv, ssm
        return o

    def _chunk(self, mixed, g, beta, slot: int, fresh: bool, at: tuple[int, ...]):
        """A chunk of one sequence from its slot's states (zeros when fresh), written back: (o, the
        (conv, recurrent) states after each of the first `at` tokens of the chunk)."""
        if fresh:
            self.conv_state[slot].zero_()
        inputs = torch.cat([self.conv_state[slot], mixed.t().to(self.conv_state.dtype)], dim=1) if at else None
        conv = ops.gated_delta_conv(mixed, self.conv_state, self.conv1d_weight, slot)
        o, self.ssm_state[slot], taken = rule.chunk_gated_delta_rule(
            *self._split(conv), g, beta, None if fresh else self.ssm_state[slot], at)
        width = self.shape.conv_kernel - 1  # the conv's state: the K-1 inputs before that position
        return o, [(inputs[:, n : n + width].clone(), state) for n, state in zip(at, taken)]

    def _decay(self, a: torch.Tensor) -> torch.Tensor:
        return -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)

    def _verify(self, mixed, a, beta, slot: int) -> torch.Tensor:
        """A verification's rows of one sequence (its last token, then its drafts), one decode step
        of the op plain decoding uses per row: each row's output is then plain decoding's bit for
        bit, and k+1 rows cost k+1 small state updates, not a chunk of the chunked rule (which cost
        a 5-row verification ~10 decode steps' worth of Gated DeltaNet time, docs/benchmarks.md).
        The states before the rows and the rows' inputs are kept for keep_verified. Each row's
        decay is its own call too: torch's softplus over 5 rows rounds otherwise than over 1 (by
        up to 2.4e-7), and that difference in the fp32 states flipped a bf16 argmax of the
        Qwen3.5-0.8B shape's random weights within 25 tokens."""
        slots = torch.tensor([slot], dtype=torch.int64, device=mixed.device)
        g = torch.cat([self._decay(a[i : i + 1]) for i in range(len(a))])
        self.verified.append((self.conv_state[slot].clone(), self.ssm_state[slot].clone(), mixed, g, beta, slots))
        return torch.cat([self._decode(mixed[i : i + 1], g[i : i + 1], beta[i : i + 1], slots)
                          for i in range(len(mixed))])

    def keep_verified(self, groups: list[tuple[int, int, int]], rows_kept: list[int]) -> None:
        """After a verification: each group's slot holds its states after the rows that stood
        (the last token and the drafts accepted), not after all its drafts: where a draft fell, the
        states before the rows come back and the rows that stood are stepped through again (the
        same op on the same inputs: the same states as plain decoding's)."""
        for (_, n, slot), kept, (conv, ssm, mixed, g, beta, slots) in zip(groups, rows_kept, self.verified):
            if kept < n:
                self.conv_state[slot], self.ssm_state[slot] = conv, ssm
                for i in range(kept):
                    self._decode(mixed[i : i + 1], g[i : i + 1], beta[i : i + 1], slots)
        self.verified = []

    def _decode(self, mixed, g, beta, slots: torch.Tensor) -> torch.Tensor:
        """One token of each decoding sequence, their states gathered and scattered back by slot."""
        return ops.gated_delta_decode(mixed, g, beta, self.conv_state, self.conv1d_weight, self.ssm_state, slots,
                                      self.shape.num_key_heads)
