"""SMG's vLLM worker protocol <-> engine types. The only module of this service that knows both
sides, as server/convert.py is for xserv.v1.

SMG tokenizes, renders the chat template, detokenizes and parses reasoning and tool calls itself;
the engine gets token ids and gives token ids back. Images come as media_refs (the router skipped
multimodal processing): one unexpanded <|image_pad|> per image in the ids, and the image's URL,
which the engine loads under its media flags and then treats as an xserv.v1 image part; or as
mm_inputs, the router's own patches (mm_inputs.py). A sampling parameter the engine cannot honour
is refused (InvalidRequest -> INVALID_ARGUMENT), never dropped. Proto3 leaves unset numbers at
0, so SMG's "unset" values (top_p 0, repetition_penalty 0, n 0) mean the defaults, as in vLLM's
own servicer.
"""

import time
from collections.abc import Callable
from datetime import datetime, timezone

from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import common_pb2

from xserv_engine.errors import InvalidRequest
from xserv_engine.inputs import PromptInput, TokenImages
from xserv_engine.media import MediaError, MediaPolicy
from xserv_engine.outputs import EngineStats, RequestOutput, TokenLogprob
from xserv_engine.sampling_params import SamplingParams
from xserv_engine.structured.constraint import CHOICE, JSON_OBJECT, JSON_SCHEMA, REGEX, Constraint

# Fields of vllm.grpc.engine.SamplingParams / GenerateRequest that change the output and that the
# engine does not implement: a request that sets one is refused, naming it.
# ("grammar" is xgrammar's EBNF there; the engine's grammars are llguidance Lark, so it is refused.)
_UNSUPPORTED_PARAMS = ("prompt_logprobs", "truncate_prompt_tokens", "structural_tag", "grammar")
_UNSUPPORTED_REQUEST = {
    "kv_transfer_params": "disaggregated prefill is not supported by this engine",
    "kv_transfer_params_json": "disaggregated prefill is not supported by this engine",
    "extra_mm_inputs": "a second multimodal batch (video, audio) is not supported by this engine; it takes "
                       "images only, in mm_inputs or media_refs",
}
_IMAGE = (common_pb2.MODALITY_UNSPECIFIED, common_pb2.IMAGE)  # unset is an image, as in mm_inputs


def prompt_from_pb(request: pb.GenerateRequest, load_media: Callable[[str], bytes]) -> PromptInput:
    """The request's prompt; with media_refs, its images loaded by `load_media` (url -> bytes,
    MediaError if refused): blocking I/O, so call it off the event loop."""
    for name, why in _UNSUPPORTED_REQUEST.items():
        if request.HasField(name) if name == "kv_transfer_params" else getattr(request, name):
            raise InvalidRequest(name, why)
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        raise InvalidRequest("data_parallel_rank", f"this engine has one rank (0), got {request.data_parallel_rank}")
    kind = request.WhichOneof("input")
    if request.media_refs.items and request.HasField("mm_inputs"):
        raise InvalidRequest("media_refs", "send images either as media_refs or as mm_inputs, not both")
    for name in ("media_refs", "mm_inputs"):
        if request.HasField(name) and kind != "tokenized":
            raise InvalidRequest(name, "requires tokenized input (the prompt's ids with its image placeholders)")
    if kind == "tokenized":
        if not request.tokenized.input_ids:
            raise InvalidRequest("tokenized.input_ids", "the prompt has no token ids")
        ids = list(request.tokenized.input_ids)
        if request.media_refs.items:
            return TokenImages(ids, _images_from_pb(request.media_refs, load_media))
        if request.HasField("mm_inputs"):
            # here, not at the top: mm_inputs needs torch, which the engine's start loads only after
            # setting OpenMP's spin (tests/server/test_openmp.py)
            from xserv_engine.server.vllm_worker.mm_inputs import token_images_from_pb

            return token_images_from_pb(request.mm_inputs, ids)
        return ids
    if kind == "text":
        return request.text
    raise InvalidRequest("input", "set one of tokenized or text")


def _images_from_pb(refs: pb.MediaRefs, load_media: Callable[[str], bytes]) -> tuple[bytes, ...]:
    for k, ref in enumerate(refs.items):
        if ref.modality not in _IMAGE:
            name = common_pb2.Modality.Name(ref.modality) if ref.modality in common_pb2.Modality.values() else ref.modality
            raise InvalidRequest(f"media_refs.items[{k}].modality", f"{name} is not supported by this engine; "
                                                                    "it takes images only")
    images = []
    for k, ref in enumerate(refs.items):
        try:
            images.append(load_media(ref.url))
        except MediaError as exc:
            raise InvalidRequest(f"media_refs.items[{k}].url", str(exc)) from None
    return tuple(images)


