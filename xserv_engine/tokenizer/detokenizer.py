"""Token ids -> text, one token at a time, never showing half a character."""

import codecs

from xserv_engine.tokenizer.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Streams the text of generated tokens.

    Works on token bytes through an incremental UTF-8 decoder: the trailing bytes of a character
    split across tokens are held back until it completes; bytes that can no longer form a
    character become U+FFFD, as in the full decode. O(1) per token.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool):
        self._tokenizer = tokenizer
        self._skip_ids = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        """The new text that token_id makes safe to show (may be empty)."""
        if token_id in self._skip_ids:
            return ""
        return self._decoder.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """The held-back remainder at the end of generation (U+FFFD for an unfinished character)."""
        return self._decoder.decode(b"", final=True)
