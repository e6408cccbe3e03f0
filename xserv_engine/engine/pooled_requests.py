"""PooledRequests: the requests of the pooling runner (Embed: an input's vector) and of the score
runner (Score: a document's relevance to a query). Each is one prompt that runs once and pools
its last row; nothing is sampled."""

import functools
from collections.abc import Callable

from xserv_engine.engine.output_stream import OutputStream
from xserv_engine.engine.request import OnOutput, Request
from xserv_engine.engine.runner_kind import RunnerKind
from xserv_engine.engine.sequence import Sequence
from xserv_engine.errors import InputTooLong, InvalidRequest
from xserv_engine.inputs import check_prompt
from xserv_engine.models.pooling import RERANK_PREFIX, RERANK_SUFFIX, EmbedParams, rerank_content
from xserv_engine.sampling_params import SamplingParams
from xserv_engine.tokenizer.tokenizer import Tokenizer

EMBED_SAMPLING = SamplingParams(max_tokens=1)  # a pooled request's sequence samples nothing
EMBED_REMEDY = "shorten it or set truncate_prompt_tokens"
SCORE_REMEDY = "with the query and the reranker's template: shorten it"


def check_fits(field: str, num_tokens: int, max_model_len: int, remedy: str) -> None:
    """InputTooLong naming `field` when an input's tokens do not fit in the context."""
    if num_tokens > max_model_len:
        raise InputTooLong(field, num_tokens, max_model_len, remedy)


def embed_ids(prompt: str | list[int], params: EmbedParams, field: str, vocab_size: int, max_model_len: int,
              encode: Callable[[str], list[int]]) -> list[int]:
    """An input's token ids as it is embedded: checked (InvalidRequest naming field.text or
    field.token_ids), encoded, cut to truncate_prompt_tokens and fitted to the context."""
    try:
        check_prompt(prompt, vocab_size)
    except InvalidRequest as exc:
        raise InvalidRequest(f"{field}.{exc.field}", exc.message) from None
    ids = encode(prompt) if isinstance(prompt, str) else list(prompt)
    if params.truncate_prompt_tokens is not None:
        ids = ids[-params.truncate_prompt_tokens:]
    check_fits(field, len(ids), max_model_len, EMBED_REMEDY)
    return ids


class PooledRequests:
    def __init__(self, kind: RunnerKind, model_id: str, tokenizer: Tokenizer, vocab_size: int, hidden_size: int,
                 max_model_len: int, block_size: int):
        self.kind, self.model_id, self.tokenizer = kind, model_id, tokenizer
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.max_model_len, self.block_size = max_model_len, block_size

    def embed(self, request_id: str, prompt: str | list[int], params: EmbedParams, on_output: OnOutput,
              field: str = "input") -> Request:
        """An input to embed: tokenized with the tokenizer's special tokens, as sentence-transformers
        does; its one output carries the vector. `field` names the input in errors (the Embed
        call's inputs[i])."""
        self.kind.check_serves(RunnerKind.POOLING, self.model_id)
        params.validate(self.hidden_size)
        encode = functools.partial(self.tokenizer.encode, add_special_tokens=True)
        ids = embed_ids(prompt, params, field, self.vocab_size, self.max_model_len, encode)
        return self._request(request_id, ids, params, on_output)

    def score(self, request_id: str, query: str, document: str, instruction: str | None, on_output: OnOutput,
              field: str = "document") -> Request:
        """A document's relevance to a query: Qwen3-Reranker's prompt around them, tokenized as its
        model card does (prefix, content, suffix apart); the one output carries [P(yes)]. `field`
        names the document in errors (the Score call's documents[i])."""
        self.kind.check_serves(RunnerKind.SCORE, self.model_id)
        if not document:
            raise InvalidRequest(field, "must not be empty")
        prefix, suffix = self._rerank_affixes
        ids = prefix + self.tokenizer.encode(rerank_content(query, document, instruction)) + suffix
        check_fits(field, len(ids), self.max_model_len, SCORE_REMEDY)
        return self._request(request_id, ids, EmbedParams(), on_output)

    @functools.cached_property
    def _rerank_affixes(self) -> tuple[list[int], list[int]]:
        return self.tokenizer.encode(RERANK_PREFIX), self.tokenizer.encode(RERANK_SUFFIX)

    def _request(self, request_id: str, ids: list[int], params: EmbedParams, on_output: OnOutput) -> Request:
        seq = Sequence(ids, EMBED_SAMPLING, self.block_size, embed=params)
        stream = OutputStream(self.tokenizer, EMBED_SAMPLING, starts_in_reasoning=False, parse_reasoning=False,
                              parse_tools=False)
        return Request(request_id, on_output, [seq], {seq.seq_id: stream})
