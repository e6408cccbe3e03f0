"""GET /v1/models and GET /v1/models/{id}: the one model the engines serve."""

from typing import Literal

from pydantic import Field

from xserv_rest.protocol.base import Answer


class ModelCard(Answer):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "xserv"
    root: str
    max_model_len: int = Field(description="the engine's context length, in tokens")


class ModelList(Answer):
    object: Literal["list"] = "list"
    data: list[ModelCard]
