"""POST /v1/chat/completions: the request (which builds its GenerateRequest) and the answer's
shapes, as OpenAI's API defines them."""

import json
from typing import Annotated, Any, Literal

from pydantic import (BeforeValidator, ConfigDict, Discriminator, Field, PrivateAttr, Tag, ValidationInfo,
                      WithJsonSchema, model_validator)
from pydantic_core import PydanticCustomError

from xserv.v1 import engine_pb2
from xserv_engine.media import MediaError
from xserv_rest.protocol.base import (Answer, AnswerHead, FieldError, FinishReason, Limits, Model, integer,
                                      needs_true, omitted)
from xserv_rest.protocol.logprobs import ChatLogprobs
from xserv_rest.protocol.structured import ONE_FORMAT, ConstrainedRequest, ToolChoice, tool_choice_name
from xserv_rest.protocol.unsupported import (Audio, LegacyFunctions, Modalities, Prediction, ReasoningEffort,
                                             Verbosity, WebSearch)
from xserv_rest.protocol.usage import Usage

ROLE_ALIASES = {"developer": "system"}
ROLES_OF_SYSTEM = ("system", "developer")


class TextPart(Model):
    type: Literal["text"]
    text: str = ""

    def to_grpc(self) -> engine_pb2.ContentPart:
        return engine_pb2.ContentPart(text=self.text)


class ImageUrl(Model):
    url: str = Field(description="a data: URL (data:image/png;base64,...); an http(s) URL on a host of the "
                                 "server's --allowed-media-domains; a file: URL under its --allowed-local-media-path")
    detail: Literal["auto", "low", "high"] | None = Field(None, description="accepted; the model's image processor "
                                                                           "sizes every image the same way")
    _data: bytes = PrivateAttr(b"")

    @model_validator(mode="after")
    def _load(self, info: ValidationInfo) -> "ImageUrl":
        """The image's bytes, under the server's rules (Limits.media); the engine decodes them."""
        try:
            self._data = Limits.of(info).media.load(self.url)
        except MediaError as exc:
            raise PydanticCustomError("image_url", "cannot be used: {why}", {"why": str(exc)}) from None
        return self


class ImagePart(Model):
    type: Literal["image_url"]
    image_url: ImageUrl

    def to_grpc(self) -> engine_pb2.ContentPart:
        return engine_pb2.ContentPart(image=engine_pb2.Image(data=self.image_url._data))


class RefusedPart(Model):
    """A part of a kind xserv does not read (audio, video, files): a 400 that names the kind."""

    type: str

    @model_validator(mode="after")
    def _refuse(self) -> "RefusedPart":
        raise PydanticCustomError("unsupported", "is a part of type {kind}: xserv reads text and images only",
                                  {"kind": self.type})


def _part_kind(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if kind in ("text", "image_url"):
        return kind
    return "refused" if isinstance(kind, str) else None


# in the schema: no part of another type is valid
REFUSED = WithJsonSchema({"not": {}, "description": "parts of other types (video, audio, files) are refused"})
ContentPart = Annotated[
    Annotated[TextPart, Tag("text")] | Annotated[ImagePart, Tag("image_url")]
    | Annotated[RefusedPart, Tag("refused"), REFUSED],
    Discriminator(_part_kind, custom_error_type="part_type",
                  custom_error_message="must be a content part with a type (text or image_url)")]


class FunctionCall(Model):
    name: str | None = None
    arguments: str | dict[str, Any] | None = Field(None, description="a JSON string (or a JSON object)")


class ToolCall(Model):
    id: str | None = None
    type: str | None = Field(None, description="function")
    function: FunctionCall | None = None

    def to_grpc(self) -> engine_pb2.ToolCall:
        function = self.function or FunctionCall()
        arguments = function.arguments or ""
        if isinstance(arguments, dict):  # lenient, as vLLM: OpenAI sends the arguments as a JSON string
            arguments = json.dumps(arguments, ensure_ascii=False)
        return engine_pb2.ToolCall(id=self.id or "", type=self.type or "function", name=function.name or "",
                                   arguments=arguments)


class ChatMessage(Model):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="developer reads as system")
    content: str | list[ContentPart] | None = Field(None, description="a string, or text and image_url parts")
    name: str | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = Field(None, description="vLLM's name for reasoning_content")
    tool_calls: list[ToolCall] | None = None

    def to_grpc(self) -> engine_pb2.ChatMessage:
        content, parts = self.content or "", []
        if not isinstance(content, str) and any(isinstance(part, ImagePart) for part in content):  # parts in order, as the engine renders them
            content, parts = "", [part.to_grpc() for part in content]
        elif not isinstance(content, str):
            content = "\n".join(part.text for part in content)
        message = engine_pb2.ChatMessage(role=ROLE_ALIASES.get(self.role, self.role), content=content, parts=parts,
                                         tool_call_id=self.tool_call_id or "", name=self.name or "",
                                         tool_calls=[call.to_grpc() for call in self.tool_calls or ()])
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            message.reasoning_content = reasoning
        return message


