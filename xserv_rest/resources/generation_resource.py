"""The shape shared by /v1/chat/completions and /v1/completions: read the body, start one
Generate call, then stream SSE chunks or answer with one JSON body."""

import json
import re
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
from xserv_rest.metrics import Metrics
from xserv_rest.ranges import check_ranges
from xserv_rest.render import Choice, UsageCounter, collect
from xserv_rest.schemas import GenerationRequest
from xserv_rest.sse import EventStream


LONE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")  # the escape of a UTF-16 surrogate, maybe unpaired


class GenerationResource(ABC):
    id_prefix: str  # "chatcmpl" or "cmpl"

    def __init__(self, config: RestConfig, engine: EngineClient, watcher: DisconnectWatcher, metrics: Metrics):
        self.config = config
        self.engine = engine
        self.watcher = watcher
        self.metrics = metrics
        self.properties = self.request_schema(config.max_n)["properties"]

    @staticmethod
    @abstractmethod
    def request_schema(max_n: int) -> dict:
        """The OpenAPI schema of the request body (its numeric bounds are enforced here)."""

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
        check_ranges(body, self.properties)
        request = self.parse(body, request_id)
        req.context.engine_request_id = request_id
        generation = Generation(self.engine, self.watcher, request.grpc_request, req.env.get("gunicorn.socket"),
                                self.metrics, req.context.request_id)
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
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid_request(f"the request body is not valid JSON: {exc}") from None
    if LONE_SURROGATE.search(raw) is None:
        return Fields(body)
    try:
        # JSON may escape lone UTF-16 surrogates ("\ud800"), which no engine string can hold.
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise invalid_request("the request body holds an invalid Unicode escape (a lone surrogate)") from None
    return Fields(body)
