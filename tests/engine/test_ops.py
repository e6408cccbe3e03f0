"""The small operations of a forward (layers/ops.py): each native CPU op against its torch path,
and whole engines with native ops on and off against transformers."""

import random

import pytest
import torch

from tests.engine.conftest import generate, make_engine
from xserv_engine.layers import native, ops
from xserv_engine.layers.attention import TorchAttentionBackend
from xserv_engine.layers.cpu_decode import CpuDecode
from xserv_engine.layers.rotary_embedding import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def built():
    if not native.load_torch_ops():
        pytest.skip("the native CPU ops need a C++ compiler (g++ or $CXX); the torch path runs here")


def both(fn, *args):
    """fn(*args) with native ops, then with the torch path."""
    try:
        ops.set_native(True)
        mine = fn(*args)
        ops.set_native(False)
        return mine, fn(*args)
    finally:
        ops.set_native(False)


def close(a, b, dtype):
    # fp32: the order of the sums; bf16: at most one rounding step of the dtype apart
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -7)
    if isinstance(a, tuple):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, **tol)
    else:
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_norms_and_swiglu_match_the_torch_path(built, dtype):
    gen = torch.Generator().manual_seed(0)
    x, delta = (torch.randn(7, 96, generator=gen).to(dtype) * 3 for _ in range(2))
    weight = (torch.rand(96, generator=gen) + 0.5).to(dtype)
    close(*both(ops.add_rms_norm, x, delta, weight, 1e-6), dtype)
    close(*both(ops.silu_and_mul, torch.randn(5, 2 * 40, generator=gen).to(dtype) * 4), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_qk_norm_and_rotary_match_the_torch_path(built, dtype):
    gen = torch.Generator().manual_seed(1)
    heads, kv, d = 4, 2, 16
    qkv = torch.randn(9, (heads + 2 * kv) * d, generator=gen).to(dtype)
    weight = (torch.rand(heads + kv, d, generator=gen) + 0.5).to(dtype)
    rope = ops.Rope(RotaryEmbedding(d, 512, 1e6), torch.tensor([0, 1, 2, 17, 63, 64, 100, 300, 511]), dtype)
    mine, torch_path = both(ops.qk_norm_rope, qkv, weight, 1e-6, rope)
    assert mine.shape == (9, heads + kv, d)
    close(mine, torch_path, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("lengths", [[1], [15, 16, 17], [64, 3, 130, 40]], ids=["one", "block-edges", "mixed"])
def test_paged_decode_attention_matches_the_torch_path(built, dtype, lengths):
    from xserv_engine.layers.attention import AttentionMetadata, DecodeMetadata
    from xserv_engine.layers.attention.layer import Attention

    gen = torch.Generator().manual_seed(2)
    heads, kv, d, bs, blocks = 4, 2, 16, 16, 40
    backend = TorchAttentionBackend()
    layer = Attention(heads, kv, d, backend)
    layer.k_cache = torch.randn(backend.kv_cache_shape(blocks, bs, kv, d), generator=gen).to(dtype)
    layer.v_cache = torch.randn(backend.kv_cache_shape(blocks, bs, kv, d), generator=gen).to(dtype)
    layer.block_size = bs
    width = -(-max(lengths) // bs)
    ids = torch.randperm(blocks, generator=gen)[: len(lengths) * width].view(len(lengths), width).int()
    q = torch.randn(len(lengths), heads, d, generator=gen).to(dtype)

    def attend():
        meta = AttentionMetadata(slot_mapping=torch.zeros(len(lengths), dtype=torch.int64), num_prefill_tokens=0,
                                 decode=DecodeMetadata(context_lens=torch.tensor(lengths, dtype=torch.int32),
                                                       block_tables=ids))
        backend.prepare(meta, bs)
        return backend.decode(layer, q, meta.decode)

    close(*both(attend), dtype)


@pytest.mark.parametrize("native_ops", [True, False], ids=["native", "torch"])
def test_an_engine_with_either_ops_answers_as_transformers(built, hf_model_dir, native_ops, monkeypatch):
    # the engine decides the route at start: force it by making the build succeed or not; the
    # native decode kernel stays out, so decode steps run the model's forward too
    monkeypatch.setattr(native, "load_torch_ops", lambda: native_ops)
    monkeypatch.setattr(CpuDecode, "supports", staticmethod(lambda *args: "off in this test"))
    path, model = hf_model_dir
    engine = make_engine(path, max_num_seqs=4, max_num_batched_tokens=16)  # long prompts chunked
    try:
        assert ops.native(torch.empty(0)) == native_ops and engine.runner.cpu_decode is None
        rng = random.Random(8)
        for prompt in ([rng.randrange(0, 151643) for _ in range(n)] for n in (3, 40)):
            got = generate(engine, prompt, max_tokens=12, temperature=0.0, ignore_eos=True).token_ids()
            with torch.no_grad():
                want = model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                      pad_token_id=0)[0, len(prompt):].tolist()
            assert got == want
    finally:
        engine.shutdown()
        ops.set_native(False)
