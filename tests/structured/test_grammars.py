"""The llguidance backend on its own: what compiles, what the mask allows, forced tool calls and
where the constraint starts in a Qwen3 prompt."""

import json
import random
from dataclasses import replace

import llguidance
import numpy as np
import pytest
import torch

from tests.structured.conftest import EOS_IDS
from tests.structured.schemas import PERSON_JSON, TOOLS
from tests.tokenizer.test_chat_tokens import QWEN3_TOKENS
from xserv_engine.errors import InvalidRequest
from xserv_engine.inputs import ChatInput
from xserv_engine.structured.bitmask import apply_bitmask, new_bitmask
from xserv_engine.structured.constraint import CHOICE, GRAMMAR, JSON_OBJECT, JSON_SCHEMA, REGEX, Constraint
from xserv_engine.structured.grammar_cache import GrammarCache
from xserv_engine.structured.guide import Phase, SequenceGuide, starting_phase
from xserv_engine.structured.llguidance_backend import LLGuidanceBackend
from xserv_engine.structured.tool_grammar import tool_call_constraint
from xserv_engine.tokenizer.tokenizer import Tokenizer

MODEL_VOCAB = 151936  # the model's logits: wider than the tokenizer's 151669 ids


@pytest.fixture(scope="module")
def tokenizer(demo_dir):
    return Tokenizer.from_dir(demo_dir)


def accepts(backend, tokenizer, constraint: Constraint, text: str) -> bool:
    matcher = backend.compile(constraint).matcher()
    return all(matcher.accept(t) for t in tokenizer.encode(text))


@pytest.mark.parametrize("constraint, keyword", [
    (Constraint(JSON_SCHEMA, '{"type": "array", "uniqueItems": true}'), "uniqueItems"),
    (Constraint(JSON_SCHEMA, '{"not": {"type": "string"}}'), "not"),
    (Constraint(JSON_SCHEMA, '{"type": "string", "format": "no-such-format"}'), "no-such-format"),
    (Constraint(JSON_SCHEMA, '{"type": '), "not valid JSON"),
    (Constraint(JSON_SCHEMA, '[1, 2]'), "JSON object"),
    (Constraint(REGEX, "[a-z"), "unclosed character class"),
    (Constraint(GRAMMAR, "start: missing_rule"), "missing_rule"),
    (Constraint(CHOICE, ()), "at least one choice"),
])
def test_a_constraint_that_cannot_compile_names_its_field_and_the_reason(backend, constraint, keyword):
    with pytest.raises(InvalidRequest) as error:
        backend.compile(constraint)
    assert error.value.field == constraint.kind
    assert keyword in error.value.message


def test_json_is_compact_unless_flexible_whitespace_is_asked_for(backend, tokenizer):
    spaced = '{"a": [1, 2]}'
    assert accepts(backend, tokenizer, Constraint(JSON_OBJECT), '{"a":[1,2]}')
    assert not accepts(backend, tokenizer, Constraint(JSON_OBJECT), spaced)
    assert accepts(backend, tokenizer, Constraint(JSON_OBJECT, whitespace_flexible=True), spaced)


def test_schema_bounds_are_enforced_token_by_token(backend, tokenizer):
    person = Constraint(JSON_SCHEMA, PERSON_JSON)
    ok = '{"name":"Ada","age":36,"role":"admin","tags":["x"],"address":{"city":"Oslo","zip":"01234","floor":3}}'
    assert accepts(backend, tokenizer, person, ok)
    assert not accepts(backend, tokenizer, person, ok.replace('"age":36', '"age":121'))
    assert not accepts(backend, tokenizer, person, ok.replace('"admin"', '"root"'))
    assert not accepts(backend, tokenizer, person, ok.replace('"tags":["x"]', '"tags":[]'))
    assert not accepts(backend, tokenizer, person, ok.replace('"Ada"', '"' + "a" * 13 + '"'))


def test_the_mask_allows_only_the_grammar_s_tokens_and_never_padded_ids(backend, tokenizer):
    matcher = backend.compile(Constraint(CHOICE, ("yes", "no"))).matcher()
    bitmask = new_bitmask(1, backend.bitmask_words)
    backend.fill_bitmask([(matcher, 0)], bitmask)
    logits = torch.zeros(1, MODEL_VOCAB)
    apply_bitmask(logits, bitmask)
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert allowed and all(tokenizer.decode([t]) in ("y", "ye", "yes", "n", "no") for t in allowed)
    assert torch.isinf(logits[0, tokenizer.vocab_size:]).all()


