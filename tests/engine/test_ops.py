"""The small operations of a forward (layers/ops.py): each native CPU op against its torch path,
and whole engines with native ops on and off against transformers."""

import logging
import random

import pytest
import torch

from tests.engine.conftest import generate, make_engine
from tests.support.hf_reference import greedy_tokens
from xserv_engine.engine.engine_setup import Route
from xserv_engine.layers import linear, native, ops
from xserv_engine.layers.attention import TorchAttentionBackend
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
@pytest.mark.parametrize("width", [96, 1027], ids=["whole-vectors", "with-a-tail"])
def test_norms_and_swiglu_match_the_torch_path(built, dtype, width):
    gen = torch.Generator().manual_seed(0)
    x, delta = (torch.randn(7, width, generator=gen).to(dtype) * 3 for _ in range(2))
    weight = (torch.rand(width, generator=gen) + 0.5).to(dtype)
    close(*both(ops.add_rms_norm, x, delta, weight, 1e-6), dtype)
    gate_up = torch.randn(5, 2 * width, generator=gen).to(dtype) * 4
    gate_up[0, :4] = torch.tensor([-100.0, -30.0, 30.0, 100.0])  # exp's far ends
    close(*both(ops.silu_and_mul, gate_up), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_the_cache_write_stores_what_the_torch_path_stores(built, dtype):
    from xserv_engine.layers.attention import AttentionMetadata
    from xserv_engine.layers.attention.layer import Attention

    gen = torch.Generator().manual_seed(3)
    heads, kv, d, bs, blocks = 4, 2, 16, 16, 6
    backend = TorchAttentionBackend()
    qkv = torch.randn(5, (heads + 2 * kv) * d, generator=gen).to(dtype)  # k and v: strided views, as the model's
    k = qkv[:, heads * d : (heads + kv) * d].view(5, kv, d)
    v = qkv[:, (heads + kv) * d :].view(5, kv, d)
    slots = torch.tensor([0, 15, 16, 47, 95])  # block edges, the last slot

    def write():
        layer = Attention(heads, kv, d, backend)
        layer.k_cache = torch.zeros(backend.kv_cache_shape(blocks, bs, kv, d), dtype=dtype)
        layer.v_cache = torch.zeros(backend.kv_cache_shape(blocks, bs, kv, d), dtype=dtype)
        layer.block_size = bs
        meta = AttentionMetadata(slot_mapping=slots, num_prefill_tokens=5)
        backend.prepare(meta, bs)
        backend.write_kv(layer, k, v, meta)
        return layer.k_cache, layer.v_cache

    mine, torch_path = both(write)
    assert torch.equal(mine[0], torch_path[0]) and torch.equal(mine[1], torch_path[1])
    assert mine[0].count_nonzero() == 5 * kv * d  # every value landed once, nothing else moved


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
@pytest.mark.parametrize("heads, kv, d, bs", [(4, 2, 16, 16), (16, 8, 128, 64), (32, 4, 64, 64), (4, 4, 64, 16),
                                              (6, 2, 64, 24), (9, 1, 32, 32)],
                         ids=["tiny", "qwen3-0.6b", "group-8", "group-1", "group-3-odd-block", "group-9"])
def test_paged_decode_attention_matches_the_torch_path(built, dtype, lengths, heads, kv, d, bs):
    # the native kernel's paths: query-head groups of 1/2/4/8 in registers and any other size,
    # head_dim a multiple of 64 or not, a block's last positions read as 16 or one by one
    from xserv_engine.layers.attention import AttentionMetadata, DecodeMetadata
    from xserv_engine.layers.attention.layer import Attention

    gen = torch.Generator().manual_seed(2)
    blocks = 40
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


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("n, heads, kv, lq, lk", [(3, 4, 2, 37, 37), (1, 8, 1, 20, 75), (2, 4, 4, 130, 130)],
                         ids=["prompts", "cached-prefix", "chunked"])
def test_prefill_attention_is_eager_attention(built, dtype, n, heads, kv, lq, lk, monkeypatch):
    # transformers' eager arithmetic (scores in the dtype, softmax in fp32), the queries being the
    # last lq of lk positions; a small score budget makes several query chunks
    monkeypatch.setattr(ops, "PREFILL_SCORES", 4096)
    gen = torch.Generator().manual_seed(3)
    d, scale = 32, 32 ** -0.5
    q = torch.randn(n, lq, heads, d, generator=gen).to(dtype).transpose(1, 2)  # as the backend views it
    k, v = (torch.randn(n, kv, lk, d, generator=gen).to(dtype) for _ in range(2))
    keys, values = (x.repeat_interleave(heads // kv, dim=1) for x in (k, v))
    scores = (q @ keys.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq), float("-inf"))
    eager = scores.softmax(-1, dtype=torch.float32).to(dtype) @ values
    mine = ops.prefill_attention(q, k, v, scale)
    close(mine, eager, dtype)
    if dtype == torch.float32:  # and the torch path's SDPA
        ops.set_native(False)
        from xserv_engine.layers.attention.torch_backend import _causal
        close(mine, _causal(q, k, v, scale), dtype)


@pytest.mark.parametrize("native_ops", [True, False], ids=["native", "torch"])
def test_an_engine_with_either_ops_answers_as_transformers(built, hf_model_dir, native_ops, monkeypatch):
    # the engine decides the route at start: force it by making the build succeed or not
    monkeypatch.setattr(native, "load_torch_ops", lambda: native_ops)
    path, model = hf_model_dir
    engine = make_engine(path, max_num_seqs=4, max_num_batched_tokens=16)  # long prompts chunked
    try:
        assert ops.native(torch.empty(0)) == native_ops
        assert engine.engine.setup.route == (Route.CPU_NATIVE if native_ops else Route.CPU_TORCH)
        rng = random.Random(8)
        for prompt in ([rng.randrange(0, 151643) for _ in range(n)] for n in (3, 40)):
            got = generate(engine, prompt, max_tokens=12, temperature=0.0, ignore_eos=True).token_ids()
            assert got == greedy_tokens(model, prompt, 12)
    finally:
        engine.shutdown()
        ops.set_native(False)


@pytest.mark.parametrize("eager, builds, route, says", [
    (False, True, Route.CPU_NATIVE, "route: cpu-native (layers/cpu_ops.cpp, built for this CPU; oneDNN's packed "
                                    "linears cannot be traced)"),
    (True, True, Route.CPU_TORCH, "route: cpu-torch (--enforce-eager)"),
    (False, False, Route.CPU_TORCH, "route: cpu-torch (the native CPU ops did not build"),
])
def test_the_route_is_chosen_once_and_logged_with_its_reason(tied_model_dir, monkeypatch, caplog, eager, builds,
                                                             route, says):
    monkeypatch.setattr(native, "load_torch_ops", lambda: builds)
    with caplog.at_level(logging.INFO, logger="xserv.engine.startup"):
        engine = make_engine(tied_model_dir, enforce_eager=eager)
    try:
        assert engine.engine.setup.route is route
        routes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("route:")]
        assert len(routes) == 1 and routes[0].startswith(says)
        assert ops.native(torch.empty(0)) == (route is Route.CPU_NATIVE)
        assert engine.engine.runner.decode_buckets is None
        assert len(generate(engine, [5, 6, 7], max_tokens=3, temperature=0.0, ignore_eos=True).token_ids()) == 3
    finally:
        engine.shutdown()
        ops.set_native(False)


SOURCE = 'extern "C" int xserv_answer() { return 42; }\n'


def test_native_code_is_compiled_once_per_machine_then_loaded_from_the_cache(tmp_path, monkeypatch):
    if native.compiler() is None:
        pytest.skip("no C++ compiler (g++ or $CXX) here")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source = tmp_path / "answer.cpp"
    source.write_text(SOURCE)
    compiles = []
    real = native._compile
    monkeypatch.setattr(native, "_compile", lambda *a: compiles.append(a) or real(*a))
    first = native.build(source, ["-O2", "-shared", "-fPIC"], "a test library")
    assert first is not None and native.build(source, ["-O2", "-shared", "-fPIC"], "a test library") == first
    assert len(compiles) == 1
    assert [p.suffix for p in first.parent.iterdir()] == [".so"]  # no temporary left beside it


def test_a_failed_compile_leaves_nothing_behind_and_logs_the_compilers_message(tmp_path, monkeypatch, caplog):
    if native.compiler() is None:
        pytest.skip("no C++ compiler (g++ or $CXX) here")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source = tmp_path / "answer.cpp"
    source.write_text(SOURCE)
    with caplog.at_level(logging.WARNING, logger="xserv_engine.layers.native"):
        assert native.build(source, ["-shared", "-fno-such-option"], "a test library") is None
    assert "-fno-such-option" in caplog.text  # the compiler's own message
    assert list((tmp_path / "cache" / "xserv" / "kernels").iterdir()) == []


@pytest.mark.parametrize("heads, n, d", [(4, 98, 64), (3, 130, 72), (2, 6, 16)],
                         ids=["patches", "head-dim-72", "one-window"])
def test_vision_attention_is_as_close_to_exact_as_sdpa(built, heads, n, d):
    # an image's full attention in bf16: the native op beside torch's SDPA, both against the fp32
    # attention of the same bf16 inputs; q drawn large so that rows peak (a rounding error shows).
    # The image's rows sit after another's in the tensor, as the tower splits them.
    if not linear.native_bf16():
        pytest.skip("the native vision attention needs AVX512-BF16 (and no AMX); SDPA runs here")
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(heads, n + 10, d, generator=gen).mul(s).to(torch.bfloat16)[:, 10:] for s in (3, 1, 1))
    exact = torch.nn.functional.scaled_dot_product_attention(q.float()[None], k.float()[None],
                                                             v.float()[None])[0].transpose(0, 1)
    sdpa = ops.vision_attention(q, k, v)  # native ops off: the torch path
    ops.set_native(True)
    try:
        mine = ops.vision_attention(q, k, v)
    finally:
        ops.set_native(False)
    assert mine.shape == (n, heads, d) and mine.dtype == torch.bfloat16
    close(mine.float(), exact, torch.bfloat16)
    mine_err, sdpa_err = (mine.float() - exact).abs(), (sdpa.float() - exact).abs()
    assert mine_err.mean() <= 1.5 * sdpa_err.mean()
    assert mine_err.max() <= 2 * sdpa_err.max()
