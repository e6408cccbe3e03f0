"""A Triton paged-decode kernel over the torch path's cache layout (torch_backend.py).

Triton ships with CUDA builds of torch; this module imports it, so only the Triton backend
imports this module. With TRITON_INTERPRET=1 set before the import, the same kernel runs on
the CPU (slowly): that is how the tests check its math without a GPU.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode(q_ptr, k_ptr, v_ptr, block_tables_ptr, context_lens_ptr, out_ptr, scale,
                  stride_qb, stride_qh, stride_bt, blocks_per_head,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    # one program per (sequence, query head); an online softmax over the sequence's blocks
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    kv_head = head // GROUP
    context_len = tl.load(context_lens_ptr + seq)
    d = tl.arange(0, HEAD_DIM)
    t = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + seq * stride_qb + head * stride_qh + d).to(tl.float32) * scale  # [D]
    m = tl.max(tl.full([BLOCK_SIZE], float("-inf"), tl.float32), 0)
    total = tl.sum(tl.zeros([BLOCK_SIZE], tl.float32), 0)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for i in range(0, tl.cdiv(context_len, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq * stride_bt + i).to(tl.int64)
        pair = kv_head.to(tl.int64) * blocks_per_head + block  # the (head, block) pair's offset, in blocks
        # keys stored transposed per block: [D, BLOCK_SIZE]; values [BLOCK_SIZE, D]
        k = tl.load(k_ptr + pair * HEAD_DIM * BLOCK_SIZE + d[:, None] * BLOCK_SIZE + t[None, :]).to(tl.float32)
        scores = tl.sum(q[:, None] * k, 0)  # [BLOCK_SIZE]
        scores = tl.where(i * BLOCK_SIZE + t < context_len, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new)
        total = total * alpha + tl.sum(p, 0)
        v = tl.load(v_ptr + (pair * BLOCK_SIZE + t[:, None]) * HEAD_DIM + d[None, :]).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m = m_new
    out = tl.where(total > 0, acc / total, 0.0)  # an empty context (a padding row) gives zeros
    tl.store(out_ptr + (seq * num_heads + head) * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, block_size: int) -> torch.Tensor:
    """q [B, Hq, D] (rows may be strided); caches [Hkv, slots, D] as torch_backend stores them;
    block_tables [B, NB] int32; context_lens [B] int32 -> [B, Hq, D]. No host sync."""
    b, num_heads, head_dim = q.shape
    num_kv_heads, slots, _ = k_cache.shape
    assert q.stride(2) == 1 and block_tables.stride(1) == 1
    out = torch.empty(b, num_heads, head_dim, dtype=q.dtype, device=q.device)
    _paged_decode[(b, num_heads)](
        q, k_cache, v_cache, block_tables, context_lens, out, scale,
        q.stride(0), q.stride(1), block_tables.stride(0), slots // block_size,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
    )
    return out
