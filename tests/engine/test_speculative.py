"""Speculative decoding (--speculative-config): what a caller notices. The same greedy tokens with
and without it (batched, chunked, cached, stopped, cut by max_tokens, n > 1, preempted), the same
seeded samples, the target's distribution under rejection sampling, refusals naming the field,
and every block freed. Every equality test also checks that drafts were accepted, so a
speculator that never speculates cannot pass it."""

import copy
import json
import re
import shutil

import pytest
import torch

from tests.engine.conftest import Collector, generate, make_engine, wait_idle
from xserv_engine.engine.block_manager import BlockManager
from xserv_engine.engine.sequence import Sequence
from xserv_engine.engine.spec_payoff import Payoff
from xserv_engine.engine.speculative import (SpeculativeConfig, Speculator, ngram_propose, parse_speculative_config,
                                             rejection_sample, verify)
from xserv_engine.errors import InvalidRequest
from xserv_engine.layers.sampler import Sampler
from xserv_engine.sampling_params import SamplingParams
from xserv_engine.structured.constraint import JSON_OBJECT, REGEX, Constraint

# the tests that count drafts turn the payoff rule off: it decides by wall time
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "disable_when_slower": False})
LOOP = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]  # repeats: the lookup has something to propose at once
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(demo_dir):
    """(plain, speculating) engines on the demo model (bf16, like a served checkpoint)."""
    plain = make_engine(demo_dir, max_model_len=512, dtype="auto")
    fast = make_engine(demo_dir, max_model_len=512, dtype="auto", speculative_config=NGRAM)
    yield plain, fast
    plain.shutdown()
    fast.shutdown()


def accepted(engine) -> int:
    return engine.stats().spec.num_accepted_tokens


def run_all(engine, prompts, **params) -> list[list[int]]:
    """Every prompt at once (one batch), each choice's tokens."""
    collectors = [Collector(params.get("n", 1)) for _ in prompts]
    for i, (prompt, collector) in enumerate(zip(prompts, collectors)):
        engine.add_request(f"batch-{id(collectors)}-{i}", prompt, SamplingParams(**params), collector)
    return [[c.wait() and c.token_ids(j) for j in range(params.get("n", 1))] for c in collectors]


# ---- configuration ----

@pytest.mark.parametrize("text, field", [
    ('{"method": "medusa", "num_speculative_tokens": 4}', "speculative_config.method"),
    ('{"method": "ngram"}', "speculative_config.num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "speculative_config.num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 17}', "speculative_config.num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": "4"}', "speculative_config.num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 3, "prompt_lookup_max": 2}',
     "speculative_config.prompt_lookup_max"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "lookahead": 2}', "speculative_config.lookahead"),
    ('{"method": "draft_model", "num_speculative_tokens": 4}', "speculative_config.model"),
    ('{"method": "ngram", "model": "/models/Qwen3-0.6B", "num_speculative_tokens": 4}', "speculative_config.model"),
    ('{"model": 7, "num_speculative_tokens": 4}', "speculative_config.model"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "disable_when_slower": 0}',
     "speculative_config.disable_when_slower"),
    ("ngram", "speculative_config"),
    ("[4]", "speculative_config"),
])
def test_a_bad_configuration_is_refused_naming_the_field(text, field):
    with pytest.raises(InvalidRequest) as err:
        parse_speculative_config(text)
    assert err.value.field == field


def test_a_good_configuration_fills_vllms_defaults():
    config = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}')
    assert config == SpeculativeConfig("ngram", 3, prompt_lookup_max=5, prompt_lookup_min=2)
    assert parse_speculative_config(None) is None
    draft = parse_speculative_config('{"model": "/models/Qwen3-0.6B", "num_speculative_tokens": 4}')
    assert (draft.method, draft.model) == ("draft_model", "/models/Qwen3-0.6B")


def test_the_engine_refuses_a_bad_configuration_before_loading(tied_model_dir):
    with pytest.raises(InvalidRequest) as err:
        make_engine(tied_model_dir, speculative_config='{"method": "ngram", "num_speculative_tokens": 99}')
    assert err.value.field == "speculative_config.num_speculative_tokens"


