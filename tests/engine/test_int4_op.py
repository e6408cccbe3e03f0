"""The 4-bit weight op (ops.int4_linear): the native kernel (torch.ops.xserv_cpu.int4_linear, on
int4_pack's layout) against the exact dequantized weight and the W4A8 arithmetic it states, and the
stock-torch fallback on the canonical parts."""

import random

import pytest
import torch

from tests.engine.conftest import generate, make_engine
from xserv_engine.engine.engine_setup import Route
from xserv_engine.layers import int8, ops


@pytest.fixture(scope="module")
def packs():
    if not ops.int4_native():
        pytest.skip("the native int4 op needs a C++ compiler and a CPU with AVX512-VNNI; the torch one runs here")


def random_int4(n: int, k: int, group_size: int, seed: int, symmetric: bool = False):
    """Canonical parts of a random 4-bit weight: any nibbles, scales of real checkpoints' size, and
    zeros anywhere in 0..15 (AWQ's and GPTQ's are asymmetric) or 8."""
    gen = torch.Generator().manual_seed(seed)
    qweight = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, k // group_size, generator=gen) * 0.02 + 0.001).half().float()  # fp16 checkpoints'
    zeros = (torch.full((n, k // group_size), 8, dtype=torch.uint8) if symmetric
             else torch.randint(0, 16, (n, k // group_size), generator=gen, dtype=torch.uint8))
    return qweight, scales, zeros


def activations(rows: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=gen) * torch.linspace(0.1, 4, rows)[:, None]).to(dtype)


# N, K, G (G = K: per channel). N: runs of 4 blocks of 16 channels whole or not; 1,100 also crosses
# the 1,024 channels a prompt's fp32 rows are dequantized at a time
SHAPES = [(37, 64, 32), (64, 256, 64), (200, 384, 128), (1000, 512, 512), (1100, 128, 64)]


def test_the_fallback_dequantizes_the_formula_exactly():
    qweight, scales, zeros = random_int4(5, 16, 8, seed=0)
    weight = ops.dequantize_int4(qweight, scales, zeros, 8)
    n, k = 3, 11  # one element by hand: k odd is the high nibble of byte k // 2
    q, z = int(qweight[n, k // 2]) >> 4, int(zeros[n, k // 8])
    assert weight[n, k].item() == torch.tensor(float(q - z)).mul(scales[n, k // 8]).item()
    x = activations(4, 16, torch.float32, seed=1)
    got = ops.int4_linear(x, *ops.prepare_int4(qweight, scales, zeros, 8, packed=False), 8, 5)
    torch.testing.assert_close(got, x @ weight.T)


@pytest.mark.parametrize("n,k,group_size", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 16, 40])
def test_float32_is_the_exact_weights_product(packs, n, k, group_size, rows):
    # fp32 serves the weight-only checkpoints exactly: nothing but the summation order may differ
    parts = random_int4(n, k, group_size, seed=n + rows)
    x = activations(rows, k, torch.float32, seed=rows)
    got = ops.int4_linear(x, *ops.prepare_int4(*parts, group_size), group_size, n)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    weight = ops.dequantize_int4(*parts, group_size).double()
    # any order of K fp32 sums is within K·u·(|x|·|W|) of the exact product (u = 2^-24; seen: up
    # to 6u). A fixed rtol was one summation order's luck: an AMX Xeon's sgemm missed 1e-5 once.
    # Weights or activations rounded to bf16 would miss it by ~2^-9 / (K·u) > 64x.
    bound = k * 2.0 ** -24 * (x.double().abs() @ weight.abs().T)
    err = (got.double() - x.double() @ weight.T).abs()
    assert (err <= bound).all(), f"{(err / bound).max().item():.2f}x the fp32 summation bound"


def w4a8_reference(x: torch.Tensor, parts, group_size: int) -> torch.Tensor:
    """What the bf16 op states, in float64: x quantized per token to int8 (int8_linear's
    quantization), times the exact 4-bit weight."""
    xq, xs = int8.quantize_rows(x)
    return (xq.double() @ ops.dequantize_int4(*parts, group_size).double().T) * xs.double()


@pytest.mark.parametrize("n,k,group_size", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 16, 33])
@pytest.mark.parametrize("symmetric", [False, True], ids=["zeros", "symmetric"])
def test_bfloat16_is_w4a8(packs, n, k, group_size, rows, symmetric):
    parts = random_int4(n, k, group_size, seed=n * rows, symmetric=symmetric)
    x = activations(rows, k, torch.bfloat16, seed=rows)
    got = ops.int4_linear(x, *ops.prepare_int4(*parts, group_size), group_size, n)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    want = w4a8_reference(x, parts, group_size)
    torch.testing.assert_close(got.double(), want, rtol=2 ** -7, atol=1e-3 * want.abs().max().item())
    # and what the activations' 8 bits cost is about a percent of the exact product (the fallback's)
    fallback = ops.int4_linear(x, *ops.prepare_int4(*parts, group_size, packed=False), group_size, n)
    exact = x.double() @ ops.dequantize_int4(*parts, group_size).double().T
    assert (got.double() - exact).norm() / exact.norm() < 0.02
    assert (fallback.double() - exact).norm() / exact.norm() < 0.01


def test_a_row_gives_the_same_answer_alone_and_in_any_batch(packs):
    # activations are quantized per token: a sequence's numbers do not depend on its neighbours
    parts = random_int4(300, 256, 128, seed=3)
    packed = ops.prepare_int4(*parts, 128)
    x = activations(13, 256, torch.bfloat16, seed=4)
    batch = ops.int4_linear(x, *packed, 128, 300)
    for r in (0, 5, 12):
        assert torch.equal(ops.int4_linear(x[r:r + 1], *packed, 128, 300), batch[r:r + 1])


def test_packing_holds_one_layout_and_refuses_what_it_cannot_pack(packs):
    qweight, scales, zeros = random_int4(40, 64, 32, seed=5)
    packed = ops.prepare_int4(qweight, scales, zeros, 32)
    assert packed[0].dim() == 4 and packed[0].numel() == 48 * 64 // 2  # 40 channels padded to 48, 4 bits each
    # a group size the kernel cannot step through keeps the canonical parts, and the fallback serves them
    odd = random_int4(8, 24, 12, seed=6)
    kept = ops.prepare_int4(*odd, 12)
    assert kept[0].dim() == 2
    x = activations(2, 24, torch.float32, seed=7)
    torch.testing.assert_close(ops.int4_linear(x, *kept, 12, 8), x @ ops.dequantize_int4(*odd, 12).T)
    with pytest.raises(RuntimeError, match="x has 32 columns"):
        ops.int4_linear(activations(1, 32, torch.bfloat16, seed=8), *packed, 32, 40)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [1, 5, 19])
def test_experts_in_one_call_are_the_looped_experts(packs, dtype, tokens):
    from xserv_engine.layers.fused_moe import looped_experts, sort_pairs

    E, H, I, top, G = 6, 128, 96, 2, 32
    w13 = [torch.stack(t) for t in zip(*(random_int4(2 * I, H, G, seed=e) for e in range(E)))]
    w2 = [torch.stack(t) for t in zip(*(random_int4(H, I, G, seed=10 + e) for e in range(E)))]
    gen = torch.Generator().manual_seed(tokens)
    x = activations(tokens, H, dtype, seed=tokens)
    topk_weights = torch.rand(tokens, top, generator=gen).to(dtype)
    topk_ids = torch.stack([torch.randperm(E, generator=gen)[:top] for _ in range(tokens)])
    order, counts = sort_pairs(topk_ids, E)
    got = ops.moe_experts_int4(x, ops.prepare_int4_experts(*w13, G), ops.prepare_int4_experts(*w2, G),
                               topk_weights, order, counts)
    packed = [ops.prepare_int4(*(p[e] for p in w13), G) for e in range(E)], \
        [ops.prepare_int4(*(p[e] for p in w2), G) for e in range(E)]
    want = looped_experts(x, topk_weights, order, counts,
                          lambda rows, e: ops.int4_linear(rows, *packed[0][e], G, 2 * I),
                          lambda act, e: ops.int4_linear(act, *packed[1][e], G, H))
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, **(dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32
                                            else dict(rtol=2 ** -6, atol=2 ** -6 * want.abs().max().item())))


def int4_engines(path, monkeypatch, dtype: str):
    """An engine under --quantization int4 with the native op (the weights packed), then one with the
    torch fallback (the canonical parts), each yielded started and stopped after."""
    for native_op in (True, False):
        monkeypatch.setattr(ops, "_int4_native", native_op)
        engine = make_engine(path, quantization="int4", dtype=dtype, max_num_seqs=4, enable_prefix_caching=False)
        try:
            assert engine.engine.setup.route is Route.CPU_TRACED and engine.engine.runner.decode_buckets is not None
            qkv = engine.runner.model.model.layers[0].self_attn.qkv_proj
            assert (qkv.qweight.dim() == 4) == native_op  # the one layout held: packed, or the canonical one
            yield native_op, engine
        finally:
            engine.shutdown()
            ops.set_native(False)


def test_quantization_int4_at_fp32_answers_as_the_fallback_on_the_traced_route(packs, hf_model_dir, monkeypatch):
    # at fp32 the native op and the fallback both multiply the exact weights: the same greedy answers
    rng = random.Random(3)
    prompts = [[rng.randrange(0, 151643) for _ in range(n)] for n in (5, 33)]
    answers = {native_op: [generate(engine, p, max_tokens=10, temperature=0.0, ignore_eos=True).token_ids()
                           for p in prompts]
               for native_op, engine in int4_engines(hf_model_dir[0], monkeypatch, "float32")}
    assert answers[True] == answers[False]


def test_w4a8_at_bf16_costs_about_what_bf16_rounding_does(packs, hf_models, monkeypatch):
    # bf16: the native op quantizes activations to int8 (W4A8), the fallback rounds to bf16 (W4A16);
    # against the exact weights at fp32, W4A8's KL is of the fallback's size (0.033 and 0.027 on
    # this random model) and the top tokens the same
    path, _ = hf_models(False)
    prompt = [random.Random(5).randrange(0, 151643) for _ in range(60)]

    def logits(engine):
        return engine.engine.runner.prompt_logits(engine.engine.block_manager, [prompt]).double().log_softmax(-1)

    at_fp32 = int4_engines(path, monkeypatch, "float32")
    exact = logits(next(at_fp32)[1])
    at_fp32.close()  # stops that engine
    kl, agree = {}, {}
    for native_op, engine in int4_engines(path, monkeypatch, "bfloat16"):
        got = logits(engine)
        kl[native_op] = (exact.exp() * (exact - got)).sum(-1).mean().item()
        agree[native_op] = (exact.argmax(-1) == got.argmax(-1)).double().mean().item()
    assert 0 < kl[True] < 2 * kl[False] and agree[True] >= 0.95, (kl, agree)