def sampling_params_from_pb(params: pb.SamplingParams) -> SamplingParams:
    """The one mapping from SMG's sampling parameters to the engine's."""
    for name in _UNSUPPORTED_PARAMS:
        if params.HasField(name):
            raise InvalidRequest(name, "is not supported by this engine's SMG worker service")
    return SamplingParams(
        max_tokens=params.max_tokens if params.HasField("max_tokens") else None,
        min_tokens=params.min_tokens,
        temperature=params.temperature if params.HasField("temperature") else 1.0,
        top_p=params.top_p or 1.0,
        top_k=params.top_k,
        min_p=params.min_p,
        seed=params.seed if params.HasField("seed") else None,
        stop=tuple(params.stop),
        stop_token_ids=tuple(params.stop_token_ids),
        include_stop_str_in_output=params.include_stop_str_in_output,
        ignore_eos=params.ignore_eos,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty or 1.0,
        logit_bias=dict(params.logit_bias),
        n=params.n or 1,
        logprobs=params.HasField("logprobs"),
        top_logprobs=params.logprobs if params.HasField("logprobs") else 0,
        skip_special_tokens=params.skip_special_tokens,
        constraint=_constraint_from_pb(params),
    )


def _constraint_from_pb(params: pb.SamplingParams) -> Constraint | None:
    kind = params.WhichOneof("constraint")
    if kind in (JSON_SCHEMA, REGEX):
        return Constraint(kind, getattr(params, kind))
    if kind == JSON_OBJECT:
        return Constraint(JSON_OBJECT) if params.json_object else None
    if kind == CHOICE:
        return Constraint(CHOICE, tuple(params.choice.choices))
    return None


def _logprobs_to_pb(logprobs: tuple[TokenLogprob, ...], top: int) -> pb.OutputLogProbs | None:
    if not logprobs:
        return None
    return pb.OutputLogProbs(
        token_logprobs=[lp.logprob for lp in logprobs],
        token_ids=[lp.token_id for lp in logprobs],
        top_logprobs=[pb.TopLogProbs(values=[t.logprob for t in lp.top], token_ids=[t.token_id for t in lp.top])
                      for lp in logprobs] if top else [],
    )


def chunk_to_pb(output: RequestOutput, prompt_tokens: int, top: int) -> pb.GenerateResponse:
    """A stream chunk: this output's new tokens (SMG accumulates them)."""
    return pb.GenerateResponse(chunk=pb.GenerateStreamChunk(
        token_ids=output.token_ids, prompt_tokens=prompt_tokens, completion_tokens=len(output.token_ids),
        cached_tokens=output.usage.cached_prompt_tokens if output.usage else 0,
        output_logprobs=_logprobs_to_pb(output.logprobs, top), index=output.index,
    ))


def complete_to_pb(output: RequestOutput, top: int) -> pb.GenerateResponse:
    """The end of one choice. Streaming: its last delta again, as vLLM's servicer sends it;
    otherwise: every token of the choice (`output` is then the choice's outputs joined)."""
    complete = pb.GenerateComplete(
        output_ids=output.token_ids, finish_reason=output.finish_reason,
        prompt_tokens=output.usage.prompt_tokens, completion_tokens=len(output.token_ids),
        cached_tokens=output.usage.cached_prompt_tokens, output_logprobs=_logprobs_to_pb(output.logprobs, top),
        index=output.index,
    )
    if isinstance(output.matched_stop, str):
        complete.matched_stop_str = output.matched_stop
    elif isinstance(output.matched_stop, int):
        complete.matched_token_id = output.matched_stop
    return pb.GenerateResponse(complete=complete)


def model_info_to_pb(engine) -> pb.GetModelInfoResponse:
    info, model_dir = engine.model_info(), engine.setup.model_dir
    hf = model_dir.hf_config
    return pb.GetModelInfoResponse(
        model_path=str(model_dir.path), is_generation=info.runner == "generate", max_context_length=info.max_model_len,
        vocab_size=info.vocab_size, supports_vision=info.max_images_per_prompt > 0, served_model_name=info.model_id,
        tokenizer_path=str(model_dir.path), model_type=str(hf.get("model_type") or ""),
        architectures=list(hf.get("architectures") or []), eos_token_ids=list(info.eos_token_ids),
        pad_token_id=int(hf.get("pad_token_id") or 0), bos_token_id=int(hf.get("bos_token_id") or 0),
        max_req_input_len=info.max_model_len,
    )


