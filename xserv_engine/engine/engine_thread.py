"""EngineThread: runs an LLMEngine on its own thread, and the crossings to and from it.

In: any thread calls add_request / abort; they reach the engine thread through the inbox, a
thread-safe queue it drains between steps. Out: each request's on_output runs on the engine
thread; a Mailbox carries those outputs to an asyncio event loop, one wake-up per batch.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import replace
from typing import TYPE_CHECKING, Callable

from xserv_engine.config import EngineConfig
from xserv_engine.engine.runner_kind import RunnerKind
from xserv_engine.errors import EngineOverloaded, EngineUnavailable, InvalidRequest
from xserv_engine.inputs import PromptInput
from xserv_engine.models.pooling import EmbedParams
from xserv_engine.outputs import EngineStats, ModelInfo, RequestOutput
from xserv_engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # the server imports this module before torch is wanted
    from xserv_engine.engine.block_manager import BlockManager
    from xserv_engine.engine.engine_setup import EngineSetup
    from xserv_engine.engine.llm_engine import LLMEngine
    from xserv_engine.engine.lora_registry import LoraRegistry
    from xserv_engine.engine.model_runner import ModelRunner
    from xserv_engine.engine.request import OnOutput, Request
    from xserv_engine.structured.manager import StructuredOutputManager
    from xserv_engine.models.lora import LoraAdapter
    from xserv_engine.tokenizer.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class EngineThread:
    """The engine as the server sees it, and all it sees: add_request / add_embed_request /
    add_score_request, abort, stats; tokenize, detokenize, model_info and the LoRA registry's
    load and unload, which any thread may call; the read-only facts the server converts with
    (kind, sampling_defaults, tokenizer, config). Admission (a running id, a full queue) is
    decided here, under a lock. Tests also read the core's parts (runner, block_manager, ...)."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._running: set[str] = set()  # request ids added and not yet finished
        self._queued = 0  # of those, the ones that have no output yet
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ---- what never changes, and the calls any thread may make ----

    @property
    def kind(self) -> RunnerKind:
        return self.engine.kind

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def sampling_defaults(self) -> dict:
        return self.engine.sampling_defaults

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def tokenize(self, prompt: PromptInput) -> tuple[list[int], str]:
        return self.engine.tokenize(prompt)

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.engine.detokenize(token_ids, skip_special_tokens)

    def model_info(self) -> ModelInfo:
        return self.engine.model_info()

    def load_lora(self, name: str, path: str) -> LoraAdapter:
        return self.engine.load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        self.engine.unload_lora(name)

    # ---- the core's parts, for the tests and benchmarks that look inside; the server reads none ----

    @property
    def setup(self) -> EngineSetup:
        return self.engine.setup

    @property
    def runner(self) -> ModelRunner:
        return self.engine.runner

    @property
    def block_manager(self) -> BlockManager:
        return self.engine.block_manager

    @property
    def structured(self) -> StructuredOutputManager:
        return self.engine.structured

    @property
    def loras(self) -> LoraRegistry:
        return self.engine.loras

    # ---- requests ----

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="xserv-engine", daemon=True)
        self._thread.start()

    def warmup(self) -> None:
        """One tiny generation through the whole path; returns when it has finished."""
        done = threading.Event()
        if self.kind is RunnerKind.SCORE:
            self.add_score_request("warmup", "Hello", "World", None, lambda out: out.finished and done.set())
        elif self.kind is RunnerKind.POOLING:
            self.add_embed_request("warmup", "Hello", EmbedParams(), lambda out: out.finished and done.set())
        else:
            self.add_request("warmup", "Hello", SamplingParams(max_tokens=2, temperature=0.0),
                             lambda out: out.finished and done.set())
        done.wait()

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams, on_output: OnOutput,
                    lora_name: str | None = None) -> None:
        """Validate and tokenize here, on the caller's thread; the engine thread adds it."""
        self._check_running()
        self._admit(self.engine.make_request(request_id, prompt, params, self._tracked(request_id, params.n, on_output),
                                             lora_name))

    def add_embed_request(self, request_id: str, prompt: str | list[int], params: EmbedParams, on_output: OnOutput,
                          field: str = "input") -> None:
        """An input to embed (LLMEngine.make_embed_request), admitted as add_request's."""
        self._check_running()
        self._admit(self.engine.make_embed_request(request_id, prompt, params, self._tracked(request_id, 1, on_output),
                                                   field))

    def add_score_request(self, request_id: str, query: str, document: str, instruction: str | None,
                          on_output: OnOutput, field: str = "document") -> None:
        """A document to score against a query (LLMEngine.make_score_request), admitted as add_request's."""
        self._check_running()
        self._admit(self.engine.make_score_request(request_id, query, document, instruction,
                                                   self._tracked(request_id, 1, on_output), field))

    def _check_running(self) -> None:
        if self._stopping:
            raise EngineUnavailable("engine is shutting down")

    def _admit(self, request: Request) -> None:
        with self._lock:
            if request.request_id in self._running:
                raise InvalidRequest("request_id", f"a request with id {request.request_id!r} is already running")
            if self._queued >= self.engine.config.max_queued_requests:
                raise EngineOverloaded(self.engine.config.max_queued_requests)
            self._running.add(request.request_id)
            self._queued += 1
        self._inbox.put(("add", request))

    def abort(self, request_id: str) -> bool:
        with self._lock:
            found = request_id in self._running
        if found:
            self._inbox.put(("abort", request_id))
        return found

    def stats(self) -> EngineStats:
        stats = self.engine.stats()
        return replace(stats, waiting=stats.waiting + self._inbox.qsize())

    def shutdown(self) -> None:
        self._stopping = True
        self._inbox.put(("stop", None))
        if self._thread:
            self._thread.join(timeout=30)

    def _tracked(self, request_id: str, n: int, on_output: OnOutput) -> OnOutput:
        """on_output, after the bookkeeping of admission: the request stops counting as queued
        at its first output and frees its id when its n-th choice finishes (before the caller
        hears of it, so the id may be reused at once)."""
        unfinished, first = [n], [True]

        def on_engine_output(output: RequestOutput) -> None:
            with self._lock:
                if first[0]:
                    first[0] = False
                    self._queued -= 1
                if output.finished:
                    unfinished[0] -= 1
                    if unfinished[0] == 0:
                        self._running.discard(request_id)
            on_output(output)

        return on_engine_output

    # ---- the engine thread ----

    def _loop(self) -> None:
        while self._apply_inbox(block=not self.engine.has_unfinished()):
            if not self.engine.has_unfinished():
                continue
            try:
                self.engine.step()
            except Exception:  # a bug, not a user error: fail what is in flight, keep serving
                log.exception("engine step failed; failing every request in flight")
                self.engine.fail_all()
        self._apply_inbox(block=False)  # requests that arrived with the stop: end them too
        self.engine.abort_all()

    def _apply_inbox(self, block: bool) -> bool:
        """Apply queued adds and aborts; False when asked to stop."""
        while True:
            try:
                kind, item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                self._stopping = True
                return False
            if kind == "add":
                self.engine.add_request(item)
            elif kind == "abort":
                self.engine.abort_request(item)


class Mailbox:
    """Carries outputs from the engine thread to one event loop with one wake-up per batch
    instead of one per output: a step's 64 outputs cost one call_soon_threadsafe (a self-pipe
    write and a GIL hand-over), not 64."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, RequestOutput]] = []

    def deliver_to(self, outputs: asyncio.Queue) -> Callable[[RequestOutput], None]:
        """The on_output callback of one request: runs on the engine thread."""

        def deliver(output: RequestOutput) -> None:
            with self._lock:
                self._pending.append((outputs, output))
                if len(self._pending) > 1:
                    return  # a flush is already on its way
            try:
                self.loop.call_soon_threadsafe(self._flush)
            except RuntimeError:
                pass  # the event loop is closed: the server is gone and the request was aborted

        return deliver

    def _flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for outputs, output in pending:
            outputs.put_nowait(output)
