"""POST /v1/responses: the request body, and the chat request it becomes.

The Responses fields map onto the chat request (so its checks and its GenerateRequest are the
chat endpoint's): instructions become a system message, function tools lose their wrapper,
reasoning.effort switches Qwen3's thinking, text.format becomes response_format.
"""

import re
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, StringConstraints, Tag, ValidationError, model_validator

from xserv_rest.errors import ApiError, invalid_request
from xserv_rest.protocol.base import FieldError, Limits, Model, RequestBody, described, integer, number
from xserv_rest.protocol.chat import ChatCompletionRequest
from xserv_rest.protocol.errors import describe
from xserv_rest.protocol.sampling import StreamOptions
from xserv_rest.protocol.unsupported import unsupported
from xserv_rest.responses.items import Item, MessageItem, to_messages

NO_THINKING = ("none", "minimal")
LOGPROBS = "message.output_text.logprobs"
Metadata = Annotated[dict[Annotated[str, StringConstraints(max_length=64)], Annotated[str, StringConstraints(
    max_length=512)]], Field(max_length=16)]  # OpenAI's limits
# The chat request's field -> the Responses field it came from, for errors.
CHAT_FIELDS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
               "response_format": "text.format", "verbosity": "text.verbosity",
               "chat_template_kwargs": "reasoning.effort"}


class FunctionTool(Model):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat_tool(self) -> dict:
        function = {"name": self.name}  # OpenAI's key order, as the chat request's tools have it
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters or {"type": "object", "properties": {}}
        return {"type": "function", "function": function}


class OtherTool(Model):
    """A hosted tool (web_search, file_search, mcp, ...): kept in the response, not offered to the model."""

    model_config = ConfigDict(extra="allow",
                              json_schema_extra={"not": {"properties": {"type": {"const": "function"}}}})
    type: str


def _tool_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "function" if kind == "function" else "other"


Tool = Annotated[Annotated[FunctionTool, Tag("function")] | Annotated[OtherTool, Tag("other")],
                 Discriminator(_tool_kind)]


class NamedFunction(Model):
    type: Literal["function"]
    name: str


class Reasoning(Model):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = Field(
        None, description="none or minimal: Qwen3 answers without thinking; any other: it thinks")
    summary: Literal["auto", "concise", "detailed"] | None = Field(
        None, description="accepted; reasoning items carry the whole reasoning text, no summary")


class TextFormat(Model):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    def response_format(self) -> dict:
        if self.type != "json_schema":
            return {"type": self.type}
        schema = {"name": self.name or "response", "schema": self.schema_ or {}}
        schema |= {"strict": self.strict} if self.strict is not None else {}
        schema |= {"description": self.description} if self.description is not None else {}
        return {"type": "json_schema", "json_schema": schema}


class TextConfig(Model):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ConversationParam(Model):
    id: Annotated[str, StringConstraints(min_length=1)]


# background needs store; conversation and previous_response_id exclude each other
ONE_HISTORY = {"not": {"required": ["conversation", "previous_response_id"], "properties": {
    "conversation": {"not": {"type": "null"}}, "previous_response_id": {"not": {"type": "null"}}}}}
STORED_BACKGROUND = {"if": {"required": ["background"], "properties": {"background": {"const": True}}},
                     "then": {"not": {"required": ["store"], "properties": {"store": {"const": False}}}}}


