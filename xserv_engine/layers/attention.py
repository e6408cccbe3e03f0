"""Paged attention behind one interface.

A step's tokens are the prefill tokens of newly scheduled sequences followed by one token per
decoding sequence. Every layer first writes the step's new keys/values into the paged cache
(slot_mapping), then attends: prefills over their whole context (a cached prefix included),
decodes over the cache. Writing first is what lets n>1 siblings and prefix-cache hits read
prompt blocks computed in the same step.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class PrefillMetadata:
    cu_seqlens_q: torch.Tensor  # [P+1] int32
    cu_seqlens_k: torch.Tensor  # [P+1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    block_tables: torch.Tensor  # [P, max_blocks] int32, padded with 0
    query_lens: list[int]  # host copies for the torch path (no device sync)
    context_lens: list[int]
    block_size: int = 0  # set by the torch backend's prepare


@dataclass
class DecodeMetadata:
    context_lens: torch.Tensor  # [D] int32: tokens in each context after this step
    block_tables: torch.Tensor  # [D, max_blocks] int32, padded with 0 (masked by context_lens)
    # torch path only, built once per step by TorchAttentionBackend.prepare
    block_size: int = 0
    key_bias: torch.Tensor | None = None  # [1, D, 1, W] float32: 0 inside the context, -inf past it
    key_index: torch.Tensor | None = None  # [Hkv * D * G * max_blocks * head_dim] rows of the k cache as [-1, bs]
    key_offsets: torch.Tensor | None = None  # [Hkv * D * G * max_blocks]: where each block's head_dim rows start
    value_index: torch.Tensor | None = None  # [Hkv * D * G * W] rows of the v cache as [-1, head_dim]
    value_offsets: torch.Tensor | None = None  # [Hkv * D * G]: where each query head's W rows start


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    num_prefill_tokens: int  # tokens [0, num_prefill_tokens) are prefills, the rest decodes
    prefill: PrefillMetadata | None = None
    decode: DecodeMetadata | None = None
    slot_block_offset: tuple | None = None  # torch path: (block, offset in it) of each new token


class Attention(nn.Module):
    """Holds the layer's KV cache (k_cache, v_cache: backend.kv_cache_shape each, blocks of
    block_size tokens); set by the model runner."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: "AttentionBackend"):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.backend = backend
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.block_size = 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata):
        # q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]
        if self.k_cache.numel():
            self.backend.write_kv(self, k, v, meta)
        p = meta.num_prefill_tokens
        if meta.decode is None:
            return self.backend.prefill(self, q, k, v, meta.prefill)
        if meta.prefill is None:
            return self.backend.decode(self, q, meta.decode)
        return torch.cat([self.backend.prefill(self, q[:p], k[:p], v[:p], meta.prefill),
                          self.backend.decode(self, q[p:], meta.decode)])


