"""The Gated DeltaNet's sequence mixing, one sequence's prompt chunk or a batch of decode tokens,
in plain torch: the depthwise causal conv1d and the gated delta rule over a per-head fp32 state.

The arithmetic is transformers' (models/qwen3_5: causal_conv1d_fn / _update,
torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule), the test oracle; what differs
is the layout: tokens first ([T, H, D]), states in a pool indexed by slot, and a prompt that may
come in several chunks, each starting from the state the last one left.

State per sequence and layer: conv [C, K-1] (the last K-1 inputs of the conv, in the model's
dtype) and recurrent [Hv, Dk, Dv] (fp32).

On CUDA the two rules run flash-linear-attention's kernels (fla-core, the cuda extra) where it is
installed: the same arithmetic, checked against these in benchmarks/gpu_acceptance.py.
"""

import functools

import torch
import torch.nn.functional as F

# the chunked form's block of positions: transformers' and fla's 64 on the GPU; on the CPU 32
# takes 15-20 % less time from 512 to 8,192 positions (triangular systems and intra-block
# products of half the size; the sequential loop's work per position is the same)
CHUNK = 32
MIN_CHUNK = 8  # a shorter chunk's block: the next power of two, at least this


def causal_conv1d(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's chunk x [n, C] after the K-1 inputs in state [C, K-1], through the depthwise
    conv weight [C, K] and SiLU: ([n, C], the new state [C, K-1])."""
    n, k = x.shape[0], weight.shape[1]
    window = torch.cat([state, x.t().to(state.dtype)], dim=1)  # [C, K-1+n]
    out = F.conv1d(window.unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), groups=weight.shape[0])[0]  # [C, n]
    return F.silu(out).t().to(x.dtype), window[:, window.shape[1] - (k - 1):]


def causal_conv1d_step(x: torch.Tensor, states: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence, x [B, C], states [B, C, K-1]: ([B, C], the new states)."""
    window = torch.cat([states, x.unsqueeze(-1).to(states.dtype)], dim=-1)  # [B, C, K]
    out = (window.float() * weight.float()).sum(-1).to(weight.dtype)  # as conv1d: fp32 sums, rounded once
    return F.silu(out).to(x.dtype), window[:, :, 1:]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def expand_key_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """[..., Hk, D] -> [..., Hk * group, D]: value head h reads key head h // group."""
    return x.repeat_interleave(group, dim=-2)


def _prepare(q, k, v, g, beta):
    """fp32, q and k L2-normalized, q scaled, each key head repeated for its value heads."""
    group = v.shape[-2] // k.shape[-2]
    if group > 1:
        q, k = expand_key_heads(q, group), expand_key_heads(k, group)
    q, k = l2norm(q.float()), l2norm(k.float())
    return q * q.shape[-1] ** -0.5, k, v.float(), g.float(), beta.float()


@functools.cache
def fla_kernels():
    """(chunk_gated_delta_rule, fused_recurrent_gated_delta_rule) of fla-core, or None."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def _on_fla(x: torch.Tensor) -> bool:
    return x.is_cuda and fla_kernels() is not None


def recurrent_gated_delta_rule(q, k, v, g, beta, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv], states
    [B, Hv, Dk, Dv] fp32 -> (o [B, Hv, Dv] in v's dtype, the new states)."""
    if _on_fla(v):  # [B, 1, H, D]: one token each; fla groups value heads over key heads itself
        o, s = fla_kernels()[1](q[:, None], k[:, None], v[:, None], g[:, None].float(), beta[:, None].to(v.dtype),
                                initial_state=states.float(), output_final_state=True, use_qk_l2norm_in_kernel=True)
        return o[:, 0].to(v.dtype), s
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    s = states * g.exp()[..., None, None]
    kv_mem = (s * k.unsqueeze(-1)).sum(dim=-2)  # [B, Hv, Dv]
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (s * q.unsqueeze(-1)).sum(dim=-2).to(dtype), s


def chunk_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor | None,
                           snapshots: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """One sequence's chunk: q, k [n, Hk, Dk], v [n, Hv, Dv], g, beta [n, Hv], state [Hv, Dk, Dv]
    fp32 or None (zeros) -> (o [n, Hv, Dv] in v's dtype, the state after the chunk, the states
    after each of the first `snapshots` positions: the prefix cache's, ascending, in 1..n). Blocks
    of CHUNK positions: within a block the delta rule's updates are one triangular solve (the UT
    transform), between blocks the state carries the past; a state inside a block is the block's
    update cut at that row."""
    dtype, n = v.dtype, v.shape[0]
    if _on_fla(v):  # the chunk in pieces that end at the snapshots, each from the state before it
        outs, taken, start = [], [], 0
        s = None if state is None else state.float()
        for end in [*snapshots, n]:
            if end > start:
                piece = slice(start, end)
                o, s = fla_kernels()[0](q[None, piece], k[None, piece], v[None, piece], g[None, piece].float(),
                                        beta[None, piece].to(dtype), initial_state=None if s is None else s[None],
                                        output_final_state=True, use_qk_l2norm_in_kernel=True)
                outs.append(o[0].to(dtype))
                s, start = s[0], end
            if len(taken) < len(snapshots):
                taken.append(s)
        return torch.cat(outs), s, taken
    hv, dk, dv = v.shape[1], k.shape[-1], v.shape[-1]
    if hv > k.shape[1]:
        q, k = expand_key_heads(q, hv // k.shape[1]), expand_key_heads(k, hv // k.shape[1])
    # a short chunk (a verification's 1 + k rows) in one block of the next power of two: padded
    # to CHUNK, its triangular systems would be mostly padding
    chunk = min(CHUNK, max(MIN_CHUNK, 1 << (n - 1).bit_length()))
    pad = (chunk - n % chunk) % chunk
    blocks = (n + pad) // chunk

    def by_block(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        # [n, H, ...] -> fp32 [blocks, H, chunk, ...], the rows past n zeros: one copy that
        # converts, pads and transposes, so each block's slice is one dense batch
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, 0, 0, pad)) if pad else x
        x = x.unflatten(0, (blocks, chunk)).transpose(1, 2)
        if out is None:
            out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        return out.copy_(x)

    def l2normalized(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:  # l2norm, in place
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        return x.mul_(norm.square_().add_(1e-6).rsqrt_().mul_(scale))

    beta, decay = by_block(beta), by_block(g).cumsum(dim=-1)  # [blocks, H, chunk]: log decay from the block's start
    decay_exp = decay.exp()
    q, k = l2normalized(by_block(q), dk ** -0.5), l2normalized(by_block(k))
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (decay.unsqueeze(-1) - decay.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    system = (k @ k.mT).mul_(pairwise * beta.unsqueeze(-1))  # (k * beta) @ k^T: beta scales the rows
    intra = (q @ k.mT).mul_(pairwise)
    # both right-hand sides of the one system in one solve: [v * beta | k * beta * exp(decay)]
    rhs = torch.empty(blocks, hv, chunk, dv + dk, dtype=torch.float32, device=q.device)
    by_block(v, rhs[..., :dv]).mul_(beta.unsqueeze(-1))
    torch.mul(k, (beta * decay_exp).unsqueeze(-1), out=rhs[..., dv:])
    # as X^T system^T = rhs^T: the right-side form reads the row-major rhs as LAPACK's
    # column-major one, without the left form's transposing copy, and solves it in place
    torch.linalg.solve_triangular(system.mT, rhs.mT, upper=True, left=False, unitriangular=True, out=rhs.mT)
    new_values, k_cumdecay = rhs[..., :dv], rhs[..., dv:]
    s = torch.zeros(hv, dk, dv, dtype=torch.float32, device=q.device) if state is None else state.float()
    out = torch.empty(blocks, hv, chunk, dv, dtype=torch.float32, device=q.device)
    q.mul_(decay_exp.unsqueeze(-1))
    k_end = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)  # [blocks, H, C, Dk]: decayed to the block's end
    block_decay = decay_exp[..., -1, None, None]
    pending, taken = list(snapshots), []
    for i in range(blocks):
        v_new = torch.baddbmm(new_values[i], k_cumdecay[i], s, alpha=-1)  # in place, a strided self is per-head mm's
        torch.bmm(q[i], s, out=out[i]).baddbmm_(intra[i], v_new)
        while pending and pending[0] < min((i + 1) * chunk, n):  # inside the block: its first j rows
            j = pending.pop(0) - i * chunk
            cut = (decay[i, :, j - 1 : j] - decay[i, :, :j]).exp().unsqueeze(-1)  # [H, j, 1]
            taken.append(s * decay_exp[i, :, j - 1, None, None] + (k[i, :, :j] * cut).mT @ v_new[:, :j])
        s = (s * block_decay[i]).baddbmm_(k_end[i].mT, v_new)  # a new tensor: the snapshots keep theirs
        while pending and pending[0] <= (i + 1) * chunk:  # the block's end (or the chunk's, in the last)
            pending.pop(0)
            taken.append(s)
    result = torch.empty(blocks, chunk, hv, dv, dtype=dtype, device=q.device)
    result.copy_(out.transpose(1, 2))  # back to tokens first, rounded to v's dtype in the same pass
    return result.flatten(0, 1)[:n], s, taken
