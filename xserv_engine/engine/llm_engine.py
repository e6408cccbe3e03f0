"""LLMEngine: the engine core. Requests in, outputs back through each request's on_output.

step() reads: schedule -> run -> postprocess. The core is single-threaded: EngineThread runs it
on its own thread and is what the server and other callers talk to. make_request, tokenize and
model_info read only what never changes, so any thread may call them.
"""

import functools
import logging
import threading
from dataclasses import replace

from xserv_engine.config import EngineConfig
from xserv_engine.engine.block_manager import BlockManager
from xserv_engine.engine.engine_setup import EngineSetup
from xserv_engine.engine.output_stream import OutputStream
from xserv_engine.engine.request import OnOutput, Request
from xserv_engine.engine.scheduler import POLICIES, ScheduledBatch, Scheduler
from xserv_engine.engine.sequence import Sequence
from xserv_engine.errors import ContextTooLong, InputTooLong, InvalidRequest, NotFound, Unsupported
from xserv_engine.inputs import ChatInput, PromptInput, check_prompt
from xserv_engine.layers.sampler import SamplerOutput
from xserv_engine.models.lora import LoraAdapter, load_lora_adapter
from xserv_engine.models.pooling import RERANK_PREFIX, RERANK_SUFFIX, EmbedParams, rerank_content
from xserv_engine.outputs import EngineStats, LoraInfo, ModelInfo, RequestOutput, Usage
from xserv_engine.sampling_params import SamplingParams
from xserv_engine.structured.manager import StructuredOutputManager
from xserv_engine.tokenizer.parsers import prompt_opens_reasoning
from xserv_engine.tokenizer.tool_call_parsers import call_parser, resolve_tool_call_parser

log = logging.getLogger(__name__)

