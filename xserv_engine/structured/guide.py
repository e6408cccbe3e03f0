"""One sequence's constraint: its matcher, and where the constraint starts.

With Qwen thinking on, the reasoning stays free and the constraint starts after </think> (as
vLLM's reasoning-aware structured outputs); with thinking off, from the first token. The matcher
follows the sequence's generated tokens only, so a preemption (recompute) or a prefix-cache hit
changes nothing here: the tokens it already accepted are not fed again.
"""

import enum

from xserv_engine.structured.backend import Matcher
from xserv_engine.tokenizer.chat_tokens import ChatTokens


class Phase(enum.Enum):
    REASONING = "reasoning"  # inside <think>: free until </think>
    MAY_REASON = "may_reason"  # thinking on, no token yet: <think> or the constraint's first token
    CONSTRAINED = "constrained"


def starting_phase(prompt_ids: list[int], is_chat: bool, tokens: ChatTokens) -> Phase:
    """From the prompt's last turn (since its last <|im_start|>): a closed think block (thinking
    off) constrains from the first token, an open one frees the reasoning, neither lets the model
    choose to open one."""
    if not is_chat:
        return Phase.CONSTRAINED
    for token_id in reversed(prompt_ids):
        if token_id == tokens.think_end:
            return Phase.CONSTRAINED
        if token_id == tokens.think_start:
            return Phase.REASONING
        if token_id == tokens.im_start:
            break
    return Phase.MAY_REASON


class GrammarViolation(RuntimeError):
    """A sampled token the mask should have ruled out: an engine bug, never a user error."""


class SequenceGuide:
    step_mask_first: bool | None = None  # StructuredOutputManager.start_fill's choice for the step

    def __init__(self, matcher: Matcher, phase: Phase, tokens: ChatTokens, separator_ids: tuple[int, ...], owner):
        self.matcher = matcher
        self.phase = phase
        self._think_start, self._think_end = tokens.think_start, tokens.think_end
        self.owner = owner  # the StructuredOutputManager: applies the step's masks
        self._separator_ids = separator_ids  # "\n\n", allowed once right after </think>
        self._after_reasoning = False
        self.num_accepted = 0
        self.released = False

    @property
    def needs_mask(self) -> bool:
        return self.phase is not Phase.REASONING

    def extra_allowed(self) -> tuple[int, ...]:
        """Tokens allowed beside the grammar's at the next position."""
        if self.phase is Phase.MAY_REASON:
            return () if self._think_start is None else (self._think_start,)
        if self._after_reasoning:
            return self._separator_ids
        return ()

    def accept(self, token_id: int) -> None:
        if self.phase is Phase.REASONING:
            if token_id == self._think_end:
                self.phase, self._after_reasoning = Phase.CONSTRAINED, True
            return
        if self.phase is Phase.MAY_REASON:
            self.phase = Phase.CONSTRAINED
            if token_id == self._think_start:
                self.phase = Phase.REASONING
                return
        if self._after_reasoning:
            self._after_reasoning = False
            if token_id in self._separator_ids:
                return
        if not self.matcher.accept(token_id):
            raise GrammarViolation(f"token {token_id} is not allowed by the grammar")
        self.num_accepted += 1

    @property
    def drafts_allowed(self) -> bool:
        """Speculative drafts can be checked against the grammar alone: inside the constraint,
        past the separator after </think> (engine/speculative.py)."""
        return self.phase is Phase.CONSTRAINED and not self._after_reasoning and self.matcher is not None

    @property
    def is_complete(self) -> bool:
        return self.phase is Phase.CONSTRAINED and self.num_accepted > 0 and self.matcher.is_finished

    def release(self) -> None:
        """Drop the matcher's state: the sequence finished, was aborted or failed."""
        self.released = True
        self.matcher = None


class DraftGuide:
    """A sequence's guide as a speculative position sees it: the matcher advanced over the drafts
    before that position, on a copy (the sequence's own matcher moves only over tokens that stand,
    in LLMEngine, so a rejected draft needs no rollback). What the Sampler and the mask fill read."""
    needs_mask = True
    step_mask_first: bool | None = None

    def __init__(self, guide: SequenceGuide, drafts: list[int]):
        self.owner = guide.owner
        self.matcher = guide.matcher.copy_after(drafts) if drafts else guide.matcher

    @staticmethod
    def extra_allowed() -> tuple[int, ...]:
        return ()  # drafts_allowed: no </think> or separator to allow beside the grammar
