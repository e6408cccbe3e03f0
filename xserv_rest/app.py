"""create_app(config, engine_client): the Falcon WSGI app of the OpenAI REST front."""

import falcon

from xserv_rest.config import RestConfig
from xserv_rest.disconnect import DisconnectWatcher
from xserv_rest.engine_client import EngineClient
from xserv_rest.errors import ApiError, ErrorHandler
from xserv_rest.resources.chat_completions import ChatCompletions
from xserv_rest.resources.completions import Completions
from xserv_rest.resources.health import Health
from xserv_rest.resources.models import Models


class ApiKeyCheck:
    """With --api-key, every route but /health needs "Authorization: Bearer <key>" (else 401)."""

    def __init__(self, api_key: str):
        self.expected = f"Bearer {api_key}"

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        if req.path != "/health" and req.get_header("Authorization") != self.expected:
            raise ApiError(401, "Incorrect or missing API key (Authorization: Bearer <key>).",
                           code="invalid_api_key")


def create_app(config: RestConfig, engine_client: EngineClient) -> falcon.App:
    middleware = [ApiKeyCheck(config.api_key)] if config.api_key else []
    app = falcon.App(middleware=middleware)
    app.req_options.strip_url_path_trailing_slash = True
    watcher = DisconnectWatcher()
    app.add_route("/health", Health(engine_client))
    app.add_route("/v1/models", Models(engine_client))
    app.add_route("/v1/chat/completions", ChatCompletions(config, engine_client, watcher))
    app.add_route("/v1/completions", Completions(config, engine_client, watcher))
    handler = ErrorHandler(config.retry_after_s)
    app.add_error_handler(Exception, handler)
    app.add_error_handler(falcon.HTTPError, handler)
    return app
