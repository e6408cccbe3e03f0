"""The items of a Responses conversation, as the request's `input` holds them (and as a stored
response's output is read back), and their conversion to the chat messages that the engine's
chat template renders.

Consecutive reasoning, assistant message and function_call items are one assistant turn (its
reasoning_content, content and tool_calls); each function_call_output is a tool message.
"""

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag, TypeAdapter, model_validator
from pydantic_core import PydanticCustomError

from xserv_rest.protocol.base import Model
from xserv_rest.protocol.chat import REFUSED, ChatMessage, FunctionCall, RefusedPart, ToolCall
from xserv_rest.protocol.unsupported import unsupported
from xserv_rest.responses.builder import new_id

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


class TextContent(Model):
    type: Literal["input_text", "output_text"] = Field(description="text only: no images, files or audio")
    text: str

    def chat_part(self) -> dict:
        return {"type": "text", "text": self.text}


class ImageContent(Model):
    """An image, loaded as chat's image_url parts are (docs/rest.md, Images) when the chat request is made."""

    type: Literal["input_image"]
    image_url: str = Field(description="a data: URL; an http(s) URL on a host of the server's "
                                       "--allowed-media-domains; a file: URL under its --allowed-local-media-path")
    detail: Literal["auto", "low", "high"] | None = Field(None, description="accepted; changes nothing")
    file_id: unsupported("xserv has no file store: send the image as image_url") = None

    def chat_part(self) -> dict:
        return {"type": "image_url", "image_url": {"url": self.image_url}}


def _content_kind(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if kind in ("input_text", "output_text"):
        return "text"
    if kind == "input_image":
        return kind
    return "refused" if isinstance(kind, str) else None


Content = Annotated[
    Annotated[TextContent, Tag("text")] | Annotated[ImageContent, Tag("input_image")]
    | Annotated[RefusedPart, Tag("refused"), REFUSED],
    Discriminator(_content_kind, custom_error_type="part_type",
                  custom_error_message="must be a content part with a type (input_text, output_text or input_image)")]


def _joined(content: str | list[TextContent]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


# an assistant message holds no input_image (a MessageItem rule, stated in the schema)
NO_ASSISTANT_IMAGES = {"if": {"required": ["role"], "properties": {"role": {"const": "assistant"}}},
                       "then": {"properties": {"content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {
                           "not": {"required": ["type"], "properties": {"type": {"const": "input_image"}}}}}]}}}}


class MessageItem(Model):
    model_config = ConfigDict(json_schema_extra={"allOf": [NO_ASSISTANT_IMAGES]})
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Content] = Field(description="a string or parts: input_text, output_text, input_image")
    id: str | None = None

    @model_validator(mode="after")
    def _images_are_input(self) -> "MessageItem":
        if self.role == "assistant" and self.has_images:
            raise PydanticCustomError("assistant_image", "is an assistant message, which cannot hold images")
        return self

    @property
    def has_images(self) -> bool:
        return not isinstance(self.content, str) and any(isinstance(part, ImageContent) for part in self.content)

    def chat_message(self) -> ChatMessage | dict:
        """With images, a dict: the chat request's validation loads them, under the server's rules."""
        if self.has_images:
            return {"role": self.role, "content": [part.chat_part() for part in self.content]}
        return ChatMessage(role=self.role, content=_joined(self.content))


class FunctionCallItem(Model):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(description="the arguments as a JSON text")
    id: str | None = None


class FunctionCallOutputItem(Model):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextContent] = Field(description="the tool's result: a string or input_text parts")
    id: str | None = None


class ReasoningText(Model):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(Model):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = Field(None, description="the reasoning text (xserv's reasoning items "
                                                                  "carry it); else the summary is used")

    def text(self) -> str:
        parts = self.content if self.content else self.summary
        return "".join(part.text for part in parts)


def _item_type(value: Any) -> str | None:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if isinstance(kind, str) else None


Item = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type, custom_error_type="item_type",
                  custom_error_message=f"must be an item of type {', '.join(ITEM_TYPES)} (xserv supports "
                                       "no others)")]
ITEMS = TypeAdapter(list[Item])


def parse_items(stored: list[dict]) -> list:
    """Items stored as JSON (a previous response's input and output) back as models."""
    return ITEMS.validate_python(stored)


def dump_items(items: list) -> list[dict]:
    return ITEMS.dump_python(items, mode="json", exclude_none=True)


def with_ids(items: list[dict]) -> list[dict]:
    """Stored items, each with an id (input items may come without one), as OpenAI names them."""
    return [item if item.get("id") else dict(item, id=new_id(ID_PREFIXES[item["type"]])) for item in items]


def listed(item: dict) -> dict:
    """A stored item as OpenAI lists it (input_items, conversation items): text content as
    parts, and a status."""
    item = dict(item)
    if item["type"] == "message" and isinstance(item["content"], str):
        kind = "output_text" if item["role"] == "assistant" else "input_text"
        item["content"] = [{"type": kind, "text": item["content"]}]
    if item["type"] != "reasoning":
        item.setdefault("status", "completed")
    return item


def to_messages(items: list, instructions: str | None) -> list[ChatMessage | dict]:
    messages = [ChatMessage(role="system", content=instructions)] if instructions else []
    turn: ChatMessage | None = None  # the assistant turn being gathered
    for item in items:
        if isinstance(item, MessageItem) and item.role != "assistant":
            messages.append(item.chat_message())
            turn = None
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=_joined(item.output)))
            turn = None
        else:
            if turn is None or _starts_new_turn(turn, item):
                turn = ChatMessage(role="assistant", content="")
                messages.append(turn)
            _add_to_turn(turn, item)
    return messages


def _starts_new_turn(turn: ChatMessage, item) -> bool:
    """Reasoning opens a turn, text follows it, calls come last: anything out of that order is
    the next assistant turn."""
    if isinstance(item, ReasoningItem):
        return bool(turn.reasoning_content or turn.content or turn.tool_calls)
    if isinstance(item, MessageItem):
        return bool(turn.content or turn.tool_calls)
    return False


def _add_to_turn(turn: ChatMessage, item) -> None:
    if isinstance(item, ReasoningItem):
        turn.reasoning_content = item.text()
    elif isinstance(item, MessageItem):
        turn.content = _joined(item.content)
    else:
        call = ToolCall(id=item.call_id, type="function", function=FunctionCall(name=item.name,
                                                                                 arguments=item.arguments))
        turn.tool_calls = (turn.tool_calls or []) + [call]