def _images_fit(messages: Any, info: ValidationInfo) -> Any:
    """Before any image is loaded, the images the served model cannot take (Limits.max_images)
    and images in a system message: a 400 naming the part, as the engine's own refusal would."""
    limit, count = Limits.of(info).max_images, 0
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if not isinstance(part, dict) or part.get("type") != "image_url":
                continue
            count, field = count + 1, f"messages[{i}].content[{j}]"
            if limit == 0:
                raise FieldError(field, f"{field}: the served model does not accept images")
            if message.get("role") in ROLES_OF_SYSTEM:
                raise FieldError(field, f"{field}: a system message cannot hold images; put them in a user message")
            if limit is not None and count > limit:
                raise FieldError(field, f"{field}: at most {limit} image(s) per prompt (the engine's "
                                        "--limit-mm-per-prompt)")
    return messages


ChatMessages = Annotated[list[ChatMessage], BeforeValidator(_images_fit)]


class ChatTemplateKwargs(Model):
    """Arguments for the chat template; any besides enable_thinking pass through as they are."""

    model_config = ConfigDict(extra="allow")
    enable_thinking: bool | None = None


class ChatCompletionRequest(ConstrainedRequest):
    model_config = ConfigDict(json_schema_extra={"allOf": [needs_true("stream_options", "stream"),
                                                           needs_true("top_logprobs", "logprobs"), ONE_FORMAT]})

    messages: ChatMessages = Field(min_length=1)
    logprobs: bool | None = Field(None, description="return the chosen tokens' logprobs")
    top_logprobs: integer("top_logprobs") | None = Field(None, description="alternatives per token; "
                                                                            "needs logprobs: true")
    tools: list[dict[str, Any]] | None = Field(None, description="OpenAI tool definitions")
    tool_choice: ToolChoice | None = Field(None, description="auto, none, required (a call is forced) or "
                                                            "{type: function, function: {name}} (that call)")
    parallel_tool_calls: bool | None = Field(None, description="with a forced tool_choice, false: exactly one call")
    add_generation_prompt: bool | None = Field(None, description="vLLM extra")
    chat_template_kwargs: ChatTemplateKwargs | None = Field(None, description="e.g. enable_thinking")
    # OpenAI fields that would change the output and that xserv does not implement.
    audio: Audio = None
    modalities: Modalities = None
    prediction: Prediction = None
    web_search_options: WebSearch = None
    functions: LegacyFunctions = None
    function_call: LegacyFunctions = None
    reasoning_effort: ReasoningEffort = None
    verbosity: Verbosity = None

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self, info: ValidationInfo) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "'top_logprobs' needs 'logprobs': true")
        return self

    def to_grpc(self, request_id: str) -> engine_pb2.GenerateRequest:
        """Without max_tokens a chat runs to the end of the context (as in OpenAI and vLLM)."""
        params = self.sampling_params(bool(self.logprobs), self.top_logprobs or 0)
        self.constrain(params)
        return engine_pb2.GenerateRequest(request_id=request_id, chat=self._chat_input(), params=params,
                                          priority=self.priority or 0)

    def _chat_input(self) -> engine_pb2.ChatInput:
        chat = chat_input(self.messages, self.tools, self.add_generation_prompt, self.chat_template_kwargs)
        chat.tool_choice = tool_choice_name(self.tool_choice)
        if self.parallel_tool_calls is False:  # true is the engine's default
            chat.parallel_tool_calls = False
        return chat


def chat_input(messages: list[ChatMessage], tools: list[dict[str, Any]] | None, add_generation_prompt: bool | None,
               kwargs: ChatTemplateKwargs | None) -> engine_pb2.ChatInput:
    """The engine's ChatInput: what its chat template renders (chat completions, /tokenize)."""
    chat = engine_pb2.ChatInput(messages=[message.to_grpc() for message in messages],
                                tools=[json.dumps(tool, ensure_ascii=False) for tool in tools or ()])
    if add_generation_prompt is not None:
        chat.add_generation_prompt = add_generation_prompt
    if kwargs is not None:
        if kwargs.enable_thinking is not None:
            chat.enable_thinking = kwargs.enable_thinking
        if kwargs.model_extra:
            chat.template_kwargs_json = json.dumps(kwargs.model_extra, ensure_ascii=False)
    return chat


# -- the answer --

class FunctionCallOut(Answer):
    name: str | None = Field(None, exclude_if=lambda value: value is None)
    arguments: str


class ToolCallOut(Answer):
    """A whole call in an answer; in a chunk's delta, its first piece carries id, type and name."""

    index: int | None = Field(None, exclude_if=lambda value: value is None)
    id: str | None = Field(None, exclude_if=lambda value: value is None)
    type: Literal["function"] | None = Field(None, exclude_if=lambda value: value is None)
    function: FunctionCallOut


class AssistantMessage(Answer):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    reasoning_content: str | None = omitted()
    reasoning: str | None = omitted()
    tool_calls: list[ToolCallOut] | None = omitted()


class ChatChoice(Answer):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None


class ChatCompletion(AnswerHead):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class Delta(Answer):
    role: Literal["assistant"] | None = omitted()
    content: str | None = omitted()
    reasoning_content: str | None = omitted()
    reasoning: str | None = omitted()
    tool_calls: list[ToolCallOut] | None = omitted()


class ChunkChoice(Answer):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(AnswerHead):
    """One server-sent event; with include_usage every chunk has "usage" (null until the last,
    which has no choices)."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChunkChoice]
    usage: Usage | None = Field(None, description="only with stream_options.include_usage")
