"""GET /health: 200 while the engine reports SERVING (grpc.health.v1), 503 otherwise."""

import falcon

from xserv_rest.engine_client import EngineClient
from xserv_rest.errors import ApiError


class Health:
    def __init__(self, engine: EngineClient):
        self.engine = engine

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        if not self.engine.is_serving():
            raise ApiError(503, "the engine is not serving (starting, draining or down)",
                           type="service_unavailable", code="engine_unavailable")
        resp.media = {"status": "ok"}
