"""The attention layer: holds its slice of the paged KV cache and hands the work to a backend."""

import torch
from torch import nn

from xserv_engine.layers.attention.backend import AttentionBackend
from xserv_engine.layers.attention.metadata import AttentionMetadata


class Attention(nn.Module):
    """Holds the layer's KV cache (k_cache, v_cache: backend.kv_cache_shape each, blocks of
    block_size tokens); set by the model runner."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: AttentionBackend):
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
        if self.block_size:  # a cache is allocated (ModelRunner.allocate_kv_cache)
            self.backend.write_kv(self, k, v, meta)
        p = meta.num_prefill_tokens
        if meta.decode is None:
            return self.backend.prefill(self, q, k, v, meta.prefill)
        if meta.prefill is None:
            return self.backend.decode(self, q, meta.decode)
        return torch.cat([self.backend.prefill(self, q[:p], k[:p], v[:p], meta.prefill),
                          self.backend.decode(self, q[p:], meta.decode)])
