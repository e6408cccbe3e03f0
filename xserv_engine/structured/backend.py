"""The interface a grammar backend implements (llguidance today; xgrammar could slot in).

A backend compiles a Constraint once into a Grammar; each constrained sequence then gets its own
Matcher, which follows the sequence's generated tokens and says which token may come next.
"""

from abc import ABC, abstractmethod

import numpy as np

from xserv_engine.structured.constraint import Constraint


class Matcher(ABC):
    """One sequence's position in a grammar."""

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance by one generated token; False (and no advance) when the grammar forbids it."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens."""

    @abstractmethod
    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of token_ids, in order, the grammar would accept from here (no advance)."""

    @property
    @abstractmethod
    def checks_tokens(self) -> bool:
        """Whether allows() answers at this position exactly as the next mask would."""

    @abstractmethod
    def allows(self, token_id: int) -> bool:
        """Whether the next mask would allow token_id (where checks_tokens)."""

    @abstractmethod
    def copy_after(self, token_ids: list[int]) -> "Matcher":
        """A copy advanced over token_ids (a valid prefix); this matcher does not move."""

    @property
    @abstractmethod
    def is_finished(self) -> bool:
        """The grammar is complete and allows no further token (except end-of-sequence)."""


class Grammar(ABC):
    """A compiled constraint; cheap to start many matchers from."""

    @abstractmethod
    def matcher(self) -> Matcher:
        """A fresh matcher at the grammar's start."""


class GrammarBackend(ABC):
    @property
    @abstractmethod
    def bitmask_words(self) -> int:
        """int32 words in one row of the token bitmask (bit i of the row: token i is allowed)."""

    @abstractmethod
    def compile(self, constraint: Constraint) -> Grammar:
        """Raise InvalidRequest(constraint.error_field, reason) when it cannot be compiled."""

    @abstractmethod
    def fill_bitmask(self, matchers: list[tuple[Matcher, int]], bitmask: np.ndarray) -> None:
        """Write each matcher's allowed next tokens into row `index` of bitmask [B, words] (int32).
        Runs on the fill thread: it must release the GIL and run no torch op."""
