"""The sampler: the greedy pick is torch.argmax exactly, ties included, at any vocabulary size;
a sampled pick follows the softmax, never a token of weight 0, within each row's top-k / nucleus."""

import pytest
import torch

from xserv_engine.layers import native, ops
from xserv_engine.layers.sampler import (ARGMAX_CHUNK, CDF_CHUNK, Sampler, _apply_top_p, _nucleus_by_floor, argmax,
                                         inverse_cdf, row_max)
from xserv_engine.sampling_params import SamplingParams


@pytest.fixture(params=["native", "torch"])
def argmax_path(request):
    """argmax through the native op (argmax_rows) or the chunked torch path."""
    if request.param == "native" and not native.load_torch_ops():
        pytest.skip("the native CPU ops need a C++ compiler (g++ or $CXX); the torch path runs here")
    ops.set_native(request.param == "native")
    yield request.param
    ops.set_native(False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [151936, 151931, 3 * ARGMAX_CHUNK, 5 * ARGMAX_CHUNK + 1, 1000, 7])
def test_argmax_equals_torch_argmax(argmax_path, dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(20, vocab, generator=gen).to(dtype)
    # ties: the same maximum in two chunks, inside one chunk, and in the ragged last column
    top = logits.max() + 1
    logits[0, [min(7, vocab - 2), vocab - 1]] = top
    logits[1, [min(ARGMAX_CHUNK, vocab - 1) - 1, min(ARGMAX_CHUNK, vocab - 1)]] = top  # across a chunk edge
    logits[2, [vocab - 2, vocab - 1]] = top
    logits[3, vocab - 1] = top
    logits[4] = float("-inf")
    logits[5] = 0.0
    logits[6, [vocab // 2, vocab - 1]] = float("nan")  # NaN counts as the largest: the first one
    logits[7, vocab - 1] = float("nan")
    logits[8, [1, vocab - 1]] = top  # the same maximum in two lanes of one 16-wide step and in the tail
    logits[9, [vocab - 1, 0]] = top
    logits[10, :] = top  # every column tied
    assert torch.equal(argmax(logits), logits.argmax(dim=-1))
    assert torch.equal(argmax(logits[::3]), logits[::3].argmax(dim=-1))  # rows a stride apart


# ---- sampling: the two-level inverse CDF ----



@pytest.mark.parametrize("vocab", [151936, 5 * CDF_CHUNK + 7, 3 * CDF_CHUNK, 700])
def test_inverse_cdf_draws_the_token_whose_interval_holds_u(vocab):
    """Token t is drawn for u in [cdf(t-1), cdf(t)) / total, cdf in float64 here: the draw is
    in proportion to the weights. float32 sums may move a boundary by ~1e-7 of the total."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(8, vocab, generator=gen) * 3
    logits[1, : vocab // 2] = float("-inf")  # half the vocabulary masked, as a grammar does
    logits[2, :-1] = float("-inf")  # only the last (tail) token allowed
    logits[3, 1:] = float("-inf")  # only the first
    weights = (logits - logits.amax(dim=-1, keepdim=True)).exp()
    cdf = weights.double().cumsum(dim=-1)
    total = cdf[:, -1]
    rows = torch.arange(8)
    for _ in range(200):
        u = torch.rand(8, generator=gen)
        drawn = inverse_cdf(weights.clone(), u)
        target, tol = u.double() * total, 1e-6 * total
        assert (weights[rows, drawn] > 0).all()
        assert (cdf[rows, drawn] - weights[rows, drawn].double() <= target + tol).all(), u
        assert (cdf[rows, drawn] >= target - tol).all(), u
    assert inverse_cdf(weights.clone(), torch.rand(8, generator=gen))[2:4].tolist() == [vocab - 1, 0]


def test_inverse_cdf_draws_several_per_row_as_one_at_a_time():
    """u [B, M]: each of a row's M draws is the draw that its u alone gives (a refused
    constrained row's further draws)."""
    gen = torch.Generator().manual_seed(1)
    weights = (torch.randn(5, 3 * CDF_CHUNK + 77, generator=gen) * 3).exp()
    weights[1, : 2 * CDF_CHUNK] = 0.0
    u = torch.rand(5, 8, generator=gen)
    many = inverse_cdf(weights.clone(), u)
    assert many.shape == (5, 8)
    for m in range(8):
        assert torch.equal(many[:, m], inverse_cdf(weights.clone(), u[:, m].contiguous()))


def test_inverse_cdf_never_draws_a_token_of_weight_zero_at_the_edges():
    vocab = 4 * CDF_CHUNK + 300
    weights = torch.zeros(7, vocab)
    weights[0, [5, CDF_CHUNK - 1, CDF_CHUNK]] = 1.0  # both sides of a chunk edge
    weights[1, vocab - 300] = 1.0  # the first token of the ragged tail chunk
    weights[2, [0, 2 * CDF_CHUNK + 3]] = torch.tensor([1e-30, 1.0])  # a weight that rounds away
    weights[3, :] = 1e-3
    weights[3, CDF_CHUNK:] = 0.0  # everything after the first chunk is masked
    weights[4, 17] = 1.0
    weights[5, ::2] = 1.0
    weights[6, :1000], weights[6, 1000] = 1e-7, 1.0  # this chunk's sum exceeds its own prefix sum's end
    allowed = weights > 0
    for u in (0.0, 1e-12, 0.5, 1 - 1e-7, torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)).item(), 1.0):
        drawn = inverse_cdf(weights.clone(), torch.full((7,), u))
        assert allowed[torch.arange(7), drawn].all(), (u, drawn)


def test_sampled_tokens_follow_the_softmax_of_the_logits():
    """Temperature 1, 0.5 and top-k / min-p on a small vocabulary: the drawn frequencies match
    the probabilities within 4 standard deviations over 20,000 draws."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    logits = probs.log()[None].repeat(20_000, 1)
    torch.manual_seed(0)
    for params, expected in [
        (SamplingParams(temperature=1.0), probs),
        (SamplingParams(temperature=0.5), probs.pow(2) / probs.pow(2).sum()),
        (SamplingParams(temperature=1.0, top_k=2), probs[:2] / probs[:2].sum()),
        (SamplingParams(temperature=1.0, min_p=0.2), probs[:3] / probs[:3].sum()),  # 0.15 >= 0.2 * 0.5
    ]:
        seqs = [_Seq(params) for _ in range(len(logits))]
        counts = torch.bincount(torch.tensor(Sampler((99,))(logits.clone(), seqs).token_ids), minlength=5).double()
        freq = counts[: len(expected)] / counts.sum()
        assert counts[len(expected):].sum() == 0, params
        sd = (expected * (1 - expected) / counts.sum()).sqrt()
        assert ((freq - expected).abs() <= 4 * sd).all(), (params, freq, expected)


def test_row_max_equals_amax():
    gen = torch.Generator().manual_seed(1)
    for vocab in (151936, 151931, 700):
        logits = torch.randn(4, vocab, generator=gen).bfloat16()
        logits[0, -1] = 50.0
        assert torch.equal(row_max(logits), logits.amax(dim=-1))


class _Seq:
    """What the sampler reads of a Sequence."""

    def __init__(self, params: SamplingParams):
        self.params, self.seed, self.guide = params, None, None
        self.token_ids, self.completion_token_ids, self.num_completion_tokens = [1], [1], 1


def test_each_row_draws_only_among_its_own_top_k():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 3000, generator=gen)
    order = logits.argsort(dim=-1, descending=True)
    for top_k in ([1, 3, 40, 3, 1, 2999], [0, 3, 40, 3, 1, 5]):  # 0: no top-k for that row
        seqs = [_Seq(SamplingParams(temperature=1.5, top_k=k)) for k in top_k]
        seen = [set() for _ in top_k]
        for _ in range(300):
            for i, token in enumerate(Sampler((99,))(logits.clone(), seqs).token_ids):
                seen[i].add(token)
        for i, k in enumerate(top_k):
            allowed = set(order[i, : k or 3000].tolist())
            assert seen[i] <= allowed, (top_k, i)
            if k in (1, 3):  # small k at temperature 1.5: every allowed token comes up in 300 draws
                assert seen[i] == allowed, (top_k, i)


def _reference_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The definition: sort each row, keep the tokens whose mass before them is <= p (a row
    with p = 1 keeps all)."""
    sorted_probs, order = probs.double().sort(dim=-1, descending=True, stable=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    kept = sorted_probs.masked_fill((before > top_p.double()[:, None]) & (top_p < 1)[:, None], 0.0)
    return torch.zeros_like(probs.double()).scatter_(1, order, kept).to(probs.dtype)


@pytest.mark.parametrize("shape", ["peaked", "flat", "mixed"])
def test_top_p_keeps_exactly_the_nucleus(shape):
    """Peaked rows (a trained model's: a few hundred plausible tokens) go through the floor
    bound, flat ones (a random model's) through the wide top-k or the full sort; rows without
    top-p keep every token. Each keeps what sorting the whole row keeps."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 151936, generator=gen) * 2.0
    if shape != "flat":
        logits[:, :300] += torch.linspace(16, 4, 300)
    if shape == "mixed":
        logits[3] = torch.randn(151936, generator=gen)  # one flat row among peaked ones
    probs = torch.softmax(logits / 0.7, dim=-1)
    top_p = torch.tensor([0.9, 0.5, 0.99, 0.95, 1.0, 0.3])
    got = _apply_top_p(probs.clone(), top_p)
    expected = _reference_top_p(probs, top_p)
    assert torch.equal(got > 0, expected > 0)
    assert torch.allclose(got, expected)
    assert torch.equal(got[4], probs[4])  # top_p 1: untouched
    by_floor = _nucleus_by_floor(probs[[0, 1, 2, 5]].clone(), top_p[[0, 1, 2, 5]])
    assert (by_floor is None) == (shape == "flat")  # the path the test meant to take


def test_top_p_tokens_of_equal_probability_stay_in_vocabulary_order():
    probs = torch.zeros(2, 4000)
    probs[0, [10, 20, 30, 40]] = 0.25  # four equal tokens: the nucleus at 0.5 is the first three
    probs[1, 3990:] = 0.1  # ten: at 0.35, the first four
    got = _apply_top_p(probs.clone(), torch.tensor([0.5, 0.35]))
    assert (got[0] > 0).nonzero().squeeze(1).tolist() == [10, 20, 30]
    assert (got[1] > 0).nonzero().squeeze(1).tolist() == [3990, 3991, 3992, 3993]


def test_top_p_ties_stay_in_vocabulary_order_past_the_floor_bound():
    """A row too flat for the floor bound whose nucleus lies inside the wide top-k, and whose
    boundary cuts a group of equal probabilities (bf16 logits make such groups common): torch's
    topk returns equal values in no set order, the nucleus takes them in vocabulary order."""
    v = 151936
    probs = torch.full((1, v), 0.7 / (v - 3000))
    tied = torch.arange(3000) * 50 + 7  # 3000 equal tokens spread over the vocabulary
    probs[0, tied] = 0.3 / 3000
    top_p = torch.tensor([0.2])
    assert _nucleus_by_floor(probs.clone(), top_p) is None  # the path this test is about
    got = _apply_top_p(probs.clone(), top_p)
    assert torch.equal(got > 0, _reference_top_p(probs, top_p) > 0)
    kept = (got[0] > 0).nonzero().squeeze(1)
    assert 1990 <= len(kept) <= 2010 and kept.tolist() == tied[: len(kept)].tolist()


def test_adjust_penalises_seen_tokens_biases_and_holds_back_eos_as_openai_defines_them():
    """presence: once per token that appeared in the completion; frequency: per appearance;
    repetition (HF's): seen tokens of prompt or completion, positive logits divided, negative
    multiplied; bias added; eos at -inf until min_tokens. Nothing else moves."""
    from xserv_engine.engine.sequence import Sequence

    sampler = Sampler(eos_token_ids=(2,))
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0,
                            logit_bias={7: 3.0}, min_tokens=10)
    seq = Sequence([3, 4], params, 16)
    for token in (5, 5, 9):
        seq.append_token(token)
    logits = torch.full((1, 12), 1.0)
    logits[0, 4] = -1.0
    sampler.adjust(logits, [seq])
    expected = torch.full((12,), 1.0)
    expected[3] = 0.5  # prompt token, positive: divided by 2
    expected[4] = -2.0  # prompt token, negative: times 2
    expected[5] = 0.5 - (0.5 + 2 * 0.25)  # repetition, then presence once and frequency twice
    expected[9] = 0.5 - (0.5 + 0.25)
    expected[7] = 4.0
    expected[2] = float("-inf")
    assert torch.equal(logits[0], expected)
    plain = torch.full((1, 12), 1.0)
    sampler.adjust(plain, [Sequence([3, 4], SamplingParams(), 16)])
    assert torch.equal(plain, torch.full((1, 12), 1.0))
