"""Streaming detokenization shows exactly the full decode, never half a character."""

from xserv_engine.tokenizer.detokenizer import IncrementalDetokenizer

MIXED = (
    "Hello 你好 世界! Emoji 😀👍🏽 family 👨‍👩‍👧‍👦 🇯🇵, Ελληνικά, русский, हिन्दी, 한국어, "
    "日本語のテキスト。 Math: ∑ x² ≤ ∞; code `x = {'a': [1, 2]}`\n\tdone 🏳️‍🌈"
)


def byte_token(tokenizer, byte: int) -> int:
    """The id of the token that is exactly this one byte."""
    return next(i for i in range(tokenizer.vocab_size) if tokenizer.token_bytes(i) == bytes([byte]))


def stream(tokenizer, ids, skip_special_tokens=False):
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    pieces = [detok.add(i) for i in ids]
    return pieces, detok.flush()


def test_streaming_equals_full_decode_without_replacement_chars(tokenizer):
    ids = tokenizer.encode(MIXED)
    assert any(not tokenizer.token_bytes(i).decode("utf-8", "ignore") for i in ids), "has split characters"
    pieces, tail = stream(tokenizer, ids)
    assert "".join(pieces) + tail == tokenizer.decode(ids) == MIXED
    assert not any("\ufffd" in piece for piece in pieces)
    assert tail == ""


def test_every_prefix_streams_safely(tokenizer):
    ids = tokenizer.encode("🎉中文😀")
    for n in range(1, len(ids) + 1):
        pieces, _ = stream(tokenizer, ids[:n])
        shown = "".join(pieces)
        assert "\ufffd" not in shown
        assert "🎉中文😀".startswith(shown)


def test_unfinished_character_is_replaced_at_flush(tokenizer):
    ids = tokenizer.encode("ok ") + [byte_token(tokenizer, 0xF0), byte_token(tokenizer, 0x9F)]  # 😀 cut short
    pieces, tail = stream(tokenizer, ids)
    assert "".join(pieces) == "ok "
    assert tail == "\ufffd"


def test_invalid_bytes_become_one_replacement_as_in_full_decode(tokenizer):
    ids = [byte_token(tokenizer, 0xE4)] + tokenizer.encode("abc")  # first byte of 中, then ASCII
    pieces, tail = stream(tokenizer, ids)
    assert "".join(pieces) + tail == tokenizer.decode(ids) == "\ufffdabc"


def test_skip_special_tokens(tokenizer):
    text = "<|im_start|>assistant\n<think>\nhm\n</think>\n\nHi 你好<|im_end|><|endoftext|>"
    ids = tokenizer.encode(text)
    pieces, tail = stream(tokenizer, ids, skip_special_tokens=True)
    shown = "".join(pieces) + tail
    assert shown == tokenizer.decode(ids, skip_special_tokens=True)
    assert shown == "assistant\n<think>\nhm\n</think>\n\nHi 你好"  # <think> is not a special token
    pieces, tail = stream(tokenizer, ids, skip_special_tokens=False)
    assert "".join(pieces) + tail == text
