"""The native CPU decode step (xserv_engine/layers/cpu_decode.cpp) against the torch path."""

import contextlib
import logging
import math
import os
import random
import shutil

import pytest
import torch

import xserv_engine.layers.cpu_decode as cpu_decode
import xserv_engine.layers.native as native
from tests.engine.conftest import generate, make_engine
from xserv_engine.engine.sequence import Sequence
from xserv_engine.layers.sampler import PlainDraws
from xserv_engine.sampling_params import SamplingParams

# contexts inside one 16-token block, at its edge, across several, and a long one
PROMPT_LENGTHS = [1, 15, 16, 17, 40, 300]


@pytest.fixture(scope="module")
def kernel():
    """The built kernel. Without a C++ compiler the engine runs the torch path (tested below), so
    these tests skip; with one, a failed build is a failure."""
    if not (os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")):
        pytest.skip("no C++ compiler (g++ or $CXX): the native decode step cannot be built here")
    lib = cpu_decode.load_library()
    if lib is None:
        pytest.fail("the C++ compiler could not build the kernel; see the log")
    return lib


@contextlib.contextmanager
def _ready_to_decode(engine, prompts):
    """Sequences of `prompts`, prefilled by the torch path, each with one more token to decode;
    their blocks go back on exit."""
    runner, blocks = engine.runner, engine.block_manager
    seqs = [Sequence(p, SamplingParams(), blocks.block_size) for p in prompts]
    try:
        for seq in seqs:
            blocks.allocate(seq)
            seq.num_scheduled_tokens = seq.num_uncomputed_tokens
        with torch.inference_mode():
            ids, pos, meta, last = runner.prepare(seqs, [])
            runner.model(ids, pos, meta)  # prefill: fills the cache
        for seq in seqs:
            seq.num_cached_tokens = len(seq)
            seq.append_token(seq.token_ids[-1] + 1)
            blocks.may_append(seq)
        yield seqs
    finally:
        for seq in seqs:
            blocks.deallocate(seq)


def _one_decode_step_both_ways(engine, prompts):
    """Logits of one decode step of `prompts` (prefilled by the torch path), by the kernel and
    by the torch path; each path writes the step's keys and values to the same slots."""
    runner = engine.runner
    with _ready_to_decode(engine, prompts) as seqs, torch.inference_mode():
        native = runner.cpu_decode.logits(seqs).float()
        ids, pos, meta, last = runner.prepare([], seqs)
        eager = runner.model.compute_logits(runner.model(ids, pos, meta)).float()
    return native, eager


@contextlib.contextmanager
def _next_step_logits(model_dir, dtype: str, lengths, seed: int):
    """(the kernel, the torch Sampler, sequences of random prompts of `lengths` ready to decode,
    the kernel's float32 logits of their next step); the engine shuts down on exit."""
    engine = make_engine(model_dir, dtype=dtype)
    native, rng = engine.runner.cpu_decode, random.Random(seed)
    try:
        with _ready_to_decode(engine, [[rng.randrange(151643) for _ in range(n)] for n in lengths]) as seqs, \
                torch.inference_mode():
            yield native, engine.runner.sampler, seqs, native.logits(seqs).float()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_decode_step_gives_the_torch_paths_logits(kernel, hf_model_dir, dtype):
    """With the LM head tied to the embedding or not; batches of 1 and 2 run the LM head in the
    kernel, larger ones oneDNN's (LM_HEAD_BATCH); 12 and 24 (MAX_BATCH) take the matmuls' rows of
    x 8 at a time, then the rest."""
    engine = make_engine(hf_model_dir[0], dtype=dtype)
    try:
        assert engine.runner.cpu_decode is not None
        assert engine.runner.cpu_decode.lm_head_batch == 2
        rng = random.Random(0)
        assert engine.runner.cpu_decode.max_batch == cpu_decode.MAX_BATCH == 24
        for batch in ([PROMPT_LENGTHS[0]], PROMPT_LENGTHS[-2:], PROMPT_LENGTHS, PROMPT_LENGTHS[2:5] * 2 + [7, 8],
                      PROMPT_LENGTHS * 2, [3, 17, 40, 65] * 6):
            prompts = [[rng.randrange(151643) for _ in range(n)] for n in batch]
            native, eager = _one_decode_step_both_ways(engine, prompts)
            if dtype == "float32":
                torch.testing.assert_close(native, eager, atol=1e-4, rtol=1e-4)
            else:
                # bf16 rounds after every op; the kernel sums in another order, so a value
                # may land one bf16 step away and carry on: bounded, and the argmax holds
                scale = eager.abs().amax(-1, keepdim=True)
                assert ((native - eager).abs() / scale).max() < 0.05
                assert (native.argmax(-1) == eager.argmax(-1)).all()
        stats = engine.stats()
        assert stats.free_blocks == stats.total_blocks
    finally:
        engine.shutdown()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_streams_are_the_same_with_and_without_the_kernel(kernel, tied_model_dir, dtype):
    rng = random.Random(1)
    prompts = [[rng.randrange(151643) for _ in range(n)] for n in (5, 16, 33, 70)]
    answers = {}
    for eager in (True, False):
        engine = make_engine(tied_model_dir, dtype=dtype, enforce_eager=eager)
        try:
            assert (engine.runner.cpu_decode is None) == eager  # --enforce-eager turns it off
            answers[eager] = [generate(engine, p, max_tokens=40, temperature=0.0, ignore_eos=True).token_ids()
                              for p in prompts]
        finally:
            engine.shutdown()
    assert answers[False] == answers[True]


# penalties, a bias and min_tokens: rows the kernel picks from after Sampler.adjust (a float32 copy)
ADJUSTED = [dict(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3),
            dict(temperature=1.0, presence_penalty=1.5), dict(temperature=0.6, top_k=20, top_p=0.95, presence_penalty=1.5),
            dict(temperature=0.8, repetition_penalty=1.2, frequency_penalty=0.7, top_p=0.9),
            dict(temperature=1.0, logit_bias={42: 8.0, 43: -100.0}, min_tokens=5)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_streams_with_penalties_bias_and_min_tokens_are_the_same_with_and_without_the_kernel(
        kernel, tied_model_dir, dtype, monkeypatch):
    rng = random.Random(3)
    prompts = [[rng.randrange(151643) for _ in range(n)] for n in (5, 33)]
    params = dict(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.8, frequency_penalty=0.4,
                  logit_bias={42: 4.0}, min_tokens=30, max_tokens=40, logprobs=True, top_logprobs=2)
    kernel_picks = []
    sample_logits = cpu_decode.CpuDecode.sample_logits
    monkeypatch.setattr(cpu_decode.CpuDecode, "sample_logits",
                        lambda self, logits, draws: kernel_picks.append(draws.on_logits) or sample_logits(self, logits, draws))
    answers, logprobs = {}, {}
    for eager in (True, False):
        engine = make_engine(tied_model_dir, dtype=dtype, enforce_eager=eager)
        try:
            results = [generate(engine, p, **params) for p in prompts]
            answers[eager] = [r.token_ids() for r in results]
            logprobs[eager] = [[lp for o in r.outputs for lp in o.logprobs] for r in results]
            answers["plain", eager] = [generate(engine, p, max_tokens=40, temperature=0.0).token_ids() for p in prompts]
        finally:
            engine.shutdown()
    assert answers[False] == answers[True]
    # the same entries, to the logits' rounding (bf16: a logit may land a step or two of ~0.06 away)
    tol = 1e-3 if dtype == "float32" else 0.3
    for native, eager in zip(logprobs[False], logprobs[True]):
        assert [e.token_id for e in native] == [e.token_id for e in eager]
        assert [e.logprob for e in native] == pytest.approx([e.logprob for e in eager], abs=tol)
        # the top two by value (their ids may swap where two are within rounding of each other)
        assert [[t.logprob for t in e.top] for e in native] == [
            pytest.approx([t.logprob for t in e.top], abs=tol) for e in eager]
        assert all(len(e.top) == 2 for e in native)
    assert answers[False] != answers["plain", False]  # the penalties changed the answer
    assert kernel_picks and all(kernel_picks)  # the kernel picked the adjusted rows' tokens


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lengths", [(9, 30), (9, 30, 2, 17)], ids=["fused-lm-head", "onednn-lm-head"])
def test_adjusted_rows_are_picked_in_the_kernel_as_the_sampler_would(kernel, tied_model_dir, dtype, lengths):
    """Rows with penalties, a bias or min_tokens to go: Sampler.adjust changes a float32 copy of
    the logits (bias added, eos at -inf before min_tokens, seen tokens penalised), then the kernel
    draws from it as from a plain row - in the exact CDF of the adjusted row, and almost always
    Sampler's own pick for the same number."""
    batch = len(lengths)
    with _next_step_logits(tied_model_dir, dtype, lengths, seed=4) as (native, torch_sampler, seqs, logits):
        for kwargs in ADJUSTED:
            params = SamplingParams(**kwargs)
            for seq in seqs:
                seq.params = params
            adjusted = logits.clone()
            torch_sampler.adjust(adjusted, seqs)
            assert not torch.equal(adjusted, logits)
            if params.logit_bias:
                assert torch.equal(adjusted[:, 42], logits[:, 42] + 8.0)
                assert (adjusted[:, torch_sampler.eos_token_ids] == float("-inf")).all()  # min_tokens
            kept = _exact_kept_weights(adjusted, max(params.temperature, 1e-6), params.top_k, params.top_p, 0.0)
            agree = 0
            for draw in range(20):
                torch.manual_seed(draw)
                draws = torch_sampler.plain_draws(seqs, cpu_decode.TOP_K_MAX)
                assert draws is not None and draws.on_logits
                picked = native.sample_logits(adjusted, draws)
                torch.manual_seed(draw)
                expected = torch_sampler(logits.to(native.out.dtype, copy=True), seqs).token_ids
                if params.greedy:
                    assert picked == adjusted.argmax(-1).tolist() == expected
                    continue
                _assert_drawn_at_their_place_in_the_exact_cdf(picked, draws, kept, params)
                agree += sum(a == e for a, e in zip(picked, expected))
            assert params.greedy or agree >= 0.9 * 20 * batch, params


def _refuse(self, tensor, dtype):
    raise ValueError(f"it reads contiguous {dtype} CPU tensors, got a transposed one")


@pytest.mark.parametrize("cause, says, built", [
    (lambda patch: patch.setenv("CXX", "/nonexistent/g++"), "CPU decode kernel unavailable", False),
    # any model is too big to hold twice now
    (lambda patch: patch.setattr(cpu_decode, "MAX_COPY_OF_MEMORY", 1e-12), "would exceed", False),
    # a weight it cannot read in place (say, a checkpoint's transposed view): met once it is built
    (lambda patch: patch.setattr(cpu_decode.CpuDecode, "_pointer", _refuse), "it reads contiguous", True),
], ids=["no-compiler", "too-big-to-hold-twice", "unreadable-tensor"])
def test_where_the_kernel_cannot_run_the_engine_runs_the_torch_path_and_says_why(tied_model_dir, monkeypatch, caplog,
                                                                                 request, cause, says, built):
    if built:
        request.getfixturevalue("kernel")
    cause(monkeypatch)
    caplog.set_level(logging.INFO, logger="xserv_engine")
    engine = make_engine(tied_model_dir)
    try:
        assert engine.runner.cpu_decode is None
        assert says in caplog.text
        assert len(generate(engine, [1, 2, 3], max_tokens=5, temperature=0.0, ignore_eos=True).token_ids()) == 5
    finally:
        engine.shutdown()


def test_the_kernel_is_compiled_once_per_machine_and_then_loaded(tmp_path, monkeypatch, kernel):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    compiles = []
    real = native._compile
    monkeypatch.setattr(native, "_compile", lambda *a: compiles.append(a) or real(*a))
    assert cpu_decode.load_library() is not None
    assert cpu_decode.load_library() is not None
    assert len(compiles) == 1
    assert [p.suffix for p in (tmp_path / "xserv" / "kernels").iterdir()] == [".so"]  # no temporary left


def test_a_failed_compile_leaves_nothing_behind_and_says_why(kernel, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_decode, "FLAGS", [*cpu_decode.FLAGS, "-DXSERV_NO_SUCH_FLAG", "-fno-such-option"])
    with caplog.at_level(logging.WARNING, logger="xserv_engine.layers.native"):
        assert cpu_decode.load_library() is None
    assert "-fno-such-option" in caplog.text  # the compiler's own message
    assert list((tmp_path / "xserv" / "kernels").iterdir()) == []


# (temperature, top_k, top_p, min_p): plain rows, which the kernel samples
PLAIN = [(1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.05), (0.6, 20, 0.95, 0.0), (1.0, 50, 1.0, 0.1),
         (0.8, 5, 0.5, 0.0), (1.3, 64, 0.9, 0.02), (1.0, 0, 0.9, 0.0), (0.3, 0, 0.5, 0.0), (0.7, 0, 0.95, 0.05)]


def _exact_kept_weights(logits: torch.Tensor, temperature, top_k, top_p, min_p) -> torch.Tensor:
    """[B, V] float64 weights of the tokens a plain row may draw, as Sampler defines them: top-k by
    logit (equal ones in vocabulary order), min-p against the top token, the nucleus of top-p."""
    scaled = (logits / temperature).double()
    order = scaled.sort(dim=-1, descending=True, stable=True).indices  # equal ones: lower id first
    weights = (scaled - scaled.amax(-1, keepdim=True)).exp()
    weights[weights < min_p] = 0.0
    ranked = weights.gather(1, order)
    if top_k:
        ranked[:, top_k:] = 0.0
    if top_p < 1:
        probs = ranked / ranked.sum(-1, keepdim=True)
        ranked[(probs.cumsum(-1) - probs) > top_p] = 0.0
    return torch.zeros_like(weights).scatter_(1, order, ranked)


def _assert_drawn_at_their_place_in_the_exact_cdf(picked: list[int], draws: PlainDraws, kept: torch.Tensor, params):
    """Each row's token has weight in `kept` and its interval of the exact CDF holds the row's
    uniform number (to float32 sums' rounding)."""
    cdf = kept.cumsum(-1)
    for b, token in enumerate(picked):
        total = cdf[b, -1].item()
        target, tol = draws.uniform[b] * total, 1e-5 * total
        assert kept[b, token] > 0, (params, token)  # a token the distribution has
        low = cdf[b, token - 1].item() if token else 0.0
        assert low - tol <= target <= cdf[b, token].item() + tol, params


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lengths", [(9, 30), (9, 30, 2, 17)], ids=["fused-lm-head", "onednn-lm-head"])
def test_the_kernel_picks_the_token_the_sampler_would(kernel, tied_model_dir, dtype, lengths):
    """Plain rows get their next token from the kernel: greedy, the first maximum; otherwise a
    token of the distribution Sampler draws from (temperature, top-k, top-p, min-p), at the place
    the row's uniform number points to in its exact CDF, and almost always Sampler's own pick
    for that number; with the LM head in the kernel's call (2 sequences) or oneDNN's (4)."""
    batch = len(lengths)
    with _next_step_logits(tied_model_dir, dtype, lengths, seed=2) as (native, torch_sampler, seqs, logits):
        greedy = PlainDraws([0.0] * batch, [0.0] * batch, [0] * batch, [1.0] * batch, [0.0] * batch)
        assert native.sample(seqs, greedy) == logits.argmax(-1).tolist()
        for temperature, top_k, top_p, min_p in PLAIN:
            params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
            for seq in seqs:
                seq.params = params
            kept = _exact_kept_weights(logits, temperature, top_k, top_p, min_p)
            agree = 0
            for draw in range(30):
                torch.manual_seed(draw)  # Sampler draws its uniform numbers from torch's generator
                draws = torch_sampler.plain_draws(seqs, cpu_decode.TOP_K_MAX)
                picked = native.sample(seqs, draws)
                torch.manual_seed(draw)
                # (a copy: Sampler works in place on float32 logits)
                expected = torch_sampler(logits.to(native.out.dtype, copy=True), seqs).token_ids
                _assert_drawn_at_their_place_in_the_exact_cdf(picked, draws, kept, params)
                agree += sum(a == e for a, e in zip(picked, expected))
            # two float32 sums over 152k weights differ in their last bits: a draw that lands
            # within them of a boundary takes the neighbour (~1 % of draws)
            assert agree >= 0.9 * 30 * batch, params


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_top_p_over_ties_keeps_the_lowest_ids(kernel, tied_model_dir, dtype):
    """Top-p over rows of exactly equal weights, where the nucleus boundary cuts a tie group of
    the whole vocabulary (row 0: every logit 0; more than the kernel's scratch, so its heap path)
    or of a few thousand scattered tokens (row 1): the nucleus is the lowest ids of the group, and
    with equal weights the draw at u is exactly the kept token at u times their number."""
    engine = make_engine(tied_model_dir, dtype=dtype)
    native = engine.runner.cpu_decode
    try:
        v = native.out.shape[1]
        logits = torch.zeros(2, v, dtype=native.out.dtype)
        logits[1] = float("-inf")
        group = torch.arange(3000) * 50 + 7
        logits[1, group] = 2.0
        logits[1, 5] = 9.0  # one far likelier token, kept first: mass e^7 / (e^7 + 3000) = 0.27
        for u in (0.0, 0.3, 0.77, 0.999, 0.99999):  # the last one: the last kept token
            draws = PlainDraws([1.0, 1.0], [u, u], [0, 0], [0.5, 0.5], [0.0, 0.0])
            picked = native.sample_logits(logits, draws)
            kept0 = v // 2 + 1  # mass before the k-th token is (k - 1) / v <= 0.5
            assert picked[0] == int(u * kept0)
            top = math.exp(7.0)
            total = top + 3000
            kept1 = int((0.5 * total - top)) + 1  # tied tokens whose mass before them is <= 0.5
            target = u * (top + kept1)
            assert picked[1] == (5 if target < top else int(group[int(target - top)]))
    finally:
        engine.shutdown()


def test_seeded_sampling_through_the_kernel_is_reproducible(kernel, tied_model_dir):
    """A seed gives the same stream twice; another seed another one. (Not the torch path's
    stream token for token: two float32 sums over 152k weights differ in the last bits, which
    moves a draw that lands within them of a boundary to the neighbouring token, ~0.5 % of draws
    here; the pick test above bounds the kernel's draws against the exact CDF.)"""
    engine = make_engine(tied_model_dir)
    try:
        assert engine.runner.cpu_decode is not None
        prompt = list(range(500, 540))
        runs = [generate(engine, prompt, max_tokens=40, temperature=1.0, seed=seed, ignore_eos=True).token_ids()
                for seed in (7, 7, 8)]
    finally:
        engine.shutdown()
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    assert len(set(runs[0])) > 10  # a draw, not a greedy loop


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_matmul_alone_computes_x_times_w_transposed(kernel, dtype):
    """What benchmarks/roofline.py times as the native LM head: it must be the same product."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(1000, 96, generator=gen).to(dtype)
    for batch in (1, 3):
        x = torch.randn(batch, 96, generator=gen).to(dtype)
        got = cpu_decode.native_matmul(kernel, weight)(x.float(), torch.empty(batch, 1000, dtype=dtype))
        torch.testing.assert_close(got.float(), (x.float() @ weight.float().T).to(dtype).float(),
                                   atol=1e-4, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5)
