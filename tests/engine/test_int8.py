"""8-bit weights (W8A8 int8): the op against its arithmetic, with the native kernel and the
stock-torch fallback each; engines under --quantization int8 against transformers' full-precision
model; compressed-tensors int8 checkpoints loaded as they are; refusals by name."""

import json
import random

import pytest
import torch

from tests.engine.conftest import generate, make_engine
from tests.support.int8_checkpoint import write_int8_checkpoint
from xserv_engine.engine.engine_setup import _check_quantization
from xserv_engine.engine.sequence import Sequence
from xserv_engine.errors import InvalidRequest, ModelLoadError
from xserv_engine.layers import int8
from xserv_engine.models.loader import read_model_dir
from xserv_engine.sampling_params import SamplingParams


@pytest.fixture(params=int8.IMPLEMENTATIONS)
def impl(request):
    """Every int8 linear made in the test runs this implementation of the op."""
    if request.param == "native" and not int8.load_native_ops():
        pytest.skip("the native int8 op needs a C++ compiler and a CPU with AVX512-VNNI; the torch one runs here")
    int8.force_implementation(request.param)
    yield request.param
    int8.force_implementation(None)


def w8a8_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What the op computes, in float64: per-channel int8 weights, per-token int8 activations."""
    q, scale = int8.quantize_weight(weight)
    xq, xs = int8.quantize_rows(x)
    return (xq.double() @ q.double().T) * xs.double() * scale.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,k", [(37, 20), (64, 64), (200, 130), (1000, 256)])
@pytest.mark.parametrize("rows", [1, 5, 7, 13, 24, 64])
def test_int8_linear_computes_w8a8(impl, dtype, n, k, rows):
    gen = torch.Generator().manual_seed(n * k + rows)
    weight = torch.randn(n, k, generator=gen) * 0.05
    x = (torch.randn(rows, k, generator=gen) * torch.linspace(0.1, 4, rows)[:, None]).to(dtype)
    linear = int8.Int8Linear.from_weight(weight, impl)
    got = linear(x)
    assert got.dtype == dtype and got.shape == (rows, n)
    want = w8a8_reference(x, weight)
    # only the last rounding to the output dtype differs
    torch.testing.assert_close(got.double(), want, rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
    # and the quantization error is what 8 bits give: about 1 % of the full-precision product
    full = x.double() @ weight.double().T
    assert (got.double() - full).norm() / full.norm() < 0.03


def test_a_row_gives_the_same_answer_alone_and_in_any_batch(impl):
    # activations are quantized per token: a sequence's numbers do not depend on its neighbours
    gen = torch.Generator().manual_seed(3)
    weight, x = torch.randn(300, 96, generator=gen), torch.randn(13, 96, generator=gen).bfloat16()
    linear = int8.Int8Linear.from_weight(weight, impl)
    batched = linear(x)
    for i in (0, 6, 12):
        assert torch.equal(linear(x[i : i + 1]), batched[i : i + 1])


def test_a_tied_embedding_reads_the_int8_head(impl):
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(100, 36, generator=gen)
    head = int8.Int8Linear.from_weight(weight, impl)
    ids = torch.tensor([0, 15, 16, 17, 99, 16])
    q, scale = int8.quantize_weight(weight)
    want = (q[ids].float() * scale[ids, None]).bfloat16()
    assert torch.equal(int8.Int8Embedding(head, torch.bfloat16)(ids), want)
    assert (want.float() - weight[ids]).abs().max() < scale.max()  # within one step of the original


def prefill_logits(engine, prompt: list[int]) -> torch.Tensor:
    """[len(prompt), V] float32 logits of every prompt position, from one forward of the engine's model."""
    return engine.engine.runner.prompt_logits(engine.engine.block_manager, [prompt])


