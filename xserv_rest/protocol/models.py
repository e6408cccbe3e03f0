"""GET /v1/models and GET /v1/models/{id}: the model the engines serve, and its LoRA adapters."""

from typing import Literal

from pydantic import Field

from xserv_rest.protocol.base import Answer


class ModelCard(Answer):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "xserv"
    root: str = Field(description="the model's id; a LoRA adapter's directory")
    parent: str | None = Field(None, description="a LoRA adapter's base model id; null for the base model")
    max_model_len: int = Field(description="the engine's context length, in tokens")
    random_weights: bool = Field(False, description="xserv's demo model (random weights): everything it writes is "
                                                    "random text; serve a real one with `xserv up --model DIR`")


class ModelList(Answer):
    object: Literal["list"] = "list"
    data: list[ModelCard]