def server_info_to_pb(engine, stats: EngineStats, started: float, draining: bool, media: MediaPolicy,
                      mm_processor: str = "inprocess") -> pb.GetServerInfoResponse:
    """With a vision model, its image limit, and with mm_processor "inprocess" the labels that
    tell SMG to send images as media_refs (it then skips its own multimodal processing) and
    which URL schemes the engine will load; "router" leaves them empty, so SMG preprocesses."""
    info = engine.model_info()
    response = pb.GetServerInfoResponse(
        active_requests=stats.running + stats.waiting, is_paused=draining, uptime_seconds=time.time() - started,
        server_type="xserv", block_size=info.block_size, model_dtype=info.dtype,
        attention_backend=engine.config.attention_backend, max_num_seqs=engine.config.max_num_seqs,
        data_parallel_size=1,
    )
    if info.max_images_per_prompt:
        response.mm_item_limits = f"image={info.max_images_per_prompt}"
        response.multimodal_encoder_dtype = info.dtype.removeprefix("torch.")
    if info.max_images_per_prompt and mm_processor == "inprocess":
        schemes = ("http", "https") * bool(media.allowed_domains) + ("data",) + ("file",) * bool(
            media.allowed_local_path)
        response.mm_processor, response.mm_processor_source = "inprocess", "flag"
        response.mm_media_ref_schemes = ",".join(schemes)
    return response


def loads_to_pb(stats: EngineStats, block_size: int, max_num_seqs: int) -> pb.GetLoadsResponse:
    used_blocks = stats.total_blocks - stats.free_blocks
    load = pb.SchedulerLoad(
        dp_rank=0, num_running_reqs=stats.running, num_waiting_reqs=stats.waiting,
        num_total_reqs=stats.running + stats.waiting, num_used_tokens=used_blocks * block_size,
        max_total_num_tokens=stats.total_blocks * block_size,
        token_usage=used_blocks / stats.total_blocks if stats.total_blocks else 0.0,
        cache_hit_rate=stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0,
        max_running_requests=max_num_seqs,
    )
    return pb.GetLoadsResponse(timestamp=datetime.now(timezone.utc).isoformat(), version="xserv",
                               dp_rank_count=1, loads=[load])


def _image_keys(images: tuple[tuple[str, int], ...]) -> list[common_pb2.KvBlockExtraKey]:
    """The images of a block as vLLM's BlockStored extra_keys: (identifier, offset of the image's
    first token from the block's start), so two blocks of the same placeholder tokens from
    different images differ for the router too."""
    return [common_pb2.KvBlockExtraKey(multimodal=common_pb2.KvMultimodalKey(identifier=key, offset=offset))
            for key, offset in images]


def kv_batch_to_pb(batch, block_size: int) -> common_pb2.KvEventBatch:
    """A KvEventFeed batch -> KvEventBatch. Consecutive stored blocks that chain (each one's
    parent is the block before it) go out as one KvBlocksStored, as vLLM groups them."""
    proto = common_pb2.KvEventBatch(sequence_number=batch.sequence_number, timestamp=batch.timestamp, dp_rank=0)
    run: common_pb2.KvBlocksStored | None = None
    last_hash = None
    for event_id, event in enumerate(batch.events, start=batch.first_event_id):
        kind = event[0]
        if kind == "stored":
            _, block_hash, parent, token_ids, images = event
            if run is None or parent != last_hash:
                run = common_pb2.KvBlocksStored()
                if parent != -1:
                    run.parent_block_hash = parent
                proto.events.append(common_pb2.KvCacheEvent(event_id=event_id, stored=run))
                run = proto.events[-1].stored
            run.blocks.append(common_pb2.KvBlock(block_hash=block_hash, token_ids=token_ids, block_size=block_size,
                                                 extra_keys=_image_keys(images)))
            last_hash = block_hash
            continue
        run, last_hash = None, None
        if kind == "removed":
            proto.events.append(common_pb2.KvCacheEvent(
                event_id=event_id, removed=common_pb2.KvBlocksRemoved(block_hashes=[event[1]])))
        else:
            proto.events.append(common_pb2.KvCacheEvent(event_id=event_id, cleared=common_pb2.KvCacheCleared()))
    return proto