def test_a_draft_model_of_another_vocabulary_or_none_at_all_is_refused(tied_model_dir, tmp_path):
    other = tmp_path / "other-vocab"
    shutil.copytree(tied_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 32000}))
    for path, words in ((other, "vocabulary has 32000 tokens"), (tmp_path / "missing", "does not exist")):
        with pytest.raises(InvalidRequest) as err:
            make_engine(tied_model_dir, speculative_config=json.dumps({"model": str(path), "num_speculative_tokens": 2}))
        assert err.value.field == "speculative_config.model" and words in str(err.value)


# ---- the n-gram lookup ----

@pytest.mark.parametrize("tokens, expected", [
    ([1, 2, 3, 9, 1, 2], [3, 9, 1, 2]),  # what followed the earlier "1 2"
    ([5, 1, 2, 7, 1, 2, 8, 1, 2], [8, 1, 2, 8]),  # the latest occurrence, copied on into its own output
    ([7, 7, 7, 7], [7, 7, 7, 7]),  # a loop shorter than k still gives k drafts
    ([1, 2, 3, 4], []),  # nothing repeats
])
def test_ngram_lookup_proposes_what_followed_the_latest_match(tokens, expected):
    assert ngram_propose(tokens, 4, 2, 4) == expected


def test_the_longest_ngram_wins():
    # "3 4" last occurred before 9, but "2 3 4" (longer) only before 5
    assert ngram_propose([2, 3, 4, 5, 6, 3, 4, 9, 2, 3, 4], 2, 2, 4) == [5, 6]


def test_speculation_turns_off_past_the_batch_size_rule():
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=2))
    assert [speculator.budget(n) for n in (1, 2, 3, 64)] == [4, 4, 0, 0]


def test_a_sequence_whose_drafts_keep_failing_backs_off():
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=4))
    blocks = BlockManager(8, 16)
    seq = Sequence(LOOP, SamplingParams(), 16)
    blocks.allocate(seq)
    speculator.propose([seq], [4], blocks)
    assert seq.spec_token_ids == [4, 5, 1, 2]
    speculator.record(seq, 4, 0)
    speculator.record(seq, 4, 0)  # two misses running: a pause
    seq.spec_token_ids = []  # as the scheduler clears them before each step
    speculator.propose([seq], [4], blocks)
    assert seq.spec_token_ids == []
    assert speculator.stats.num_draft_tokens == 8 and speculator.stats.num_accepted_tokens == 0


class CountingDraft:
    """A draft model's stand-in: proposes as many drafts as it is asked for, and counts them."""

    def __init__(self):
        self.asked = []

    def catch_up(self, seqs):
        pass

    def propose(self, seqs, rooms):
        self.asked.append(list(rooms))
        return [[7] * room for room in rooms]


def test_a_draft_model_probes_with_one_draft_until_one_stands():
    """Each of a draft model's drafts costs a step of its own: one at first and after a miss,
    all k after an accepted one; two misses running pause the sequence."""
    draft = CountingDraft()
    speculator = Speculator(SpeculativeConfig(method="draft_model", model="draft", num_speculative_tokens=4), draft)
    blocks = BlockManager(8, 16)
    seq = Sequence(LOOP, SamplingParams(), 16)
    blocks.allocate(seq)
    for accepted_drafts in (1, 0, 1, 0, 0):
        speculator.propose([seq], [4], blocks)
        speculator.record(seq, len(seq.spec_token_ids), accepted_drafts)
        seq.spec_token_ids = []
    assert draft.asked == [[1], [4], [1], [4], [1]]
    speculator.propose([seq], [4], blocks)
    assert seq.spec_token_ids == [] and len(draft.asked) == 5  # paused


# ---- the payoff rule: speculate where it is measured faster ----

def drive(payoff: Payoff, size: int, steps: int, plain_s: float, speculating_s: float, tokens: int) -> list[bool]:
    """`steps` decode steps of `size` rows: a plain one takes plain_s and emits `size` tokens, a
    speculating one speculating_s and `tokens`; which of them speculated."""
    chosen = []
    for _ in range(steps):
        speculating = payoff.speculate(size)
        payoff.observe(size, speculating, speculating_s if speculating else plain_s, tokens if speculating else size)
        chosen.append(speculating)
    return chosen


