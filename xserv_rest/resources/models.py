"""GET /v1/models and GET /v1/models/{id}: the one model the engines serve."""

import time

import falcon

from xserv.v1 import engine_pb2
from xserv_rest.engine_client import EngineClient
from xserv_rest.errors import ApiError
from xserv_rest.protocol.models import ModelCard, ModelList

STARTED = int(time.time())


class Models:
    def __init__(self, engine: EngineClient):
        self.engine = engine

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.text = ModelList(data=[self._model()]).model_dump_json()

    def on_get_model(self, req: falcon.Request, resp: falcon.Response, model_id: str) -> None:
        """What the OpenAI SDK's models.retrieve(id) asks; ids may hold slashes (org/name)."""
        model = self._model()
        if model_id != model.id:
            raise ApiError(404, f"The model '{model_id}' does not exist", param="model", code="model_not_found")
        resp.text = model.model_dump_json()

    def _model(self) -> ModelCard:
        info = self.engine.model_info()
        return ModelCard(id=info.model_id, created=STARTED, root=info.model_id, max_model_len=info.max_model_len)


def served_model(engine: EngineClient, requested: str | None) -> engine_pb2.GetModelInfoResponse:
    """The served model's info; 404 model_not_found when a request names another model."""
    info = engine.served_model()
    if requested not in (None, info.model_id):
        raise ApiError(404, f"The model `{requested}` does not exist; this server serves `{info.model_id}`.",
                       param="model", code="model_not_found")
    return info
