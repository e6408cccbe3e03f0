"""POST /v1/completions (OpenAI's legacy text completions): the request, which builds its
GenerateRequest, and the answer's shapes."""

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationError, WrapValidator
from pydantic_core import PydanticCustomError

from xserv.v1 import engine_pb2
from xserv_rest.protocol.base import Answer, AnswerHead, FinishReason, TokenId, integer, needs_true
from xserv_rest.protocol.logprobs import CompletionLogprobs
from xserv_rest.protocol.structured import ONE_FORMAT, ConstrainedRequest
from xserv_rest.protocol.unsupported import BestOf, Suffix
from xserv_rest.protocol.usage import Usage

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the completions API


def _one_prompt(value: Any, handler) -> str | list[int]:
    """One prompt per request; a batch of one is that prompt."""
    try:
        prompt = handler(value)
    except ValidationError:
        raise PydanticCustomError("prompt", "must be a string, an array of token ids, or an array holding one "
                                            "of those (one prompt per request)") from None
    return prompt[0] if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) else prompt


PromptIds = Annotated[list[TokenId], Field(min_length=1)]
Prompt = Annotated[str | PromptIds | Annotated[list[str | PromptIds], Field(min_length=1, max_length=1)],
                   WrapValidator(_one_prompt)]


class CompletionRequest(ConstrainedRequest):
    model_config = ConfigDict(json_schema_extra={"allOf": [needs_true("stream_options", "stream"), ONE_FORMAT]})

    prompt: Prompt = Field(description="one prompt: a string, token ids, or a list holding one of them")
    max_tokens: integer("max_tokens") | None = Field(DEFAULT_MAX_TOKENS, description="most tokens to generate")
    logprobs: integer("top_logprobs") | None = Field(None, description="alternatives per token to return")
    echo: bool | None = Field(None, description="start each choice's text with the prompt; with logprobs, also "
                                                "the prompt tokens' logprobs (the first token's is null)")
    suffix: Suffix = None
    best_of: BestOf = None

    def to_grpc(self, request_id: str) -> engine_pb2.GenerateRequest:
        params = self.sampling_params(self.logprobs is not None, self.logprobs or 0)
        if not params.HasField("max_tokens"):
            params.max_tokens = DEFAULT_MAX_TOKENS
        self.constrain(params)
        if self.echo and (self.logprobs is not None or not isinstance(self.prompt, str)):
            params.prompt_logprobs = self.logprobs or 0  # a token-id prompt's text comes from its tokens
        request = engine_pb2.GenerateRequest(request_id=request_id, params=params)
        if isinstance(self.prompt, str):
            request.text = self.prompt
        else:
            request.token_ids.ids.extend(self.prompt)
        return request


    def echoed(self, prompt_logprobs) -> str:
        """The prompt as echo shows it: as sent, or a token-id prompt's tokens joined."""
        if isinstance(self.prompt, str):
            return self.prompt
        return b"".join(lp.token_bytes for lp in prompt_logprobs).decode("utf-8", errors="replace")


# -- the answer --

class CompletionChoice(Answer):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class Completion(AnswerHead):
    """The answer, and also each streamed chunk (OpenAI uses one shape for both)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = Field(None, description="in a stream: only with stream_options.include_usage")
