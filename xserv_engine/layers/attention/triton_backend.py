"""The Triton backend: CUDA with what a stock torch install ships (no flash-attn).

Same paged cache as the torch path; prefills go through torch's SDPA (its flash and
memory-efficient kernels on CUDA), decodes through a Triton kernel that reads the block tables
on the device (triton_decode.py). Nothing in a decode step depends on host values, so the
model runner can capture it in a CUDA graph.
"""

from xserv_engine.layers.attention.torch_backend import TorchAttentionBackend


class TritonAttentionBackend(TorchAttentionBackend):
    name = "triton"
    graph_safe = True

    def __init__(self):
        from xserv_engine.layers.attention.triton_decode import paged_decode  # ImportError without triton

        self._paged_decode = paged_decode

    def kv_cache_shape(self, num_blocks, block_size, num_kv_heads, head_dim):
        for what, n in (("block_size", block_size), ("head_dim", head_dim)):
            if n & (n - 1):
                raise ValueError(f"the Triton attention backend needs a power-of-two {what}, got {n}")
        return super().kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)

    def prepare(self, meta, block_size):
        meta.slot_block_offset = (meta.slot_mapping // block_size, meta.slot_mapping % block_size)
        if meta.prefill is not None:
            meta.prefill.block_size = block_size
        if meta.decode is not None:
            meta.decode.block_size = block_size

    def decode(self, layer, q, meta):
        return self._paged_decode(q, layer.k_cache, layer.v_cache, meta.block_tables, meta.context_lens,
                                  layer.scale, meta.block_size)
