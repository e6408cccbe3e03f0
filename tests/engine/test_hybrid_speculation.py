"""Speculative decoding on a hybrid model composes with the rest of the engine: logprobs, output
grammars, preemption, aborts and prefix-cache hits give what plain decoding (or transformers)
gives, and every state slot comes back. Drafts come from an oracle standing in for the n-gram
lookup: plain decoding's own continuation with every other proposal's second draft wrong, so
whole and partial acceptances both happen whatever the random weights do; each test checks
that drafts stood and that drafts were refused."""

import json
import re

import pytest
import torch

from tests.engine.conftest import Collector, generate, make_engine
from tests.engine.test_fidelity import hf_greedy
from tests.engine.test_hybrid_models import assert_idle_with_every_slot_free, prompts
from tests.support.hybrid_checkpoint import write_hybrid_checkpoint
from xserv_engine.sampling_params import SamplingParams
from xserv_engine.structured.constraint import JSON_OBJECT, REGEX, Constraint

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "disable_when_slower": False})
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory, demo_dir):
    """(directory, transformers model) of a random Qwen3.5 (tests/support/hybrid_checkpoint.py)."""
    path = tmp_path_factory.mktemp("qwen3_5-speculation")
    return path, write_hybrid_checkpoint(path, demo_dir, "qwen3_5,v4-over-k2,tied")


