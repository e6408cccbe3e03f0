"""A small stand-in for LLMEngine with the same API: an engine thread that emits one scripted
token per choice per step ("w0 ", "w1 ", ...), KV blocks held while a request runs, aborts."""

import threading
import time
from dataclasses import dataclass, field

from xserv_engine.errors import EngineOverloaded, EngineUnavailable, InvalidRequest, NotFound
from xserv_engine.inputs import ChatInput, check_prompt
from xserv_engine.outputs import EngineStats, ModelInfo, RequestOutput, Usage

VOCAB_SIZE = 1000
BLOCKS_PER_CHOICE = 2
FAIL_PROMPT = "please fail"  # this prompt makes the fake report an internal error mid-stream


@dataclass
class _Request:
    request_id: str
    prompt_len: int
    max_tokens: int
    on_output: object
    fail: bool
    generated: dict[int, int] = field(default_factory=dict)  # index -> tokens so far
    aborted: bool = False


class FakeEngine:
    def __init__(self, total_blocks: int = 64, step_s: float = 0.005, max_queued: int = 1000):
        self.total_blocks = total_blocks
        self.add_delay_s = 0.0  # how long add_request takes (a slow chat-template render)
        self.add_started = threading.Event()  # set when an add_request has passed its checks
        self.add_gate = threading.Event()  # clear it to hold add_request there until it is set again
        self.add_gate.set()
        self.step_s = step_s
        self.max_queued = max_queued
        self.sampling_defaults = {}  # what unset sampling fields take (LLMEngine: generation_config.json's)
        self.received = []  # (request_id, prompt, params), in arrival order
        self.aborted = []
        self._requests: dict[str, _Request] = {}
        self._lock = threading.Lock()
        self._aborts = threading.Condition(self._lock)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fake-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def warmup(self) -> None:
        pass

    def shutdown(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)

    def add_request(self, request_id, prompt, params, on_output, lora_name=None) -> None:
        if self._stopped.is_set():
            raise EngineUnavailable("engine is stopped")
        if lora_name is not None:
            raise NotFound("lora_name", f"LoRA adapter {lora_name!r} is not loaded (loaded: none)")
        params.validate(VOCAB_SIZE)
        check_prompt(prompt, VOCAB_SIZE)
        self.add_started.set()
        time.sleep(self.add_delay_s)
        self.add_gate.wait(timeout=60)
        with self._lock:
            if request_id in self._requests:
                raise InvalidRequest("request_id", f"{request_id!r} is already running")
            if len(self._requests) >= self.max_queued:
                raise EngineOverloaded(self.max_queued)
            self.received.append((request_id, prompt, params))
            self._requests[request_id] = _Request(
                request_id, len(self.tokenize(prompt)[0]), params.max_tokens, on_output,
                fail=prompt == FAIL_PROMPT, generated={i: 0 for i in range(params.n)})

    def abort(self, request_id: str) -> bool:
        with self._lock:
            request = self._requests.get(request_id)
            if request is None:
                return False
            request.aborted = True
            self.aborted.append(request_id)
            self._aborts.notify_all()
            return True

    def wait_aborted(self, request_id: str, timeout: float) -> bool:
        """Whether `request_id` was aborted, waiting up to `timeout` seconds for it."""
        with self._aborts:
            return self._aborts.wait_for(lambda: request_id in self.aborted, timeout)

    def tokenize(self, prompt) -> tuple[list[int], str]:
        check_prompt(prompt, VOCAB_SIZE)
        if isinstance(prompt, ChatInput):
            text = "".join(f"<{m['role']}>{m['content']}" for m in prompt.messages)
        elif isinstance(prompt, list):
            return prompt, " ".join(map(str, prompt))
        else:
            text = prompt
        return [len(word) % VOCAB_SIZE for word in text.split()] or [0], text

    def stats(self) -> EngineStats:
        with self._lock:
            used = sum(BLOCKS_PER_CHOICE * len(r.generated) for r in self._requests.values())
            return EngineStats(running=len(self._requests), waiting=0,
                               free_blocks=self.total_blocks - used, total_blocks=self.total_blocks)

    def model_info(self) -> ModelInfo:
        return ModelInfo(model_id="fake-model", max_model_len=128, vocab_size=VOCAB_SIZE,
                         eos_token_ids=(7,), dtype="float32", device="cpu", block_size=16)

    def _loop(self) -> None:
        while not self._stopped.wait(self.step_s):
            with self._lock:
                requests = list(self._requests.values())
            for request in requests:
                self._step(request)
        for request in list(self._requests.values()):
            request.aborted = True
            self._step(request)

    def _step(self, request: _Request) -> None:
        if request.fail:
            request.on_output(RequestOutput(request.request_id, 0, error="fake failure"))
        for index, count in list(request.generated.items()):
            if request.aborted or request.fail:
                self._finish(request, index, "abort", RequestOutput(request.request_id, index))
                continue
            request.generated[index] = count + 1
            output = RequestOutput(request.request_id, index, token_ids=(count,), text=f"w{count} ")
            if count + 1 == request.max_tokens:
                self._finish(request, index, "length", output)
            else:
                request.on_output(output)

    def _finish(self, request: _Request, index: int, reason: str, output: RequestOutput) -> None:
        """Forgets the choice (and the request after its last) before the caller hears of it, as
        LLMEngine does: a caller that has its last output must find nothing left to abort."""
        usage = Usage(request.prompt_len, request.generated[index], 0)
        with self._lock:
            del request.generated[index]
            if not request.generated:
                del self._requests[request.request_id]
        request.on_output(RequestOutput(request.request_id, index, output.token_ids, output.text,
                                        finish_reason=reason, usage=usage))
