"""The interface every attention backend implements (torch_backend, flash_backend)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from xserv_engine.layers.attention.metadata import AttentionMetadata, DecodeMetadata, PrefillMetadata

if TYPE_CHECKING:
    from xserv_engine.layers.attention.layer import Attention


class AttentionBackend:
    name = "base"
    # decode reads block tables and context lengths on the device only: a CUDA graph can replay it
    graph_safe = False

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple:
        """One layer's k (and v) cache. Default: flash-attn's paged layout [blocks, block_size, Hkv, D]."""
        return num_blocks, block_size, num_kv_heads, head_dim

    def write_kv(self, layer: Attention, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """Store the step's new keys/values [T, Hkv, D] at their cache slots (meta.slot_mapping)."""
        layer.k_cache.view(-1, layer.num_kv_heads, layer.head_dim).index_copy_(0, meta.slot_mapping, k)
        layer.v_cache.view(-1, layer.num_kv_heads, layer.head_dim).index_copy_(0, meta.slot_mapping, v)

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Per-step work shared by every layer; called once by the model runner."""

    def prefill(self, layer: Attention, q, k, v, meta: PrefillMetadata) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, layer: Attention, q, meta: DecodeMetadata) -> torch.Tensor:
        raise NotImplementedError
