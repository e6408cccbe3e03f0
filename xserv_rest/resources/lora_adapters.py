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


class _LoraUpdate:
    def __init__(self, config: RestConfig, engine: EngineClient):
        self.config = config
        self.engine = engine

    def _body(self, req: falcon.Request, model: type[BaseModel]):
        """The validated body, once the engine is known to serve LoRA adapters."""
        request = parse_body(model, read_body(req, self.config.max_body_bytes))
        if not self.engine.served_model().lora_enabled:
            raise invalid_request("LoRA adapters are not enabled: the engine was started without --enable-lora "
                                  "(or --lora-modules)")
        req.context.param_names = {"model": "lora_name"}
        return request


class LoadLoraAdapter(_LoraUpdate):
    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        request = self._body(req, LoadLoraAdapterRequest)
        self.engine.load_lora_adapter(request.to_grpc())
        resp.content_type = falcon.MEDIA_TEXT
        resp.text = f"Success: LoRA adapter '{request.lora_name}' added successfully."


class UnloadLoraAdapter(_LoraUpdate):
    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        request = self._body(req, UnloadLoraAdapterRequest)
        self.engine.unload_lora_adapter(request.to_grpc())
        resp.content_type = falcon.MEDIA_TEXT
        resp.text = f"Success: LoRA adapter '{request.lora_name}' removed successfully."
