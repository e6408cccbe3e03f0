"""Embedding models: how a checkpoint pools its final hidden states into one vector, and what an
embedding request may ask.

Qwen3-Embedding ships as a sentence-transformers directory: modules.json lists the Transformer,
then a Pooling module (1_Pooling/config.json: `pooling_mode_lasttoken`) and a Normalize module.
Its vector is the final (normed) hidden state of the input's last token - the <|endoftext|> its
tokenizer appends - L2-normalized. This module reads that layout; it imports no torch.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from xserv_engine.errors import InvalidRequest, ModelLoadError

ST_POOLING = "sentence_transformers.models.Pooling"
ST_NORMALIZE = "sentence_transformers.models.Normalize"
MAX_EMBED_INPUTS = 2048  # inputs per Embed call (OpenAI's limit per embeddings request)
# sentence-transformers' pooling modes (xserv computes lasttoken)
_MODES = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")


# Qwen3-Reranker's prompt (its model card): the document is relevant when the model answers "yes"
RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
                 "the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
                 "<|im_start|>user\n")
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@dataclass(frozen=True)
class PoolingConfig:
    mode: str = "lasttoken"
    normalize: bool = True  # L2-normalize the pooled vector (and again after Matryoshka truncation)
    # the score runner's: (no, yes) token ids; the pooled "vector" is then [P(yes)], the softmax of
    # the LM head's two logits at the last token (Qwen3-Reranker's recipe)
    classify: tuple[int, int] | None = None


def rerank_content(query: str, document: str, instruction: str | None) -> str:
    """What goes between RERANK_PREFIX and RERANK_SUFFIX (Qwen3-Reranker's format_instruction)."""
    return f"<Instruct>: {instruction or RERANK_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"


@dataclass(frozen=True)
class EmbedParams:
    dimensions: int | None = None  # keep the first `dimensions` values (Matryoshka), then normalize
    truncate_prompt_tokens: int | None = None  # embed only the input's last this-many tokens

    def validate(self, hidden_size: int) -> None:
        if self.dimensions is not None and not 1 <= self.dimensions <= hidden_size:
            raise InvalidRequest("dimensions", f"must be between 1 and the model's {hidden_size}, got {self.dimensions}")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise InvalidRequest("truncate_prompt_tokens", f"must be at least 1, got {self.truncate_prompt_tokens}")


def read_pooling_config(root: Path) -> PoolingConfig | None:
    """The sentence-transformers pooling of a model directory; None when it has no modules.json
    with a Pooling module (a generation checkpoint)."""
    modules_file = root / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text())
        pooling = next((m for m in modules if m.get("type") == ST_POOLING), None)
        if pooling is None:
            return None
        settings = json.loads((root / pooling.get("path", "") / "config.json").read_text())
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        raise ModelLoadError(f"{root}: unreadable sentence-transformers pooling config: {exc}") from exc
    modes = [mode for mode in _MODES if settings.get(f"pooling_mode_{mode}")]
    if modes != ["lasttoken"]:
        raise ModelLoadError(f"{root}: pooling {modes or 'none'} is not supported (xserv pools the last token, "
                             f"as Qwen3-Embedding does)")
    return PoolingConfig("lasttoken", normalize=any(m.get("type") == ST_NORMALIZE for m in modules))
