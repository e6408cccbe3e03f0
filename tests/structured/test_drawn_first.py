"""Constrained rows drawn before their mask (structured/manager.py): the grammar checks the drawn
token and only a refused row is masked and drawn again. What a user would notice if it were wrong:
answers drawn from another distribution than the masked one, or a matcher broken by the check."""

import json
import random
from collections import Counter

import numpy as np
import pytest
import torch

from tests.engine.conftest import Collector, make_engine
from tests.structured.conftest import EOS_IDS, PREFIXES, person_rows
from tests.structured.schemas import PERSON_JSON, TOOLS
from tests.support.scripted_model import write_scripted_model
from tests.tokenizer.test_chat_tokens import QWEN3_TOKENS
from xserv_engine.engine.sequence import Sequence
from xserv_engine.layers.sampler import Sampler
from xserv_engine.sampling_params import SamplingParams
from xserv_engine.structured.bitmask import new_bitmask
from xserv_engine.structured.constraint import CHOICE, JSON_OBJECT, JSON_SCHEMA, REGEX, Constraint
from xserv_engine.structured.guide import Phase
from xserv_engine.structured.manager import TOP_K_CHECKS, StructuredOutputManager, mask_first
from xserv_engine.structured.tool_grammar import tool_call_constraint
from xserv_engine.tokenizer.tool_call_parsers import XML_PARSER
from xserv_engine.tokenizer.tokenizer import Tokenizer

MODEL_VOCAB = 151936  # the model's logits: wider than the tokenizer's 151669 ids
ROLE = '{"name":"Ada","age":36,"role":"'  # an enum's value next: "admin", "user" or "guest"


@pytest.fixture(scope="module")
def tokenizer(demo_dir):
    return Tokenizer.from_dir(demo_dir)


@pytest.fixture
def manager(demo_dir):
    return StructuredOutputManager(demo_dir / "tokenizer.json", EOS_IDS, separator_ids=())


def mask_bits(backend, matcher) -> np.ndarray:
    bitmask = new_bitmask(1, backend.bitmask_words)
    backend.fill_bitmask([(matcher, 0)], bitmask)
    return np.unpackbits(bitmask.view(np.uint8), bitorder="little").astype(bool)


@pytest.mark.parametrize("constraint", [
    Constraint(JSON_SCHEMA, PERSON_JSON),
    Constraint(JSON_OBJECT),
    Constraint(REGEX, r"[A-Z][a-z]{2,8} [0-9]{1,3}"),
    Constraint(CHOICE, ("yes", "no", "maybe not")),
    tool_call_constraint(TOOLS, "required", QWEN3_TOKENS),  # <tool_call> JSON blocks, special tokens included
    tool_call_constraint(TOOLS, "required", QWEN3_TOKENS, parser=XML_PARSER),  # Qwen3-Coder's XML form
], ids=["schema", "json-object", "regex", "choice", "tool-calls", "xml-tool-calls"])
def test_the_check_agrees_with_the_mask_on_every_token(backend, constraint):
    """Along a random walk through the grammar, wherever the matcher says it checks tokens it
    answers exactly as the mask does, over the whole vocabulary and the ids past it (elsewhere
    its rows are masked first); the checks never move or break the matcher."""
    matcher = backend.compile(constraint).matcher()
    short = constraint.kind in (REGEX, CHOICE)  # a few positions long: check each
    rng = random.Random(0)
    checked = unanswered = 0
    for position in range(60):
        bits = mask_bits(backend, matcher)
        if not matcher.checks_tokens:
            unanswered += 1
        elif position % 4 == 0 or short:
            allowed = np.zeros(MODEL_VOCAB, dtype=bool)
            allowed[: min(len(bits), MODEL_VOCAB)] = bits[:MODEL_VOCAB]
            answers = np.array([matcher.allows(t) for t in range(MODEL_VOCAB)])
            assert np.array_equal(answers, allowed), f"position {position}"
            checked += 1
        if matcher.is_finished:
            break
        token_id = rng.choice(np.flatnonzero(bits).tolist())
        assert matcher.accept(token_id), "the checks left the matcher where it was"
    assert checked >= 1 and unanswered >= 1  # both kinds of position were met


def role_rows(manager, tokenizer, count: int, **params) -> list[Sequence]:
    grammar = manager.compile(Constraint(JSON_SCHEMA, PERSON_JSON))
    prefix = tokenizer.encode(ROLE)
    seqs = []
    for i in range(count):
        seq = Sequence([9707], SamplingParams(seed=i, **params), 16)
        seq.guide = manager.guide(grammar, seq.token_ids, is_chat=False, tokens=QWEN3_TOKENS)
        for token_id in prefix:
            seq.append_token(token_id)
            seq.guide.accept(token_id)
        seqs.append(seq)
    return seqs