class ResponsesRequest(RequestBody):
    model_config = ConfigDict(json_schema_extra={"allOf": [ONE_HISTORY, STORED_BACKGROUND]})
    model: str | None = Field(None, description="the served model id or a LoRA adapter's name (GET /v1/models); "
                                                "may be omitted")
    input: str | Annotated[list[Item], Field(min_length=1)] = Field(description="a user message, or a list of "
                                                                                "items")
    instructions: str | None = Field(None, description="a system message before the input (not carried over "
                                                       "by previous_response_id)")
    previous_response_id: str | None = Field(None, description="continue after this stored response")
    tools: list[Tool] | None = Field(None, description="function tools are offered to the model; others "
                                                        "(web_search, mcp, ...) are accepted and not offered")
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    reasoning: Reasoning | None = None
    max_output_tokens: integer("max_tokens") | None = Field(None, description="most tokens to generate, "
                                                                               "reasoning included")
    temperature: number("temperature") | None = None
    top_p: number("top_p") | None = None
    text: TextConfig | None = None
    metadata: Metadata | None = Field(None, description="kept with the response")
    store: bool | None = Field(None, description="keep the response for GET and previous_response_id "
                                                 "(default true)")
    stream: bool | None = Field(None, description="answer as server-sent events")
    stream_options: StreamOptions | None = None
    background: bool | None = Field(None, description="answer at once (status queued) and generate on the server; "
                                                      "needs store. GET polls it, POST .../cancel stops it")
    conversation: Annotated[str, StringConstraints(min_length=1)] | ConversationParam | None = Field(
        None, description="a conversation (POST /v1/conversations): its items come before the input, and the "
                          "input and output are added to it")
    include: list[str] | None = Field(None, description=f"{LOGPROBS!r}: the answer text's logprobs; the others "
                                                        "are accepted and add nothing")
    top_logprobs: integer("top_logprobs") | None = Field(None, description="alternatives per token, with the "
                                                                            "answer text's logprobs")
    truncation: Literal["auto", "disabled"] | None = Field(None, description="accepted; input past the "
                                                                             "context is a 400 either way")
    priority: integer("priority") | None = described("priority", "(vLLM extra)")
    # Accepted and unused: they change nothing xserv produces.
    user: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    # Fields that would change the output and that xserv does not implement.
    prompt: unsupported("stored prompt templates are not implemented") = None
    max_tool_calls: unsupported("xserv cannot cap the number of tool calls") = None
    context_management: unsupported("context compaction is not implemented") = None

    @property
    def store_it(self) -> bool:
        return self.store is not False

    @property
    def conversation_id(self) -> str | None:
        return self.conversation.id if isinstance(self.conversation, ConversationParam) else self.conversation

    @model_validator(mode="after")
    def _one_history(self) -> "ResponsesRequest":
        if self.background and self.store is False:
            raise FieldError("background", "background responses must be stored: leave store out or set it true")
        if self.conversation is not None and self.previous_response_id is not None:
            raise FieldError("conversation", "conversation and previous_response_id cannot both be given")
        return self

    @property
    def logprobs(self) -> bool:
        return LOGPROBS in (self.include or ()) or self.top_logprobs is not None

    def echo(self) -> dict:
        """The settings a response repeats, as OpenAI's do (defaults filled in)."""
        tool_choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedFunction) else self.tool_choice
        text = self.text.model_dump(by_alias=True, exclude_none=True) if self.text and self.text.format else None
        return dict(self.model_dump(include={"instructions", "previous_response_id", "max_output_tokens",
                                             "temperature", "top_p", "top_logprobs", "user"}),
                    tools=[tool.model_dump(mode="json", by_alias=True, exclude_none=True) for tool in self.tools or ()],
                    tool_choice=tool_choice or "auto", parallel_tool_calls=self.parallel_tool_calls is not False,
                    reasoning=self.reasoning.model_dump() if self.reasoning else {},
                    text=text or {"format": {"type": "text"}}, truncation=self.truncation or "disabled",
                    metadata=self.metadata or {}, store=self.store_it, background=bool(self.background),
                    conversation={"id": self.conversation_id} if self.conversation_id else None)

    def input_items(self) -> list:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def chat_request(self, items: list, limits) -> ChatCompletionRequest:
        """The chat request for `items` (the stored conversation, then this input), checked by
        the chat model: a refusal names this request's field."""
        body = {"messages": to_messages(items, self.instructions), "max_completion_tokens": self.max_output_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "stream": self.stream,
                "tools": [tool.chat_tool() for tool in self.tools or () if isinstance(tool, FunctionTool)] or None,
                "tool_choice": self._chat_tool_choice(), "parallel_tool_calls": self.parallel_tool_calls,
                "response_format": self.text.format.response_format() if self.text and self.text.format else None,
                "verbosity": self.text.verbosity if self.text else None,
                "logprobs": self.logprobs or None, "top_logprobs": self.top_logprobs, "priority": self.priority}
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["chat_template_kwargs"] = {"enable_thinking": self.reasoning.effort not in NO_THINKING}
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None},
                                                        context={"limits": limits})
        except ValidationError as exc:
            raise _renamed(*describe(exc, ChatCompletionRequest)) from None

    def _chat_tool_choice(self) -> str | dict | None:
        if isinstance(self.tool_choice, NamedFunction):
            return {"type": "function", "function": {"name": self.tool_choice.name}}
        return self.tool_choice


def chat_accepts(**fields) -> bool:
    """Whether a request with these fields (and input "x") gets past the chat request's checks."""
    try:
        ResponsesRequest.model_validate(dict(fields, input="x")).chat_request([MessageItem(role="user", content="x")],
                                                                             Limits())
    except (ValidationError, ApiError):
        return False
    return True


def responses_param(param: str) -> str:
    """A chat (or engine) field's name -> the Responses field it came from: "max_tokens" ->
    "max_output_tokens", "messages[2].content" -> "input"."""
    head = param.split(".")[0].split("[")[0]
    if head == "messages":
        return "input"  # messages hold instructions and earlier turns too: their index is not input's
    return CHAT_FIELDS.get(head, head) + param[len(head):]


def in_responses_terms(message: str, param: str) -> tuple[str, str]:
    """(message, param) of a chat (or engine) field's error, told in the Responses field's name."""
    renamed = responses_param(param)
    # the whole name: not the start of a longer one ("messages[1]" in "messages[1].content")
    return re.sub(rf"(?<![\w.]){re.escape(param)}(?![\w.\[])", renamed, message), renamed


def _renamed(message: str, param: str | None, code: str | None) -> ApiError:
    if param is None:
        return invalid_request(message, code=code)
    message, param = in_responses_terms(message, param)
    return invalid_request(message, param=param, code=code)
