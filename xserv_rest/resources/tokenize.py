"""POST /tokenize, POST /detokenize, GET /tokenizer_info: vLLM's tokenizer endpoints, answered
by the engine's tokenizer (Tokenize, Detokenize and GetTokenizerInfo over gRPC)."""

import falcon
from pydantic import BaseModel

from xserv.v1 import engine_pb2
from xserv_rest.config import RestConfig
from xserv_rest.engine_client import EngineClient
from xserv_rest.protocol.tokenize import (DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse,
                                          TokenizerInfo)
from xserv_rest.resources.generation_resource import parse_body, read_body, request_limits
from xserv_rest.resources.models import selected_model


class _TokenizerPost:
    def __init__(self, config: RestConfig, engine: EngineClient):
        self.config = config
        self.engine = engine

    def _body(self, req: falcon.Request, model: type[BaseModel]):
        """The validated body, after checking that it names the served model or one of its LoRA
        adapters (if any: they share its tokenizer); and that model's info."""
        limits = request_limits(self.config, self.engine.served_model())
        request = parse_body(model, read_body(req, self.config.max_body_bytes), limits)
        return request, selected_model(self.engine, request.model).info


class Tokenize(_TokenizerPost):
    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        request, info = self._body(req, TokenizeRequest)
        tokens = list(self.engine.tokenize(request.to_grpc()).token_ids)
        resp.text = TokenizeResponse(count=len(tokens), max_model_len=info.max_model_len,
                                     tokens=tokens).model_dump_json()


class Detokenize(_TokenizerPost):
    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        request, _ = self._body(req, DetokenizeRequest)
        reply = self.engine.detokenize(engine_pb2.DetokenizeRequest(token_ids=request.tokens))
        resp.text = DetokenizeResponse(prompt=reply.text).model_dump_json()


class TokenizerInfoResource:
    def __init__(self, engine: EngineClient):
        self.engine = engine

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        info = self.engine.tokenizer_info()
        resp.text = TokenizerInfo(
            eos_token=_optional(info, "eos_token"), bos_token=_optional(info, "bos_token"),
            pad_token=_optional(info, "pad_token"), chat_template=info.chat_template or None,
            model_max_length=self.engine.served_model().max_model_len, vocab_size=info.vocab_size,
        ).model_dump_json()


def _optional(message, name: str) -> str | None:
    return getattr(message, name) if message.HasField(name) else None
