"""The response object of the Responses API and its output items, as OpenAI's API defines them.
Output items have the shape of input items too, so a stored response's output is read back as
the next turn's input."""

from typing import Any, Literal

from pydantic import Field

from xserv_rest.protocol.base import Answer, omitted
from xserv_rest.protocol.logprobs import TokenLogprob

Status = Literal["in_progress", "completed", "incomplete"]


class OutputText(Answer):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list = Field(default_factory=list)
    logprobs: list[TokenLogprob] = Field(default_factory=list, description="with include "
                                         "[\"message.output_text.logprobs\"] or top_logprobs")


class OutputMessage(Answer):
    type: Literal["message"] = "message"
    id: str
    status: Status = "in_progress"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningContent(Answer):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class ReasoningOutput(Answer):
    type: Literal["reasoning"] = "reasoning"
    id: str
    status: Status = "in_progress"
    summary: list = Field(default_factory=list, description="empty: the reasoning text is in content")
    content: list[ReasoningContent] = Field(default_factory=list)


class FunctionCallOutput(Answer):
    type: Literal["function_call"] = "function_call"
    id: str
    status: Status = "in_progress"
    call_id: str
    name: str
    arguments: str = ""


OutputItem = OutputMessage | ReasoningOutput | FunctionCallOutput


class InputTokensDetails(Answer):
    cached_tokens: int = Field(description="input tokens found in the prefix cache")


class OutputTokensDetails(Answer):
    reasoning_tokens: int = Field(description="output tokens of the reasoning, <think> through </think>")


class ResponseUsage(Answer):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(Answer):
    reason: Literal["max_output_tokens"]


class ResponseError(Answer):
    code: str
    message: str


class ConversationRef(Answer):
    id: str


class Response(Answer):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = omitted()
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"] = "in_progress"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    # The request's settings, echoed as OpenAI does.
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    reasoning: dict[str, Any] = Field(default_factory=dict)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: str = "disabled"
    metadata: dict[str, str] = Field(default_factory=dict)
    store: bool = True
    background: bool = False
    conversation: ConversationRef | None = omitted()
    user: str | None = None


class DeletedResponse(Answer):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True


class ItemList(Answer):
    """A page of items (input_items, conversation items), as OpenAI's cursor pagination."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
