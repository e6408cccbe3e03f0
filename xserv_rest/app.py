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
from xserv_rest.routes import ROUTES


def create_app(config: RestConfig, engine_client: EngineClient) -> falcon.App:
    metrics = Metrics(config.metrics_dir)
    # AccessLog first: it stamps the request id and counts every request, rejected ones too;
    # then the request's span (traces on), which the engine calls made below it join.
    middleware = [AccessLog(metrics)]
    if config.otlp_traces_endpoint is not None:
        from xserv_rest.tracing import Tracing

        middleware.append(Tracing(config.otlp_traces_endpoint))
    middleware += [ApiKeyCheck(config.api_keys)] if config.api_keys else []
    app = falcon.App(middleware=middleware)
    app.req_options.strip_url_path_trailing_slash = True
    watcher = DisconnectWatcher()
    resources = _resources(config, engine_client, watcher, metrics)
    for route in ROUTES:
        app.add_route(route.path, resources[route.resource], suffix=route.suffix)
    if config.web_ui:
        add_web_ui_routes(app)
    handler = ErrorHandler(config.retry_after_s)
    app.add_error_handler(Exception, handler)
    app.add_error_handler(falcon.HTTPError, handler)
    return app


def _resources(config: RestConfig, engine_client: EngineClient, watcher: DisconnectWatcher,
               metrics: Metrics) -> dict[str, object]:
    """The resource objects ROUTES names, by name."""
    database = Database(config.responses_store, config.responses_max_age_s, config.responses_max_bytes)
    conversation_store = ConversationStore(database)
    return {
        "health": Health(engine_client),
        "metrics": MetricsResource(metrics),
        "openapi": OpenApi(config, engine_client),
        "models": Models(engine_client),
        "load_lora_adapter": load_lora_adapter(config, engine_client),
        "unload_lora_adapter": unload_lora_adapter(config, engine_client),
        "chat_completions": ChatCompletions(config, engine_client, watcher, metrics),
        "completions": Completions(config, engine_client, watcher, metrics),
        "embeddings": Embeddings(config, engine_client, watcher),
        "rerank": Rerank(config, engine_client, watcher),
        "score": Score(config, engine_client, watcher),
        "tokenize": Tokenize(config, engine_client),
        "detokenize": Detokenize(config, engine_client),
        "tokenizer_info": TokenizerInfoResource(engine_client),
        "responses": Responses(config, engine_client, watcher, metrics, ResponseStore(database), conversation_store),
        "conversations": Conversations(config, conversation_store),
    }
