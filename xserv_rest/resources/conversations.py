"""/v1/conversations[/{id}] and /v1/conversations/{id}/items[/{item_id}]: OpenAI's Conversations
API over the shared store."""

import time

import falcon

from xserv_rest.config import RestConfig
from xserv_rest.conversations.objects import (Conversation, ConversationCreate, ConversationUpdate,
                                              DeletedConversation, ItemsCreate)
from xserv_rest.conversations.store import ConversationStore
from xserv_rest.errors import ApiError
from xserv_rest.resources.generation_resource import parse_body, read_body
from xserv_rest.responses.builder import new_id
from xserv_rest.responses.items import dump_items, listed, with_ids
from xserv_rest.responses.objects import ItemList
from xserv_rest.responses.pages import page


class Conversations:
    def __init__(self, config: RestConfig, store: ConversationStore):
        self.config = config
        self.store = store

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = parse_body(ConversationCreate, read_body(req, self.config.max_body_bytes))
        conversation = Conversation(id=new_id("conv"), created_at=int(time.time()), metadata=body.metadata or {})
        self.store.create(conversation.model_dump(mode="json"), with_ids(dump_items(body.items or [])))
        resp.media = conversation.model_dump(mode="json")

    def on_get_conversation(self, req: falcon.Request, resp: falcon.Response, conversation_id: str) -> None:
        resp.media = self._conversation(conversation_id)

    def on_post_conversation(self, req: falcon.Request, resp: falcon.Response, conversation_id: str) -> None:
        body = parse_body(ConversationUpdate, read_body(req, self.config.max_body_bytes))
        updated = self.store.update(conversation_id, body.metadata)
        if updated is None:
            raise _not_found(conversation_id)
        resp.media = updated

    def on_delete_conversation(self, req: falcon.Request, resp: falcon.Response, conversation_id: str) -> None:
        if not self.store.delete(conversation_id):
            raise _not_found(conversation_id)
        resp.media = DeletedConversation(id=conversation_id).model_dump(mode="json")

    def on_get_items(self, req: falcon.Request, resp: falcon.Response, conversation_id: str) -> None:
        items = self.store.items(conversation_id)
        if items is None:
            raise _not_found(conversation_id)
        resp.media = page([listed(item) for item in items], req).model_dump(mode="json")

    def on_post_items(self, req: falcon.Request, resp: falcon.Response, conversation_id: str) -> None:
        body = parse_body(ItemsCreate, read_body(req, self.config.max_body_bytes))
        items = with_ids(dump_items(body.items))
        if not self.store.add_items(conversation_id, items):
            raise _not_found(conversation_id)
        data = [listed(item) for item in items]
        resp.media = ItemList(data=data, first_id=data[0]["id"], last_id=data[-1]["id"],
                              has_more=False).model_dump(mode="json")

    def on_get_item(self, req: falcon.Request, resp: falcon.Response, conversation_id: str, item_id: str) -> None:
        self._conversation(conversation_id)
        item = self.store.item(conversation_id, item_id)
        if item is None:
            raise _item_not_found(item_id)
        resp.media = listed(item)

    def on_delete_item(self, req: falcon.Request, resp: falcon.Response, conversation_id: str, item_id: str) -> None:
        conversation = self._conversation(conversation_id)
        if not self.store.delete_item(conversation_id, item_id):
            raise _item_not_found(item_id)
        resp.media = conversation

    def _conversation(self, conversation_id: str) -> dict:
        conversation = self.store.get(conversation_id)
        if conversation is None:
            raise _not_found(conversation_id)
        return conversation


def _not_found(conversation_id: str) -> ApiError:
    return ApiError(404, f"No conversation found with id '{conversation_id}'.", param="conversation_id",
                    code="not_found")


def _item_not_found(item_id: str) -> ApiError:
    return ApiError(404, f"No item found with id '{item_id}'.", param="item_id", code="not_found")