def test_a_drawn_row_comes_out_as_the_masked_distribution(manager, tokenizer):
    """Rows whose likeliest token the grammar refuses and rows whose likeliest it allows, drawn
    together: each comes out in the masked distribution's proportions, whether a row took its
    first draw, a later one, or was masked."""
    admin, user, guest = (tokenizer.encode(w)[0] for w in ("admin", "user", "guest"))
    refused = tokenizer.encode("hello")[0]
    n = 600
    seqs = role_rows(manager, tokenizer, n, temperature=1.0)
    assert not mask_first(seqs[0])
    logits = torch.full((n, MODEL_VOCAB), -30.0)
    half = n // 2
    logits[:half, refused] = 4.0  # the first half would mostly draw a refused token
    logits[:, admin], logits[:, user], logits[:, guest] = 1.0, 0.0, -1.0
    logits[half:, MODEL_VOCAB - 1] = 0.5  # a padded id past the tokenizer: never allowed
    token_ids = Sampler(EOS_IDS)(logits, seqs).token_ids
    weights = np.exp([1.0, 0.0, -1.0])
    expected = weights / weights.sum()  # the masked distribution: admin 0.67, user 0.24, guest 0.09
    for rows in (token_ids[:half], token_ids[half:]):
        counts = Counter(rows)
        assert set(counts) <= {admin, user, guest}
        for token_id, p in zip((admin, user, guest), expected):
            assert abs(counts[token_id] / half - p) < 4 * np.sqrt(p * (1 - p) / half) + 0.01
    assert manager.drawn_rows == n
    assert half < manager.refused_rows < n  # the first half refused, most of the second drawn as they were
    assert 0 < manager.masked_rows < manager.refused_rows  # some took a later draw, some were masked
    for seq, token_id in zip(seqs, token_ids):
        seq.guide.accept(token_id)  # GrammarViolation if a refused token got through


def test_a_greedy_row_takes_the_masked_argmax(manager, tokenizer):
    admin, user = tokenizer.encode("admin")[0], tokenizer.encode("user")[0]
    seqs = role_rows(manager, tokenizer, 3, temperature=0.0)
    logits = torch.zeros(3, MODEL_VOCAB)
    logits[:, user] = 2.0
    logits[0, admin] = 3.0  # allowed and the argmax: kept
    logits[1, tokenizer.encode("hello")[0]] = 5.0  # refused: the masked argmax is "user"
    logits[2, MODEL_VOCAB - 1] = 5.0  # a padded id: refused without breaking the matcher
    assert Sampler(EOS_IDS)(logits, seqs).token_ids == [admin, user, user]
    assert manager.refused_rows == manager.masked_rows == 2  # a greedy row draws once
    for seq in seqs:
        seq.guide.accept(user)  # the matcher still takes the grammar's tokens (else GrammarViolation)


@pytest.mark.parametrize("params", [dict(top_p=0.9), dict(min_p=0.1), dict(logprobs=True), dict(top_k=5, logprobs=True),
                                    dict(top_k=TOP_K_CHECKS + 1)],
                         ids=["top-p", "min-p", "logprobs", "top-k-logprobs", "large-top-k"])
def test_rows_that_truncate_or_report_logprobs_are_masked_first(manager, tokenizer, params):
    seqs = role_rows(manager, tokenizer, 4, temperature=0.8, **params)
    plain = role_rows(manager, tokenizer, 1, temperature=0.8)[0]
    assert mask_first(seqs[0]) and not mask_first(plain)
    logits = torch.zeros(4, MODEL_VOCAB)
    logits[:, tokenizer.encode("hello")[0]] = 9.0
    for seq, token_id in zip(seqs, Sampler(EOS_IDS)(logits, seqs).token_ids):
        seq.guide.accept(token_id)
    assert manager.drawn_rows == 0


def test_a_model_that_follows_its_grammar_is_never_masked_where_it_draws(demo_dir, tmp_path, tokenizer):
    """A scripted model writing a valid answer at temperature 1: every answer is the script's,
    and no drawn row was refused, so masks were made only where the grammar forces text."""
    answer = '{"city":"Paris","floor":3}'
    trigger = tokenizer.encode(" Answer")[0]
    write_scripted_model(tmp_path, demo_dir, [[trigger, *tokenizer.encode(answer)]])
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "floor"],
              "properties": {"city": {"type": "string", "maxLength": 20}, "floor": {"type": "integer"}}}
    engine = make_engine(tmp_path)
    try:
        params = SamplingParams(temperature=1.0, max_tokens=32, constraint=Constraint(JSON_SCHEMA, json.dumps(schema)))
        collectors = [Collector() for _ in range(8)]
        for i, collector in enumerate(collectors):
            engine.add_request(f"follows-{i}", [9707, trigger], params, collector)
        for collector in collectors:
            collector.wait()
            assert collector.text() == answer and collector.final().finish_reason == "stop"
        structured = engine.structured
        assert structured.drawn_rows >= 8 and structured.refused_rows == 0
    finally:
        engine.shutdown()


