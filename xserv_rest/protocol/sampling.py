"""The request fields chat and completions share: sampling parameters (bounded by the engine's
BOUNDS), streaming options, and the fields that change nothing xserv produces."""

from typing import Annotated

from pydantic import Field, StringConstraints, ValidationInfo, WithJsonSchema, field_validator, model_validator
from pydantic_core import PydanticCustomError

from xserv.v1 import engine_pb2
from xserv_engine.sampling_params import BOUNDS, MAX_STOP
from xserv_rest.protocol.base import FieldError, Limits, Model, RequestBody, TokenId, described, integer, number

_BIAS = BOUNDS["logit_bias"]
LogitBias = Annotated[
    dict[Annotated[str, StringConstraints(pattern=r"^[0-9]{1,9}$")], number("logit_bias")],
    WithJsonSchema({"type": "object", "propertyNames": {"pattern": "^[0-9]{1,9}$"},
                    "additionalProperties": {"type": "number", "minimum": _BIAS.low, "maximum": _BIAS.high},
                    "description": "token id (as a string) -> bias added to its logit"})]
StopText = Annotated[str, StringConstraints(min_length=1)]  # "" would match everywhere: the engine refuses it
Stop = StopText | Annotated[list[StopText], Field(max_length=MAX_STOP)]
FLOAT32_TINY = 1.401298464324817e-45  # the smallest positive float32
# Copied to engine_pb2.SamplingParams as they are: the scalar fields both sides name alike.
_SPECIAL = {"max_tokens", "logprobs", "top_logprobs"}
_SCALARS = tuple(field.name for field in engine_pb2.SamplingParams.DESCRIPTOR.fields
                 if not field.is_repeated and field.message_type is None and field.name not in _SPECIAL)


class StreamOptions(Model):
    include_usage: bool | None = Field(None, description="a last chunk with the usage and no choices")
    continuous_usage_stats: bool | None = Field(
        None, description="vLLM extra: every chunk with choices also carries usage (the prompt's tokens and its "
                          "choice's tokens so far); implies include_usage unless that is false")
    include_obfuscation: bool | None = Field(None, description="accepted; xserv adds no obfuscation field")


class SamplingRequest(RequestBody):
    model: str | None = Field(None, description="the served model id or a LoRA adapter's name (GET /v1/models); "
                                                "may be omitted")
    max_tokens: integer("max_tokens") | None = described(
        "max_tokens", "; past the context: 400 context_length_exceeded")
    max_completion_tokens: integer("max_tokens") | None = Field(
        None, description="the same as max_tokens; wins when both are given")
    temperature: number("temperature") | None = described("temperature")
    top_p: number("top_p") | None = described("top_p")
    n: integer("n") | None = described("n", "(at most --max-n)")
    stop: Stop | None = Field(None, description="stop strings, not included in the output")
    seed: integer("seed") | None = described("seed")
    presence_penalty: number("presence_penalty") | None = described("presence_penalty")
    frequency_penalty: number("frequency_penalty") | None = described("frequency_penalty")
    logit_bias: LogitBias | None = None
    stream: bool | None = Field(None, description="answer as server-sent events")
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    # vLLM's extras.
    top_k: integer("top_k") | None = described("top_k")
    min_p: number("min_p") | None = described("min_p")
    repetition_penalty: number("repetition_penalty") | None = described("repetition_penalty")
    min_tokens: integer("min_tokens") | None = described("min_tokens")
    ignore_eos: bool | None = Field(None, description="vLLM extra: generate past EOS")
    skip_special_tokens: bool | None = Field(None, description="vLLM extra: leave special tokens out of the text")
    include_stop_str_in_output: bool | None = Field(None, description="vLLM extra: keep the matched stop string")
    stop_token_ids: list[TokenId] | None = Field(None, description="vLLM extra: token ids that end the answer")
    priority: integer("priority") | None = described("priority", "(vLLM extra)")
    # Accepted and unused: they change nothing xserv produces.
    user: str | None = Field(None, description="accepted and ignored")
    metadata: dict[str, str] | None = Field(None, description="accepted and ignored")
    store: bool | None = Field(None, description="accepted and ignored: xserv stores nothing")
    service_tier: str | None = Field(None, description="accepted and ignored")
    safety_identifier: str | None = Field(None, description="accepted and ignored")
    prompt_cache_key: str | None = Field(None, description="accepted and ignored: prefix caching is automatic")

    @field_validator("n")
    @classmethod
    def _n_within_max_n(cls, n: int | None, info: ValidationInfo) -> int | None:
        max_n = Limits.of(info).max_n
        if n is not None and n > max_n:
            raise PydanticCustomError("n_limit", "must be between 1 and {max_n}, got {n}", {"max_n": max_n, "n": n})
        return n

    @model_validator(mode="after")
    def _streaming_and_context(self, info: ValidationInfo) -> "SamplingRequest":
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "'stream_options' is only allowed with 'stream': true")
        max_model_len = Limits.of(info).max_model_len
        if max_model_len and self.output_limit() is not None and self.output_limit() >= max_model_len:
            name = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
            raise FieldError(name, f"this model's maximum context length is {max_model_len} tokens, but {name} "
                             f"asks for {self.output_limit()} plus the prompt; lower {name}",
                             code="context_length_exceeded")
        return self

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        options = self.stream_options
        if options is None:
            return False
        if options.include_usage is None:  # vLLM's include_usage defaults to true, OpenAI's to false
            return bool(options.continuous_usage_stats)
        return options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk, as vLLM: only when the usage chunk is sent too."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    @property
    def choices(self) -> int:
        return self.n or 1

    def engine_requests(self, request_id: str) -> list[engine_pb2.GenerateRequest]:
        """The Generate calls that answer this request: one, unless the endpoint takes several prompts."""
        return [self.to_grpc(request_id)]

    def sampling_params(self, logprobs: bool, top_logprobs: int) -> engine_pb2.SamplingParams:
        params = engine_pb2.SamplingParams(logprobs=logprobs, top_logprobs=top_logprobs,
                                           stop=[self.stop] if isinstance(self.stop, str) else self.stop,
                                           stop_token_ids=self.stop_token_ids,
                                           logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()})
        if self.output_limit() is not None:
            params.max_tokens = self.output_limit()
        for name in _SCALARS:
            value = getattr(self, name, None)
            if value is not None:
                # a positive number stays positive in the proto's float32 (top_p 1e-300 is valid JSON
                # and (0, 1]; rounded to 0.0 the engine would refuse it)
                setattr(params, name, FLOAT32_TINY if isinstance(value, float) and 0 < value < FLOAT32_TINY else value)
        return params
