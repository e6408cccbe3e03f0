"""EngineService on grpc.aio: protobuf in -> engine call -> protobuf out, and nothing more.

Outputs cross from the engine thread into one asyncio.Queue per call. Whenever a Generate call
ends before every choice finished (cancel, deadline, lost connection, error), the request is
aborted so its KV blocks are freed at once.
"""

import asyncio
import logging
import time
import uuid
from typing import Callable

from xserv.v1 import engine_pb2, engine_pb2_grpc

from xserv_engine.errors import EngineUnavailable, InvalidRequest
from xserv_engine.outputs import RequestOutput
from xserv_engine.server import convert
from xserv_engine.server.status import grpc_status

log = logging.getLogger("xserv.engine.server")


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    """Serves one engine. Calls get UNAVAILABLE until attach() and again after drain()."""

    def __init__(self, engine=None):
        self._engine = None
        self._vocab_size = 0
        self._draining = False
        self._streams = 0
        self._idle = asyncio.Event()
        self._idle.set()
        if engine is not None:
            self.attach(engine)

    def attach(self, engine) -> None:
        self._vocab_size = engine.model_info().vocab_size
        self._engine = engine

    def drain(self) -> None:
        """Refuse new calls from now on; running streams go on."""
        self._draining = True

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no Generate stream is running; False if timeout came first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def _serving_engine(self):
        if self._draining:
            raise EngineUnavailable("engine is shutting down; retry on another replica")
        if self._engine is None:
            raise EngineUnavailable("engine is loading the model; watch grpc.health.v1.Health")
        return self._engine

    async def Generate(self, request, context):
        started = time.monotonic()
        try:
            engine = self._serving_engine()
            request_id, prompt, params = convert.generate_request_from_pb(request, self._vocab_size)
            request_id = request_id or f"req-{uuid.uuid4().hex}"
            queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
            engine.add_request(request_id, prompt, params, _deliver_to(queue))
        except Exception as exc:
            await _abort(context, exc)
        self._stream_started()
        unfinished = set(range(params.n))
        finish_reasons, completion_tokens = [], 0
        try:
            while unfinished:
                output = await queue.get()
                if output.error is not None:
                    await _abort(context, RuntimeError(f"request {request_id}: {output.error}"))
                if output.finished:
                    unfinished.discard(output.index)
                    finish_reasons.append(output.finish_reason)
                    completion_tokens += output.usage.completion_tokens if output.usage else 0
                yield convert.generate_response_to_pb(output)
        finally:
            if unfinished:
                engine.abort(request_id)
            self._stream_ended()
            log.debug("request id=%s finish=%s completion_tokens=%d ended_early=%s elapsed_ms=%.0f",
                      request_id, ",".join(finish_reasons) or "-", completion_tokens,
                      bool(unfinished), 1000 * (time.monotonic() - started))

    async def Tokenize(self, request, context):
        try:
            engine = self._serving_engine()
            prompt = convert.tokenize_input_from_pb(request)
            token_ids, rendered = await asyncio.to_thread(engine.tokenize, prompt)
        except Exception as exc:
            await _abort(context, exc)
        return engine_pb2.TokenizeResponse(token_ids=token_ids, prompt=rendered)

    async def GetModelInfo(self, request, context):
        try:
            engine = self._serving_engine()
            return convert.model_info_to_pb(engine.model_info(), engine.stats())
        except Exception as exc:
            await _abort(context, exc)

    async def Abort(self, request, context):
        # Allowed while draining: it only frees what a lost client left running.
        try:
            if self._engine is None:
                raise EngineUnavailable("engine is loading the model")
            if not request.request_id:
                raise InvalidRequest("request_id", "the request id is empty")
            found = self._engine.abort(request.request_id)
        except Exception as exc:
            await _abort(context, exc)
        return engine_pb2.AbortResponse(found=found)

    def _stream_started(self) -> None:
        self._streams += 1
        self._idle.clear()

    def _stream_ended(self) -> None:
        self._streams -= 1
        if self._streams == 0:
            self._idle.set()


def _deliver_to(queue: asyncio.Queue) -> Callable[[RequestOutput], None]:
    """The on_output callback: runs on the engine thread, hands the output to this call's loop."""
    loop = asyncio.get_running_loop()

    def deliver(output: RequestOutput) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, output)
        except RuntimeError:
            pass  # the event loop is closed: the server is gone and the request was aborted

    return deliver


async def _abort(context, exc: BaseException) -> None:
    code, message = grpc_status(exc)
    await context.abort(code, message)
