"""GET /v1/models and GET /v1/models/{id}: the model the engines serve, then its LoRA adapters (as
vLLM lists them); and what a request's "model" selects."""

import time
from dataclasses import dataclass

import falcon

from xserv.v1 import engine_pb2
from xserv_rest.engine_client import EngineClient
from xserv_rest.errors import ApiError
from xserv_rest.protocol.models import ModelCard, ModelList

STARTED = int(time.time())


class Models:
    """Asks the engine each time (adapters come and go at runtime), which also refreshes the
    worker's cached model info."""

    def __init__(self, engine: EngineClient):
        self.engine = engine

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.text = ModelList(data=self._models()).model_dump_json()

    def on_get_model(self, req: falcon.Request, resp: falcon.Response, model_id: str) -> None:
        """What the OpenAI SDK's models.retrieve(id) asks; ids may hold slashes (org/name)."""
        model = next((card for card in self._models() if card.id == model_id), None)
        if model is None:
            raise ApiError(404, f"The model '{model_id}' does not exist", param="model", code="model_not_found")
        resp.text = model.model_dump_json()

    def _models(self) -> list[ModelCard]:
        info = self.engine.served_model(fresh=True)
        shared = dict(created=STARTED, max_model_len=info.max_model_len, random_weights=info.random_weights)
        base = ModelCard(id=info.model_id, root=info.model_id, **shared)
        return [base] + [ModelCard(id=adapter.name, root=adapter.path, parent=info.model_id, **shared)
                         for adapter in info.lora_adapters]


@dataclass(frozen=True)
class SelectedModel:
    """What a generation request's "model" selects: the engine's model info, and a LoRA adapter."""

    info: engine_pb2.GetModelInfoResponse
    lora_name: str  # GenerateRequest.lora_name: "" for the base model

    @property
    def id(self) -> str:
        """The answer's "model": the adapter's name, or the base model's id (as vLLM)."""
        return self.lora_name or self.info.model_id


def selected_model(engine: EngineClient, requested: str | None) -> SelectedModel:
    """The base model (no model, or its id) or one of its LoRA adapters; 404 model_not_found for
    any other name. With LoRA enabled, a name the cached model info does not know is asked about
    once more: adapters are loaded at runtime (one unloaded meanwhile makes Generate NOT_FOUND,
    also a 404)."""
    info = engine.served_model()
    if requested in (None, info.model_id):
        return SelectedModel(info, "")
    if info.lora_enabled and not _has_adapter(info, requested):
        info = engine.served_model(fresh=True)
    if not _has_adapter(info, requested):
        adapters = " and the LoRA adapters that GET /v1/models lists" if info.lora_enabled else ""
        raise _not_found(requested, f"`{info.model_id}`{adapters}")
    return SelectedModel(info, requested)


def served_model(engine: EngineClient, requested: str | None) -> engine_pb2.GetModelInfoResponse:
    """The served model's info, for endpoints that LoRA adapters do not serve (embeddings,
    reranking); 404 model_not_found when a request names another model."""
    info = engine.served_model()
    if requested not in (None, info.model_id):
        raise _not_found(requested, f"`{info.model_id}`")
    return info


def _has_adapter(info: engine_pb2.GetModelInfoResponse, name: str) -> bool:
    return any(adapter.name == name for adapter in info.lora_adapters)


def _not_found(requested: str, served: str) -> ApiError:
    return ApiError(404, f"The model `{requested}` does not exist; this server serves {served}.", param="model",
                    code="model_not_found")
