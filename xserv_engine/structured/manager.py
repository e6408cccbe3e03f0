"""StructuredOutputManager: the engine's one owner of grammars and matchers.

compile() runs on the caller's thread before a request is queued (a bad constraint is the
caller's InvalidRequest); start_fill() runs on the engine thread once a step is scheduled and
fills the step's bitmask on the fill thread while the forward pass runs; apply() runs in the
sampler, for the constrained rows of the step only.

Most constrained rows need no mask at all. A row drawn from softmax(logits / temperature), or
greedily, is drawn first from its whole distribution and the grammar checks the drawn token (under
a microsecond). A refused sampled row draws a few more times (Sampler's REDRAWS) and takes the
first its grammar allows; only a row that draws none, or a refused greedy one, is masked and
drawn again. That is rejection sampling, so exact: an allowed token x comes out with probability
p(x) (1 + (1 - Z) + ... + (1 - Z)^(n-1)) + (1 - Z)^n p(x) / Z = p(x) / Z after n draws, Z being
the allowed mass: the masked distribution's; greedily, an allowed argmax is the masked argmax.
A trained model mostly draws what its grammar allows, and where a random-weight one draws inside
a JSON string half its draws are allowed, so the costliest masks (up to ~1 ms a row on Qwen's
151k vocabulary) are mostly never made. Rows with a top-k, top-p or min-p, or asking for logprobs, are masked first
(mask_first): their truncation and their reported logprobs are of the masked distribution; so
are rows where the grammar forces text (their masks are cheap, and a draw would mostly miss).
"""

import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from xserv_engine.errors import InvalidRequest
from xserv_engine.inputs import ChatInput
from xserv_engine.layers.ops import native
from xserv_engine.structured.backend import GrammarBackend
from xserv_engine.structured.bitmask import Candidates, allow, allowed_ids, apply_bitmask, count_allowed, new_bitmask
from xserv_engine.structured.constraint import Constraint
from xserv_engine.structured.grammar_cache import GrammarCache
from xserv_engine.structured.guide import SequenceGuide, starting_phase
from xserv_engine.structured.tool_grammar import tool_call_constraint
from xserv_engine.tokenizer.chat_tokens import ChatTokens
from xserv_engine.tokenizer.tool_call_parsers import JSON_PARSER

# a constrained top-k row checks this many of its likeliest tokens against its grammar for its k
# best allowed ones (Sampler._allowed_top_k); where fewer are allowed, or k is larger, it is masked
TOP_K_CHECKS = 64
# a row allowing at most this many tokens is sampled among them (a gather) instead of masked
# (passes over the whole vocabulary); in a JSON answer most rows allow a handful
MAX_CANDIDATES = 4096


