"""OpenAI's Responses API (POST/GET/DELETE /v1/responses) over the engine's chat Generate call:
the request and its input items (request.py, items.py), the response object (objects.py), the
events of a streamed answer (builder.py, stream.py) and the store of finished responses
(store.py)."""
