"""Token counts of an answer, as OpenAI reports them."""

from pydantic import Field

from xserv_rest.protocol.base import Answer


class PromptTokensDetails(Answer):
    cached_tokens: int = Field(description="prompt tokens found in the prefix cache")


class CompletionTokensDetails(Answer):
    reasoning_tokens: int = Field(description="completion tokens of the reasoning, <think> through </think>")


class Usage(Answer):
    prompt_tokens: int
    completion_tokens: int = Field(description="summed over the choices")
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = Field(
        None, exclude_if=lambda value: value is None,
        description="absent from the chunks of a stream with stream_options.continuous_usage_stats")
    completion_tokens_details: CompletionTokensDetails | None = Field(
        None, exclude_if=lambda value: value is None,
        description="absent from the chunks of a stream with stream_options.continuous_usage_stats")
