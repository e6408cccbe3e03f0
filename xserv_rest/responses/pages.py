"""OpenAI's cursor pagination of item lists (a response's input_items, a conversation's items):
`after` an item id, `limit` 1 to 100 (default 20), `order` asc or desc (default desc)."""

import falcon

from xserv_rest.errors import invalid_request
from xserv_rest.responses.objects import ItemList

DEFAULT_LIMIT = 20
MAX_LIMIT = 100


def page(items: list[dict], req: falcon.Request) -> ItemList:
    """The page of `items` (oldest first) that the request's query asks for."""
    order = req.get_param("order") or "desc"
    if order not in ("asc", "desc"):
        raise invalid_request(f"'order' must be asc or desc, got {order!r}", param="order")
    limit = req.get_param("limit") or str(DEFAULT_LIMIT)
    if not limit.isdigit() or not 1 <= int(limit) <= MAX_LIMIT:
        raise invalid_request(f"'limit' must be an integer from 1 to {MAX_LIMIT}, got {limit!r}", param="limit")
    ordered = items if order == "asc" else items[::-1]
    start = 0
    after = req.get_param("after")
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise invalid_request(f"'after': no item has id {after!r}", param="after")
        start = ids.index(after) + 1
    data = ordered[start:start + int(limit)]
    return ItemList(data=data, first_id=data[0]["id"] if data else None, last_id=data[-1]["id"] if data else None,
                    has_more=start + int(limit) < len(ordered))


def list_parameters() -> list[dict]:
    """The query parameters of a paginated list, for /openapi.json."""
    return [{"name": "after", "in": "query", "schema": {"type": "string"}, "description": "an item id: the page "
             "starts after it"},
            {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT,
                                                          "default": DEFAULT_LIMIT}},
            {"name": "order", "in": "query", "schema": {"enum": ["asc", "desc"], "default": "desc"}}]