class Oracle:
    """ngram_propose's stand-in: for a sequence that starts with one of `want`'s prompts (the
    longest that fits), the next k tokens of that prompt's known continuation, the second and
    third swapped (or the second wrong) in every other proposal: a wrong draft that an output
    grammar may still allow."""

    def __init__(self):
        self.want: dict[tuple[int, ...], list[int]] = {}
        self.calls = 0

    def __call__(self, token_ids: list[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
        fits = [p for p in self.want if tuple(token_ids[: len(p)]) == p]
        if not fits:
            return []
        prompt = max(fits, key=len)
        done = len(token_ids) - len(prompt)
        drafts = list(self.want[prompt][done : done + k])
        self.calls += 1
        if self.calls % 2 and len(drafts) > 2 and drafts[1] != drafts[2]:
            drafts[1], drafts[2] = drafts[2], drafts[1]
        elif self.calls % 2 and len(drafts) > 1:
            drafts[1] = (drafts[1] + 1) % 151643
        return drafts


@pytest.fixture
def oracle(monkeypatch):
    from xserv_engine.engine import speculative

    stand_in = Oracle()
    monkeypatch.setattr(speculative, "ngram_propose", stand_in)
    return stand_in


def assert_drafts_stood_and_were_refused(engine, before=None, refused: bool = True) -> None:
    """Since `before` (engine stats' spec): drafts stood, and (refused) drafts were refused."""
    spec = engine.stats().spec
    accepted = spec.num_accepted_tokens - (before.num_accepted_tokens if before else 0)
    drafted = spec.num_draft_tokens - (before.num_draft_tokens if before else 0)
    assert 0 < accepted < drafted or (not refused and 0 < accepted == drafted)


def test_logprobs_and_output_grammars_with_drafts_are_plain_decodings(qwen3_5, oracle):
    path, _ = qwen3_5
    prompt = prompts(30, lengths=(25,))[0]
    cases = [dict(logprobs=True, top_logprobs=3), dict(constraint=Constraint(REGEX, "[a-z]+( [a-z]+)*")),
             dict(constraint=Constraint(JSON_OBJECT))]
    plain, fast = make_engine(path), make_engine(path, speculative_config=NGRAM)
    try:
        for params in cases:
            want = generate(plain, prompt, max_tokens=30, **GREEDY, **params)
            oracle.want = {tuple(prompt): want.token_ids()}
            before = fast.stats().spec
            got = generate(fast, prompt, max_tokens=30, **GREEDY, **params)
            assert got.token_ids() == want.token_ids(), params
            # a grammar cuts the drafts it refuses before they are verified
            assert_drafts_stood_and_were_refused(fast, before, refused="constraint" not in params)
            if "constraint" in params and params["constraint"].kind == REGEX:
                assert re.fullmatch("[a-z]+( [a-z]+)*", got.text())
            if params.get("logprobs"):
                ours, theirs = ([lp for o in r.outputs for lp in o.logprobs] for r in (got, want))
                assert [[t.token_id for t in e.top] for e in ours] == [[t.token_id for t in e.top] for e in theirs]
                assert [t.logprob for e in ours for t in (e, *e.top)] == \
                    pytest.approx([t.logprob for e in theirs for t in (e, *e.top)], abs=1e-4)
        assert_idle_with_every_slot_free(fast)
        assert fast.structured.num_active == 0
    finally:
        plain.shutdown()
        fast.shutdown()


def test_preempted_and_aborted_sequences_with_drafts_answer_the_same_and_free_their_slots(qwen3_5, oracle):
    path, model = qwen3_5
    batch = prompts(31, lengths=(20, 24, 18, 22))
    oracle.want = {tuple(p): hf_greedy(model, tuple(p), 30) for p in batch}
    engine = make_engine(path, num_kv_blocks=8, max_model_len=128, speculative_config=NGRAM)  # 128 tokens for 4 x ~50
    try:
        collectors = [Collector() for _ in batch]
        for i, (prompt, collector) in enumerate(zip(batch, collectors)):
            engine.add_request(f"preempted-{i}", prompt, SamplingParams(max_tokens=30, **GREEDY), collector)
        for prompt, collector in zip(batch, collectors):
            collector.wait()
            assert collector.token_ids() == oracle.want[tuple(prompt)]
        assert engine.stats().preemptions > 0
        assert_drafts_stood_and_were_refused(engine)

        collector, aborted = Collector(), []

        def on_output(out):
            collector(out)
            if sum(len(o.token_ids) for o in collector.outputs) >= 10 and not aborted:
                aborted.append(engine.abort("aborted"))

        oracle.want = {tuple(batch[0]): hf_greedy(model, tuple(batch[0]), 100)}
        engine.add_request("aborted", batch[0], SamplingParams(max_tokens=100, **GREEDY), on_output)
        assert collector.wait()[-1].finish_reason == "abort" and aborted == [True]
        assert sum(len(o.token_ids) for o in collector.outputs) < 100
        assert_idle_with_every_slot_free(engine)
    finally:
        engine.shutdown()


def test_a_turn_that_hits_the_prefix_cache_speculates_from_the_restored_states(qwen3_5, oracle):
    """An agent loop sends back the model's own answer (speculated) and more: the blocks decoding
    filled are hits (drafts are cut so that a verification ends at a block's end rather than
    past it: it keeps the states after its last row only), and the next answer, speculated from
    the restored states, is transformers'."""
    path, model = qwen3_5
    engine = make_engine(path, speculative_config=NGRAM)
    try:
        first = prompts(32, lengths=(37,))[0]
        oracle.want = {tuple(first): hf_greedy(model, tuple(first), 30)}
        answer = generate(engine, first, max_tokens=30, **GREEDY).token_ids()
        assert answer == oracle.want[tuple(first)]
        second = first + answer + prompts(33, lengths=(10,))[0]
        oracle.want = {tuple(second): hf_greedy(model, tuple(second), 24)}
        before = engine.stats().spec
        out = generate(engine, second, max_tokens=24, **GREEDY)
        assert out.token_ids() == oracle.want[tuple(second)]
        assert out.final().usage.cached_prompt_tokens == 64  # blocks end at 48 and 64 while decoding
        assert_drafts_stood_and_were_refused(engine, before)
        assert_idle_with_every_slot_free(engine)
    finally:
        engine.shutdown()


def test_sampled_tokens_after_drafts_keep_the_targets_distribution(qwen3_5, oracle):
    """The chi-square test of test_speculative.py through the engine on a hybrid model: many
    seeded requests (top-k 5, temperature 1) on one prompt; where the first token is the likeliest
    one c, the oracle drafts position 1's likeliest token and position 2's second likeliest, so
    drafts are accepted and refused. The second token (verified row 0) and, after an accepted
    draft, the third (row 1, from the states after the draft) follow the target's distributions
    there, computed by a plain engine."""
    from tests.engine.test_speculative import CHI2_999, chi_square

    path, _ = qwen3_5
    prompt = prompts(34, lengths=(20,))[0]
    plain = make_engine(path)
    try:
        def top5(context):  # the 5 likeliest next tokens and their probabilities at temperature 1, top-k 5
            entry = generate(plain, context, max_tokens=1, logprobs=True, top_logprobs=5, **GREEDY).outputs[0].logprobs[0]
            ids = torch.tensor([t.token_id for t in entry.top])
            return ids, torch.softmax(torch.tensor([t.logprob for t in entry.top], dtype=torch.float64), dim=0)

        c = int(top5(prompt)[0][0])
        first, p1 = top5(prompt + [c])
        second, p2 = top5(prompt + [c, int(first[0])])
    finally:
        plain.shutdown()
    oracle.want = {tuple(prompt + [c]): [int(first[0]), int(second[1])]}
    config = json.dumps({"method": "ngram", "num_speculative_tokens": 2, "disable_when_slower": False,
                         "disable_by_batch_size": 64})
    engine = make_engine(path, max_num_seqs=64, speculative_config=config)
    try:
        outputs = run_seeded(engine, prompt, range(1500), max_tokens=3, temperature=1.0, top_k=5, ignore_eos=True)
        assert_drafts_stood_and_were_refused(engine)
    finally:
        engine.shutdown()
    at1 = [t[1] for t in outputs if t[0] == c]
    at2 = [t[2] for t in outputs if t[0] == c and t[1] == int(first[0])]
    for tokens, ids, probs in ((at1, first, p1), (at2, second, p2)):
        assert len(tokens) > 150
        counts = torch.tensor([tokens.count(int(t)) for t in ids], dtype=torch.float64)
        assert counts.sum() == len(tokens), "a token outside the target's top 5 came out"
        stat, df = chi_square(counts, probs)
        assert stat < CHI2_999[df], (counts.tolist(), probs.tolist())


def run_seeded(engine, prompt: list[int], seeds, **params) -> list[list[int]]:
    """The tokens of one request per seed, queued 500 at a time (the queue holds 1024)."""
    seeds, tokens = list(seeds), []
    for start in range(0, len(seeds), 500):
        collectors = {seed: Collector() for seed in seeds[start : start + 500]}
        for seed, collector in collectors.items():
            engine.add_request(f"seeded-{seed}", prompt, SamplingParams(seed=seed, **params), collector)
        tokens += [c.wait() and c.token_ids() for c in collectors.values()]
    return tokens
