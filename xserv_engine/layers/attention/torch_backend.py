"""The torch attention backend: plain torch over the paged cache, on any device (the CPU included)."""

import torch
import torch.nn.functional as F

from xserv_engine.layers import ops
from xserv_engine.layers.attention.backend import AttentionBackend
from xserv_engine.layers.attention.layer import Attention
from xserv_engine.layers.attention.metadata import DecodeMetadata


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
        if ops.native(k):  # the same stores in one native call (layers/ops.py)
            ops.write_kv(layer.k_cache, layer.v_cache, k, v, meta.slot_mapping, layer.block_size)
            return
        block, offset = meta.slot_block_offset
        _keys_by_block(layer)[:, block, :, offset] = k  # advanced indexing: [T, Hkv, D] in that order
        layer.v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))

    def prepare(self, meta, block_size):
        if meta.prefill is not None:
            meta.prefill.block_size = block_size
        if meta.decode is not None:
            meta.decode.block_size = block_size
        if ops.native(meta.slot_mapping):  # the native write_kv and decode_attention read nothing else
            return
        meta.slot_block_offset = (meta.slot_mapping // block_size, meta.slot_mapping % block_size)
        if meta.decode is not None:
            meta.decode.key_bias = _key_bias(meta.decode, block_size)

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
                oi = _causal(qi, ki, vi, layer.scale)  # [n, Hq, L, D]
                out[start:end] = oi.transpose(1, 2).reshape(end - start, *q.shape[1:])
            else:  # a cached prefix: read the whole context back from the cache
                j, end = i + 1, start + q_len
                rows = _head_block_rows(layer, meta.block_tables[i : i + 1], meta.block_size)
                ki = _keys_by_block(layer).flatten(0, 1)[rows].transpose(1, 2)  # [Hkv * NB, bs, D]
                ki = ki.reshape(layer.num_kv_heads, -1, layer.head_dim)[:, :ctx_len]
                vi = _gather_blocks(layer, layer.v_cache, rows, 1, meta.block_size)[:, 0, :ctx_len]
                # 4-D like the batched path: CPU SDPA's 3-D and 4-D kernels round differently, and a
                # prompt must give the same answer with and without its prefix cached
                qi = q[start:end].transpose(0, 1)[None]
                oi = _causal(qi, ki[None], vi[None], layer.scale)
                out[start:end] = oi[0].transpose(0, 1)
            start, i = end, j
        return out

    def decode(self, layer, q, meta):
        # One query per sequence, read straight out of the paged cache by embedding_bag (weighted
        # sums of cache rows): the scores as sums of key rows weighted by q, the output as sums of
        # value rows weighted by the probabilities. No block is copied out first: such a gather
        # (8 MB per layer at 64 x 256 tokens) is memory-bound and slows down whenever another
        # core is busy with the shared L3 (the numbers are in docs/benchmarks-log.md).
        if ops.native(q):  # the same sums in one native call (layers/ops.py)
            return ops.decode_attention(q, layer.k_cache, layer.v_cache, meta.block_tables, meta.context_lens,
                                        meta.block_size, layer.scale)
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


def _key_bias(d: DecodeMetadata, block_size: int) -> torch.Tensor:
    """Added to the torch decode's scores [Hkv, D, G, W]: 0 inside each context, -inf past it;
    [1, D, 1, W], broadcast over KV heads and groups."""
    width = d.block_tables.shape[1] * block_size
    outside = torch.arange(width, device=d.block_tables.device)[None, :] >= d.context_lens[:, None]
    # one in-place pass instead of an inverted mask and a masked_fill
    return torch.zeros(outside.shape, device=outside.device).masked_fill_(outside, float("-inf"))[None, :, None]


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


def _causal(q, k, v, scale):
    """q [n, Hq, Lq, D] over k/v [n, Hkv, Lk, D], the queries the last Lq of the Lk positions;
    GQA by head-group broadcast."""
    if ops.native(q):
        return ops.prefill_attention(q, k, v, scale)
    lq, lk = q.shape[-2], k.shape[-2]
    mask = None if lq == lk else torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                          enable_gqa=True)
