"""The small operations of a forward, each native on the CPU or plain torch.

A one-stream decode step of a Qwen3-0.6B shape reads its weights in ~16 ms in int8; in plain
torch the ~40 small ops per decoder layer around the matmuls (norms, rotary, the residual adds,
SwiGLU, paged attention), each with its own dispatch and allocations, cost as much again. Here
each of them is one call: a torch operator of layers/cpu_ops.cpp (torch.ops.xserv_cpu) where
native ops are on (set_native, decided once per engine by engine_setup with the decode route),
else the torch code that is also their reference (tests run both). Numerics are the torch
path's: fp32 arithmetic, rounded to the model's dtype where the torch path stores a tensor.
"""

import torch

from xserv_engine.engine.device import empty_on_huge_pages, on_huge_pages
from xserv_engine.layers import gated_delta_rule as rule
from xserv_engine.layers import linear
from xserv_engine.layers import native as native_build
from xserv_engine.layers.layernorm import rms_norm as torch_rms_norm
from xserv_engine.layers.rotary_embedding import RotaryEmbedding

_native = False


def set_native(enabled: bool) -> None:
    """Native CPU ops for every model of this process from now on (they must be loaded)."""
    global _native
    _native = enabled


def native(x: torch.Tensor) -> bool:
    return _native and x.device.type == "cpu"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain torch: once per forward (the first layer's input), and a native one made a prompt
    prefilled in chunks sample differently from one prefilled whole, in fp32 (test_llm_engine)."""
    return torch_rms_norm(x, weight, eps)


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, rms_norm(h)) with h = residual + delta: a decoder layer's residual add and its next norm."""
    if native(residual):
        return torch.ops.xserv_cpu.add_rms_norm(residual, delta, weight, eps)
    h = residual + delta
    return h, torch_rms_norm(h, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(gate) * up, gate and up side by side on the last dim."""
    if native(x):
        return torch.ops.xserv_cpu.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


class Rope:
    """One forward's positions and the rotary tables: gathered for them once (torch path), or
    read by the native op where it needs them."""

    def __init__(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype):
        self.rotary, self.positions, self.dtype = rotary, positions, dtype
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos_sin is None:
            self._cos_sin = self.rotary.cos_sin(self.positions, self.dtype)
        return self._cos_sin


def qk_norm_rope(qkv: torch.Tensor, weight: torch.Tensor, eps: float, rope: Rope) -> torch.Tensor:
    """The q and k heads at the start of each row of qkv [T, W] ([Hq + Hkv] heads of D = weight's
    [Hq + Hkv, D]), each RMS-normed with its head's weight, then rotated: [T, Hq + Hkv, D]."""
    heads, d = weight.shape
    if native(qkv) and rope.positions.dim() == 1:  # the native op reads one position per token, not MRoPE's three
        return torch.ops.xserv_cpu.qk_norm_rope(qkv, weight, rope.rotary.cos, rope.rotary.signed_sin, rope.positions,
                                                eps, heads)
    qk = qkv[:, : heads * d].view(-1, heads, d)
    return RotaryEmbedding.apply_one(torch_rms_norm(qk, weight, eps), *rope.cos_sin())


def gated_delta_decode(mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_state: torch.Tensor,
                       conv_weight: torch.Tensor, ssm_state: torch.Tensor, slots: torch.Tensor,
                       num_key_heads: int) -> torch.Tensor:
    """A Gated DeltaNet's decode token per sequence: conv step, SiLU and the gated delta rule on
    the states at `slots` (updated in place); mixed [B, C] -> o [B, Hv, Dv]. Natively one op."""
    if native(mixed):
        return torch.ops.xserv_cpu.gdn_decode(mixed, g, beta, conv_state, conv_weight, ssm_state, slots,
                                              num_key_heads)
    conv, conv_state[slots] = rule.causal_conv1d_step(mixed, conv_state[slots], conv_weight)
    key_dim = num_key_heads * ssm_state.shape[2]
    q, k, v = conv.split([key_dim, key_dim, conv.shape[1] - 2 * key_dim], dim=-1)
    heads = (q.view(len(q), num_key_heads, -1), k.view(len(k), num_key_heads, -1),
             v.view(len(v), ssm_state.shape[1], -1))
    o, ssm_state[slots] = rule.recurrent_gated_delta_rule(*heads, g, beta, ssm_state[slots])
    return o


def gated_delta_conv(x: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor, slot: int) -> torch.Tensor:
    """One sequence's prompt chunk x [n, C] through the causal conv and SiLU after the inputs its
    slot's conv state holds (updated in place to the chunk's last K-1): [n, C]."""
    if native(x):
        return torch.ops.xserv_cpu.gdn_conv_prefill(x, conv_state, conv_weight, slot)
    out, conv_state[slot] = rule.causal_conv1d(x, conv_state[slot], conv_weight)
    return out


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm(o) * w * silu(z) over the last dim (the Gated DeltaNet's output norm), normalized in
    fp32 and scaled in o's dtype as transformers' Qwen3_5RMSNormGated; [N, D]."""
    if native(o):
        return torch.ops.xserv_cpu.gated_rms_norm(o, z, weight, eps)
    of = o.float()
    normed = (of * torch.rsqrt(of.square().mean(-1, keepdim=True) + eps)).to(o.dtype)
    return (weight * normed * torch.nn.functional.silu(z.reshape(o.shape).float())).to(o.dtype)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, block_size: int) -> None:
    """k, v [T, Hkv, D] into the torch backend's cache at their slots: native only;
    TorchAttentionBackend.write_kv is the torch path."""
    torch.ops.xserv_cpu.write_kv(k_cache, v_cache, k, v, slot_mapping, block_size)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """One query per sequence over its paged context (the torch backend's cache layout): native only;
    TorchAttentionBackend.decode is the torch path."""
    return torch.ops.xserv_cpu.decode_attention(q, k_cache, v_cache, block_tables, context_lens, block_size, scale)


# scores a prompt's attention holds at once (elements, ~8 MB in bf16): its queries go in chunks
# of at most this many scores, so a long prompt's [H, L, L] scores never exist whole
PREFILL_SCORES = 1 << 22


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of prompts, q [n, Hq, Lq, D] over k/v [n, Hkv, Lk, D], the queries being
    the last Lq of the Lk positions; [n, Hq, Lq, D]. Native only: the two matmuls are torch's
    (oneDNN's bf16 kernels), the scaled, causally masked softmax between them is
    torch.ops.xserv_cpu.causal_softmax, in place; the arithmetic of transformers' eager attention.
    CPU SDPA (TorchAttentionBackend's torch path) took 3.5x as long here for 16 prompts of 190 tokens
    (docs/benchmarks-log.md). A query chunk reads the keys up to its last position only."""
    n, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    group, offset = hq // hkv, lk - lq
    k, v = k.contiguous(), v.contiguous()  # once, not per chunk (matmul copies what it cannot batch)
    out = q.new_empty(n, lq, hkv, group, d)  # the caller's [T, Hq, D] order, so it need not copy
    queries = q.view(n, hkv, group, lq, d)
    step = max(16, PREFILL_SCORES // max(1, n * hq * lk) // 16 * 16)
    for r0 in range(0, lq, step):
        r1 = min(lq, r0 + step)
        keys = r1 + offset
        chunk = queries[:, :, :, r0:r1].reshape(n, hkv, group * (r1 - r0), d)
        scores = torch.matmul(chunk, k[:, :, :keys].transpose(-1, -2))  # [n, Hkv, G * chunk, keys]
        torch.ops.xserv_cpu.causal_softmax(scores, scale, r1 - r0, r0 + offset)
        values = torch.matmul(scores, v[:, :, :keys]).view(n, hkv, group, r1 - r0, d)
        out[:, r0:r1] = values.permute(0, 3, 1, 2, 4)
    return out.view(n, lq, hq, d).transpose(1, 2)


def vision_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full (bidirectional) attention within one image of a vision tower: q, k, v [H, n, D], each
    head's rows contiguous -> [n, H, D]. Native in bf16 where linears run the native bf16 kernel
    (AVX512-BF16, no AMX): torch.ops.xserv_cpu.vision_attention, fp32 scores as SDPA's, 0.6x its CPU
    time at 3,072 patches x 12 heads x 64 (benchmarks/vision_tower.py). Else torch's SDPA."""
    n, d = q.shape[1], q.shape[2]
    if native(q) and q.dtype == torch.bfloat16 and n % 2 == 0 and d % 2 == 0 and linear.native_bf16():
        return torch.ops.xserv_cpu.vision_attention(q, k, v, d ** -0.5)
    # [1, H, n, D]: with a batch dimension torch's CPU SDPA takes its flash kernel; [H, n, D]
    # falls back to the math path, full n x n scores (3.8x slower at n = 3,072)
    return torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None])[0].transpose(0, 1)


# ---- 4-bit weights (layers/int4.py; the layout is docs/notes' "int4 layout": W[n, k] =
# (q[n, k] - z[n, k // G]) * s[n, k // G]) ----

_int4_native: bool | None = None


def int4_native() -> bool:
    """Whether torch.ops.xserv_cpu.int4_linear runs here: cpu_ops.cpp built and loaded, and AVX512-VNNI."""
    global _int4_native
    if _int4_native is None:
        _int4_native = native_build.load_torch_ops() and bool(torch.ops.xserv_cpu.has_vnni())
    return _int4_native


def prepare_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                 packed: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The parts of a 4-bit linear as int4_linear reads them, made once at load (the module holds
    these alone): qweight uint8 [N, K // 2], scales float32 [N, K // G], zeros uint8 [N, K // G]
    repacked into the native op's blocked layout (cpu_ops.cpp's int4_pack: 16 channels by 8 k per
    64-byte line) where it runs on this CPU (packed None: decide; False: keep them as they are),
    K and G allowing (multiples of 8). The packed form is only ever read by int4_linear. Each part
    of 2 MB or more is held on transparent huge pages (device.on_huge_pages)."""
    return tuple(on_huge_pages(part) for part in _int4_parts(qweight, scales, zeros, group_size, packed))


def _int4_parts(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                packed: bool | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """prepare_int4's parts in ordinary memory (prepare_int4_experts copies them into its stacks)."""
    k = qweight.shape[-1] * 2
    if packed is None:
        packed = qweight.device.type == "cpu" and int4_native()
    if not packed or group_size % 8 or k % group_size:
        return qweight.contiguous(), scales.float().contiguous(), zeros.contiguous()
    return torch.ops.xserv_cpu.int4_pack(qweight.contiguous(), scales.float().contiguous(), zeros.contiguous(),
                                         group_size)


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int, out_features: int) -> torch.Tensor:
    """x [T, K] times the 4-bit weight [out_features, K]^T, in x's dtype; the parts as prepare_int4
    made them. Packed: torch.ops.xserv_cpu.int4_linear (bfloat16 x: W4A8, each row quantized per
    token to int8 as int8_linear's are, int32 sums per group of the unpacked nibbles; float32 x:
    the exact weights, fp32 sums). Else stock torch: the weight dequantized in x's dtype, whole,
    then one matmul (the reference for float32: the exact weights)."""
    if qweight.dim() == 4:
        return torch.ops.xserv_cpu.int4_linear(x, qweight, scales, zeros, out_features)
    return torch.matmul(x, dequantize_int4(qweight, scales, zeros, group_size, x.dtype).t())


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The canonical parts ([..., N, K // 2], [..., N, K // G] twice) -> W [..., N, K] in `dtype`:
    (q - z) in integers, one multiply in float32 (bit for bit the checkpoint's dequantized
    weight), then rounded to `dtype`."""
    q = torch.stack((qweight & 15, qweight >> 4), dim=-1).flatten(-2).unflatten(-1, (-1, group_size))
    diff = q.to(torch.int16) - zeros.to(torch.int16).unsqueeze(-1)
    return (diff.float() * scales.float().unsqueeze(-1)).flatten(-2).to(dtype)


def prepare_int4_experts(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                         packed: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """prepare_int4 for a stack of experts' parts ([E, N, K // 2] ...): each expert packed, the
    packs stacked ([E, N16 / 16, K / 8, 16, 4] ...), one expert at a time into stacks made once."""
    stacks: list[torch.Tensor] = []
    for e in range(qweight.shape[0]):
        parts = _int4_parts(qweight[e], scales[e], zeros[e], group_size, packed)  # the stacks are on huge pages
        if not stacks:
            stacks = [empty_on_huge_pages((qweight.shape[0], *p.shape), p.dtype, p.device) for p in parts]
        for stack, part in zip(stacks, parts):
            stack[e] = part
    return stacks[0], stacks[1], stacks[2]


def moe_experts_int4(x: torch.Tensor, w13: tuple[torch.Tensor, ...], w2: tuple[torch.Tensor, ...],
                     topk_weights: torch.Tensor, order: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """An MoE layer's experts in one native call (torch.ops.xserv_cpu.moe_experts_int4): w13 and w2
    the (qweight, scales, zeros) stacks prepare_int4_experts packed; order and counts as
    fused_moe.sort_pairs gives them. bf16 x: W4A8 as int4_linear; fp32: the exact weights."""
    return torch.ops.xserv_cpu.moe_experts_int4(x, *w13, *w2, topk_weights, order, counts)
