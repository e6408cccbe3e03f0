"""EngineService on grpc.aio: protobuf in -> engine call -> protobuf out, and nothing more.

Outputs cross from the engine thread into one asyncio.Queue per call. Whenever a Generate call
ends before every choice finished (cancel, deadline, lost connection, error), the request is
aborted so its KV blocks are freed at once.
"""

import asyncio
import functools
import logging
import uuid
from contextlib import aclosing, contextmanager

from xserv.v1 import engine_pb2, engine_pb2_grpc

from xserv_engine.engine.engine_thread import Mailbox
from xserv_engine.errors import EngineUnavailable, InvalidRequest
from xserv_engine.outputs import RequestOutput, coalesce
from xserv_engine.server import convert
from xserv_engine.server.metrics import EngineMetrics
from xserv_engine.server.request_record import RequestRecord, metadata_request_id
from xserv_engine.server.status import maps_errors, status_code

log = logging.getLogger("xserv.engine.server")

DEADLINE_SLACK_S = 0.1
EMBED_WINDOW = 128  # inputs of one Embed call in the engine at once


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    """Serves one engine. Calls get UNAVAILABLE until attach() and again after drain()."""

    def __init__(self, engine=None, metrics: EngineMetrics | None = None, spans=None):
        self._engine = None
        self.metrics = metrics or EngineMetrics()
        self.spans = spans  # a CallSpans when traces are on (--otlp-traces-endpoint)
        self._draining = False
        self._calls = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._mailbox_: Mailbox | None = None
        if engine is not None:
            self.attach(engine)

    def attach(self, engine) -> None:
        self.metrics.attach(engine)
        self._engine = engine

    def drain(self) -> None:
        """Refuse new calls from now on; running streams go on."""
        self._draining = True

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no generating call (Generate, Embed, Score, of either service) is running;
        False if timeout came first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def _mailbox(self) -> Mailbox:
        loop = asyncio.get_running_loop()
        if self._mailbox_ is None or self._mailbox_.loop is not loop:
            self._mailbox_ = Mailbox(loop)
        return self._mailbox_

    def serving_engine(self):
        """The engine, or EngineUnavailable while loading or draining."""
        return self._serving_engine()

    def _serving_engine(self):
        if self._draining:
            raise EngineUnavailable("engine is shutting down; retry on another replica")
        if self._engine is None:
            raise EngineUnavailable("engine is loading the model; watch grpc.health.v1.Health")
        return self._engine

    def generate_record(self, request_id: str, context, lora_name: str, n: int,
                        max_tokens: int | None) -> RequestRecord:
        """The record of one Generate call (of either service): its log line, metrics and spans."""
        trace = None if self.spans is None else functools.partial(self.spans.export, self.spans.parent_of(context))
        return RequestRecord(request_id, metadata_request_id(context), context.peer(), self.metrics, lora_name,
                             n=n, max_tokens=max_tokens, trace=trace)

    @maps_errors
    async def Generate(self, request, context):
        request_id = request.request_id or metadata_request_id(context) or f"req-{uuid.uuid4().hex}"
        params = request.params
        record = self.generate_record(request_id, context, request.lora_name, n=params.n if params.HasField("n") else 1,
                                      max_tokens=params.max_tokens if params.HasField("max_tokens") else None)
        with recorded(record, context):
            async with aclosing(self._outputs(request_id, request, context)) as outputs:
                async for output in outputs:
                    record.observe(output)
                    yield convert.generate_response_to_pb(output)

    def _outputs(self, request_id: str, request, context):
        self._serving_engine()  # UNAVAILABLE comes before any complaint about the request
        _, prompt, params = convert.generate_request_from_pb(request, self._engine.sampling_defaults)
        return self.engine_outputs(request_id, prompt, params, context, request.lora_name or None)

    async def engine_outputs(self, request_id: str, prompt, params, context, lora_name: str | None = None):
        """The request's outputs as the engine makes them; aborts it if the stream ends early.
        Also used by the other services of this server (SMG's worker service), so that drain
        waits for their streams too."""
        engine = self._serving_engine()
        self._call_started(context)
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        await _add_request(engine, request_id, prompt, params, self._mailbox().deliver_to(queue), lora_name)
        unfinished = set(range(params.n))
        try:
            while unfinished:
                waiting = [await queue.get()]
                while not queue.empty():  # fell behind the engine: one message per choice
                    waiting.append(queue.get_nowait())
                for output in coalesce(waiting):
                    if output.error is not None:
                        raise RuntimeError(f"request {request_id}: {output.error}")
                    if output.finished:
                        unfinished.discard(output.index)
                    yield output
        finally:
            if unfinished:
                engine.abort(request_id)

    @maps_errors
    async def Embed(self, request, context):
        """Each input runs as its own engine request ("<request_id>-<i>"), at most EMBED_WINDOW at
        a time, so that one large call neither fills the engine's queue nor starves other calls."""
        def inputs(request):
            params = convert.embed_params_from_pb(request)
            return convert.embed_inputs_from_pb(request), lambda rid, prompt, deliver, field: (
                self._engine.add_embed_request(rid, prompt, params, deliver, field))

        request_id, outputs = await self._pooled_call(request, context, "emb", inputs, "inputs")
        return engine_pb2.EmbedResponse(request_id=request_id, embeddings=[convert.embedding_to_pb(o) for o in outputs])

    @maps_errors
    async def Score(self, request, context):
        """Each document runs as its own engine request ("<request_id>-<i>"), as Embed's inputs."""
        def documents(request):
            query, documents, instruction = convert.score_request_from_pb(request)
            return documents, lambda rid, document, deliver, field: (
                self._engine.add_score_request(rid, query, document, instruction, deliver, field))

        request_id, outputs = await self._pooled_call(request, context, "score", documents, "documents")
        return engine_pb2.ScoreResponse(request_id=request_id, scores=[convert.score_to_pb(o) for o in outputs])

    async def _pooled_call(self, request, context, prefix: str, parse, field: str) -> tuple[str, list[RequestOutput]]:
        """Embed's and Score's call: parse(request) -> (items, add), the items run through
        embeddings() as "<request_id>-<i>", the call logged and counted as Generate's are."""
        self._serving_engine()  # UNAVAILABLE comes before any complaint about the request
        trace_id = metadata_request_id(context)
        request_id = request.request_id or trace_id or f"{prefix}-{uuid.uuid4().hex}"
        record = RequestRecord(request_id, trace_id, context.peer(), self.metrics)
        with recorded(record, context):
            items, add = parse(request)
            outputs = await self.embeddings([f"{request_id}-{i}" for i in range(len(items))], items, record, add,
                                            context, field)
        return request_id, outputs

    async def embeddings(self, request_ids: list[str], inputs: list, record: RequestRecord | None, add, context,
                         field: str = "inputs") -> list[RequestOutput]:
        """Input i's output (its vector in .embedding), as engine request request_ids[i], added
        with add(request_id, input, on_output, field name); those still running when this ends
        early are aborted. Also used by Score and by SMG's worker service."""
        engine = self._serving_engine()
        self._call_started(context)
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        deliver = self._mailbox().deliver_to(queue)
        outputs: list[RequestOutput | None] = [None] * len(inputs)
        index_of: dict[str, int] = {}

        def take(output: RequestOutput) -> None:
            if output.error is not None or output.embedding is None:
                raise RuntimeError(f"request {output.request_id}: {output.error or output.finish_reason}")
            if record is not None:
                record.observe(output)
            outputs[index_of[output.request_id]] = output

        try:
            running = 0
            for i, prompt in enumerate(inputs):
                if running == EMBED_WINDOW:
                    take(await queue.get())
                    running -= 1
                index_of[request_ids[i]] = i
                quick = isinstance(prompt, list) or len(prompt) <= INLINE_PROMPT_CHARS
                await _run_add(engine, request_ids[i], quick, add, prompt, deliver, f"{field}[{i}]")
                running += 1
            for _ in range(running):
                take(await queue.get())
        finally:
            for rid, i in index_of.items():
                if outputs[i] is None:
                    engine.abort(rid)
        return outputs

    @maps_errors
    async def Tokenize(self, request, context):
        engine = self._serving_engine()
        prompt = convert.tokenize_input_from_pb(request)
        token_ids, rendered = await asyncio.to_thread(engine.tokenize, prompt)
        return engine_pb2.TokenizeResponse(token_ids=token_ids, prompt=rendered)

    @maps_errors
    async def Detokenize(self, request, context):
        engine = self._serving_engine()
        text = engine.detokenize(list(request.token_ids), request.skip_special_tokens)
        return engine_pb2.DetokenizeResponse(text=text)

    @maps_errors
    async def GetTokenizerInfo(self, request, context):
        return convert.tokenizer_info_to_pb(self._serving_engine().tokenizer)

    @maps_errors
    async def GetModelInfo(self, request, context):
        engine = self._serving_engine()
        return convert.model_info_to_pb(engine.model_info(), engine.stats())

    @maps_errors
    async def Abort(self, request, context):
        # Allowed while draining: it only frees what a lost client left running.
        if self._engine is None:
            raise EngineUnavailable("engine is loading the model")
        if not request.request_id:
            raise InvalidRequest("request_id", "the request id is empty")
        return engine_pb2.AbortResponse(found=self._engine.abort(request.request_id))

    @maps_errors
    async def LoadLoraAdapter(self, request, context):
        engine = self._serving_engine()
        if not request.lora_path:
            raise InvalidRequest("lora_path", "the adapter's directory is empty")
        adapter = await asyncio.to_thread(engine.load_lora, request.lora_name, request.lora_path)
        log.info("LoRA adapter %s loaded from %s (rank %d)", adapter.name, adapter.path, adapter.rank)
        return engine_pb2.LoadLoraAdapterResponse(adapter=convert.lora_adapter_to_pb(adapter))

    @maps_errors
    async def UnloadLoraAdapter(self, request, context):
        self._serving_engine().unload_lora(request.lora_name)
        log.info("LoRA adapter %s unloaded", request.lora_name)
        return engine_pb2.UnloadLoraAdapterResponse()

    def _call_started(self, context) -> None:
        """The drain waits for this call until gRPC has ended it, not just until the engine's
        last output: the call's final status goes out after that, and a server stopped in
        between cancels it (a client that has every token then sees UNAVAILABLE, not OK)."""
        self._calls += 1
        self._idle.clear()
        context.add_done_callback(self._call_ended)

    def _call_ended(self, _context) -> None:
        self._calls -= 1
        if self._calls == 0:
            self._idle.set()


