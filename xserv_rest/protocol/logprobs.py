"""Logprobs in an answer: chat's list of tokens, and the legacy completions' parallel lists."""

from pydantic import Field

from xserv_rest.protocol.base import Answer


class TopLogprob(Answer):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Answer):
    content: list[TokenLogprob] | None
    refusal: None = None


class CompletionLogprobs(Answer):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int] = Field(description="each token's offset from the completion's start")
