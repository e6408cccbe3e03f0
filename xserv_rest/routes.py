"""Every route of the REST front, once: create_app mounts them, the OpenAPI document describes
the documented ones and the tests read them from here.

`resource` names the object create_app builds for the route (several routes may share one);
`suffix` is Falcon's responder suffix (on_get_<suffix>). `openapi_path` is the route's path in
/openapi.json: its Falcon path unless it differs, None for a route the document leaves out.
The chat page (`/`, `/web/{name}`) is not an API route: resources/web_ui.py mounts it.
"""

from dataclasses import dataclass

SAME = "same"


@dataclass(frozen=True)
class Route:
    path: str  # Falcon's URI template; also the route label of the metrics and the access log
    resource: str
    suffix: str | None = None
    openapi: str | None = SAME

    @property
    def openapi_path(self) -> str | None:
        return self.path if self.openapi == SAME else self.openapi


ROUTES = (
    Route("/health", "health"),
    Route("/metrics", "metrics"),
    Route("/openapi.json", "openapi", openapi=None),
    Route("/v1/models", "models"),
    Route("/v1/models/{model_id:path}", "models", "model", openapi="/v1/models/{model}"),
    Route("/v1/load_lora_adapter", "load_lora_adapter"),  # vLLM's runtime LoRA endpoints
    Route("/v1/unload_lora_adapter", "unload_lora_adapter"),
    Route("/v1/chat/completions", "chat_completions"),
    Route("/v1/completions", "completions"),
    Route("/v1/embeddings", "embeddings"),
    Route("/rerank", "rerank"),  # vLLM's reranking endpoints (Jina's and Cohere's API)
    Route("/v1/rerank", "rerank"),
    Route("/v2/rerank", "rerank"),
    Route("/score", "score"),
    Route("/v1/score", "score"),
    Route("/tokenize", "tokenize"),  # vLLM's tokenizer endpoints
    Route("/detokenize", "detokenize"),
    Route("/tokenizer_info", "tokenizer_info"),
    Route("/v1/responses", "responses"),
    Route("/v1/responses/{response_id}", "responses", "response"),
    Route("/v1/responses/{response_id}/cancel", "responses", "cancel"),
    Route("/v1/responses/{response_id}/input_items", "responses", "input_items"),
    Route("/v1/conversations", "conversations"),
    Route("/v1/conversations/{conversation_id}", "conversations", "conversation"),
    Route("/v1/conversations/{conversation_id}/items", "conversations", "items"),
    Route("/v1/conversations/{conversation_id}/items/{item_id}", "conversations", "item"),
)


def openapi_paths() -> list[str]:
    """The paths /openapi.json documents, in the table's order."""
    return list(dict.fromkeys(route.openapi_path for route in ROUTES if route.openapi_path is not None))
