"""The llguidance backend: reads the model's tokenizer.json itself (no transformers), compiles a
constraint in about a millisecond and fills token masks in Rust with the GIL released."""

import json

import llguidance
# llguidance.numpy, not llguidance.torch: the latter runs torch.compile at import, which races
# with other threads importing torch._dynamo (the backend loads on its own thread)
import llguidance.numpy as llg_numpy
import numpy as np

from xserv_engine.errors import InvalidRequest
from xserv_engine.structured.backend import Grammar, GrammarBackend, Matcher
from xserv_engine.structured.constraint import CHOICE, GRAMMAR, JSON_OBJECT, JSON_SCHEMA, REGEX, Constraint


# llguidance's slicer: a slice's tokens are allowed at once, without walking the token trie, where
# the lexer allows every string the slice's regex matches. Its defaults cover unbounded JSON strings
# ({1,10}, {1,30}, +); these add the short bounded ones (a "maxLength": 8 string after 3 characters
# allows exactly {0,5} more), where the masks are the slowest: up to ~1 ms each on Qwen's 151k
# vocabulary. Masks stay the same, bit for bit; each costs 28 % less on average over a JSON answer
# with 8-character strings (tests/structured/test_grammars.py checks the masks).
_STRING_CHAR = r'[^"\\\x00-\x1F\x7F]'  # a character of a JSON string that needs no escape
SLICES = ([r"[\x20\x0A\x0D\x09]+"] + [f"{_STRING_CHAR}{{1,{n}}}" for n in (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 30)]
          + [f"{_STRING_CHAR}+"])


class LLGuidanceMatcher(Matcher):
    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self.ll = matcher
        self.vocab_size = vocab_size  # the tokenizer's: the model's rows may be wider

    def accept(self, token_id: int) -> bool:
        return self.ll.consume_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        assert self.ll.rollback(num_tokens), self.ll.get_error()

    def valid_prefix(self, token_ids: list[int]) -> int:
        # validate_tokens errs the matcher on an id past the tokenizer's vocabulary (a random
        # draft model can propose one): stop before it
        inside = next((j for j, t in enumerate(token_ids) if t >= self.vocab_size), len(token_ids))
        return self.ll.validate_tokens(token_ids[:inside]) if inside else 0

    @property
    def checks_tokens(self) -> bool:
        # Where the grammar forces bytes, llguidance's mask holds only their canonical tokens
        # ('{"' but not '{'), while validate_tokens takes any token the bytes allow; after the
        # grammar's end the mask holds end-of-sequence only. Elsewhere the two agree token for
        # token (tests/structured/test_drawn_first.py compares them over the whole vocabulary).
        return not self.ll.is_stopped() and not self.ll.compute_ff_bytes()

    def allows(self, token_id: int) -> bool:
        # an id past the tokenizer's vocabulary (a padded row of the LM head) is never in the
        # mask, and validate_tokens would put the matcher in an error state
        return token_id < self.vocab_size and self.ll.validate_tokens([token_id]) == 1

    def copy_after(self, token_ids: list[int]) -> "LLGuidanceMatcher":
        copy = self.ll.deep_copy()
        assert copy.consume_tokens(token_ids), copy.get_error()
        return LLGuidanceMatcher(copy, self.vocab_size)

    @property
    def is_finished(self) -> bool:
        return self.ll.is_stopped()


class LLGuidanceGrammar(Grammar):
    def __init__(self, template: llguidance.LLMatcher, vocab_size: int):
        self._template = template  # never advanced: every matcher starts as a copy of it
        self._vocab_size = vocab_size

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._template.deep_copy(), self._vocab_size)


class LLGuidanceBackend(GrammarBackend):
    def __init__(self, tokenizer_json: str, eos_token_ids: list[int]):
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, eos_token=list(eos_token_ids), slices=SLICES)
        self._executor = llguidance.LLExecutor()
        self._words = llg_numpy.get_bitmask_shape(1, self.tokenizer.vocab_size)[1]

    @property
    def bitmask_words(self) -> int:
        return self._words

    def compile(self, constraint: Constraint) -> LLGuidanceGrammar:
        template = llguidance.LLMatcher(self.tokenizer, _grammar_text(constraint), log_level=0)
        if template.is_error():
            raise InvalidRequest(constraint.error_field, f"cannot be enforced: {template.get_error().strip()}")
        return LLGuidanceGrammar(template, self.tokenizer.vocab_size)

    def fill_bitmask(self, matchers: list[tuple[Matcher, int]], bitmask: np.ndarray) -> None:
        llg_numpy.fill_next_token_bitmask_par(self._executor, [(m.ll, i) for m, i in matchers], bitmask)


def _grammar_text(c: Constraint) -> str:
    if c.kind == JSON_SCHEMA:
        return _json_grammar(_parse_schema(c), c.whitespace_flexible)
    if c.kind == JSON_OBJECT:
        return _json_grammar({"type": "object"}, c.whitespace_flexible)
    if c.kind == REGEX:
        return llguidance.LLMatcher.grammar_from_regex(c.spec)
    if c.kind == GRAMMAR:
        return llguidance.LLMatcher.grammar_from_lark(c.spec)
    assert c.kind == CHOICE
    if not c.spec or not all(c.spec):
        raise InvalidRequest(c.error_field, "must list at least one choice, and no empty one")
    alternatives = " | ".join(json.dumps(option, ensure_ascii=False) for option in c.spec)
    return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")


def _parse_schema(c: Constraint) -> dict | bool:
    try:
        schema = json.loads(c.spec)
    except ValueError as exc:
        raise InvalidRequest(c.error_field, f"is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest(c.error_field, "must be a JSON object (a JSON schema)")
    return schema


def _json_grammar(schema: dict | bool, whitespace_flexible: bool) -> str:
    # Unimplemented schema keywords are errors, never silently dropped (lenient stays off).
    return llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": whitespace_flexible})
