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