class StructuredOutputManager:
    def __init__(self, tokenizer_json: Path, eos_token_ids: list[int], separator_ids: tuple[int, ...]):
        self.cache = GrammarCache()
        self.separator_ids = separator_ids
        self._guides: weakref.WeakSet = weakref.WeakSet()  # a failed add_request's guides just vanish
        self.mask_seconds = 0.0  # the sampler's wait for the bitmask and applying it, summed over steps
        self.fill_seconds = 0.0  # filling bitmasks (llguidance): beside the forward pass, and refused rows' after it
        self.mask_steps = 0  # steps with constrained rows
        self.drawn_rows = 0  # constrained rows not masked first (drawn first, or top-k rows checking their likeliest)
        self.refused_rows = 0  # drawn-first rows whose first draw the grammar refused
        self.masked_rows = 0  # rows of drawn_rows masked after all (the rest took a later draw or found their k)
        self._lock = threading.Lock()
        self._filler: ThreadPoolExecutor | None = None  # its thread ends when the manager is collected
        self._pending: tuple[list[SequenceGuide], Future] | None = None
        self._backend: GrammarBackend | None = None
        self._loaded = threading.Event()
        # reading the vocabulary takes about a second: done beside the engine's own start
        self._loader = threading.Thread(target=self._load, args=(tokenizer_json, eos_token_ids),
                                        name="xserv-grammar-load", daemon=True)
        self._loader.start()

    def _load(self, tokenizer_json: Path, eos_token_ids: list[int]) -> None:
        from xserv_engine.structured.llguidance_backend import LLGuidanceBackend

        try:
            self._backend = LLGuidanceBackend(tokenizer_json.read_text(), eos_token_ids)
        finally:
            self._loaded.set()

    @property
    def backend(self) -> GrammarBackend:
        self._loaded.wait()
        if self._backend is None:
            raise RuntimeError("the grammar backend failed to load (see the log)")
        return self._backend

    def compile(self, constraint: Constraint):
        """The compiled grammar (cached by key); InvalidRequest naming the field if it cannot be."""
        backend = self.backend
        return self.cache.get(constraint.key, lambda: backend.compile(constraint))

    def guide(self, grammar, prompt_ids: list[int], is_chat: bool, tokens: ChatTokens) -> SequenceGuide:
        """A sequence's guide through `grammar`; `tokens`: the model's <think> ids, where it starts."""
        phase = starting_phase(prompt_ids, is_chat, tokens)
        guide = SequenceGuide(grammar.matcher(), phase, tokens, self.separator_ids, self)
        with self._lock:
            self._guides.add(guide)
        return guide

    @property
    def num_active(self) -> int:
        """Matchers held by sequences that have not finished."""
        with self._lock:
            return sum(1 for guide in self._guides if not guide.released)

    def start_fill(self, seqs: list) -> None:
        """Start filling the bitmask of the step's constrained rows on the fill thread, so that it
        runs beside the forward pass (llguidance releases the GIL); apply() takes it. The
        matchers do not move until the step's tokens are accepted, after apply()."""
        if self._pending is not None:  # a stale fill (its step failed): no fill may run while matchers are asked
            self._pending[1].exception()
        rows = masked_rows(seqs)
        self.mask_steps += bool(rows)
        for i in rows:
            seqs[i].guide.step_mask_first = mask_first(seqs[i])
        guides = [seqs[i].guide for i in rows if seqs[i].guide.step_mask_first]
        if not guides:
            self._pending = None
            return
        if self._filler is None:
            self._filler = ThreadPoolExecutor(1, thread_name_prefix="xserv-mask-fill")
        self._pending = guides, self._filler.submit(self._fill, *_fill_args(guides))

    def _fill(self, matchers: list, extra: list[tuple[int, ...]]) -> np.ndarray:
        start = time.perf_counter()
        bitmask = new_bitmask(len(matchers), self.backend.bitmask_words)
        self.backend.fill_bitmask(matchers, bitmask)
        for j, token_ids in enumerate(extra):
            allow(bitmask, j, token_ids)
        self.fill_seconds += time.perf_counter() - start
        return bitmask

    def _bitmask(self, guides: list[SequenceGuide]) -> np.ndarray:
        pending, self._pending = self._pending, None
        if pending is not None:
            started, future = pending
            if len(started) == len(guides) and all(a is b for a, b in zip(started, guides)):
                return future.result()
            future.exception()  # a stale fill (its step failed): wait, so no two fills overlap
        return self._fill(*_fill_args(guides))

    def apply(self, logits: torch.Tensor, rows: list[int], guides: list[SequenceGuide],
              narrowable: list[bool]) -> Candidates | None:
        """Mask logits [B, V] in place at `rows`, guides[j] giving rows[j]'s allowed tokens. A
        narrowable row that allows at most MAX_CANDIDATES tokens is left as it is and comes back
        among the Candidates, for the sampler to draw among its allowed ids only."""
        start = time.perf_counter()
        bitmask = self._bitmask(guides)
        native_op = native(logits)
        counts = count_allowed(bitmask, native_op)
        few, many = [], []
        for j in range(len(rows)):
            (few if narrowable[j] and counts[j] <= MAX_CANDIDATES else many).append(j)
        if many:
            apply_bitmask(logits, bitmask if len(many) == len(rows) else bitmask[many], [rows[j] for j in many])
        candidates = None
        if few:
            ids, valid = allowed_ids(bitmask, few, logits.shape[1], native_op)
            candidates = Candidates([rows[j] for j in few], ids.to(logits.device), valid.to(logits.device))
        self.mask_seconds += time.perf_counter() - start
        return candidates

    def refused(self, guides: list, token_ids: list[int]) -> list[int]:
        """Indices j of the drawn-first rows whose token_ids[j] guides[j] does not allow."""
        out = [j for j, found in enumerate(_in_order(guides, [[t] for t in token_ids], [1] * len(guides)))
               if found is None]
        self.drawn_rows += len(guides)
        self.refused_rows += len(out)
        return out

    def allowed_in_order(self, guides: list, ranked: list[list[int]], counts: list[int]) -> list[list[int] | None]:
        """For each row, the first counts[j] tokens of ranked[j] that its guide allows, or None
        where ranked[j] holds fewer (the row is masked)."""
        out = _in_order(guides, ranked, counts)
        self.drawn_rows += len(guides)
        self.masked_rows += out.count(None)
        return out

    def first_allowed(self, guides: list, draws: list[list[int]]) -> list[int | None]:
        """For each refused row, the first of its further draws that its guide allows, or None
        (the row is masked)."""
        out = [None if found is None else found[0] for found in _in_order(guides, draws, [1] * len(guides))]
        self.masked_rows += out.count(None)
        return out

    def request_grammar(self, prompt, params, tokens: ChatTokens, tool_call_parser: str = JSON_PARSER):
        """The compiled grammar a request's answer must match, or None: its constraint, or the
        tool-call grammar its tool_choice forces (in the format of `tool_call_parser`, between
        the <tool_call> tokens of `tokens`)."""
        constraint = params.constraint
        if isinstance(prompt, ChatInput):
            forced = tool_call_constraint(prompt.tools, prompt.tool_choice, tokens, prompt.parallel_tool_calls,
                                          tool_call_parser)
            if forced is not None and constraint is not None:
                raise InvalidRequest("chat.tool_choice", "a forced tool call cannot be combined with an output constraint")
            constraint = forced or constraint
        return None if constraint is None else self.compile(constraint)


