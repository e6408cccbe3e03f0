"""vllm.grpc.engine.VllmEngine (SMG's worker protocol, from smg-grpc-proto) over the same engine
as xserv.v1.EngineService, on the same server and port.

Thin like the EngineService servicer: protobuf in -> engine call -> protobuf out. Streams go
through EngineServicer.engine_outputs, so the abort-on-exit, the drain and the UNAVAILABLE while
loading are the same for both services; errors map to status in status.maps_errors.
"""

import asyncio
import time
import uuid
from contextlib import aclosing

from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc
from smg_grpc_proto.generated import common_pb2

from xserv_engine.errors import EngineUnavailable
from xserv_engine.media import MediaPolicy
from xserv_engine.models.pooling import EmbedParams
from xserv_engine.outputs import RequestOutput
from xserv_engine.server.servicer import EngineServicer, recorded
from xserv_engine.server.status import maps_errors
from xserv_engine.server.vllm_worker import convert
from xserv_engine.server.vllm_worker.kv_events import KvEventFeed
from xserv_engine.server.vllm_worker.tokenizer_bundle import chunks, tokenizer_zip

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["VllmEngine"].full_name


class VllmEngineServicer(pb_grpc.VllmEngineServicer):
    def __init__(self, core: EngineServicer, media: MediaPolicy = MediaPolicy(), mm_processor: str = "inprocess"):
        """media: how the image URLs of media_refs are loaded (the engine's media flags);
        mm_processor: who preprocesses SMG's images (mm_processors.MM_PROCESSORS)."""
        self._core = core
        self._media, self._mm_processor = media, mm_processor
        self._started = time.time()
        self._feed: KvEventFeed | None = None

    @maps_errors
    async def Generate(self, request, context):
        self._core.serving_engine()
        params = convert.sampling_params_from_pb(request.sampling_params)
        if request.media_refs.items:  # fetching may take up to --media-fetch-timeout
            prompt = await asyncio.to_thread(convert.prompt_from_pb, request, self._media.load)
        else:
            prompt = convert.prompt_from_pb(request, self._media.load)
        request_id = request.request_id or f"smg-{uuid.uuid4().hex}"
        top = params.top_logprobs
        joined: dict[int, RequestOutput] = {}  # not streaming: each choice's outputs so far
        record = self._core.generate_record(request_id, context, "", params.n, params.max_tokens)
        with recorded(record, context):
            async with aclosing(self._core.engine_outputs(request_id, prompt, params, context)) as outputs:
                async for output in outputs:
                    record.observe(output)
                    for message in _messages(output, request.stream, joined, top):
                        yield message

    @maps_errors
    async def Embed(self, request, context):
        """SMG's embeddings: one tokenized input, its vector (the pooling runner's)."""
        request_id = request.request_id or f"smg-{uuid.uuid4().hex}"
        engine = self._core.serving_engine()
        (output,) = await self._core.embeddings(
            [request_id], [list(request.tokenized.input_ids)], None,
            lambda rid, ids, deliver, field: engine.add_embed_request(rid, ids, EmbedParams(), deliver, field), context)
        return pb.EmbedResponse(embedding=output.embedding, prompt_tokens=output.usage.prompt_tokens,
                                embedding_dim=len(output.embedding))

    @maps_errors
    async def Abort(self, request, context):
        engine = self._core.serving_engine()
        for request_id in request.request_ids:
            engine.abort(request_id)
        return pb.AbortResponse()

    async def HealthCheck(self, request, context):
        try:
            self._core.serving_engine()
        except EngineUnavailable as exc:
            return pb.HealthCheckResponse(healthy=False, message=str(exc))
        return pb.HealthCheckResponse(healthy=True, message="serving")

    @maps_errors
    async def GetModelInfo(self, request, context):
        return convert.model_info_to_pb(self._core.serving_engine())

    @maps_errors
    async def GetServerInfo(self, request, context):
        engine = self._core.serving_engine()
        return convert.server_info_to_pb(engine, engine.stats(), self._started, draining=False, media=self._media,
                                         mm_processor=self._mm_processor)

    @maps_errors
    async def GetLoads(self, request, context):
        engine = self._core.serving_engine()
        return convert.loads_to_pb(engine.stats(), engine.model_info().block_size, engine.config.max_num_seqs)

    @maps_errors
    async def GetTokenizer(self, request, context):
        engine = self._core.serving_engine()
        data, digest = await asyncio.to_thread(tokenizer_zip, engine.setup.model_dir.path)
        parts = chunks(data)
        for i, part in enumerate(parts):
            yield common_pb2.GetTokenizerChunk(data=part, sha256=digest if i == len(parts) - 1 else "")

    @maps_errors
    async def SubscribeKvEvents(self, request, context):
        """A snapshot of the prefix cache ("cleared", then every stored block), then its
        changes as they happen; start_sequence_number is not needed: the snapshot is exact."""
        engine = self._core.serving_engine()
        block_size = engine.model_info().block_size
        async with aclosing(self._kv_feed(engine).subscribe()) as batches:
            async for batch in batches:
                yield convert.kv_batch_to_pb(batch, block_size)

    def _kv_feed(self, engine) -> KvEventFeed:
        if self._feed is None:
            self._feed = KvEventFeed(asyncio.get_running_loop())
            engine.block_manager.events = self._feed  # from now on the engine thread reports to it
        return self._feed


def _messages(output: RequestOutput, stream: bool, joined: dict[int, RequestOutput], top: int):
    """The worker-protocol messages of one engine output: streaming, a chunk (and the complete
    message when its choice finished); else the complete message of a finished choice, joined
    from its outputs so far in `joined`."""
    if stream:
        yield convert.chunk_to_pb(output, output.prompt_tokens, top)
        if output.finished:
            yield convert.complete_to_pb(output, top)
        return
    before = joined.get(output.index)
    joined[output.index] = before.then(output) if before is not None else output
    if output.finished:
        yield convert.complete_to_pb(joined.pop(output.index), top)
