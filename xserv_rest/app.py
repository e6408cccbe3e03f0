"""create_app(config, engine_client): the Falcon WSGI app of the OpenAI REST front."""

import falcon

from xserv_rest.access_log import AccessLog
from xserv_rest.auth import ApiKeyCheck
from xserv_rest.config import RestConfig
from xserv_rest.conversations.store import ConversationStore
from xserv_rest.disconnect import DisconnectWatcher
from xserv_rest.engine_client import EngineClient
from xserv_rest.errors import ErrorHandler
from xserv_rest.metrics import Metrics
from xserv_rest.resources.chat_completions import ChatCompletions
from xserv_rest.resources.completions import Completions
from xserv_rest.resources.conversations import Conversations
from xserv_rest.resources.embeddings import Embeddings
from xserv_rest.resources.health import Health
from xserv_rest.resources.lora_adapters import load_lora_adapter, unload_lora_adapter
from xserv_rest.resources.metrics import MetricsResource
from xserv_rest.resources.models import Models
from xserv_rest.resources.openapi import OpenApi
from xserv_rest.resources.rerank import Rerank, Score
from xserv_rest.resources.responses import Responses
from xserv_rest.resources.tokenize import Detokenize, Tokenize, TokenizerInfoResource
from xserv_rest.resources.web_ui import add_web_ui_routes
from xserv_rest.responses.database import Database
from xserv_rest.responses.store import ResponseStore


def create_app(config: RestConfig, engine_client: EngineClient) -> falcon.App:
    metrics = Metrics(config.metrics_dir)
    # AccessLog first: it stamps the request id and counts every request, rejected ones too.
    middleware = [AccessLog(metrics)] + ([ApiKeyCheck(config.api_keys)] if config.api_keys else [])
    app = falcon.App(middleware=middleware)
    app.req_options.strip_url_path_trailing_slash = True
    watcher = DisconnectWatcher()
    app.add_route("/health", Health(engine_client))
    app.add_route("/metrics", MetricsResource(metrics))
    app.add_route("/openapi.json", OpenApi(config, engine_client))
    models = Models(engine_client)
    app.add_route("/v1/models", models)
    app.add_route("/v1/models/{model_id:path}", models, suffix="model")
    app.add_route("/v1/load_lora_adapter", load_lora_adapter(config, engine_client))  # vLLM's runtime LoRA endpoints
    app.add_route("/v1/unload_lora_adapter", unload_lora_adapter(config, engine_client))
    app.add_route("/v1/chat/completions", ChatCompletions(config, engine_client, watcher, metrics))
    app.add_route("/v1/completions", Completions(config, engine_client, watcher, metrics))
    app.add_route("/v1/embeddings", Embeddings(config, engine_client, watcher))
    rerank = Rerank(config, engine_client, watcher)  # vLLM's reranking endpoints (Jina's and Cohere's API)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.add_route(path, rerank)
    score = Score(config, engine_client, watcher)
    app.add_route("/score", score)
    app.add_route("/v1/score", score)
    app.add_route("/tokenize", Tokenize(config, engine_client))  # vLLM's tokenizer endpoints
    app.add_route("/detokenize", Detokenize(config, engine_client))
    app.add_route("/tokenizer_info", TokenizerInfoResource(engine_client))
    database = Database(config.responses_store, config.responses_max_age_s, config.responses_max_bytes)
    conversation_store = ConversationStore(database)
    responses = Responses(config, engine_client, watcher, metrics, ResponseStore(database), conversation_store)
    app.add_route("/v1/responses", responses)
    app.add_route("/v1/responses/{response_id}", responses, suffix="response")
    app.add_route("/v1/responses/{response_id}/cancel", responses, suffix="cancel")
    app.add_route("/v1/responses/{response_id}/input_items", responses, suffix="input_items")
    conversations = Conversations(config, conversation_store)
    app.add_route("/v1/conversations", conversations)
    app.add_route("/v1/conversations/{conversation_id}", conversations, suffix="conversation")
    app.add_route("/v1/conversations/{conversation_id}/items", conversations, suffix="items")
    app.add_route("/v1/conversations/{conversation_id}/items/{item_id}", conversations, suffix="item")
    if config.web_ui:
        add_web_ui_routes(app)
    handler = ErrorHandler(config.retry_after_s)
    app.add_error_handler(Exception, handler)
    app.add_error_handler(falcon.HTTPError, handler)
    return app