def kl_and_agreement(reference: torch.Tensor, logits: torch.Tensor) -> tuple[float, float]:
    """Mean KL(reference || logits) per position, and how often their top tokens agree."""
    p, q = reference.double().log_softmax(-1), logits.double().log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1)
    return kl.mean().item(), (reference.argmax(-1) == logits.argmax(-1)).double().mean().item()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_int8_engine_predicts_what_the_full_precision_model_predicts(impl, hf_model_dir, dtype):
    path, model = hf_model_dir
    prompt = [random.Random(5).randrange(0, 151643) for _ in range(60)]
    with torch.no_grad():
        reference = model(torch.tensor([prompt])).logits[0].float()
    results = {}
    for quantization in (None, "int8"):
        engine = make_engine(path, dtype=dtype, quantization=quantization, enable_prefix_caching=False)
        try:
            head = type(engine.runner.model.lm_head).__name__
            assert engine.model_info().quantization == (quantization or "")  # what GetModelInfo says
            results[quantization] = kl_and_agreement(reference, prefill_logits(engine, prompt))
        finally:
            engine.shutdown()
        assert (head == "Int8Linear") == (quantization == "int8")
    kl, agree = results["int8"]
    full_kl, _ = results[None]
    # measured on these random models: KL 0.004-0.008, every top token the same
    assert kl < 0.02 and agree >= 0.9, results
    assert kl > full_kl  # the int8 numbers are really used (the full-precision engine's KL is ~0 or bf16's)


def test_greedy_tokens_are_the_same_alone_and_in_a_chunked_batch(impl, tied_model_dir):
    engine = make_engine(tied_model_dir, quantization="int8", max_num_seqs=8, max_num_batched_tokens=16)
    try:
        rng = random.Random(6)
        batch = [[rng.randrange(0, 151643) for _ in range(n)] for n in (5, 40, 1, 23)]
        alone = [generate(engine, p, max_tokens=12, temperature=0.0, ignore_eos=True).token_ids() for p in batch]
        collectors = []
        from tests.engine.conftest import Collector

        for i, p in enumerate(batch):
            collectors.append(Collector())
            engine.add_request(f"int8-batch-{impl}-{i}", p, SamplingParams(max_tokens=12, temperature=0.0,
                                                                           ignore_eos=True), collectors[-1])
        assert [c.wait() and c.token_ids() for c in collectors] == alone
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def int8_dir(tmp_path_factory, hf_models):
    src, _ = hf_models(False)  # untied: the LM head is a linear of its own
    path = tmp_path_factory.mktemp("w8a8")
    write_int8_checkpoint(src, path, ignore=[])
    return src, path


def test_a_compressed_tensors_int8_checkpoint_serves_its_own_int8_weights(impl, int8_dir):
    src, path = int8_dir
    assert read_model_dir(str(path)).quantization is not None
    prompt = [random.Random(7).randrange(0, 151643) for _ in range(30)]
    logits = {}
    for name, directory, quantization in (("checkpoint", path, None), ("at load", src, "int8")):
        engine = make_engine(directory, quantization=quantization, enable_prefix_caching=False)
        try:
            assert type(engine.runner.model.model.layers[0].self_attn.qkv_proj).__name__ == "Int8Linear"
            logits[name] = prefill_logits(engine, prompt)
        finally:
            engine.shutdown()
    # the checkpoint's int8 weights are the ones quantizing at load makes: the same answers
    torch.testing.assert_close(logits["checkpoint"], logits["at load"], rtol=1e-5, atol=1e-5)


def test_modules_a_checkpoint_ignores_stay_in_full_precision(tmp_path, hf_models):
    src, _ = hf_models(False)
    write_int8_checkpoint(src, tmp_path, ignore=["lm_head", "model.layers.0.mlp.down_proj"])
    engine = make_engine(tmp_path)
    try:
        model = engine.runner.model
        assert type(model.lm_head).__name__ != "Int8Linear"
        assert type(model.model.layers[0].mlp.down_proj).__name__ != "Int8Linear"
        assert type(model.model.layers[1].mlp.down_proj).__name__ == "Int8Linear"
        assert len(generate(engine, [1, 2, 3], max_tokens=4, temperature=0.0, ignore_eos=True).token_ids()) == 4
    finally:
        engine.shutdown()


