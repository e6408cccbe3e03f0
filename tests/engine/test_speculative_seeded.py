"""Seeded requests under speculative decoding: the same tokens as an engine that never speculates,
whichever steps the payoff rule lets speculate, with n-gram and draft-model drafts, on a dense
model and on hybrid ones. Each test also checks that drafts were accepted and refused and that
steps were taken both ways, so an engine that never speculates cannot pass it."""

import json

import pytest

from tests.engine.conftest import generate, make_engine, wait_idle
from tests.support.hybrid_checkpoint import write_hybrid_checkpoint

LOOP = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]  # repeats: the n-gram lookup proposes from the first step
# the request (temperature 0.1, seed 1234, 40 tokens), and ones whose drafts are often
# refused. Each draw must land where plain decoding's lands, and a verification's logits round
# differently from a plain step's (another batch shape, a hybrid's chunked state update): with
# the nearly flat distributions of random weights at temperature 1 over the whole vocabulary,
# tokens 1e-6 wide, a draw within rounding of a boundary would differ, as it would in plain
# decoding between batches of other sizes; top-k keeps the tokens wide
SEEDED = [dict(temperature=0.1, seed=1234), dict(temperature=0.8, top_k=20, seed=7),
          dict(temperature=1.0, top_k=50, repetition_penalty=1.1, seed=99)]


class Switching:
    """Stands in for the payoff rule (spec_payoff.Payoff), whose choice flips when its measured
    timings or a trial say so: here it speculates 3 steps, then decodes plainly 2, and so on, so
    that every request is decoded both ways."""

    def __init__(self):
        self.chosen: list[bool] = []

    def speculate(self, num_decodes: int) -> bool:
        self.chosen.append(len(self.chosen) % 5 < 3)
        return self.chosen[-1]

    def observe(self, *args, **kwargs) -> None:
        pass


def speculating_engine(path, config: dict, **overrides):
    engine = make_engine(path, speculative_config=json.dumps({**config, "disable_when_slower": True}), **overrides)
    engine.engine.speculator.payoff = Switching()  # before any request: the engine thread reads it per step
    return engine


def seeded_outputs(path, prompts: list, seeded: list = SEEDED, **overrides) -> dict[tuple[int, int], list[int]]:
    """(seeded index, prompt index) -> the tokens of an engine that never speculates."""
    plain = make_engine(path, **overrides)
    try:
        return {(i, j): generate(plain, prompt, max_tokens=40, ignore_eos=True, **params).token_ids()
                for i, params in enumerate(seeded) for j, prompt in enumerate(prompts)}
    finally:
        plain.shutdown()


def assert_seeded_requests_equal_plain_decoding(path, configs: list[dict], prompts: list, some_stand: bool = True,
                                                **overrides) -> None:
    """Each SEEDED request on each prompt, with each speculative config, gives plain decoding's
    tokens; drafts were refused and (some_stand) drafts stood, over all the configs, and steps
    were taken both ways."""
    want = seeded_outputs(path, prompts, **overrides)
    accepted = refused = 0
    for config in configs:
        fast = speculating_engine(path, config, **overrides)
        try:
            for (i, j), tokens in want.items():
                got = generate(fast, prompts[j], max_tokens=40, ignore_eos=True, **SEEDED[i]).token_ids()
                assert got == tokens, (config, SEEDED[i], j)
            spec, chosen = fast.stats().spec, fast.engine.speculator.payoff.chosen
            accepted += spec.num_accepted_tokens
            refused += spec.num_draft_tokens - spec.num_accepted_tokens
            assert True in chosen and False in chosen
            wait_idle(fast)
        finally:
            fast.shutdown()
    assert refused > 0 and (accepted > 0 or not some_stand)


NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def test_ngram_speculation_keeps_seeded_output_on_a_dense_model(demo_dir):
    assert_seeded_requests_equal_plain_decoding(demo_dir, [NGRAM], [LOOP, "hello hello hello hello"],
                                                max_model_len=512, dtype="auto")


def test_drafts_that_stand_keep_seeded_output_on_the_qwen3_5_demo(demo_qwen3_5_dir, monkeypatch):
    """In float32: a verification computes a linear-attention layer's rows in the chunked form, a
    plain step in the recurrent one, and in bf16 their logits differ by enough to move a draw
    near a boundary between two likely tokens. The demo's random weights never repeat what the
    lookup could find: drafts from the oracle."""
    assert_oracle_drafts_keep_seeded_output(demo_qwen3_5_dir, monkeypatch, TOP_K_SEEDED, max_model_len=512,
                                            dtype="float32")