def test_the_added_slices_leave_every_mask_as_llguidance_s_defaults_make_it(backend, demo_dir):
    """SLICES only make masks faster: walked through bounded and unbounded strings, enums,
    numbers and a regex, token by token, each mask equals the one llguidance's own slices give."""
    plain = LLGuidanceBackend((demo_dir / "tokenizer.json").read_text(), EOS_IDS)
    plain.tokenizer = llguidance.LLTokenizer((demo_dir / "tokenizer.json").read_text(), eos_token=EOS_IDS)
    assert backend.tokenizer.vocab_size == plain.tokenizer.vocab_size
    rng = random.Random(0)
    schema = json.dumps({"type": "object", "required": ["a", "b", "c"], "additionalProperties": False, "properties": {
        "a": {"type": "string", "maxLength": 5}, "b": {"type": "array", "items": {"type": "string"}},
        "c": {"type": "string", "minLength": 2, "maxLength": 14}}})
    compared = 0
    for constraint in (Constraint(JSON_SCHEMA, PERSON_JSON), Constraint(JSON_SCHEMA, schema),
                       Constraint(REGEX, r"[A-Z][a-z]{2,8} [0-9]{1,3}")):
        for _ in range(4):  # four random walks, each drawing among the allowed tokens
            ours, theirs = backend.compile(constraint).matcher(), plain.compile(constraint).matcher()
            for _ in range(40):
                masks = []
                for owner, matcher in ((backend, ours), (plain, theirs)):
                    mask = new_bitmask(1, owner.bitmask_words)
                    owner.fill_bitmask([(matcher, 0)], mask)
                    masks.append(mask)
                assert (masks[0] == masks[1]).all()
                compared += 1
                allowed = np.flatnonzero(np.unpackbits(masks[0].view(np.uint8), bitorder="little"))
                token_id = int(rng.choice(list(allowed)))
                if token_id in EOS_IDS:
                    break
                assert ours.accept(token_id) and theirs.accept(token_id)
    assert compared > 100


def test_the_grammar_cache_compiles_a_key_once(backend):
    cache = GrammarCache(capacity=2)
    for _ in range(3):
        cache.get(Constraint(REGEX, "[0-9]+").key, lambda: backend.compile(Constraint(REGEX, "[0-9]+")))
    assert (cache.misses, cache.hits) == (1, 2)
    for pattern in ("a", "b", "c"):
        cache.get(Constraint(REGEX, pattern).key, lambda: backend.compile(Constraint(REGEX, pattern)))
    assert len(cache) == 2


def call(name: str, arguments: dict) -> str:
    """Qwen3's tool-call format, arguments as compact JSON."""
    compact = json.dumps(arguments, separators=(",", ":"))
    return f'<tool_call>\n{{"name": "{name}", "arguments": {compact}}}\n</tool_call>'


def test_required_tool_choice_accepts_qwen_tool_calls_with_valid_arguments_only(backend, tokenizer):
    required = tool_call_constraint(TOOLS, "required", QWEN3_TOKENS)
    weather = call("get_weather", {"city": "Oslo", "unit": "celsius"})
    assert accepts(backend, tokenizer, required, weather)
    assert not accepts(backend, tokenizer, required, weather.replace("celsius", "kelvin"))
    assert not accepts(backend, tokenizer, required, weather.replace("get_weather", "get_news"))
    two = weather + "\n" + call("get_time", {"zone": "UTC"})
    assert accepts(backend, tokenizer, required, two)
    single = tool_call_constraint(TOOLS, "required", QWEN3_TOKENS, parallel_tool_calls=False)
    assert not accepts(backend, tokenizer, single, two)


def test_a_named_tool_choice_allows_that_function_only(backend, tokenizer):
    named = tool_call_constraint(TOOLS, "get_time", QWEN3_TOKENS)
    assert accepts(backend, tokenizer, named, call("get_time", {"zone": "CET"}))
    assert not accepts(backend, tokenizer, named, call("get_weather", {"city": "a", "unit": "celsius"}))


