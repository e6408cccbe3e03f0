"""The shape shared by /v1/chat/completions and /v1/completions: validate the body with the
endpoint's protocol model, start one Generate call, then stream SSE chunks or answer with one
JSON body. The streaming loop is here, once; each endpoint says what its chunks hold."""

import time
import uuid
from abc import ABC, abstractmethod
from typing import ClassVar, Iterator

import falcon
from pydantic import BaseModel, ValidationError

from xserv.v1 import engine_pb2
from xserv_rest.config import RestConfig
from xserv_rest.disconnect import DisconnectWatcher
from xserv_rest.engine_client import EngineClient
from xserv_rest.errors import ApiError, invalid_body
from xserv_rest.generation import Generation, start
from xserv_rest.metrics import Metrics
from xserv_rest.protocol.base import Limits
from xserv_rest.protocol.sampling import SamplingRequest
from xserv_rest.render import Choice, RunningUsage, UsageCounter, collect, finish_reason
from xserv_rest.resources.models import selected_model
from xserv_rest.sse import EventStream, Frames


class ChunkShape(ABC):
    """What one endpoint's chunks hold, for one stream (it may keep state, e.g. text offsets)."""

    def opening(self) -> Iterator[tuple[int, dict]]:
        """(index, choice fields) sent before the engine's first output."""
        return iter(())

    @abstractmethod
    def content(self, message: engine_pb2.GenerateResponse) -> dict | None:
        """The choice fields of one engine message's output, or None when it has none."""

    @abstractmethod
    def finish(self, reason: str) -> dict:
        """The choice fields of the chunk that ends a choice."""


class GenerationResource(ABC):
    id_prefix: ClassVar[str]  # "chatcmpl" or "cmpl"
    object: ClassVar[str]  # the chunks' "object"
    request_model: ClassVar[type[SamplingRequest]]

    def __init__(self, config: RestConfig, engine: EngineClient, watcher: DisconnectWatcher, metrics: Metrics):
        self.config = config
        self.engine = engine
        self.watcher = watcher
        self.metrics = metrics

    @abstractmethod
    def chunk_shape(self, request: SamplingRequest) -> ChunkShape:
        """The chunks of one streamed answer."""

    @abstractmethod
    def answer(self, choices: list[Choice], usage: UsageCounter, request: SamplingRequest, head: dict) -> BaseModel:
        """The body of a non-streamed answer."""

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        raw = read_body(req, self.config.max_body_bytes)
        request_id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        info = self.engine.served_model()
        request = parse_body(self.request_model, raw, request_limits(self.config, info))
        model = selected_model(self.engine, request.model)
        req.context.engine_request_id = request_id
        engine_requests = request.engine_requests(request_id)
        for engine_request in engine_requests:
            engine_request.lora_name = model.lora_name
        generation = start(self.engine, self.watcher, engine_requests, request.n or 1,
                           req.env.get("gunicorn.socket"), self.metrics, req.context.request_id)
        req.context.generation = generation  # its tokens go on the request's span (traces on)
        generation.first()
        head = {"id": request_id, "created": int(time.time()), "model": model.id}
        if request.stream:
            resp.content_type = "text/event-stream"
            resp.cache_control = ["no-cache"]
            frames = Frames(request_id, self.object, head["created"], model.id, request.include_usage)
            resp.stream = EventStream(self.stream(generation, request, frames), generation,
                                      self.config.retry_after_s)
            return
        try:
            choices, usage = collect(generation, request.choices)
        finally:
            generation.close()
        resp.content_type = falcon.MEDIA_JSON
        resp.text = self.answer(choices, usage, request, head).model_dump_json()


    def stream(self, generation: Generation, request: SamplingRequest, frames: Frames) -> Iterator[bytes]:
        """The SSE chunks of a streamed answer, usage chunk included; [DONE] is added later."""
        shape = self.chunk_shape(request)
        opening = shape.opening()
        usage = UsageCounter()
        running = RunningUsage() if request.continuous_usage else None
        for message in generation:
            # the opening goes out with the first message (already here: first() read it), which
            # says how long the prompt is
            for index, fields in opening:
                yield frames.choice(index, fields, running and running.body(message, index))
            opening = ()
            if running is not None:
                running.add(message)
            chunk_usage = running and running.body(message)
            fields = shape.content(message)
            if fields is not None:
                yield frames.choice(message.index, fields, chunk_usage)
            reason = finish_reason(message)
            if reason:
                yield frames.choice(message.index, shape.finish(reason), chunk_usage)
            usage.add(message)
        if request.include_usage:
            yield frames.usage(usage.body())


def request_limits(config: RestConfig, info: engine_pb2.GetModelInfoResponse) -> Limits:
    """What a generation request is held to: this front's flags and the served model's limits."""
    return Limits(max_n=config.max_n, max_model_len=info.max_model_len, media=config.media,
                  max_images=info.max_images_per_prompt)


def parse_body(model: type[BaseModel], raw: bytes, limits: Limits | None = None):
    """The body validated by its protocol model (with the runtime limits), or a 400 naming the field."""
    try:
        return model.model_validate_json(raw, context={"limits": limits} if limits else None)
    except ValidationError as exc:
        raise invalid_body(exc, model) from None


def read_body(req: falcon.Request, max_bytes: int) -> bytes:
    too_large = ApiError(413, f"request body is larger than {max_bytes} bytes", code="request_too_large")
    if req.content_length is not None and req.content_length > max_bytes:
        raise too_large
    raw = req.bounded_stream.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise too_large
    return raw
