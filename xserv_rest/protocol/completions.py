"""POST /v1/completions (OpenAI's legacy text completions): the request, which builds its
GenerateRequest, and the answer's shapes."""

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, StringConstraints, ValidationError, WrapValidator
from pydantic_core import PydanticCustomError

from xserv.v1 import engine_pb2
from xserv_rest.protocol.base import Answer, AnswerHead, FinishReason, TokenId, integer, needs_true
from xserv_rest.protocol.logprobs import CompletionLogprobs
from xserv_rest.protocol.structured import ONE_FORMAT, ConstrainedRequest
from xserv_rest.protocol.unsupported import BestOf, Suffix
from xserv_rest.protocol.usage import Usage

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the completions API


MAX_PROMPTS = 256  # prompts in one request (lm-evaluation-harness sends its batch_size)


def _prompts(value: Any, handler) -> list[str | list[int]]:
    """The request's prompts: a string or token ids is one; an array of those is several."""
    try:
        prompt = handler(value)
    except ValidationError:
        raise PydanticCustomError("prompt", "must be a non-empty string, an array of token ids, or an array of "
                                            "at most {most} of those", {"most": MAX_PROMPTS}) from None
    return prompt if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) else [prompt]


PromptText = Annotated[str, StringConstraints(min_length=1)]  # the engine has nothing to continue from ""
PromptIds = Annotated[list[TokenId], Field(min_length=1)]
Prompts = Annotated[PromptText | PromptIds
                    | Annotated[list[PromptText | PromptIds], Field(min_length=1, max_length=MAX_PROMPTS)],
                    WrapValidator(_prompts)]


class CompletionRequest(ConstrainedRequest):
    model_config = ConfigDict(json_schema_extra={"allOf": [needs_true("stream_options", "stream"), ONE_FORMAT]})

    prompt: Prompts = Field(description="a prompt (a string or token ids) or a list of them; prompt p's choice i "
                                        "is choice p * n + i of the answer")
    max_tokens: integer("max_tokens") | None = Field(DEFAULT_MAX_TOKENS, description="most tokens to generate")
    logprobs: integer("top_logprobs") | None = Field(None, description="alternatives per token to return")
    echo: bool | None = Field(None, description="start each choice's text with the prompt; with logprobs, also "
                                                "the prompt tokens' logprobs (the first token's is null)")
    suffix: Suffix = None
    best_of: BestOf = None

    @property
    def choices(self) -> int:
        return len(self.prompt) * (self.n or 1)

    def engine_requests(self, request_id: str) -> list[engine_pb2.GenerateRequest]:
        """One Generate call per prompt (request ids request_id-0, -1, ... when there are several)."""
        if len(self.prompt) == 1:
            return [self._engine_request(request_id, self.prompt[0])]
        return [self._engine_request(f"{request_id}-{p}", prompt) for p, prompt in enumerate(self.prompt)]

    def _engine_request(self, request_id: str, prompt: str | list[int]) -> engine_pb2.GenerateRequest:
        params = self.sampling_params(self.logprobs is not None, self.logprobs or 0)
        if not params.HasField("max_tokens"):
            params.max_tokens = DEFAULT_MAX_TOKENS
        self.constrain(params)
        if self.echo and (self.logprobs is not None or not isinstance(prompt, str)):
            params.prompt_logprobs = self.logprobs or 0  # a token-id prompt's text comes from its tokens
        request = engine_pb2.GenerateRequest(request_id=request_id, params=params, priority=self.priority or 0)
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.ids.extend(prompt)
        return request

    def echoed(self, index: int, prompt_logprobs) -> str:
        """Choice `index`'s prompt as echo shows it: as sent, or a token-id prompt's tokens joined."""
        prompt = self.prompt[index // (self.n or 1)]
        if isinstance(prompt, str):
            return prompt
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
