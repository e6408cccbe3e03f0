"""StructuredOutputManager: the engine's one owner of grammars and matchers.

compile() runs on the caller's thread before a request is queued (a bad constraint is the
caller's InvalidRequest); apply() runs on the engine thread, in the sampler, for the constrained
rows of a step only.
"""

import threading
import time
import weakref
from pathlib import Path

import torch

from xserv_engine.errors import InvalidRequest
from xserv_engine.inputs import ChatInput
from xserv_engine.structured.backend import GrammarBackend
from xserv_engine.structured.bitmask import Candidates, allow, allowed_ids, apply_bitmask, count_allowed, new_bitmask
from xserv_engine.structured.constraint import Constraint
from xserv_engine.structured.grammar_cache import GrammarCache
from xserv_engine.structured.guide import SequenceGuide, starting_phase
from xserv_engine.structured.tool_grammar import tool_call_constraint

# a row allowing at most this many tokens is sampled among them (a gather) instead of masked
# (passes over the whole vocabulary); in a JSON answer most rows allow a handful
MAX_CANDIDATES = 4096


class StructuredOutputManager:
    def __init__(self, tokenizer_json: Path, eos_token_ids: list[int], separator_ids: tuple[int, ...]):
        self.cache = GrammarCache()
        self.separator_ids = separator_ids
        self._guides: weakref.WeakSet = weakref.WeakSet()  # a failed add_request's guides just vanish
        self.mask_seconds = 0.0  # filling and applying masks, summed over steps
        self.fill_seconds = 0.0  # of which filling (llguidance, CPU; the rest is the masked_fill)
        self.mask_steps = 0
        self._lock = threading.Lock()
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

    def guide(self, grammar, prompt_ids: list[int], is_chat: bool) -> SequenceGuide:
        guide = SequenceGuide(grammar.matcher(), starting_phase(prompt_ids, is_chat), self.separator_ids, self)
        with self._lock:
            self._guides.add(guide)
        return guide

    @property
    def num_active(self) -> int:
        """Matchers held by sequences that have not finished."""
        with self._lock:
            return sum(1 for guide in self._guides if not guide.released)

    def apply(self, logits: torch.Tensor, rows: list[int], guides: list[SequenceGuide],
              narrowable: list[bool]) -> Candidates | None:
        """Mask logits [B, V] in place at `rows`, guides[j] giving rows[j]'s allowed tokens. A
        narrowable row that allows at most MAX_CANDIDATES tokens is left as it is and comes back
        among the Candidates, for the sampler to draw among its allowed ids only."""
        start = time.perf_counter()
        bitmask = new_bitmask(len(rows), self.backend.bitmask_words)
        self.backend.fill_bitmask([(g.matcher, j) for j, g in enumerate(guides)], bitmask)
        for j, guide in enumerate(guides):
            allow(bitmask, j, guide.extra_allowed())
        self.fill_seconds += time.perf_counter() - start
        counts = count_allowed(bitmask)
        few = [j for j in range(len(rows)) if narrowable[j] and counts[j] <= MAX_CANDIDATES]
        many = [j for j in range(len(rows)) if not narrowable[j] or counts[j] > MAX_CANDIDATES]
        if many:
            _mask_rows(logits, [rows[j] for j in many], bitmask if len(many) == len(rows) else bitmask[many])
        candidates = None
        if few:
            ids, valid = allowed_ids(bitmask, few, logits.shape[1])
            candidates = Candidates([rows[j] for j in few], torch.from_numpy(ids).to(logits.device),
                                    torch.from_numpy(valid).to(logits.device))
        self.mask_seconds += time.perf_counter() - start
        self.mask_steps += 1
        return candidates

    def request_grammar(self, prompt, params):
        """The compiled grammar a request's answer must match, or None: its constraint, or the
        tool-call grammar its tool_choice forces."""
        constraint = params.constraint
        if isinstance(prompt, ChatInput):
            forced = tool_call_constraint(prompt.tools, prompt.tool_choice, prompt.parallel_tool_calls)
            if forced is not None and constraint is not None:
                raise InvalidRequest("chat.tool_choice", "a forced tool call cannot be combined with an output constraint")
            constraint = forced or constraint
        return None if constraint is None else self.compile(constraint)


def _mask_rows(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    if len(rows) == logits.shape[0]:
        apply_bitmask(logits, bitmask)
        return
    index = torch.tensor(rows, device=logits.device)
    masked = logits.index_select(0, index)
    apply_bitmask(masked, bitmask)
    logits.index_copy_(0, index, masked)