def test_speculation_that_costs_more_than_it_earns_is_tried_less_and_less():
    payoff = Payoff()
    chosen = drive(payoff, 1, 1000, plain_s=0.010, speculating_s=0.030, tokens=2)  # 15 ms a token against 10
    assert chosen[:3] == [True] * 3 and chosen[3:6] == [False] * 3  # each side measured
    assert sum(chosen[:100]) < 20 and sum(chosen[500:]) <= 2 * 3  # trials, ever further apart
    assert payoff.speedup(1) == pytest.approx(10 / 15)
    assert drive(payoff, 4, 20, plain_s=0.012, speculating_s=0.020, tokens=12).count(True) > 15  # another size


def test_speculation_that_pays_stays_on_and_a_change_of_workload_is_followed():
    payoff = Payoff()
    chosen = drive(payoff, 1, 600, plain_s=0.010, speculating_s=0.015, tokens=4)
    assert sum(chosen[6:]) > 0.97 * len(chosen[6:])  # plain decoding tried now and then
    chosen = drive(payoff, 1, 600, plain_s=0.010, speculating_s=0.015, tokens=1)  # the drafts stop standing
    assert sum(chosen[300:]) < 0.05 * 300


class Clock:
    """A clock an engine step advances by STEP_S, and a lookup costs LOOKUP_S on."""
    STEP_S, LOOKUP_S = 0.01, 0.5

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += self.STEP_S / 2  # read twice a step
        return self.now


def test_the_engine_turns_off_a_lookup_that_is_measured_slower_and_keeps_greedy_output(demo_dir, engines, monkeypatch):
    """With lookups that cost 50 steps each, drafts that stand still lose: the engine speculates
    in a few steps of hundreds, and its greedy output is plain decoding's all the same."""
    import xserv_engine.engine.speculative as speculative

    clock, lookup = Clock(), speculative.ngram_propose

    def slow_lookup(*args):
        clock.now += Clock.LOOKUP_S
        return lookup(*args)

    monkeypatch.setattr(speculative, "ngram_propose", slow_lookup)
    engine = make_engine(demo_dir, max_model_len=512, dtype="auto",
                         speculative_config='{"method": "ngram", "num_speculative_tokens": 4}')
    try:
        speculator = engine.engine.speculator
        speculator.clock = clock
        tokens = generate(engine, LOOP, max_tokens=300, **GREEDY).token_ids()
        assert tokens == generate(engines[0], LOOP, max_tokens=300, **GREEDY).token_ids()
        verifications = engine.stats().spec.num_drafts
        assert 0 < verifications < 30 and speculator.payoff.speedup(1) < 1
        wait_idle(engine)
    finally:
        engine.shutdown()


# ---- exactness through the engine ----

def test_greedy_output_is_identical_and_drafts_are_accepted(engines):
    plain, fast = engines
    before = accepted(fast)
    for prompt in (LOOP, "hello hello hello", list(range(2000, 2040))):
        assert generate(fast, prompt, max_tokens=60, **GREEDY).token_ids() == \
            generate(plain, prompt, max_tokens=60, **GREEDY).token_ids()
    assert accepted(fast) - before > 30
    wait_idle(fast)


@pytest.mark.parametrize("model", ["tied", "untied"])
def test_greedy_output_is_identical_on_the_fp32_test_models(hf_models, model):
    model_dir = hf_models(model == "tied")[0]
    plain, fast = make_engine(model_dir), make_engine(model_dir, speculative_config=NGRAM)
    try:
        prompts = [LOOP, [7] * 20, list(range(3000, 3030)) * 2]
        assert run_all(fast, prompts, max_tokens=40, **GREEDY) == run_all(plain, prompts, max_tokens=40, **GREEDY)
        assert fast.stats().spec.num_draft_tokens > 0
        wait_idle(fast)
    finally:
        plain.shutdown()
        fast.shutdown()


def test_batched_n2_chunked_and_cached_prompts_give_the_same_tokens(demo_dir, engines):
    plain, _ = engines
    chunked = make_engine(demo_dir, max_model_len=512, dtype="auto", speculative_config=NGRAM,
                          max_num_batched_tokens=16)  # every prompt prefilled in 16-token chunks
    try:
        prompts = [LOOP * 3, "hello hello hello", list(range(2000, 2040)), LOOP * 3]  # the last one: cached
        expected = run_all(plain, prompts, max_tokens=48, n=2, **GREEDY)
        assert run_all(chunked, prompts, max_tokens=48, n=2, **GREEDY) == expected
        assert accepted(chunked) > 20
        assert chunked.stats().prefix_cache_hits > 0
        wait_idle(chunked)
    finally:
        chunked.shutdown()


