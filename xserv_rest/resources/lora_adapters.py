"""POST /v1/load_lora_adapter and POST /v1/unload_lora_adapter: vLLM's runtime LoRA endpoints over
the engine's LoadLoraAdapter and UnloadLoraAdapter. The answer is vLLM's plain-text line; errors
are the engine's, mapped as everywhere (INVALID_ARGUMENT: 400 naming lora_name or lora_path), its
NOT_FOUND naming lora_name rather than model."""

import falcon
from pydantic import BaseModel

from xserv_rest.config import RestConfig
from xserv_rest.engine_client import EngineClient
from xserv_rest.errors import invalid_request
from xserv_rest.protocol.lora import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from xserv_rest.resources.generation_resource import parse_body, read_body


class LoraUpdate:
    """One of the two endpoints: its body, the EngineClient call it makes (load_lora_adapter or
    unload_lora_adapter) and what vLLM's answer says was done."""

    def __init__(self, config: RestConfig, engine: EngineClient, body: type[BaseModel], call: str, done: str):
        self.config, self.engine = config, engine
        self.body, self.call, self.done = body, call, done

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        request = parse_body(self.body, read_body(req, self.config.max_body_bytes))
        if not self.engine.served_model().lora_enabled:
            raise invalid_request("LoRA adapters are not enabled: the engine was started without --enable-lora "
                                  "(or --lora-modules)")
        req.context.param_names = {"model": "lora_name"}
        getattr(self.engine, self.call)(request.to_grpc())
        resp.content_type = falcon.MEDIA_TEXT
        resp.text = f"Success: LoRA adapter '{request.lora_name}' {self.done} successfully."


def load_lora_adapter(config: RestConfig, engine: EngineClient) -> LoraUpdate:
    return LoraUpdate(config, engine, LoadLoraAdapterRequest, "load_lora_adapter", "added")


def unload_lora_adapter(config: RestConfig, engine: EngineClient) -> LoraUpdate:
    return LoraUpdate(config, engine, UnloadLoraAdapterRequest, "unload_lora_adapter", "removed")