@pytest.mark.parametrize("tools, choice, field", [
    (TOOLS, "get_news", "chat.tool_choice"),
    (None, "required", "chat.tool_choice"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "required", "chat.tools"),
])
def test_a_forced_tool_choice_that_cannot_be_served_names_the_field(tools, choice, field):
    with pytest.raises(InvalidRequest) as error:
        tool_call_constraint(tools, choice, QWEN3_TOKENS)
    assert error.value.field == field


def test_auto_and_none_leave_the_model_free():
    assert tool_call_constraint(TOOLS, "auto", QWEN3_TOKENS) is None
    assert tool_call_constraint(TOOLS, "none", QWEN3_TOKENS) is None


@pytest.mark.parametrize("model, thinking_on", [("demo_dir", Phase.MAY_REASON), ("demo_qwen3_5_dir", Phase.REASONING)],
                         ids=["qwen3", "qwen3_5"])
def test_the_constraint_starts_after_the_reasoning(request, model, thinking_on):
    """Qwen3's template leaves <think> to the model; Qwen3.5's opens it (both in their own ids)."""
    tokenizer = Tokenizer.from_dir(request.getfixturevalue(model))
    tokens = tokenizer.chat_tokens

    def phase(**kwargs):
        prompt = tokenizer.render_chat(ChatInput([{"role": "user", "content": "hi"}], template_kwargs=kwargs))
        return starting_phase(tokenizer.encode(prompt), True, tokens)

    assert phase(enable_thinking=False) is Phase.CONSTRAINED  # the template closed the think block
    assert phase(enable_thinking=True) is thinking_on
    assert starting_phase(tokenizer.encode("<|im_start|>assistant\n<think>\n"), True, tokens) is Phase.REASONING
    assert starting_phase(tokenizer.encode("<think>\n</think><|im_start|>assistant\n"), True, tokens) is \
        Phase.MAY_REASON  # an earlier turn's think block
    assert starting_phase(tokenizer.encode("Hello"), False, tokens) is Phase.CONSTRAINED


def test_reasoning_is_free_and_the_grammar_follows_the_answer_only(backend, tokenizer):
    matcher = backend.compile(Constraint(CHOICE, ("yes",))).matcher()
    guide = SequenceGuide(matcher, Phase.MAY_REASON, QWEN3_TOKENS, tuple(tokenizer.encode("\n\n")), owner=None)
    assert QWEN3_TOKENS.think_start in guide.extra_allowed()
    for token_id in [QWEN3_TOKENS.think_start, *tokenizer.encode("free text, not yes"), QWEN3_TOKENS.think_end]:
        assert not guide.needs_mask or token_id == QWEN3_TOKENS.think_start
        guide.accept(token_id)
    assert guide.needs_mask and guide.extra_allowed() == tuple(tokenizer.encode("\n\n"))
    for token_id in tokenizer.encode("\n\nyes"):
        guide.accept(token_id)
    assert guide.is_complete


def test_without_think_tokens_the_grammar_holds_from_the_first_token(backend, tokenizer):
    no_think = replace(QWEN3_TOKENS, think_start=None, think_end=None)
    guide = SequenceGuide(backend.compile(Constraint(CHOICE, ("yes",))).matcher(), Phase.MAY_REASON, no_think,
                          tuple(tokenizer.encode("\n\n")), owner=None)
    assert guide.needs_mask and guide.extra_allowed() == ()
    for token_id in tokenizer.encode("yes"):
        guide.accept(token_id)
    assert guide.is_complete


def test_a_vocabulary_without_tool_call_tokens_cannot_force_a_call():
    no_calls = replace(QWEN3_TOKENS, tool_call_start=None, tool_call_end=None)
    with pytest.raises(InvalidRequest) as error:
        tool_call_constraint(TOOLS, "required", no_calls)
    assert error.value.field == "chat.tool_choice" and "<tool_call>" in error.value.message
    assert tool_call_constraint(TOOLS, "auto", no_calls) is None


def test_a_matcher_rolls_back_to_take_another_path(backend, tokenizer):
    matcher = backend.compile(Constraint(CHOICE, ("yes", "no"))).matcher()
    [no] = tokenizer.encode("no")
    assert matcher.accept(no) and matcher.is_finished
    matcher.rollback(1)
    assert not matcher.is_finished
    assert all(matcher.accept(t) for t in tokenizer.encode("yes")) and matcher.is_finished