def _in_order(guides: list, ranked: list[list[int]], counts: list[int]) -> list[list[int] | None]:
    """For each row j, the first counts[j] tokens of ranked[j] that guides[j] allows, in order,
    or None where ranked[j] holds fewer."""
    out = []
    for guide, ids, count in zip(guides, ranked, counts):
        allowed = []
        for token_id in ids:
            if allows(guide, token_id):
                allowed.append(token_id)
                if len(allowed) == count:
                    break
        out.append(allowed if len(allowed) == count else None)
    return out


def _fill_args(guides: list[SequenceGuide]) -> tuple[list, list[tuple[int, ...]]]:
    """What _fill needs of the guides, read on the engine thread: (matcher, row) pairs and the
    tokens each row allows beyond its grammar."""
    return [(g.matcher, j) for j, g in enumerate(guides)], [g.extra_allowed() for g in guides]


def masked_rows(seqs: list) -> list[int]:
    """The rows of a step whose next token a grammar constrains."""
    return [i for i, s in enumerate(seqs) if s.guide is not None and s.guide.needs_mask]


def mask_first(seq) -> bool:
    """Whether a constrained row is masked before its draw (else drawn first: the module's doc):
    it reports logprobs, or truncates its distribution by top-p or min-p without a top-k or by a
    top-k above TOP_K_CHECKS, unless greedy; or its grammar cannot check a token at this
    position exactly as the mask would (where it forces text: the mask is a token or two there,
    and cheap). A smaller top-k row is not drawn first but checks its likeliest tokens in order
    (Sampler._allowed_top_k)."""
    p = seq.params
    truncated = p.top_k > TOP_K_CHECKS or (p.top_k <= 0 and (p.top_p < 1 or p.min_p > 0))
    return bool(p.logprobs) or (not p.greedy and truncated) or not seq.guide.matcher.checks_tokens


def take_mask_first(seq) -> bool:
    """mask_first as start_fill decided it for this step (the matchers cannot be asked while the
    step's fill runs), or decided now for a row that start_fill did not see."""
    decided, seq.guide.step_mask_first = seq.guide.step_mask_first, None
    return mask_first(seq) if decided is None else decided


def allows(guide, token_id: int) -> bool:
    """Whether the guide's next mask allows token_id (its grammar checks_tokens here)."""
    return guide.matcher.allows(token_id) or token_id in guide.extra_allowed()
