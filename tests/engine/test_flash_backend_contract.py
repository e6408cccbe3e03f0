"""The flash-attn backend's calls, checked on the CPU against flash-attn's documented semantics.

No GPU here, so `flash_attn` is replaced by a slow torch reference of the two functions the
backend uses (varlen with an optional block table; with_kvcache with a block table). The engine
driven through that backend must answer exactly as through the torch backend: this pins the
metadata we hand flash-attn (cu_seqlens, block tables, cache_seqlens, the paged layout).
"""

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from tests.engine.conftest import Collector, generate, make_engine, wait_idle
from xserv_engine.sampling_params import SamplingParams


def _attend(q, k, v, scale, causal):
    # q [Lq, Hq, D], k/v [Lk, Hkv, D]; causal aligned bottom-right, as flash-attn >= 2.1
    lq, lk = q.shape[0], k.shape[0]
    mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq) if causal else None
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def _paged(cache, block_table_row, length):
    return cache[block_table_row.long()].flatten(0, 1)[:length]


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale=None, causal=False, block_table=None):
    out = torch.empty_like(q)
    for i in range(len(cu_seqlens_q) - 1):
        q0, q1 = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        k0, k1 = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        if block_table is None:
            ki, vi = k[k0:k1], v[k0:k1]
        else:
            ki, vi = _paged(k, block_table[i], k1 - k0), _paged(v, block_table[i], k1 - k0)
        out[q0:q1] = _attend(q[q0:q1], ki, vi, softmax_scale, causal)
    return out


def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, block_table=None,
                            softmax_scale=None, causal=False):
    out = torch.empty_like(q)  # q [B, 1, Hq, D]
    for i in range(q.shape[0]):
        n = int(cache_seqlens[i])
        out[i] = _attend(q[i], _paged(k_cache, block_table[i], n), _paged(v_cache, block_table[i], n),
                         softmax_scale, causal)
    return out


@pytest.fixture
def fake_flash_attn(monkeypatch):
    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = flash_attn_varlen_func
    module.flash_attn_with_kvcache = flash_attn_with_kvcache
    monkeypatch.setitem(sys.modules, "flash_attn", module)


def run_workload(engine):
    prompts = [list(range(1000 + 300 * i, 1000 + 300 * i + n)) for i, n in enumerate([5, 40, 300, 17])]
    first = [generate(engine, p, max_tokens=12, temperature=0.0, ignore_eos=True).token_ids() for p in prompts]
    # then all at once, twice each: a mixed continuous batch with prefix-cache hits (paged prefill)
    collectors = []
    for i, p in enumerate(prompts * 2):
        collectors.append(Collector())
        engine.add_request(f"mix-{i}", p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                           collectors[-1])
    second = [c.wait() and c.token_ids() for c in collectors]
    cached = [c.final().usage.cached_prompt_tokens for c in collectors]
    wait_idle(engine)
    return first, second, cached


def test_flash_backend_answers_as_the_torch_backend(tied_model_dir, fake_flash_attn):
    torch_engine = make_engine(tied_model_dir, attention_backend="torch", block_size=256)
    try:
        expected = run_workload(torch_engine)
    finally:
        torch_engine.shutdown()
    flash_engine = make_engine(tied_model_dir, attention_backend="flash")
    try:
        assert flash_engine.runner.backend.name == "flash"
        assert flash_engine.setup.block_size == 256  # flash_attn_with_kvcache's paged block size
        got = run_workload(flash_engine)
    finally:
        flash_engine.shutdown()
    assert got[0] == expected[0] and got[1] == expected[1]
    assert got[2] == expected[2] and max(got[2]) == 256  # the 300-token prompt hit a cached block