# --stream-interval auto: about this many outputs per step at most (each stream's tokens go out
# every ceil(decoding / AUTO_STREAM_MESSAGES) steps, at most every AUTO_STREAM_MAX_INTERVAL).
# Every output costs the server and its client ~0.1 ms of CPU each (grpc.aio's write and read
# paths), whatever it carries: over gRPC on 2 cores, 64 streams at one token each ran at 0.77-0.86
# of the in-process engine, at 16 messages per step (4 tokens each) 0.84-0.91, at 8 (8 tokens
# each) 0.94 (docs/benchmarks.md, "Through gRPC"). At 64 streams a stream still gets a message
# ~4 times a second on 2 CPU cores, more often on faster hardware.
AUTO_STREAM_MESSAGES = 8
AUTO_STREAM_MAX_INTERVAL = 8
NO_LORA = "this engine serves no LoRA adapters: start it with --enable-lora or --lora-modules"
EMBED_SAMPLING = SamplingParams(max_tokens=1)  # an embedding request's sequence samples nothing


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = True):
        if config.stream_interval is not None and config.stream_interval < 1:
            raise InvalidRequest("stream_interval", f"must be at least 1, got {config.stream_interval}")
        self.config = config
        setup = _on_own_thread(lambda: EngineSetup.build(config, progress=progress))
        self.setup = setup
        self.tokenizer, self.runner = setup.tokenizer, setup.runner
        self.max_model_len = setup.max_model_len
        self.eos_token_ids = set(setup.model_dir.eos_token_ids)
        self.default_max_tokens = config.default_max_tokens or setup.model_dir.max_new_tokens
        self.tool_call_parser = resolve_tool_call_parser(config.tool_call_parser, self.tokenizer.chat_template)
        if config.sampling_defaults not in ("model", "openai"):
            raise InvalidRequest("sampling_defaults", f"must be model or openai, got {config.sampling_defaults!r}")
        # what a gRPC request's unset sampling fields take (server/convert.py); {}: SamplingParams'
        self.sampling_defaults = setup.model_dir.sampling_defaults if config.sampling_defaults == "model" else {}
        self.vocab_size = setup.model_dir.config.vocab_size
        self.pooling = setup.pooling  # the pooling runner's: this engine embeds and never generates
        self.block_manager = BlockManager(setup.num_blocks, setup.block_size, config.enable_prefix_caching)
        if config.scheduling_policy not in POLICIES:
            raise InvalidRequest("scheduling_policy", f"must be one of {', '.join(POLICIES)}, got "
                                                      f"{config.scheduling_policy!r}")
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, setup.max_num_batched_tokens,
                                   config.scheduling_policy)
        self.structured = StructuredOutputManager(setup.model_dir.path / "tokenizer.json", setup.model_dir.eos_token_ids,
                                                  separator_ids=tuple(self.tokenizer.encode("\n\n")))
        self._requests: dict[str, Request] = {}
        self._by_seq: dict[int, Request] = {}
        self._generated_tokens = 0
        self._prompt_tokens = 0
        self.loras: dict[str, LoraAdapter] = {}  # name -> adapter, in load order
        for name, path in config.lora_modules:
            self.load_lora(name, path)

    # ---- any thread ----

    def make_request(self, request_id: str, prompt: PromptInput, params: SamplingParams,
                     on_output: OnOutput, lora_name: str | None = None) -> Request:
        """Validate, render and tokenize a request (InvalidRequest, ContextTooLong; NotFound for a
        lora_name not loaded) into what add_request takes. Slow for a long chat: callers run it
        off their event loop."""
        if self.pooling is not None:
            use = "Score (REST: /rerank)" if self.pooling.classify else "Embed (REST: /v1/embeddings)"
            serves = "relevance scores" if self.pooling.classify else "embeddings"
            raise Unsupported(f"model {self.setup.model_id} serves {serves} (--runner {self.runner_name}), not "
                              f"generation: use {use}")
        params.validate(self.vocab_size)
        if params.priority and not self.scheduler.by_priority:
            raise InvalidRequest("priority", f"got priority {params.priority}, but this engine schedules first come, "
                                             "first served: start it with --scheduling-policy priority")
        lora = self.lora(lora_name) if lora_name else None
        prompt_ids, _ = self.tokenize(prompt)
        room = self.max_model_len - len(prompt_ids)
        if params.max_tokens is None:
            if room < 1:
                raise ContextTooLong(len(prompt_ids), 1, self.max_model_len)
            params = replace(params, max_tokens=min(room, self.default_max_tokens or room))
        elif params.max_tokens > room:
            raise ContextTooLong(len(prompt_ids), params.max_tokens, self.max_model_len)
        # InvalidRequest if it cannot compile
        grammar = self.structured.request_grammar(prompt, params, self.tool_call_parser)
        return self._build_request(request_id, prompt, prompt_ids, params, on_output, grammar, lora)

    def lora(self, name: str) -> LoraAdapter:
        adapter = self.loras.get(name)
        if adapter is None:
            loaded = ", ".join(self.loras) or "none"
            raise NotFound("lora_name", f"LoRA adapter {name!r} is not loaded (loaded: {loaded})")
        return adapter

    def load_lora(self, name: str, path: str) -> LoraAdapter:
        """Load a PEFT adapter directory under `name` (any thread: reading it takes a while; the
        engine thread sees it from its next request on)."""
        if not self.config.enable_lora:
            raise Unsupported(NO_LORA)
        if not name:
            raise InvalidRequest("lora_name", "the adapter's name is empty")
        if name in self.loras or name == self.setup.model_id:
            raise InvalidRequest("lora_name", f"{name!r} is already the name of "
                                              f"{'a loaded adapter' if name in self.loras else 'the base model'}")
        s = self.setup
        adapter = _on_own_thread(lambda: load_lora_adapter(name, path, s.model_dir.config, s.dtype, s.device,
                                                            self.config.max_lora_rank))
        if self.loras.setdefault(name, adapter) is not adapter:  # the same name loaded meanwhile
            raise InvalidRequest("lora_name", f"{name!r} is already the name of a loaded adapter")
        return adapter

    def unload_lora(self, name: str) -> None:
        """New requests can no longer name it; running ones finish with it."""
        if not self.config.enable_lora:
            raise Unsupported(NO_LORA)
        if self.loras.pop(name, None) is None:
            raise NotFound("lora_name", f"LoRA adapter {name!r} is not loaded")

    def make_embed_request(self, request_id: str, prompt: str | list[int], params: EmbedParams,
                           on_output: OnOutput, field: str = "input") -> Request:
        """An embedding request (the pooling runner's): the input is tokenized with the tokenizer's
        special tokens, as sentence-transformers does; its one output carries the vector. `field`
        names the input in errors (the Embed call's inputs[i])."""
        if self.pooling is None or self.pooling.classify is not None:
            kind = "a generation model" if self.pooling is None else "a reranker (--runner score): use Score"
            raise Unsupported(f"model {self.setup.model_id} is {kind}; Embed needs an embedding model (such as "
                              f"Qwen3-Embedding), served with --runner pooling")
        params.validate(self.setup.model_dir.config.hidden_size)
        try:
            check_prompt(prompt, self.vocab_size)
        except InvalidRequest as exc:
            raise InvalidRequest(f"{field}.{exc.field}", exc.message) from None
        ids = self.tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else list(prompt)
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens:]
        if len(ids) > self.max_model_len:
            raise InputTooLong(field, len(ids), self.max_model_len, "shorten it or set truncate_prompt_tokens")
        return self._pooled_request(request_id, ids, params, on_output)

    def make_score_request(self, request_id: str, query: str, document: str, instruction: str | None,
                           on_output: OnOutput, field: str = "document") -> Request:
        """A relevance score (the score runner's): Qwen3-Reranker's prompt around the query and the
        document, tokenized as its model card does (prefix, content, suffix apart); the one output
        carries [P(yes)]. `field` names the document in errors (the Score call's documents[i])."""
        if self.pooling is None or self.pooling.classify is None:
            kind = "a generation model" if self.pooling is None else "an embedding model: use Embed"
            raise Unsupported(f"model {self.setup.model_id} is {kind}; Score needs a reranker (such as "
                              f"Qwen3-Reranker), served with --runner score")
        if not document:
            raise InvalidRequest(field, "must not be empty")
        prefix, suffix = self._rerank_affixes
        ids = prefix + self.tokenizer.encode(rerank_content(query, document, instruction)) + suffix
        if len(ids) > self.max_model_len:
            raise InputTooLong(field, len(ids), self.max_model_len, "with the query and the reranker's template: "
                                                                    "shorten it")
        return self._pooled_request(request_id, ids, EmbedParams(), on_output)

    @functools.cached_property
    def _rerank_affixes(self) -> tuple[list[int], list[int]]:
        return self.tokenizer.encode(RERANK_PREFIX), self.tokenizer.encode(RERANK_SUFFIX)

    def _pooled_request(self, request_id: str, ids: list[int], params: EmbedParams, on_output: OnOutput) -> Request:
        seq = Sequence(ids, EMBED_SAMPLING, self.block_manager.block_size, embed=params)
        stream = OutputStream(self.tokenizer, EMBED_SAMPLING, starts_in_reasoning=False, parse_reasoning=False,
                              parse_tools=False)
        return Request(request_id, on_output, [seq], {seq.seq_id: stream})

    def tokenize(self, prompt: PromptInput) -> tuple[list[int], str]:
        """(token ids, the text they encode: the rendered chat, or "" for token ids)."""
        check_prompt(prompt, self.vocab_size)
        if isinstance(prompt, ChatInput):
            text = self.tokenizer.render_chat(prompt)
            return self.tokenizer.encode(text), text
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt), prompt
        return list(prompt), ""

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        if token_ids:
            check_prompt(token_ids, self.vocab_size)  # InvalidRequest naming token_ids
        return self.tokenizer.decode(token_ids, skip_special_tokens)

    @property
    def runner_name(self) -> str:
        """generate, pooling (embeddings) or score (a reranker)."""
        if self.pooling is None:
            return "generate"
        return "pooling" if self.pooling.classify is None else "score"

    def model_info(self) -> ModelInfo:
        s = self.setup
        return ModelInfo(
            model_id=s.model_id, max_model_len=self.max_model_len, vocab_size=self.vocab_size,
            eos_token_ids=s.model_dir.eos_token_ids, dtype=str(s.dtype).removeprefix("torch."),
            device=str(s.device), block_size=s.block_size, runner=self.runner_name,
            embedding_size=s.model_dir.config.hidden_size if self.runner_name == "pooling" else 0,
            lora_enabled=self.config.enable_lora, max_lora_rank=self.config.max_lora_rank if self.config.enable_lora else 0,
            lora_adapters=tuple(LoraInfo(a.name, a.path, a.rank) for a in list(self.loras.values())),
            tool_call_parser=self.tool_call_parser,
        )

    def stats(self) -> EngineStats:
        """A snapshot; read from another thread it may be a step old."""
        bm = self.block_manager
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            free_blocks=bm.num_free_blocks, total_blocks=bm.num_total_blocks,
            prefix_cache_hits=bm.cache_hits, prefix_cache_queries=bm.cache_queries,
            preemptions=self.scheduler.num_preemptions, generated_tokens=self._generated_tokens,
            prompt_tokens=self._prompt_tokens,
        )

    # ---- the engine's own thread ----

    def add_request(self, request: Request) -> None:
        self._requests[request.request_id] = request
        for seq in request.seqs:
            self.scheduler.add(seq)
            self._by_seq[seq.seq_id] = request

    def abort_request(self, request_id: str) -> None:
        """End every unfinished choice of the request with finish_reason "abort"."""
        request = self._requests.get(request_id)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.is_finished and seq.seq_id in self._by_seq:
                self.scheduler.finish(seq, "abort")
                self._emit(request, seq, request.streams[seq.seq_id], "abort", None)

    def abort_all(self) -> None:
        for request_id in list(self._requests):
            self.abort_request(request_id)

    def fail_all(self) -> None:
        """After a bug: end every request in flight with an internal error."""
        for request in list(self._requests.values()):
            self._fail(request)

    def has_unfinished(self) -> bool:
        return not self.scheduler.is_finished()

    def step(self) -> None:
        batch = self.scheduler.schedule()
        if not batch:
            return
        self.structured.start_fill(batch.sampled)  # the grammar masks fill while the forward pass runs
        output = self._run(batch)
        if output is not None:
            self._postprocess(batch, output)

    def _run(self, batch: ScheduledBatch) -> SamplerOutput | None:
        """The batch's forward and sampling; None (its requests failed) if the model step raised."""
        try:
            return self.runner.run(batch)
        except Exception:
            log.exception("model step failed; failing the %d sequences in it", len(batch.seqs))
            for seq in batch.seqs:
                self.block_manager.forget_uncomputed(seq)
                request = self._by_seq.get(seq.seq_id)
                if request is not None:
                    self._fail(request)
            return None

    def _postprocess(self, batch: ScheduledBatch, output: SamplerOutput) -> None:
        for seq in batch.prefills:
            if seq.seq_id in output.prompt_logprobs:
                first, entries = output.prompt_logprobs[seq.seq_id]
                have = len(seq.prompt_logprobs)  # a prompt computed again after a preemption keeps what it has
                assert first <= have, "prompt logprobs skipped a position"
                seq.prompt_logprobs.extend(entries[have - first :])
        for seq in batch.seqs:
            seq.num_cached_tokens += seq.num_scheduled_tokens
        for seq in batch.pooled:
            self._finish_embedding(seq, output.embeddings[seq.seq_id])
        seqs = batch.sampled  # a prompt chunk that does not end its prompt makes no token
        self._generated_tokens += len(seqs)
        self._prompt_tokens += sum(seq.num_prompt_tokens for seq in (*seqs, *batch.pooled)
                                   if not seq.num_completion_tokens)
        interval = self.config.stream_interval or min(-(-len(seqs) // AUTO_STREAM_MESSAGES), AUTO_STREAM_MAX_INTERVAL)
        for seq, token_id, logprob in zip(seqs, output.token_ids, output.logprobs):
            try:
                self._append_token(seq, token_id, logprob, interval)
            except Exception:
                log.exception("output processing failed for sequence %d", seq.seq_id)
                request = self._by_seq.get(seq.seq_id)
                if request is not None:
                    self._fail(request)

    def _append_token(self, seq: Sequence, token_id: int, logprob, interval: int) -> None:
        request = self._by_seq.get(seq.seq_id)
        if request is None or seq.is_finished:
            return
        self.block_manager.register_full_block(seq)
        seq.append_token(token_id)
        if seq.guide is not None:
            seq.guide.accept(token_id)
        stream = request.streams[seq.seq_id]
        reason, matched = self._check_stop(seq, token_id, logprob, stream)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            stream.finish()
            if stream.matched_stop is not None:
                reason, matched = "stop", stream.matched_stop
            if reason == "stop" and stream.has_tool_calls:
                reason = "tool_calls"
        elif seq.num_completion_tokens % interval and seq.num_completion_tokens > 1:
            return  # --stream-interval: the stream keeps the delta for the next output
        self._emit(request, seq, stream, reason, matched)

    def _finish_embedding(self, seq: Sequence, vector) -> None:
        request = self._by_seq.get(seq.seq_id)
        if request is None or seq.is_finished:
            return
        self.scheduler.finish(seq, "stop")
        self._forget_seq(request, seq)
        out = RequestOutput(request.request_id, seq.index, finish_reason="stop", embedding=tuple(vector.tolist()),
                            usage=Usage(seq.num_prompt_tokens, 0, seq.num_prompt_cached_tokens or 0))
        try:
            request.on_output(out)
        except Exception:
            log.exception("output listener of %s failed", request.request_id)

    def _check_stop(self, seq: Sequence, token_id: int, logprob, stream: OutputStream):
        p = seq.params
        if token_id in p.stop_token_ids:
            stream.add_token(token_id, logprob, show_text=False)
            return "stop", token_id
        if token_id in self.eos_token_ids and not p.ignore_eos:
            stream.add_token(token_id, logprob, show_text=False)
            return "stop", None
        stream.add_token(token_id, logprob)
        if stream.matched_stop is not None:
            return "stop", stream.matched_stop
        if seq.guide is not None and seq.guide.is_complete:
            return "stop", None  # the grammar allows nothing more: end even if the model would go on
        if seq.num_completion_tokens >= p.max_tokens or len(seq) >= self.max_model_len:
            return "length", None
        return None, None

    def _emit(self, request: Request, seq: Sequence, stream: OutputStream, reason, matched) -> None:
        usage = None
        if reason is not None:
            usage = Usage(seq.num_prompt_tokens, seq.num_completion_tokens, seq.num_prompt_cached_tokens or 0)
        prompt_logprobs = ()
        if seq.prompt_logprobs is not None and not seq.needs_prompt_logprobs:  # on the first output
            prompt_logprobs = stream.prompt_logprobs(seq.token_ids[: seq.num_prompt_tokens], seq.prompt_logprobs)
            seq.prompt_logprobs = None
        out = RequestOutput(request.request_id, seq.index, **stream.take(), prompt_logprobs=prompt_logprobs,
                            finish_reason=reason, matched_stop=matched, usage=usage,
                            prompt_tokens=seq.num_prompt_tokens, scheduled_at=seq.first_scheduled_at)
        if reason is not None:
            self._forget_seq(request, seq)
        try:
            request.on_output(out)
        except Exception:
            log.exception("output listener of %s failed; aborting it", request.request_id)
            self.abort_request(request.request_id)

    def _forget_seq(self, request: Request, seq: Sequence) -> None:
        del self._by_seq[seq.seq_id]
        if seq.guide is not None:
            seq.guide.release()
        request.unfinished -= 1
        if request.unfinished == 0:
            del self._requests[request.request_id]

    def _fail(self, request: Request) -> None:
        for seq in request.seqs:
            if seq.seq_id in self._by_seq:
                self.scheduler.finish(seq, "abort")
                self._forget_seq(request, seq)
                out = RequestOutput(request.request_id, seq.index, finish_reason="abort",
                                    error="internal error while generating")
                try:
                    request.on_output(out)
                except Exception:
                    log.exception("output listener of %s failed", request.request_id)

    def _build_request(self, request_id, prompt, prompt_ids, params, on_output, grammar, lora=None) -> Request:
        is_chat = isinstance(prompt, ChatInput)
        parse_tools = is_chat and bool(prompt.tools) and prompt.tool_choice != "none"
        parse_call = call_parser(self.tool_call_parser, prompt.tools) if parse_tools else None
        opens_reasoning = is_chat and prompt_opens_reasoning(prompt_ids)
        seqs = [Sequence(prompt_ids, params, self.block_manager.block_size, index=i, lora=lora)
                for i in range(params.n)]
        if grammar is not None:
            for seq in seqs:
                seq.guide = self.structured.guide(grammar, prompt_ids, is_chat)
        streams = {
            seq.seq_id: OutputStream(self.tokenizer, params, starts_in_reasoning=opens_reasoning,
                                     parse_reasoning=is_chat, parse_tools=parse_tools, parse_call=parse_call)
            for seq in seqs
        }
        return Request(request_id, on_output, seqs, streams)


def _on_own_thread(work):
    """work() on a short-lived thread (the model's load, an adapter's), so that the caller's
    thread never runs a parallel torch op. CPU torch keeps an OpenMP thread team for every
    thread that has run one; while the caller's team exists, the engine thread's many small ops
    run much slower (docs/benchmarks.md). The team of a thread that has exited is gone."""
    result: dict = {}

    def run() -> None:
        try:
            result["value"] = work()
        except BaseException as exc:  # re-raised in the caller: ModelLoadError, InvalidRequest, ...
            result["error"] = exc

    thread = threading.Thread(target=run, name="xserv-load", daemon=True)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]