@pytest.mark.parametrize("weights,says", [
    ({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor"}, "strategy"),
    ({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel"}, "num_bits"),
    ({"num_bits": 8, "type": "int", "symmetric": False, "strategy": "channel"}, "symmetric"),
])
def test_other_compressed_tensors_schemes_are_refused_by_name(tmp_path, hf_models, weights, says):
    src, _ = hf_models(False)
    write_int8_checkpoint(src, tmp_path, ignore=[], weights=weights)
    with pytest.raises(ModelLoadError, match=says) as error:
        read_model_dir(str(tmp_path))
    assert "W8A8 int8" in str(error.value)


def test_int8_weights_without_a_quantization_config_are_refused(tmp_path, hf_models):
    src, _ = hf_models(False)
    write_int8_checkpoint(src, tmp_path, ignore=[])
    config = json.loads((tmp_path / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="is int8 but config.json has no"):
        make_engine(tmp_path)


def test_int8_is_refused_on_cuda_and_unknown_schemes_by_name(tied_model_dir):
    model_dir = read_model_dir(str(tied_model_dir))
    with pytest.raises(InvalidRequest, match="CPU only"):
        _check_quantization("int8", model_dir, torch.device("cuda"))
    with pytest.raises(InvalidRequest, match="must be int8, int4 or unset, got 'int2'"):
        _check_quantization("int2", model_dir, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_int8_experts_compute_each_pairs_w8a8_swiglu(impl, dtype, tokens):
    from xserv_engine.layers import fused_moe

    gen = torch.Generator().manual_seed(tokens)
    hidden, inter, experts, top_k = 72, 40, 6, 2  # widths that are not multiples of 16 or 64
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.1
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.1
    weights, ids = fused_moe.route(torch.randn(tokens, experts, generator=gen).to(dtype), top_k, normalize=True)
    got = int8.Int8Experts(w13.to(dtype), w2.to(dtype), impl)(x, weights, ids).double()
    want = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for k in range(top_k):
            e = ids[t, k]
            gate, up = w8a8_reference(x[t : t + 1].float(), w13[e].to(dtype)).chunk(2, dim=-1)
            act = torch.nn.functional.silu(gate) * up
            want[t] += weights[t, k].double() * w8a8_reference(act.float(), w2[e].to(dtype))[0]
    tol = 1e-4 if dtype == torch.float32 else 3e-2  # bf16: the torch path's roundings between the products
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_an_int8_moe_engine_predicts_what_the_full_precision_model_predicts(impl, tmp_path, demo_dir):
    from tests.support.moe_checkpoint import SHAPES, write_moe_checkpoint

    shape = next(iter(SHAPES))
    model = write_moe_checkpoint(tmp_path, demo_dir, shape)
    prompt = [random.Random(7).randrange(0, 151643) for _ in range(40)]
    with torch.no_grad():
        reference = model(torch.tensor([prompt])).logits[0].float()
    engine = make_engine(tmp_path, quantization="int8", enable_prefix_caching=False)
    try:
        layers = [type(m).__name__ for m in engine.engine.runner.model.modules()]
        assert "Int8Experts" in layers and "FusedExperts" not in layers  # the experts are int8 too
        kl, agree = kl_and_agreement(reference, prefill_logits(engine, prompt))
        # measured on this random model: KL 0.008, every top token the same (both implementations)
        assert kl < 0.05 and agree >= 0.85, (kl, agree)
        rng = random.Random(8)
        prompts = [[rng.randrange(0, 151643) for _ in range(n)] for n in (3, 30)]
        alone = [generate(engine, p, max_tokens=8, temperature=0.0, ignore_eos=True).token_ids() for p in prompts]
        assert all(len(tokens) == 8 for tokens in alone)
    finally:
        engine.shutdown()


def test_quantizing_frees_each_full_precision_weight_as_it_goes(impl, monkeypatch):
    """A model quantized at load holds its full-precision weights and its int8 ones at once only a
    layer at a time: the 35B-A3B shape ran out of memory when every original stayed alive until the
    last layer was done."""
    import types
    import weakref

    from xserv_engine.layers.fused_moe import FusedExperts

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.config = types.SimpleNamespace(tie_word_embeddings=False)
    model.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64, bias=False) for _ in range(4))
    model.experts = torch.nn.ModuleList(FusedExperts(4, 64, 32) for _ in range(3))
    for parameter in model.experts.parameters():
        torch.nn.init.normal_(parameter)
    del parameter  # the test's own reference would keep the last one alive
    originals = [weakref.ref(m.weight) for m in model.layers] + [weakref.ref(e.w13_weight) for e in model.experts]
    alive_at_each_step = []

    def counting(make):
        def wrapper(*args, **kwargs):
            alive_at_each_step.append(sum(ref() is not None for ref in originals))
            return make(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(int8.Int8Linear, "from_weight", staticmethod(counting(int8.Int8Linear.from_weight)))
    monkeypatch.setattr(int8, "Int8Experts", counting(int8.Int8Experts))
    assert int8.quantize_model(model, torch.float32, progress=False) == 4
    # before the k-th of 7 layers is quantized, the k-1 before it are already gone
    assert alive_at_each_step == [7, 6, 5, 4, 3, 2, 1]
    assert [ref() is None for ref in originals] == [True] * 7
