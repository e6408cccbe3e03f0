"""The flash-attn backend (CUDA): varlen prefill, paged decode over the same block tables."""

from xserv_engine.layers.attention.backend import AttentionBackend


class FlashAttentionBackend(AttentionBackend):
    """flash-attn on CUDA: varlen prefill (paged when a prefix is cached), paged decode."""

    name = "flash"
    graph_safe = True

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
