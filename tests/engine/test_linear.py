"""oneDNN-packed linears answer as F.linear does (bit-identical in bf16)."""

import pytest
import torch
from torch import nn

from xserv_engine.layers.linear import PackedLinear, pack_cpu_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")


def test_packed_linear_equals_f_linear_at_any_batch():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(1000, 64, generator=gen)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 0.0)):
        if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            continue
        w = weight.to(dtype)
        layer = PackedLinear(w)
        for batch in (1, 7, 64, 300):
            x = torch.randn(batch, 64, generator=gen).to(dtype)
            torch.testing.assert_close(layer(x), nn.functional.linear(x, w), atol=tol, rtol=tol)


def test_pack_swaps_bias_free_linears_and_leaves_the_rest():
    model = nn.ModuleDict({"emb": nn.Embedding(50, 16), "proj": nn.Linear(16, 32, bias=False),
                           "biased": nn.Linear(32, 8), "head": nn.Linear(16, 50, bias=False)})
    model["head"].weight = model["emb"].weight  # tied, like Qwen3's small models
    x = torch.randn(3, 16)
    before = model["head"](x), model["proj"](x)
    assert pack_cpu_linears(model, torch.float32) == 2
    assert isinstance(model["proj"], PackedLinear) and isinstance(model["head"], PackedLinear)
    assert type(model["biased"]) is nn.Linear and isinstance(model["emb"], nn.Embedding)
    torch.testing.assert_close((model["head"](x), model["proj"](x)), before, atol=1e-5, rtol=1e-5)


def _native_bf16_runs() -> bool:
    from xserv_engine.layers import native

    return native.load_torch_ops() and bool(torch.ops.xserv_cpu.has_bf16_linear())


@pytest.fixture
def packing():
    from xserv_engine.layers import linear

    yield linear.force_packing
    linear.force_packing(None)


@pytest.mark.parametrize("n, k", [(1000, 64), (3072, 1024), (17, 33), (5, 2)])
def test_native_bf16_linear_answers_as_f_linear(n, k):
    # the int8 kernel's tiles with vdpbf16ps: fp32 sums of bf16 products, rounded to bf16 once
    if not _native_bf16_runs():
        pytest.skip("the native ops did not build here, or this CPU has no AVX512-BF16")
    from xserv_engine.layers.linear import Bf16Linear

    gen = torch.Generator().manual_seed(1)
    w = torch.randn(n, k, generator=gen).bfloat16()
    layer = Bf16Linear(w)
    for batch in (1, 5, 16, 300):
        x = torch.randn(batch, k, generator=gen).bfloat16()
        want = x.float() @ w.float().T  # exact products, fp32 sums
        got = layer(x)
        assert got.shape == (batch, n) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, atol=2e-2 * want.abs().max().item(), rtol=1e-2)
        # 3-D input, as a caller may pass
        torch.testing.assert_close(layer(x[None])[0], got, atol=0, rtol=0)


@pytest.mark.parametrize("how", ["native", "onednn"])
def test_bf16_packing_is_picked_and_answers_the_same(packing, how):
    from xserv_engine.layers.linear import Bf16Linear

    if how == "native" and not _native_bf16_runs():
        pytest.skip("the native ops did not build here, or this CPU has no AVX512-BF16")
    if how == "onednn" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bf16 here")
    packing(how)
    gen = torch.Generator().manual_seed(2)
    model = nn.ModuleDict({"proj": nn.Linear(64, 96, bias=False), "head": nn.Linear(96, 40, bias=False)}).bfloat16()
    x = torch.randn(7, 64, generator=gen).bfloat16()
    before = model["head"](model["proj"](x)).float()
    assert pack_cpu_linears(model, torch.bfloat16) == 2
    assert isinstance(model["proj"], Bf16Linear if how == "native" else PackedLinear)
    torch.testing.assert_close(model["head"](model["proj"](x)).float(), before, atol=5e-2, rtol=2e-2)
