"""The shape shared by /v1/chat/completions and /v1/completions: read the body, start one
Generate call, then stream SSE chunks or answer with one JSON body."""

import json
import time
import uuid
from abc import ABC, abstractmethod
from typing import Iterator

import falcon

from xserv_rest.config import RestConfig
from xserv_rest.disconnect import DisconnectWatcher
from xserv_rest.engine_client import EngineClient
from xserv_rest.errors import ApiError, invalid_request
from xserv_rest.fields import Fields
from xserv_rest.generation import Generation
from xserv_rest.render import Choice, UsageCounter, collect
from xserv_rest.schemas import GenerationRequest
from xserv_rest.sse import EventStream


class GenerationResource(ABC):
    id_prefix: str  # "chatcmpl" or "cmpl"

    def __init__(self, config: RestConfig, engine: EngineClient, watcher: DisconnectWatcher):
        self.config = config
        self.engine = engine
        self.watcher = watcher

    @abstractmethod
    def parse(self, body: Fields, request_id: str) -> GenerationRequest:
        """The request body as one GenerateRequest."""

    @abstractmethod
    def chunks(self, generation: Generation, request: GenerationRequest, head: dict) -> Iterator[dict]:
        """The SSE events of a streamed answer, usage chunk included; [DONE] is added later."""

    @abstractmethod
    def answer(self, choices: list[Choice], usage: UsageCounter, request: GenerationRequest, head: dict) -> dict:
        """The body of a non-streamed answer."""

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = read_json(req, self.config.max_body_bytes)
        request_id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        model_id = self.engine.served_model_id()
        asked = body.string("model")
        if asked not in (None, model_id):
            raise ApiError(404, f"The model `{asked}` does not exist; this server serves `{model_id}`.",
                           param="model", code="model_not_found")
        request = self.parse(body, request_id)
        generation = Generation(self.engine, self.watcher, request.grpc_request, req.env.get("gunicorn.socket"))
        generation.first()
        # "object" is filled in per answer shape; it is listed here to keep OpenAI's key order.
        head = {"id": request_id, "object": "", "created": int(time.time()), "model": model_id}
        if request.stream:
            resp.content_type = "text/event-stream"
            resp.cache_control = ["no-cache"]
            resp.stream = EventStream(self.chunks(generation, request, head), generation,
                                      self.config.retry_after_s)
            return
        try:
            choices, usage = collect(generation, request.n)
        finally:
            generation.close()
        resp.media = self.answer(choices, usage, request, head)


def read_json(req: falcon.Request, max_bytes: int) -> Fields:
    too_large = ApiError(413, f"request body is larger than {max_bytes} bytes", code="request_too_large")
    if req.content_length is not None and req.content_length > max_bytes:
        raise too_large
    raw = req.bounded_stream.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise too_large
    try:
        return Fields(json.loads(raw))
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid_request(f"the request body is not valid JSON: {exc}") from None