def test_max_tokens_and_stops_inside_an_accepted_run_end_it_there(engines):
    plain, fast = engines
    full = generate(plain, LOOP, max_tokens=40, **GREEDY)
    before = accepted(fast)
    for max_tokens in (1, 2, 3, 5, 7, 11):
        cut = generate(fast, LOOP, max_tokens=max_tokens, **GREEDY)
        assert cut.token_ids() == full.token_ids()[:max_tokens]
        assert cut.final().finish_reason == "length" and cut.final().usage.completion_tokens == max_tokens
    tokens = full.token_ids()
    stop_id = tokens[9]
    stopped = generate(fast, LOOP, max_tokens=40, stop_token_ids=[stop_id], **GREEDY)
    assert stopped.token_ids() == tokens[: tokens.index(stop_id) + 1]
    text = full.text()
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    by_string = generate(fast, LOOP, max_tokens=40, stop=[stop], **GREEDY)
    assert by_string.text() == text[: text.index(stop)]
    assert accepted(fast) > before
    wait_idle(fast)


def test_preemption_with_drafts_keeps_outputs_and_frees_every_block(demo_dir, engines):
    plain, _ = engines
    prompts = [LOOP * 2, [9, 8, 7] * 6, "hello hello hello", list(range(2000, 2020))]
    expected = run_all(plain, prompts, max_tokens=48, **GREEDY)
    small = make_engine(demo_dir, max_model_len=128, dtype="auto", speculative_config=NGRAM, num_kv_blocks=8)
    try:
        assert run_all(small, prompts, max_tokens=48, **GREEDY) == expected
        assert small.stats().preemptions > 0 and accepted(small) > 0
        wait_idle(small)  # every block back, drafts' included
    finally:
        small.shutdown()


def test_an_abort_while_drafting_ends_the_request_and_frees_its_blocks(engines):
    _, fast = engines
    before = accepted(fast)
    collector = Collector()
    aborted = []

    def on_output(out):
        collector(out)
        if sum(len(o.token_ids) for o in collector.outputs) >= 20 and not aborted:
            aborted.append(fast.abort("spec-abort"))

    fast.add_request("spec-abort", LOOP, SamplingParams(max_tokens=400, **GREEDY), on_output)
    outputs = collector.wait()
    assert aborted == [True] and outputs[-1].finish_reason == "abort"
    assert sum(len(o.token_ids) for o in outputs) < 400 and accepted(fast) > before
    wait_idle(fast)


def test_seeded_samples_are_the_same_with_and_without_speculation(engines):
    plain, fast = engines
    before = fast.stats().spec
    # low temperatures on a looping prompt: drafts are sometimes right and sometimes not (0.05:
    # sampled rows that loop as greedy ones do, so drafts are proposed whatever ran before)
    for params in (dict(temperature=0.05, seed=1), dict(temperature=0.3, seed=5),
                   dict(temperature=0.5, top_p=0.9, top_k=20, seed=9),
                   dict(temperature=0.3, repetition_penalty=1.05, min_tokens=30, seed=2)):
        assert generate(fast, LOOP, max_tokens=48, ignore_eos=True, **params).token_ids() == \
            generate(plain, LOOP, max_tokens=48, ignore_eos=True, **params).token_ids()
    assert fast.stats().spec.num_draft_tokens > before.num_draft_tokens
    wait_idle(fast)


def test_logprobs_are_the_targets_for_accepted_tokens(engines):
    plain, fast = engines
    before = accepted(fast)
    a = generate(fast, LOOP, max_tokens=24, logprobs=True, top_logprobs=2, **GREEDY)
    b = generate(plain, LOOP, max_tokens=24, logprobs=True, top_logprobs=2, **GREEDY)
    assert accepted(fast) > before
    got = [lp for o in a.outputs for lp in o.logprobs]
    want = [lp for o in b.outputs for lp in o.logprobs]
    assert [e.token_id for e in got] == [e.token_id for e in want] == a.token_ids()
    # checked in one chunk instead of one token at a time: bf16 rounding apart, the same numbers
    assert [e.logprob for e in got] == pytest.approx([e.logprob for e in want], abs=0.05)


