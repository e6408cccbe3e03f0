"""The sampler's greedy pick is torch.argmax exactly, ties included, at any vocabulary size."""

import pytest
import torch

from xserv_engine.layers.sampler import ARGMAX_CHUNK, argmax


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [151936, 151931, 3 * ARGMAX_CHUNK, 5 * ARGMAX_CHUNK + 1, 1000])
def test_argmax_equals_torch_argmax(dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(16, vocab, generator=gen).to(dtype)
    # ties: the same maximum in two chunks, inside one chunk, and in the ragged last column
    top = logits.max() + 1
    logits[0, [7, vocab - 1]] = top
    logits[1, [min(ARGMAX_CHUNK, vocab - 1) - 1, min(ARGMAX_CHUNK, vocab - 1)]] = top  # across a chunk edge
    logits[2, [vocab - 2, vocab - 1]] = top
    logits[3, vocab - 1] = top
    logits[4] = float("-inf")
    logits[5] = 0.0
    assert torch.equal(argmax(logits), logits.argmax(dim=-1))


# ---- sampling: the two-level inverse CDF ----

from xserv_engine.layers.sampler import CDF_CHUNK, Sampler, inverse_cdf, row_max  # noqa: E402
from xserv_engine.sampling_params import SamplingParams  # noqa: E402


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
        self.params, self.generator, self.guide = params, None, None
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
