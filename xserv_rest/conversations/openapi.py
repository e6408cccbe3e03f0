"""The Conversations API's part of /openapi.json (added with the Responses API's)."""

from xserv_rest.conversations.objects import (Conversation, ConversationCreate, ConversationUpdate,
                                              DeletedConversation, ItemsCreate)
from xserv_rest.protocol.openapi import REF, error_responses, json_body
from xserv_rest.responses.pages import list_parameters

CONVERSATION_MODELS = [(ConversationCreate, "validation"), (ConversationUpdate, "validation"),
                       (ItemsCreate, "validation"), (Conversation, "serialization"),
                       (DeletedConversation, "serialization")]


def _ok(model: str, description: str) -> dict:
    return json_body({"$ref": REF.format(model=model)}) | {"description": description}


def _body(model: str) -> dict:
    return {"required": True, "content": {"application/json": {"schema": {"$ref": REF.format(model=model)}}}}


def conversation_paths(secured: bool) -> dict:
    auth = ["401"] if secured else []
    conversation_id = [{"name": "conversation_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    item_id = conversation_id + [{"name": "item_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    return {
        "/v1/conversations": {"post": {
            "summary": "create a conversation", "operationId": "createConversation",
            "requestBody": _body("ConversationCreate"),
            "responses": {"200": _ok("Conversation", "the conversation"),
                          **error_responses(["400", "413"] + auth)}}},
        "/v1/conversations/{conversation_id}": {
            "get": {"summary": "a conversation", "operationId": "retrieveConversation", "parameters": conversation_id,
                    "responses": {"200": _ok("Conversation", "the conversation"), **error_responses(["404"] + auth)}},
            "post": {"summary": "replace a conversation's metadata", "operationId": "updateConversation",
                     "parameters": conversation_id, "requestBody": _body("ConversationUpdate"),
                     "responses": {"200": _ok("Conversation", "the conversation"),
                                   **error_responses(["400", "404", "413"] + auth)}},
            "delete": {"summary": "delete a conversation and its items", "operationId": "deleteConversation",
                       "parameters": conversation_id,
                       "responses": {"200": _ok("DeletedConversation", "deleted"),
                                     **error_responses(["404"] + auth)}}},
        "/v1/conversations/{conversation_id}/items": {
            "get": {"summary": "a conversation's items", "operationId": "listConversationItems",
                    "parameters": conversation_id + list_parameters(),
                    "responses": {"200": _ok("ItemList", "a page of items"),
                                  **error_responses(["400", "404"] + auth)}},
            "post": {"summary": "add items to a conversation", "operationId": "createConversationItems",
                     "parameters": conversation_id, "requestBody": _body("ItemsCreate"),
                     "responses": {"200": _ok("ItemList", "the items added"),
                                   **error_responses(["400", "404", "413"] + auth)}}},
        "/v1/conversations/{conversation_id}/items/{item_id}": {
            "get": {"summary": "a conversation's item", "operationId": "retrieveConversationItem",
                    "parameters": item_id,
                    "responses": {"200": json_body({"type": "object"}) | {"description": "the item"},
                                  **error_responses(["404"] + auth)}},
            "delete": {"summary": "delete an item from a conversation", "operationId": "deleteConversationItem",
                       "parameters": item_id,
                       "responses": {"200": _ok("Conversation", "the conversation"),
                                     **error_responses(["404"] + auth)}}},
    }