async def _add_request(engine, request_id: str, prompt, params, on_output, lora_name: str | None) -> None:
    await _run_add(engine, request_id, _quick_to_add(prompt, params), engine.add_request, prompt, params, on_output,
                   lora_name)


async def _run_add(engine, request_id: str, quick: bool, add, *args) -> None:
    """add(request_id, *args): engine.add_request renders the chat template and tokenizes:
    milliseconds for a long chat, tens for a very long one, which on the event loop would stall
    every other stream. Unless quick (_quick_to_add), it runs on a worker thread instead; if the
    call is cancelled meanwhile, the request is aborted as soon as it has been added, so no
    orphan keeps KV blocks."""
    if quick:
        add(request_id, *args)
        return
    added = asyncio.get_running_loop().run_in_executor(None, add, request_id, *args)
    try:
        await asyncio.shield(added)
    except asyncio.CancelledError:
        added.add_done_callback(lambda f: f.cancelled() or f.exception() is not None or engine.abort(request_id))
        raise


INLINE_PROMPT_CHARS = 512  # ~0.2 ms to tokenize here (2,000 chars: 0.7 ms)
INLINE_PROMPT_IDS = 2048


def _quick_to_add(prompt, params) -> bool:
    """A short text or token prompt without a grammar: validating and tokenizing it on the
    event loop costs less than the hop to a worker thread and back (64 streams arriving at once:
    TTFT p50 94-103 ms against 127-128)."""
    if params.constraint is not None:
        return False
    if isinstance(prompt, str):
        return len(prompt) <= INLINE_PROMPT_CHARS
    return isinstance(prompt, list) and len(prompt) <= INLINE_PROMPT_IDS


@contextmanager
def recorded(record: RequestRecord, context):
    """Ends `record` with the call's status: OK, the code of the error raised, or (cancelled, a
    deadline: nothing raised here) how the call ended early."""
    status = None
    try:
        yield
        status = "OK"
    except Exception as exc:
        status = status_code(exc).name
        raise
    finally:
        record.end(status or _early_end_status(context))


def _early_end_status(context) -> str:
    """Why a stream ended before its choices finished, when no error was raised here. The
    client's own timer usually cancels the call a few ms before the server's copy of the
    deadline runs out, hence the slack."""
    remaining = context.time_remaining()
    return "DEADLINE_EXCEEDED" if remaining is not None and remaining < DEADLINE_SLACK_S else "CANCELLED"
