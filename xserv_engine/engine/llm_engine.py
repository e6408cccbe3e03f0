"""LLMEngine: the engine core. Requests in, outputs back through each request's on_output.

step() reads: schedule -> run -> postprocess. The core is single-threaded: EngineThread runs it
on its own thread and is what the server and other callers talk to. Requests are made on the
caller's thread, by the module of the engine's RunnerKind: GenerateRequests (generate_requests.py)
or PooledRequests (pooled_requests.py, embed and score); LoRA adapters are LoraRegistry's
(lora_registry.py). Those, tokenize and model_info read only what never changes (and the
registry), so any thread may call them.
"""

import copy
import logging
import threading

from xserv_engine.config import EngineConfig
from xserv_engine.demo import RANDOM_WEIGHTS
from xserv_engine.engine.block_manager import BlockManager
from xserv_engine.engine.engine_setup import EngineSetup
from xserv_engine.engine.generate_requests import GenerateRequests
from xserv_engine.engine.lora_registry import LoraRegistry
from xserv_engine.engine.output_stream import OutputStream
from xserv_engine.engine.pooled_requests import PooledRequests
from xserv_engine.engine.request import OnOutput, Request
from xserv_engine.engine.runner_kind import RunnerKind
from xserv_engine.engine.scheduler import POLICIES, ScheduledBatch, Scheduler
from xserv_engine.engine.sequence import Sequence
from xserv_engine.engine.speculative import Speculator, parse_speculative_config
from xserv_engine.errors import InvalidRequest
from xserv_engine.inputs import PromptInput, check_prompt
from xserv_engine.layers.sampler import SamplerOutput
from xserv_engine.models.lora import LoraAdapter, load_lora_adapter
from xserv_engine.models.pooling import EmbedParams
from xserv_engine.multimodal.prompt_images import image_prompts
from xserv_engine.outputs import EngineStats, LoraInfo, ModelInfo, RequestOutput, Usage
from xserv_engine.sampling_params import SamplingParams
from xserv_engine.structured.manager import StructuredOutputManager
from xserv_engine.tokenizer.tool_call_parsers import resolve_tool_call_parser

log = logging.getLogger(__name__)

