"""The added tokens of Qwen's chat format, by id: where reasoning and tool calls open and close,
and where a turn starts. Their texts are the same in every Qwen generation, their ids are not
(<think> is 151667 in Qwen3's vocabulary, 248068 in Qwen3.5's), so the ids are looked up once,
from the model's tokenizer, and passed down to whatever switches on them.
"""

from collections.abc import Callable
from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
IM_START = "<|im_start|>"


@dataclass(frozen=True)
class ChatTokens:
    """Each id is None where the vocabulary has no such token: the model never writes it."""

    think_start: int | None
    think_end: int | None
    tool_call_start: int | None
    tool_call_end: int | None
    im_start: int | None  # where a turn begins: the prompt's last one is the answer's

    @classmethod
    def lookup(cls, token_id: Callable[[str], int | None]) -> "ChatTokens":
        """From a vocabulary's text -> id lookup (Tokenizer.token_id)."""
        return cls(token_id(THINK_START), token_id(THINK_END), token_id(TOOL_CALL_START),
                   token_id(TOOL_CALL_END), token_id(IM_START))

    def tag_texts(self) -> dict[int, str]:
        """The reasoning and tool-call tags the vocabulary has: id -> text."""
        tags = {self.think_start: THINK_START, self.think_end: THINK_END,
                self.tool_call_start: TOOL_CALL_START, self.tool_call_end: TOOL_CALL_END}
        return {token_id: text for token_id, text in tags.items() if token_id is not None}