def test_grammar_rows_speculate_within_their_grammar_and_give_the_same_tokens(engines):
    """A regex that loops: its drafts stand (the grammar allows them); a JSON object and a regex
    that the looping prompt's drafts break: those drafts are cut where the grammar refuses them.
    Each beside an unconstrained looping row, and each equal to plain decoding, token for token."""
    plain, fast = engines
    cases = [("Say hello:", Constraint(REGEX, "(hello )+")), ("JSON please:", Constraint(JSON_OBJECT)),
             (LOOP, Constraint(REGEX, "[a-z]+( [a-z]+)*"))]
    for prompt, constraint in cases:
        params = dict(max_tokens=40, temperature=0.0, constraint=constraint)
        expected = generate(plain, prompt, **params)
        before = fast.stats().spec
        mixed = [Collector(), Collector()]
        fast.add_request(f"grammar-{id(mixed)}", prompt, SamplingParams(**params), mixed[0])
        fast.add_request(f"loop-{id(mixed)}", LOOP, SamplingParams(max_tokens=40, **GREEDY), mixed[1])
        assert mixed[0].wait() and mixed[0].token_ids() == expected.token_ids()
        assert mixed[1].wait() and mixed[1].token_ids() == generate(plain, LOOP, max_tokens=40, **GREEDY).token_ids()
        assert fast.stats().spec.num_accepted_tokens > before.num_accepted_tokens
        if constraint.kind == REGEX:
            assert re.fullmatch(constraint.spec, mixed[0].text()) or mixed[0].final().finish_reason == "length"
    alone = generate(fast, "Say hello:", max_tokens=40, temperature=0.0, constraint=cases[0][1])
    assert alone.final().spec_tokens[1] > 0  # the looping regex's own drafts stood
    wait_idle(fast)
    assert fast.structured.num_active == 0


def test_counters_and_the_request_output_report_acceptance(engines):
    _, fast = engines
    before = fast.stats().spec
    result = generate(fast, LOOP, max_tokens=40, **GREEDY)
    after = fast.stats().spec
    drafted, kept = result.final().spec_tokens
    assert 0 < kept <= drafted
    assert after.num_draft_tokens - before.num_draft_tokens == drafted
    assert after.num_accepted_tokens - before.num_accepted_tokens == kept
    assert sum(after.accepted_per_pos) - sum(before.accepted_per_pos) == kept
    assert after.accepted_per_pos[0] >= after.accepted_per_pos[-1]
    assert json.loads(fast.model_info().speculative_config)["num_speculative_tokens"] == 4


# ---- the target's distribution ----

CHI2_999 = {4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}  # chi-square quantiles at 0.999 by degrees of freedom


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    keep = probs > 0
    expected = probs[keep] * counts.sum()
    assert counts[~keep].sum() == 0, "a token outside the target's support came out"
    return float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.8),
                                    dict(temperature=1.3, top_k=5)], ids=["t1", "top_p", "top_k"])
def test_rejection_sampling_keeps_the_targets_distribution(params):
    """Many draws of a 3-draft verification over fixed logits: the first token follows the
    target's (tempered, truncated) distribution at position 0, and after an accepted first draft
    the second follows position 1's, whatever the drafts are."""
    torch.manual_seed(0)
    vocab, draws = 8, 6000
    logits = torch.randn(4, vocab) * 1.5
    drafts = [int(logits[0].argmin()), 3, 5]  # the first draft unlikely: rejections must be handled too
    sampler = Sampler(eos_token_ids=(vocab - 1,))
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    for _, token, rest in verified_draws(sampler, logits, params, draws, lambda seq: drafts):
        first[token] += 1
        if token != drafts[0]:  # a rejected draft ends the step's tokens
            assert rest == []
        else:  # position 1's logits hold after the first draft: the next token is drawn from them
            second[rest[0][0]] += 1
    for counts, row in ((first, 0), (second, 1)):
        probs = target_probs(logits[row], params)
        if counts.sum() < 200:
            counts, probs = probs_draws(sampler, logits, params, drafts)  # the first draft is rare: force it
        stat, df = chi_square(counts, probs)
        assert stat < CHI2_999.get(df, 30.0), (row, counts.tolist(), probs.tolist())


