"""POST /v1/load_lora_adapter and POST /v1/unload_lora_adapter: vLLM's runtime LoRA endpoints.
Each body builds its engine request; the answer is vLLM's plain-text line."""

from pydantic import Field

from xserv.v1 import engine_pb2
from xserv_rest.protocol.base import RequestBody, integer


class LoadLoraAdapterRequest(RequestBody):
    lora_name: str = Field(min_length=1, description="the name requests select it by (their \"model\")")
    lora_path: str = Field(min_length=1, description="the PEFT adapter's directory, on the engine's machine")

    def to_grpc(self) -> engine_pb2.LoadLoraAdapterRequest:
        return engine_pb2.LoadLoraAdapterRequest(lora_name=self.lora_name, lora_path=self.lora_path)


class UnloadLoraAdapterRequest(RequestBody):
    lora_name: str = Field(min_length=1, description="a loaded adapter's name")
    lora_int_id: integer() | None = Field(None, description="vLLM's; accepted and unused")

    def to_grpc(self) -> engine_pb2.UnloadLoraAdapterRequest:
        return engine_pb2.UnloadLoraAdapterRequest(lora_name=self.lora_name)
