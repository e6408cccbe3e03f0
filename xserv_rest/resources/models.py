"""GET /v1/models: the one model the engines serve."""

import time

import falcon

from xserv_rest.engine_client import EngineClient

STARTED = int(time.time())


class Models:
    def __init__(self, engine: EngineClient):
        self.engine = engine

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        info = self.engine.model_info()
        resp.media = {"object": "list", "data": [
            {"id": info.model_id, "object": "model", "created": STARTED, "owned_by": "xserv",
             "root": info.model_id, "max_model_len": info.max_model_len},
        ]}