def probs_draws(sampler, logits, params, drafts):
    """Draws of position 1 with a first draft that always stands (its logit made huge)."""
    logits = logits.clone()
    logits[0, drafts[0]] = 1e4
    counts = torch.zeros(logits.shape[1])
    for _, token, rest in verified_draws(sampler, logits[:3], params, 3000, lambda seq: drafts[:2]):
        assert token == drafts[0]
        counts[rest[0][0]] += 1
    return counts, target_probs(logits[1], params)


def verified_draws(sampler, logits, params, draws, draft, batch=500):
    """(seq, its first token, its spec tokens) of `draws` verifications of one sequence over the
    same logits [k + 1, V], `batch` sequences to a verify (draft(seq) sets seq's drafts)."""
    for start in range(0, draws, batch):
        seqs = [Sequence([0, 1], SamplingParams(**params, ignore_eos=True), block_size=16)
                for _ in range(min(batch, draws - start))]
        for seq in seqs:
            seq.spec_token_ids = draft(seq)
        out = verify(sampler, logits.repeat(len(seqs), 1), seqs)
        yield from ((seq, out.token_ids[j], out.spec_tokens[seq.seq_id]) for j, seq in enumerate(seqs))


def target_probs(row: torch.Tensor, params: dict) -> torch.Tensor:
    """The distribution plain sampling draws from: softmax at the temperature, cut to the top k,
    then to the nucleus (the likeliest tokens whose mass before them is at most top_p)."""
    probs = torch.softmax(row.double() / params.get("temperature", 1.0), dim=-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[order[: params.get("top_k", len(row))]] = True
    sorted_probs = torch.where(keep, probs, 0.0)[order]
    before = sorted_probs.cumsum(0) - sorted_probs
    keep[order[before > params.get("top_p", 1.0)]] = False
    probs = torch.where(keep, probs, 0.0)
    return probs / probs.sum()


PARAMS = [dict(temperature=1.0), dict(temperature=0.7, top_p=0.8), dict(temperature=1.3, top_k=5)]


@pytest.mark.parametrize("params", PARAMS + [dict(temperature=0.9, min_p=0.2, repetition_penalty=1.3)],
                         ids=["t1", "top_p", "top_k", "min_p"])
def test_the_samplers_distribution_is_what_it_draws_from(params):
    """Sampler.distribution, which rejection sampling compares, against the distribution plain
    sampling draws from, written out here: penalties, temperature, top-k, min-p, top-p; in a
    batch with a row of other parameters."""
    torch.manual_seed(1)
    logits = torch.randn(3, 50) * 2
    row_params = [params, dict(temperature=0.8), params]
    seqs = [Sequence([0, 1, 7], SamplingParams(**p, ignore_eos=True), block_size=16) for p in row_params]
    probs, _ = Sampler(eos_token_ids=(49,)).distribution(logits, seqs)
    for row, (seq, p) in enumerate(zip(seqs, row_params)):
        adjusted = logits[row].clone()
        penalty = p.get("repetition_penalty", 1.0)
        for t in set(seq.token_ids):
            adjusted[t] = adjusted[t] / penalty if adjusted[t] > 0 else adjusted[t] * penalty
        expected = target_probs(adjusted, p)
        if p.get("min_p"):
            expected = torch.where(expected >= p["min_p"] * expected.max(), expected, 0.0)
            expected /= expected.sum()
        assert torch.allclose(probs[row].double(), expected, atol=1e-6)


@pytest.mark.parametrize("params", PARAMS, ids=["t1", "top_p", "top_k"])
def test_drafts_drawn_from_a_draft_distribution_keep_the_targets(params):
    """Drafts drawn from another distribution q (a draft model's) and verified by min(1, p/q) with
    the residual max(0, p - q) on rejection: the first token follows the target's distribution
    at position 0, and after an accepted first draft the second follows position 1's. Both
    would fail if a rejected draft's position drew from p instead of the residual."""
    torch.manual_seed(0)
    vocab, draws = 8, 6000
    logits = torch.randn(3, vocab) * 1.5
    q = torch.softmax(torch.randn(2, vocab), dim=-1)  # far from p: many rejections
    sampler = Sampler(eos_token_ids=(vocab - 1,))
    first, second = torch.zeros(vocab), torch.zeros(vocab)

    def draft(seq):
        seq.spec.draft_probs = q
        return torch.multinomial(q, 1).squeeze(1).tolist()

    for seq, token, rest in verified_draws(sampler, logits, params, draws, draft):
        first[token] += 1
        if rest:  # the first draft stood: the next token is position 1's
            assert token == seq.spec_token_ids[0]
            second[rest[0][0]] += 1
        assert seq.spec.draft_probs is None  # used once
    for counts, row in ((first, 0), (second, 1)):
        assert counts.sum() > 500
        stat, df = chi_square(counts, target_probs(logits[row], params))
        assert stat < CHI2_999.get(df, 30.0), (row, counts.tolist())


def test_rejection_sampling_accepts_a_draft_that_matches_the_target():
    """q == p: every draft stands (k + 1 tokens a step); q far from p: some are refused."""
    p = torch.softmax(torch.randn(4, 10), dim=-1)
    g = torch.Generator().manual_seed(3)
    for _ in range(50):
        drafts = torch.multinomial(p[:3], 1, generator=g).squeeze(1).tolist()
        assert rejection_sample(p, p[:3], drafts, g)[0] == 3
    far = torch.zeros(3, 10)
    far[:, 9] = 1.0
    p[:, 9] = 1e-6
    p /= p.sum(dim=-1, keepdim=True)
    m, token = rejection_sample(p, far, [9, 9, 9], g)
    assert m == 0 and token != 9


# ---- a draft model ----

def draft_config(path) -> str:
    return json.dumps({"model": str(path), "num_speculative_tokens": 3, "disable_when_slower": False})


def test_a_draft_model_gives_the_same_greedy_tokens_and_reproducible_samples(hf_models):
    """The untied test model drafts for the tied one (same vocabulary, other weights: drafts often
    wrong), and the tied one for itself (always right): greedy output is plain decoding's either
    way; seeded samples come out the same run after run, and the model drafting for itself has its
    sampled drafts accepted (q == p), where one-hot drafts at t=0.8 would rarely be."""
    target, other = hf_models(True)[0], hf_models(False)[0]
    plain = make_engine(target)
    try:
        prompts = [LOOP, list(range(3000, 3030)), "hello world"]
        greedy = run_all(plain, prompts, max_tokens=40, **GREEDY)
        for draft in (other, target):
            fast = make_engine(target, speculative_config=draft_config(draft))
            try:
                assert run_all(fast, prompts, max_tokens=40, **GREEDY) == greedy
                stats = fast.stats().spec
                assert stats.num_draft_tokens > 0
                if draft == target:  # the model drafting for itself: its greedy drafts stand
                    assert stats.num_accepted_tokens > 0.9 * stats.num_draft_tokens
                before = copy.deepcopy(fast.stats().spec)
                seeded = [[generate(fast, p, max_tokens=40, temperature=0.8, seed=4, ignore_eos=True).token_ids()
                           for p in prompts] for _ in range(2)]
                assert seeded[0] == seeded[1]
                stats = fast.stats().spec
                drafted = stats.num_draft_tokens - before.num_draft_tokens
                assert drafted > 0
                if draft == target:
                    assert stats.num_accepted_tokens - before.num_accepted_tokens > 0.8 * drafted
                assert json.loads(fast.model_info().speculative_config)["method"] == "draft_model"
                wait_idle(fast)
            finally:
                fast.shutdown()
    finally:
        plain.shutdown()


def test_a_draft_model_under_preemption_keeps_outputs_and_frees_every_block(tied_model_dir):
    prompts = [LOOP * 2, [9, 8, 7] * 6, list(range(2000, 2020)), [5] * 10]
    plain = make_engine(tied_model_dir)
    small = make_engine(tied_model_dir, num_kv_blocks=10, max_model_len=128,
                        speculative_config=draft_config(tied_model_dir))
    try:
        assert run_all(small, prompts, max_tokens=60, **GREEDY) == run_all(plain, prompts, max_tokens=60, **GREEDY)
        assert small.stats().preemptions > 0 and accepted(small) > 0
        wait_idle(small)
    finally:
        plain.shutdown()
        small.shutdown()
