"""The bodies of the Conversations API: what a client sends, and the conversation object."""

from typing import Annotated, Literal

from pydantic import Field

from xserv_rest.protocol.base import Answer, RequestBody
from xserv_rest.responses.items import Item
from xserv_rest.responses.request import Metadata

MAX_ITEMS_AT_ONCE = 20  # OpenAI's limit per create call


class ConversationCreate(RequestBody):
    items: Annotated[list[Item], Field(max_length=MAX_ITEMS_AT_ONCE)] | None = Field(
        None, description="the conversation's first items")
    metadata: Metadata | None = None


class ConversationUpdate(RequestBody):
    metadata: Metadata = Field(description="replaces the conversation's metadata")


class ItemsCreate(RequestBody):
    items: Annotated[list[Item], Field(min_length=1, max_length=MAX_ITEMS_AT_ONCE)]


class Conversation(Answer):
    id: str
    object: Literal["conversation"] = "conversation"
    created_at: int
    metadata: dict[str, str] = Field(default_factory=dict)


class DeletedConversation(Answer):
    id: str
    object: Literal["conversation.deleted"] = "conversation.deleted"
    deleted: Literal[True] = True