# the Qwen3.5 demo's random distributions are nearly flat even at temperature 0.1 (its tokens a
# draw tells apart are too narrow for two forms' rounding): its rows draw among their top 20
TOP_K_SEEDED = [dict(temperature=0.1, top_k=20, seed=1234), dict(temperature=0.8, top_k=20, seed=7)]


def drafting(*models) -> list[dict]:
    return [{"model": str(model), "num_speculative_tokens": 3} for model in models]


def test_a_draft_model_keeps_seeded_output_on_a_dense_model(hf_models):
    """The untied test model drafts for the tied one (drafts mostly refused), and the tied one for
    itself (mostly accepted)."""
    target, other = hf_models(True)[0], hf_models(False)[0]
    assert_seeded_requests_equal_plain_decoding(target, drafting(other, target), [LOOP, list(range(3000, 3030))])


@pytest.fixture(scope="module")
def qwen3_5_checkpoint(tmp_path_factory, demo_dir):
    """A random Qwen3.5 checkpoint (tests/support/hybrid_checkpoint.py) with the demo model's
    Qwen3 vocabulary, so that the Qwen3 demo model can draft for it."""
    path = tmp_path_factory.mktemp("qwen3_5-seeded")
    write_hybrid_checkpoint(path, demo_dir, "qwen3_5,v4-over-k2,tied")
    return path


def test_a_draft_model_keeps_seeded_output_on_a_hybrid_model(qwen3_5_checkpoint, demo_dir):
    """The Qwen3 demo model drafts for the random Qwen3.5 (a hybrid cannot draft): other random
    weights, so its drafts are refused (the states kept are those before them);
    test_drafts_that_stand_keep_seeded_output_on_a_hybrid_model has drafts that stand."""
    assert_seeded_requests_equal_plain_decoding(qwen3_5_checkpoint, drafting(demo_dir), [LOOP, list(range(3000, 3030))],
                                                some_stand=False)


def test_drafts_that_stand_keep_seeded_output_on_a_hybrid_model(qwen3_5_checkpoint, monkeypatch):
    assert_oracle_drafts_keep_seeded_output(qwen3_5_checkpoint, monkeypatch)


def assert_oracle_drafts_keep_seeded_output(path, monkeypatch, seeded: list = SEEDED, **overrides) -> None:
    """The n-gram lookup replaced by an oracle that proposes plain decoding's seeded tokens, with
    every other proposal's second draft wrong: full and partial acceptances, each verified by the
    row's own seeded draws through the hybrid's per-position states."""
    from xserv_engine.engine import speculative

    prompts = [LOOP, list(range(3000, 3030))]
    want = seeded_outputs(path, prompts, seeded, **overrides)
    current = {}  # the prompt index -> the SEEDED index running now (one request at a time)
    calls = []

    def oracle(token_ids, k, lookup_min, lookup_max):
        j = next(j for j, prompt in enumerate(prompts) if token_ids[: len(prompt)] == prompt)
        done = len(token_ids) - len(prompts[j])
        drafts = list(want[(current[j], j)][done : done + k])
        calls.append(j)
        if len(calls) % 2 and len(drafts) > 1:
            drafts[1] = (drafts[1] + 1) % 151643
        return drafts

    monkeypatch.setattr(speculative, "ngram_propose", oracle)
    fast = speculating_engine(path, NGRAM, **overrides)
    try:
        for (i, j), tokens in want.items():
            current[j] = i
            assert generate(fast, prompts[j], max_tokens=40, ignore_eos=True, **seeded[i]).token_ids() == tokens, \
                seeded[i]
        spec, chosen = fast.stats().spec, fast.engine.speculator.payoff.chosen
        assert 0.5 * spec.num_draft_tokens < spec.num_accepted_tokens < spec.num_draft_tokens
        assert True in chosen and False in chosen
        wait_idle(fast)
    finally:
        fast.shutdown()


def test_a_model_drafting_for_itself_has_its_seeded_drafts_accepted(tied_model_dir):
    """A seeded row's draft is drawn with the number the target's own draw at that position uses:
    a draft distribution equal to the target's picks the target's token, so at temperature 1 its
    drafts stand nearly always (as rejection sampling's min(1, p/q) would accept them)."""
    fast = speculating_engine(tied_model_dir, {"model": str(tied_model_dir), "num_speculative_tokens": 3})
    try:
        for seed in range(4):
            generate(fast, list(range(3000, 3030)), max_tokens=40, temperature=1.0, seed=seed, ignore_eos=True)
        spec = fast.stats().spec
        assert spec.num_accepted_tokens > 0.9 * spec.num_draft_tokens > 0
        wait_idle(fast)
    finally:
        fast.shutdown()