# --stream-interval auto: about this many outputs per step at most (each stream's tokens go out
# every ceil(decoding / AUTO_STREAM_MESSAGES) steps, at most every AUTO_STREAM_MAX_INTERVAL).
# Every output costs the server and its client ~0.1 ms of CPU each (grpc.aio's write and read
# paths), whatever it carries: over gRPC on 2 cores, 64 streams at one token each ran at 0.77-0.86
# of the in-process engine, at 16 messages per step (4 tokens each) 0.84-0.91, at 8 (8 tokens
# each) 0.94 (docs/benchmarks-log.md, "Through gRPC"). At 64 streams a stream still gets a message
# ~4 times a second on 2 CPU cores, more often on faster hardware.
AUTO_STREAM_MESSAGES = 8
AUTO_STREAM_MAX_INTERVAL = 8


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = True):
        if config.stream_interval is not None and config.stream_interval < 1:
            raise InvalidRequest("stream_interval", f"must be at least 1, got {config.stream_interval}")
        self.config = config
        speculative = parse_speculative_config(config.speculative_config)  # refused before the model loads
        setup = _on_own_thread(lambda: EngineSetup.build(config, progress=progress, speculative=speculative))
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
        self.kind = RunnerKind.of(setup.pooling)
        if speculative is not None and self.kind is not RunnerKind.GENERATE:
            raise InvalidRequest("speculative_config", f"only a generate runner decodes; this one is {self.kind.value}")
        hybrid = setup.model_dir.config.is_hybrid
        prefix_caching = config.enable_prefix_caching and (not hybrid or len(setup.snapshot_slots) > 0)
        if hybrid and config.enable_prefix_caching and not prefix_caching:  # KV alone cannot rebuild the states
            log.info("prefix caching is off: %s has linear-attention layers and no room for snapshots of their "
                     "states (--mamba-snapshot-slots)", setup.model_dir.path.name)
        self.block_manager = BlockManager(setup.num_blocks, setup.block_size, prefix_caching, setup.num_state_slots,
                                          setup.snapshot_slots, setup.snapshot_interval)
        if hybrid and prefix_caching:
            self.block_manager.copy_states = self.runner.copy_states
        if config.scheduling_policy not in POLICIES:
            raise InvalidRequest("scheduling_policy", f"must be one of {', '.join(POLICIES)}, got "
                                                      f"{config.scheduling_policy!r}")
        self.speculator = Speculator(speculative, setup.draft) if speculative is not None else None
        self.scheduler = Scheduler(self.block_manager, setup.max_num_seqs, setup.max_num_batched_tokens,
                                   config.scheduling_policy, self.speculator)
        self.structured = StructuredOutputManager(setup.model_dir.path / "tokenizer.json", setup.model_dir.eos_token_ids,
                                                  separator_ids=tuple(self.tokenizer.encode("\n\n")))
        self._requests: dict[str, Request] = {}
        self._by_seq: dict[int, Request] = {}
        self._generated_tokens = 0
        self._prompt_tokens = 0
        self.loras = LoraRegistry(config.enable_lora, setup.model_id, self._read_lora)
        for name, path in config.lora_modules:
            self.load_lora(name, path)
        self.generate_requests = GenerateRequests(
            self.kind, setup.model_id, self.tokenizer, self.vocab_size, self.max_model_len, self.default_max_tokens,
            self.scheduler.by_priority, setup.block_size, self.structured, self.tool_call_parser, self.loras,
            setup.model_dir.config.accepts_images, config.limit_mm_per_prompt, image_prompts(setup.model_dir))
        self.pooled_requests = PooledRequests(self.kind, setup.model_id, self.tokenizer, self.vocab_size,
                                              setup.model_dir.config.hidden_size, self.max_model_len, setup.block_size)

    # ---- any thread ----

    def make_request(self, request_id: str, prompt: PromptInput, params: SamplingParams,
                     on_output: OnOutput, lora_name: str | None = None) -> Request:
        """A Generate request, checked, rendered and tokenized (GenerateRequests.make)."""
        return self.generate_requests.make(request_id, prompt, params, on_output, lora_name)

    def make_embed_request(self, request_id: str, prompt: str | list[int], params: EmbedParams,
                           on_output: OnOutput, field: str = "input") -> Request:
        """An input to embed (PooledRequests.embed)."""
        return self.pooled_requests.embed(request_id, prompt, params, on_output, field)

    def make_score_request(self, request_id: str, query: str, document: str, instruction: str | None,
                           on_output: OnOutput, field: str = "document") -> Request:
        """A document to score against a query (PooledRequests.score)."""
        return self.pooled_requests.score(request_id, query, document, instruction, on_output, field)

    def load_lora(self, name: str, path: str) -> LoraAdapter:
        """Serve a PEFT adapter directory under `name` (any thread: LoraRegistry.load)."""
        return self.loras.load(name, path)

    def unload_lora(self, name: str) -> None:
        """New requests can no longer name it; running ones finish with it."""
        self.loras.unload(name)

    def _read_lora(self, name: str, path: str) -> LoraAdapter:
        s = self.setup  # on a thread of its own, as the model's load
        return _on_own_thread(lambda: load_lora_adapter(name, path, s.model_dir.config, s.dtype, s.device,
                                                        self.config.max_lora_rank))

    def tokenize(self, prompt: PromptInput) -> tuple[list[int], str]:
        """(token ids as the model sees them, the text they encode: the rendered chat, or "" for
        token ids). Each image's placeholder is expanded to the image's tokens, as vLLM's
        /tokenize does, so the count is what the prompt costs (InvalidRequest for a bad image)."""
        requests = self.generate_requests
        token_ids, text = requests.tokenize(prompt)
        if requests.image_prompts is not None:
            token_ids, _ = requests.image_prompts.expand(prompt, token_ids)
        return token_ids, text

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        if token_ids:
            check_prompt(token_ids, self.vocab_size)  # InvalidRequest naming token_ids
        return self.tokenizer.decode(token_ids, skip_special_tokens)

    def model_info(self) -> ModelInfo:
        s = self.setup
        return ModelInfo(
            model_id=s.model_id, max_model_len=self.max_model_len, vocab_size=self.vocab_size,
            eos_token_ids=s.model_dir.eos_token_ids, dtype=str(s.dtype).removeprefix("torch."),
            device=str(s.device), block_size=s.block_size, runner=self.kind.value,
            embedding_size=s.model_dir.config.hidden_size if self.kind is RunnerKind.POOLING else 0,
            lora_enabled=self.config.enable_lora, max_lora_rank=self.config.max_lora_rank if self.config.enable_lora else 0,
            lora_adapters=tuple(LoraInfo(a.name, a.path, a.rank) for a in self.loras.adapters()),
            tool_call_parser=self.tool_call_parser, decode_route=s.route.value,
            quantization=s.runner.quantization or "",
            speculative_config=self.speculator.config.to_json() if self.speculator is not None else "",
            state_slot_bytes=s.state_slot_bytes,
            random_weights=bool(s.model_dir.hf_config.get(RANDOM_WEIGHTS)),
            max_images_per_prompt=self.config.limit_mm_per_prompt if s.model_dir.config.accepts_images else 0,
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
            spec=copy.deepcopy(self.speculator.stats) if self.speculator is not None else None,
            free_state_slots=len(bm.free_state_slots), total_state_slots=bm.num_state_slots,
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
        if self.speculator is not None:
            self.speculator.begin_step()
        batch = self.scheduler.schedule()
        if not batch:
            return
        self.structured.start_fill(batch.rows)  # the grammar masks fill while the forward pass runs
        output = self._run(batch)
        if output is not None:
            self._postprocess(batch, output)
            if self.speculator is not None:
                self.speculator.end_step(batch, output)

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
        for seq in batch.seqs:  # of a decode with drafts, the KV of its last token and the drafts that stood
            spec = output.spec_tokens.get(seq.seq_id)
            seq.num_cached_tokens += seq.num_scheduled_tokens if spec is None else 1 + len(spec)
        for seq in batch.prefills:
            self.block_manager.snapshots_written(seq)
        for seq in batch.pooled:
            self._finish_embedding(seq, output.embeddings[seq.seq_id])
        seqs = batch.sampled  # a prompt chunk that does not end its prompt makes no token
        self._generated_tokens += len(seqs) + sum(len(spec) for spec in output.spec_tokens.values())
        self._prompt_tokens += sum(seq.num_prompt_tokens for seq in (*seqs, *batch.pooled)
                                   if not seq.num_completion_tokens)
        interval = self.config.stream_interval or min(-(-len(seqs) // AUTO_STREAM_MESSAGES), AUTO_STREAM_MAX_INTERVAL)
        for seq, token_id, logprob in zip(seqs, output.token_ids, output.logprobs):
            tokens = [(token_id, logprob)]
            if seq.spec_token_ids:
                tokens += output.spec_tokens[seq.seq_id]
                self.speculator.record(seq, len(seq.spec_token_ids), len(tokens) - 1)
                seq.spec_token_ids = []
            try:
                self._append_tokens(seq, tokens, interval)
            except Exception:
                log.exception("output processing failed for sequence %d", seq.seq_id)
                request = self._by_seq.get(seq.seq_id)
                if request is not None:
                    self._fail(request)

    def _append_tokens(self, seq: Sequence, tokens: list, interval: int) -> None:
        """The step's tokens of a sequence (one, or more when drafts stood), up to the first that
        ends it; one output for them all, every `interval` tokens or at the end."""
        request = self._by_seq.get(seq.seq_id)
        if request is None or seq.is_finished:
            return
        stream = request.streams[seq.seq_id]
        due = False
        for i, (token_id, logprob) in enumerate(tokens):
            # a verification's states end after its last token's position, past any block end before it
            self.block_manager.register_full_block(seq, states_here=i == len(tokens) - 1)
            seq.append_token(token_id)
            if seq.guide is not None:
                seq.guide.accept(token_id)
            reason, matched = self._check_stop(seq, token_id, logprob, stream)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                stream.finish()
                if stream.matched_stop is not None:
                    reason, matched = "stop", stream.matched_stop
                if reason == "stop" and stream.has_tool_calls:
                    reason = "tool_calls"
                self._emit(request, seq, stream, reason, matched)
                return
            # --stream-interval: between outputs the stream keeps the deltas
            due = due or seq.num_completion_tokens % interval == 0 or seq.num_completion_tokens == 1
        if due:
            self._emit(request, seq, stream, None, None)

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
            usage = Usage(seq.num_prompt_tokens, seq.num_completion_tokens, seq.num_prompt_cached_tokens or 0,
                          stream.reasoning_tokens)
        prompt_logprobs = ()
        if seq.prompt_logprobs is not None and not seq.needs_prompt_logprobs:  # on the first output
            prompt_logprobs = stream.prompt_logprobs(seq.token_ids[: seq.num_prompt_tokens], seq.prompt_logprobs)
            seq.prompt_logprobs = None
        spec = (seq.spec.draft_tokens, seq.spec.accepted_tokens) if reason is not None and self.speculator else None
        out = RequestOutput(request.request_id, seq.index, **stream.take(), prompt_logprobs=prompt_logprobs,
                            finish_reason=reason, matched_stop=matched, usage=usage,
                            prompt_tokens=seq.num_prompt_tokens, scheduled_at=seq.first_scheduled_at,
                            spec_tokens=spec)
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


def _on_own_thread(work):
    """work() on a short-lived thread (the model's load, an adapter's), so that the caller's
    thread never runs a parallel torch op. CPU torch keeps an OpenMP thread team for every
    thread that has run one; while the caller's team exists, the engine thread's many small ops
    run much slower (docs/benchmarks-log.md). The team of a thread that has exited is gone."""
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
