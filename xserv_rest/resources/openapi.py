"""GET /openapi.json: the OpenAPI 3.1 document of this server's API, generated from the protocol
models with this server's limits (the engine's context length, and an embedding model's width,
once the engine has answered)."""

import falcon
import grpc

from xserv_rest.config import RestConfig
from xserv_rest.engine_client import EngineClient
from xserv_rest.protocol.openapi import openapi_document


class OpenApi:
    def __init__(self, config: RestConfig, engine: EngineClient):
        self.config = config
        self.engine = engine
        self.document: dict | None = None  # kept once it holds the engine's context length

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        if self.document is not None:
            resp.media = self.document
            return
        try:
            info = self.engine.served_model()
        except grpc.RpcError:
            resp.media = openapi_document(self.config)  # the engine is not up yet: no context limit
            return
        self.document = openapi_document(self.config, info.max_model_len, info.embedding_size or None)
        resp.media = self.document