def test_a_draft_past_the_vocabulary_stops_the_valid_prefix_and_leaves_the_matcher_usable(backend, tokenizer):
    """A random draft model can propose a padded id (past the tokenizer's): the drafts are cut
    there, and the matcher still takes the grammar's tokens."""
    matcher = backend.compile(Constraint(JSON_SCHEMA, PERSON_JSON)).matcher()
    ids = tokenizer.encode('{"name":"Ada')
    assert matcher.valid_prefix(ids + [MODEL_VOCAB - 1] + ids) == len(ids)
    assert matcher.valid_prefix([MODEL_VOCAB - 1]) == 0
    assert all(matcher.accept(t) for t in ids)


TOP_K_PARAMS = [
    SamplingParams(temperature=0.6, top_k=20, top_p=0.95),  # Qwen3's generation_config
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.0, top_k=50, min_p=0.05),
    SamplingParams(temperature=1.0, top_k=8, repetition_penalty=1.5, logit_bias={90: 5.0, 15: -3.0}),
]


def test_a_top_k_row_draws_what_its_masked_row_draws(manager, tokenizer, monkeypatch):
    """Top-k rows find their k best allowed tokens among their likeliest, unmasked: seeded, they
    draw exactly what the same rows masked first draw, step after step."""
    logits = 1.5 * torch.randn(len(PREFIXES) * len(TOP_K_PARAMS) * 3, MODEL_VOCAB,
                               generator=torch.Generator().manual_seed(0))
    logits[:, tokenizer.encode('"')[0]] += 6.0  # a likely token that most positions refuse
    checked, masked_first = (person_rows(manager, tokenizer, TOP_K_PARAMS, copies=3) for _ in range(2))
    for _ in range(3):
        drawn = Sampler(EOS_IDS)(logits.clone(), checked).token_ids
        with monkeypatch.context() as patch:
            patch.setattr("xserv_engine.structured.manager.mask_first", lambda seq: True)
            reference = Sampler(EOS_IDS)(logits.clone(), masked_first).token_ids
        assert drawn == reference
        for seqs in (checked, masked_first):
            for seq, token_id in zip(seqs, drawn):
                seq.append_token(token_id)
                seq.guide.accept(token_id)  # GrammarViolation if a refused token got through
    assert len(set(drawn)) > len(PREFIXES)  # drawn, not one forced token per prefix
    assert 0 < manager.masked_rows < manager.drawn_rows  # most found their k, some (digits) were masked


def test_seeded_rows_draw_the_same_tokens_again_whatever_was_refused(manager, tokenizer):
    """A seeded row's draws, a refused row's further draws and its masked draw included, are a
    function of its seed and position (speculative decoding verifies several positions in one
    step and must draw at each what plain decoding draws there): the same rows sampled again
    give the same tokens, and other seeds other tokens."""
    logits = torch.full((64, MODEL_VOCAB), -30.0)
    logits[:, tokenizer.encode("hello")[0]] = 3.0  # refused, drawn 87 times in 100: 8 more draws of it, 1 in 3
    for role in ("admin", "user", "guest"):
        logits[:, tokenizer.encode(role)[0]] = 0.0
    drawn = [Sampler(EOS_IDS)(logits.clone(), role_rows(manager, tokenizer, 64, temperature=1.0)).token_ids
             for _ in range(2)]
    assert drawn[0] == drawn[1]
    assert len(set(drawn[0])) == 3 and tokenizer.encode("hello")[0] not in drawn[0]
    assert 0 < manager.masked_rows < manager.refused_rows  # redraws taken, and masked draws


def test_a_draw_of_think_where_the_model_may_reason_is_taken(manager, tokenizer):
    """Thinking on and no token yet: <think> is allowed beside the grammar's first tokens, and a
    draw of it stands; </think> is not, and is masked away."""
    grammar = manager.compile(Constraint(CHOICE, ("yes", "no")))
    prompt = [QWEN3_TOKENS.im_start, *tokenizer.encode("assistant\n")]
    seqs = []
    for _ in range(2):
        seq = Sequence(prompt, SamplingParams(temperature=0.0), 16)
        seq.guide = manager.guide(grammar, prompt, is_chat=True, tokens=QWEN3_TOKENS)
        assert seq.guide.phase is Phase.MAY_REASON and not mask_first(seq)
        seqs.append(seq)
    yes = tokenizer.encode("yes")[0]
    logits = torch.zeros(2, MODEL_VOCAB)
    logits[0, QWEN3_TOKENS.think_start] = 5.0
    logits[1, QWEN3_TOKENS.think_end] = 5.0
    logits[1, yes] = 1.0
    assert Sampler(EOS_IDS)(logits, seqs).token_ids == [QWEN3_TOKENS.think_start, yes]
    assert manager.drawn_rows == 2 and manager.refused_rows == 1