class AttentionBackend:
    name = "base"

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple:
        """One layer's k (and v) cache. Default: flash-attn's paged layout [blocks, block_size, Hkv, D]."""
        return num_blocks, block_size, num_kv_heads, head_dim

    def write_kv(self, layer: "Attention", k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """Store the step's new keys/values [T, Hkv, D] at their cache slots (meta.slot_mapping)."""
        layer.k_cache.view(-1, layer.num_kv_heads, layer.head_dim).index_copy_(0, meta.slot_mapping, k)
        layer.v_cache.view(-1, layer.num_kv_heads, layer.head_dim).index_copy_(0, meta.slot_mapping, v)

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Per-step work shared by every layer; called once by the model runner."""

    def prefill(self, layer: Attention, q, k, v, meta: PrefillMetadata) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, layer: Attention, q, meta: DecodeMetadata) -> torch.Tensor:
        raise NotImplementedError


class TorchAttentionBackend(AttentionBackend):
    """Plain torch over the paged cache; runs on any device, the CPU included.

    The cache is head-major, [Hkv, slots, D] (slot = block * block_size + offset). Values are
    stored so; keys are stored transposed inside each block, [Hkv, blocks, D, block_size] in the
    same memory. A decode step then reads both straight out of the cache with embedding_bag
    (weighted sums of rows), no gather: a block's scores = sum over d of q[d] * keys[d, :], the
    output = sum over positions of p * values.
    """

    name = "torch"

    def kv_cache_shape(self, num_blocks, block_size, num_kv_heads, head_dim):
        return num_kv_heads, num_blocks * block_size, head_dim

    def write_kv(self, layer, k, v, meta):
        block, offset = meta.slot_block_offset
        _keys_by_block(layer)[:, block, :, offset] = k  # advanced indexing: [T, Hkv, D] in that order
        layer.v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))

    def prepare(self, meta, block_size):
        meta.slot_block_offset = (meta.slot_mapping // block_size, meta.slot_mapping % block_size)
        if meta.prefill is not None:
            meta.prefill.block_size = block_size
        if meta.decode is None:
            return
        d = meta.decode
        d.block_size = block_size
        width = d.block_tables.shape[1] * block_size
        outside = torch.arange(width, device=d.block_tables.device)[None, :] >= d.context_lens[:, None]
        # added to the scores: one in-place pass instead of an inverted mask and a masked_fill
        d.key_bias = torch.zeros(outside.shape, device=outside.device).masked_fill_(outside, float("-inf"))
        d.key_bias = d.key_bias[None, :, None]  # [1, D, 1, W], broadcast over KV heads and groups

    def prefill(self, layer, q, k, v, meta):
        out = torch.empty_like(q)
        start, i, n = 0, 0, len(meta.query_lens)
        while i < n:
            q_len, ctx_len = meta.query_lens[i], meta.context_lens[i]
            if ctx_len == q_len or not layer.k_cache.numel():
                # a run of same-length prompts without a cached prefix: one batched call
                j = i + 1
                while j < n and meta.query_lens[j] == q_len and meta.context_lens[j] == q_len:
                    j += 1
                end = start + (j - i) * q_len
                qi, ki, vi = (x[start:end].view(j - i, q_len, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
                oi = _sdpa(qi, ki, vi, layer.scale, mask=None, causal=True)  # [n, Hq, L, D]
                out[start:end] = oi.transpose(1, 2).reshape(end - start, *q.shape[1:])
            else:  # a cached prefix: read the whole context back from the cache
                j, end = i + 1, start + q_len
                rows = _head_block_rows(layer, meta.block_tables[i : i + 1], meta.block_size)
                ki = _keys_by_block(layer).flatten(0, 1)[rows].transpose(1, 2)  # [Hkv * NB, bs, D]
                ki = ki.reshape(layer.num_kv_heads, -1, layer.head_dim)[:, :ctx_len]
                vi = _gather_blocks(layer, layer.v_cache, rows, 1, meta.block_size)[:, 0, :ctx_len]
                causal = torch.ones(q_len, ctx_len, dtype=torch.bool, device=q.device).tril(ctx_len - q_len)
                # 4-D like the batched path: CPU SDPA's 3-D and 4-D kernels round differently, and a
                # prompt must give the same answer with and without its prefix cached
                qi = q[start:end].transpose(0, 1)[None]
                oi = _sdpa(qi, ki[None], vi[None], layer.scale, mask=causal, causal=False)
                out[start:end] = oi[0].transpose(0, 1)
            start, i = end, j
        return out

    def decode(self, layer, q, meta):
        # One query per sequence, read straight out of the paged cache by embedding_bag (weighted
        # sums of cache rows): the scores as sums of key rows weighted by q, the output as sums of
        # value rows weighted by the probabilities. It replaced a gather of the blocks (8 MB per
        # layer at 64 x 256 tokens) and two batched matmuls: ~2.4 -> ~1.6 ms per step in the
        # profiler, and no copy for a busy shared L3 to slow down.
        b, hkv, d = q.shape[0], layer.num_kv_heads, layer.head_dim
        group, bs = layer.num_heads // hkv, meta.block_size
        if meta.key_index is None:  # once per step: every layer's cache has the same shape
            self._decode_indices(layer, meta, group)
        nb = meta.block_tables.shape[1]
        qg = (q * layer.scale).view(b, hkv, group, 1, d).transpose(0, 1)  # [Hkv, B, G, 1, D]
        scores = F.embedding_bag(meta.key_index, layer.k_cache.view(-1, bs), meta.key_offsets, mode="sum",
                                 per_sample_weights=qg.expand(-1, -1, -1, nb, -1).reshape(-1))
        scores = scores.view(hkv, b, group, nb * bs).float().add_(meta.key_bias)  # [Hkv, B, G, W]
        probs = scores.softmax(dim=-1).to(q.dtype)
        out = F.embedding_bag(meta.value_index, layer.v_cache.view(-1, d), meta.value_offsets, mode="sum",
                              per_sample_weights=probs.view(-1))  # [Hkv * B * G, D]
        return out.view(hkv, b, group, d).transpose(0, 1).reshape(b, -1, d)

    @staticmethod
    def _decode_indices(layer, meta, group: int) -> None:
        """embedding_bag's rows and bag starts, in [Hkv, B, G, ...] order: per block, the
        head_dim rows of its keys (cache as [-1, block_size]); per position, its value row
        (cache as [-1, head_dim])."""
        bs, (nseq, nb), d = meta.block_size, meta.block_tables.shape, layer.head_dim
        device, hkv = meta.block_tables.device, layer.num_kv_heads
        head_blocks = _head_block_rows(layer, meta.block_tables, bs).view(hkv, nseq, 1, nb)  # [Hkv, B, 1, NB]
        key_rows = (head_blocks * d)[..., None] + torch.arange(d, device=device)  # [Hkv, B, 1, NB, D]
        meta.key_index = key_rows.expand(-1, -1, group, -1, -1).reshape(-1)
        meta.key_offsets = torch.arange(0, meta.key_index.numel(), d, device=device)
        # a (head, block) pair's bs value rows follow each other in the cache as [-1, head_dim]
        value_rows = (head_blocks[..., None] * bs + torch.arange(bs, device=device)).view(hkv, nseq, 1, nb * bs)
        meta.value_index = value_rows.expand(-1, -1, group, -1).reshape(-1)
        meta.value_offsets = torch.arange(0, meta.value_index.numel(), nb * bs, device=device)


def _keys_by_block(layer: Attention) -> torch.Tensor:
    """The torch path's key cache as stored: [Hkv, blocks, D, block_size]."""
    hkv, slots, d = layer.k_cache.shape
    return layer.k_cache.view(hkv, -1, d, layer.block_size)


def _head_block_rows(layer: Attention, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, NB] block ids -> [Hkv * B * NB] indices of (head, block) pairs, head-major."""
    blocks = layer.k_cache.shape[1] // block_size
    heads = torch.arange(layer.num_kv_heads, device=block_tables.device)[:, None] * blocks
    return (heads + block_tables.long().view(1, -1)).view(-1)


def _gather_blocks(layer: Attention, cache: torch.Tensor, rows: torch.Tensor, num_seqs: int,
                   block_size: int) -> torch.Tensor:
    """The [Hkv, slots, D] cache's blocks at `rows` (from _head_block_rows) as [Hkv, B, NB * block_size, D]."""
    gathered = cache.view(-1, block_size * layer.head_dim).index_select(0, rows)
    return gathered.view(layer.num_kv_heads, num_seqs, -1, layer.head_dim)


def _sdpa(q, k, v, scale, mask, causal):
    # q [..., Hq, Lq, D], k/v [..., Hkv, Lk, D]; GQA by head-group broadcast
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)


class FlashAttentionBackend(AttentionBackend):
    """flash-attn on CUDA: varlen prefill (paged when a prefix is cached), paged decode."""

    name = "flash"

    def __init__(self):
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache

    def prefill(self, layer, q, k, v, meta):
        paged = meta.query_lens != meta.context_lens  # some sequence reads a cached prefix
        return self._varlen(
            q, layer.k_cache if paged else k, layer.v_cache if paged else v,
            cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
            max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
            softmax_scale=layer.scale, causal=True, block_table=meta.block_tables if paged else None,
        )

    def decode(self, layer, q, meta):
        out = self._with_kvcache(
            q.unsqueeze(1), layer.k_cache, layer.v_cache, cache_seqlens=meta.context_lens,
            block_table=meta.block_tables, softmax_scale=layer.scale, causal=True,
        )
        return out.squeeze(1)


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto`: flash-attn on CUDA when it is installed, else the torch path."""
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchAttentionBackend()
    try:
        return FlashAttentionBackend()
    except ImportError:
        if name == "flash":
            raise
        return TorchAttentionBackend()
