"""A fake xserv engine for the REST front's tests: a real gRPC server (EngineService + Health)
on a free loopback port whose answers are scripted by the prompt's last words.

User errors end the call as the real engine's do (its own rpc_status_of): INVALID_ARGUMENT with
a google.rpc.BadRequest naming the field in GenerateRequest's terms ("chat.messages[0].content")
or EmbedRequest's ("inputs[1].text"), and an ErrorInfo CONTEXT_LENGTH_EXCEEDED when the context is
too short. What a request may not ask is checked by the real engine's own code (convert's
*_from_pb, SamplingParams.validate, check_prompt, fitted_max_tokens, check_fits, the LoRA
registry's errors), so the two cannot drift; tests/rest/test_error_cases.py runs one table of
such calls against both. The suffix "error:wrong-runner" makes any of Generate, Embed and Score
answer UNIMPLEMENTED with RunnerKind's words, as an engine serving another kind of model does.

Embed answers each input with a vector derived from its tokens (`embedding_of`; a text's tokens
are its characters' code points, as Tokenize's), so tests can check values and order. It waits
for a "slow" input's caller to go away. GetModelInfo reports an embedding_size, which the front checks
`dimensions` against (the fake serves every RPC; a real engine only its runner's).

Score, the fake reranker, scores a document by the share of the query's words it holds
(`score_of`), its prompt one token per character plus a template's (`score_tokens`), and refuses
what the real engine refuses (empty query or document, no documents or too many, a prompt longer
than the context).

LoRA adapters, as the real engine with --enable-lora serves them: LoadLoraAdapter adds one (rank 8),
UnloadLoraAdapter removes one (NOT_FOUND when none has the name), GetModelInfo lists them, and
Generate with a lora_name none has is NOT_FOUND. A name or path ending in "error:invalid" is
INVALID_ARGUMENT naming lora_name or lora_path; a name already loaded is loaded again (the real
engine refuses it, INVALID_ARGUMENT too: schemathesis, which loads names at random, counts a 400
for a schema-valid body as a failure). With `lora_enabled` False the two RPCs are UNIMPLEMENTED,
as on an engine started without --enable-lora. Tests may also change `adapters` directly, as
another front's load or unload would.

Like the real engine it streams text in many small messages, never splitting a character, and
ends each choice with finish_reason and usage. It records every request, the metadata each
Generate, Embed or Score call came with, and every call the client cancelled. With a token set,
EngineService calls without "authorization: Bearer <token>" are refused UNAUTHENTICATED and
health stays open, as with the real engine's --grpc-token.
"""

import hashlib
import math
import struct
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from xserv.v1 import engine_pb2, engine_pb2_grpc
from xserv_engine.engine.generate_requests import fitted_max_tokens
from xserv_engine.engine.lora_registry import NO_LORA, not_loaded
from xserv_engine.engine.pooled_requests import EMBED_REMEDY, SCORE_REMEDY, check_fits, embed_ids
from xserv_engine.engine.runner_kind import RunnerKind
from xserv_engine.errors import ContextTooLong, InputTooLong, InvalidRequest, Unsupported, XservError
from xserv_engine.inputs import ChatInput, check_images, check_prompt
from xserv_engine.server import convert
from xserv_engine.server.status import rpc_status_of

MODEL_ID = "fake-qwen3"
MAX_MODEL_LEN = 4096
IMAGE_LIMIT = 2  # the fake's --limit-mm-per-prompt; it takes images (accepts_images), as a vision model
VOCAB_SIZE = 151936
HELLO = ["Hel", "lo", " wor", "ld"]
UNICODE = ["你好", "，世界", " 🙂", "🎉", "!"]
USER_ERRORS = {  # prompt suffix -> the engine exception it raises
    "error:invalid": InvalidRequest("top_p", "must be greater than 0 and at most 1, got 0.0"),
    "error:content": InvalidRequest("chat.messages[0].content", "cannot be rendered"),
    "error:token": InvalidRequest("token_ids", "token id 999999 is not below vocab_size 151936"),
    "error:context": ContextTooLong(prompt_tokens=5000, max_tokens=1, max_model_len=MAX_MODEL_LEN),
    "error:max_tokens": ContextTooLong(prompt_tokens=7, max_tokens=4000, max_model_len=MAX_MODEL_LEN),
    "error:wrong-runner": RunnerKind.POOLING.refusal(RunnerKind.GENERATE, MODEL_ID),
}
ERRORS = {
    "error:overloaded": (grpc.StatusCode.RESOURCE_EXHAUSTED, "engine queue is full (2 requests waiting); retry later"),
    "error:unavailable": (grpc.StatusCode.UNAVAILABLE, "engine is draining"),
    "error:internal": (grpc.StatusCode.INTERNAL, "CUDA error: secret stack detail"),
}
# what a REST user reads when the engine refuses a call for another kind of model (WRONG_RUNNER)
NOT_AN_EMBEDDING_MODEL = (f"this model does not serve embeddings: {MODEL_ID} is a generation model; for this endpoint "
                          "start xserv with an embedding model (such as Qwen3-Embedding-0.6B): "
                          "xserv up --model DIR --runner pooling")
NOT_A_RERANKER = (f"this model does not serve reranking or scores: {MODEL_ID} is a generation model; for this "
                  "endpoint start xserv with a reranker (such as Qwen3-Reranker-0.6B): "
                  "xserv up --model DIR --runner score")
EMBEDDING_SIZE = 64
MAX_LORA_RANK = 64
TEMPLATE_TOKENS = 20  # the fake reranker's prompt around the query and the document


def characters(text: str) -> list[int]:
    """The fake tokenizer: one token per character, its code point (as Tokenize's)."""
    return [ord(c) for c in text]


def embedding_of(tokens: list[int], dimensions: int | None = None) -> list[float]:
    """The fake model's embedding of some tokens: 64 values from their SHA-512, the first
    `dimensions` of them, L2-normalized."""
    digest = hashlib.sha512(struct.pack(f"<{len(tokens)}I", *tokens)).digest()
    values = [byte + 1.0 for byte in digest[:dimensions or EMBEDDING_SIZE]]
    norm = math.sqrt(sum(value * value for value in values))
    return [value / norm for value in values]


def embed_input_error(index: int, text: str) -> XservError | None:
    """The engine error an input's suffix scripts, with the engine's field names."""
    if text.endswith("error:invalid"):
        return InvalidRequest(f"inputs[{index}].text", "cannot be embedded")
    if text.endswith("error:context"):
        return InputTooLong(f"inputs[{index}]", 5000, MAX_MODEL_LEN, EMBED_REMEDY)
    if text.endswith("error:wrong-runner"):
        return RunnerKind.GENERATE.refusal(RunnerKind.POOLING, MODEL_ID)
    return None


def score_of(query: str, document: str) -> float:
    """The fake reranker's relevance: the share of the query's words (casefolded) in the document."""
    words = query.casefold().split()
    found = set(document.casefold().split())
    return sum(word in found for word in words) / len(words) if words else 0.0


def score_tokens(query: str, document: str, instruction: str = "") -> int:
    """The fake reranker's prompt length: one token per character, plus the template's."""
    return TEMPLATE_TOKENS + len(instruction) + len(query) + len(document)


def score_error(request: engine_pb2.ScoreRequest) -> XservError | None:
    """What a suffix scripts ("error:invalid" on the query, a document or the instruction,
    "error:wrong-runner" on the query), then what the real engine refuses, by its own checks."""
    if request.query.endswith("error:wrong-runner"):
        return RunnerKind.GENERATE.refusal(RunnerKind.SCORE, MODEL_ID)
    if request.query.endswith("error:invalid"):
        return InvalidRequest("query", "cannot be scored")
    if request.instruction.endswith("error:invalid"):
        return InvalidRequest("instruction", "cannot be used")
    try:
        query, documents, instruction = convert.score_request_from_pb(request)
        for index, document in enumerate(documents):
            if document.endswith("error:invalid"):
                return InvalidRequest(f"documents[{index}]", "cannot be scored")
            check_fits(f"documents[{index}]", score_tokens(query, document, instruction or ""), MAX_MODEL_LEN,
                       SCORE_REMEDY)
    except XservError as error:
        return error
    return None


def _text_of(content: str | list[dict]) -> str:
    """A message's text (an image part counts as none)."""
    return content if isinstance(content, str) else "".join(part.get("text", "") for part in content)


def prompt_of(request: engine_pb2.GenerateRequest) -> str:
    if request.HasField("chat"):
        return request.chat.messages[-1].content if request.chat.messages else ""
    return request.text if request.HasField("text") else ""


def logprob(token_id: int, text: str, top: int) -> engine_pb2.TokenLogprob:
    alternatives = [engine_pb2.TopLogprob(token_id=token_id + k, token=f"{text}{k}" if k else text,
                                          token_bytes=(f"{text}{k}" if k else text).encode(), logprob=-0.5 - k)
                    for k in range(top)]
    return engine_pb2.TokenLogprob(token_id=token_id, token=text, token_bytes=text.encode(),
                                   logprob=-0.5, top_logprobs=alternatives)


class FakeEngine(engine_pb2_grpc.EngineServiceServicer):
    def __init__(self):
        self.requests: list[engine_pb2.GenerateRequest] = []
        self.embed_requests: list[engine_pb2.EmbedRequest] = []
        self.score_requests: list[engine_pb2.ScoreRequest] = []
        self.metadata: dict[str, dict[str, str]] = {}  # request_id -> the call's metadata
        self.cancelled: dict[str, float] = {}  # request_id -> when the call was cancelled
        self.started: dict[str, float] = {}
        self.slow_interval_s = 0.1
        self.lora_enabled = True
        self.adapters: dict[str, engine_pb2.LoraAdapter] = {}  # name -> adapter, in the order loaded
        self.model_info_calls = 0
        self.random_weights = False  # GetModelInfo: the model is xserv's random demo
        self.reported_image_limit = IMAGE_LIMIT  # GetModelInfo's max_images_per_prompt (what the front checks)
        self._lock = threading.Lock()

    # -- scripted answers --
    def Generate(self, request, context):
        with self._lock:
            self.requests.append(request)
            self.metadata[request.request_id] = dict(context.invocation_metadata())
            self.started[request.request_id] = time.monotonic()
        done = threading.Event()
        context.add_callback(lambda: None if done.is_set() else self._on_cancel(request.request_id))
        prompt = prompt_of(request)
        error = self._generate_error(request, prompt)
        if error is not None:
            done.set()
            context.abort_with_status(rpc_status_of(error))
        for key, (code, details) in ERRORS.items():
            if prompt.endswith(key):
                done.set()
                context.abort(code, details)
        try:
            yield from self._script(request, prompt, context)
        finally:
            done.set()

    def _generate_error(self, request: engine_pb2.GenerateRequest, prompt: str) -> XservError | None:
        """An unknown adapter, a scripted error, then what the real engine refuses, by its own checks
        (the prompt's tokens: one per character, a chat's contents joined)."""
        if request.lora_name and request.lora_name not in self.adapters:
            return not_loaded(request.lora_name, list(self.adapters))
        scripted = next((error for key, error in USER_ERRORS.items() if prompt.endswith(key)), None)
        if scripted is not None:
            return scripted
        try:
            _, prompt_input, params = convert.generate_request_from_pb(request)
            params.validate(VOCAB_SIZE)
            check_prompt(prompt_input, VOCAB_SIZE)
            check_images(prompt_input, MODEL_ID, True, IMAGE_LIMIT)
            text = "".join(_text_of(m["content"]) for m in prompt_input.messages) if isinstance(
                prompt_input, ChatInput) else prompt_input
            fitted_max_tokens(params, len(text), MAX_MODEL_LEN, None)
        except XservError as error:
            return error
        return None

    def _on_cancel(self, request_id: str) -> None:
        with self._lock:
            self.cancelled[request_id] = time.monotonic()

    def _script(self, request, prompt, context):
        if prompt.endswith("slow"):
            yield from self._slow(request, context)
        elif prompt.endswith("midstream"):
            yield engine_pb2.GenerateResponse(index=0, text="partial", request_id=request.request_id)
            context.abort(grpc.StatusCode.UNAVAILABLE, "engine is draining")
        elif prompt.endswith("pause"):
            time.sleep(1.0)
            yield from self._text(request, HELLO)
        elif prompt.endswith("tools"):
            yield from self._tools(request)
        elif prompt.endswith("echo"):  # the prompt before "echo", markup and all, in up to 8 pieces
            said = prompt[:-len("echo")]
            size = max(1, -(-len(said) // 8))
            yield from self._text(request, [said[i:i + size] for i in range(0, len(said), size)])
        else:
            pieces = UNICODE if prompt.endswith("unicode") else HELLO
            yield from self._text(request, pieces)

    def _text(self, request, pieces):
        params = request.params
        n = params.n if params.HasField("n") else 1
        limit = params.max_tokens if params.HasField("max_tokens") else 16
        stop_at = len(pieces) if not params.stop else 2  # a stop string "matches" after two pieces
        count = min(len(pieces), limit, stop_at)
        for step in range(count):
            for index in range(n):
                message = engine_pb2.GenerateResponse(index=index, token_ids=[100 + step], text=pieces[step],
                                                      request_id=request.request_id, prompt_tokens=7)
                if params.logprobs:
                    message.logprobs.append(logprob(100 + step, pieces[step], params.top_logprobs))
                if step == count - 1:
                    finish = engine_pb2.FINISH_REASON_STOP if count < limit else engine_pb2.FINISH_REASON_LENGTH
                    message.finish_reason = finish
                    message.usage.CopyFrom(engine_pb2.Usage(prompt_tokens=7, completion_tokens=count,
                                                            cached_prompt_tokens=3))
                yield message

    def _tools(self, request):
        rid = request.request_id
        yield engine_pb2.GenerateResponse(reasoning_text="I should call ", request_id=rid)
        yield engine_pb2.GenerateResponse(reasoning_text="the tool.", request_id=rid)
        yield engine_pb2.GenerateResponse(request_id=rid, tool_calls=[engine_pb2.ToolCallDelta(
            index=0, id="call_1", name="get_weather", arguments='{"city": ')])
        yield engine_pb2.GenerateResponse(
            request_id=rid, tool_calls=[engine_pb2.ToolCallDelta(index=0, arguments='"Paris"}')],
            finish_reason=engine_pb2.FINISH_REASON_TOOL_CALLS,
            usage=engine_pb2.Usage(prompt_tokens=20, completion_tokens=12))

    def _slow(self, request, context):
        for step in range(300):
            if not context.is_active():
                return
            yield engine_pb2.GenerateResponse(index=0, token_ids=[step], text=f"t{step} ", request_id=request.request_id)
            time.sleep(self.slow_interval_s)
        yield engine_pb2.GenerateResponse(index=0, finish_reason=engine_pb2.FINISH_REASON_LENGTH,
                                          usage=engine_pb2.Usage(prompt_tokens=1, completion_tokens=300))

    def Embed(self, request, context):
        with self._lock:
            self.embed_requests.append(request)
            self.metadata[request.request_id] = dict(context.invocation_metadata())
        done = threading.Event()
        context.add_callback(lambda: None if done.is_set() else self._on_cancel(request.request_id))
        texts = [item.text for item in request.inputs if item.HasField("text")]
        try:
            for key, (code, details) in ERRORS.items():
                if any(text.endswith(key) for text in texts):
                    context.abort(code, details)
            try:
                embeddings = self._embeddings(request)
            except XservError as error:
                context.abort_with_status(rpc_status_of(error))
            while any(text.endswith("slow") for text in texts) and context.is_active():
                time.sleep(0.02)
            return engine_pb2.EmbedResponse(request_id=request.request_id, embeddings=embeddings)
        finally:
            done.set()

    def _embeddings(self, request: engine_pb2.EmbedRequest) -> list[engine_pb2.Embedding]:
        """Each input's embedding, after the scripted errors and the real engine's checks."""
        for index, item in enumerate(request.inputs):
            error = embed_input_error(index, item.text) if item.HasField("text") else None
            if error is not None:
                raise error
        inputs = convert.embed_inputs_from_pb(request)
        params = convert.embed_params_from_pb(request)
        params.validate(EMBEDDING_SIZE)
        embeddings = []
        for index, prompt in enumerate(inputs):
            tokens = embed_ids(prompt, params, f"inputs[{index}]", VOCAB_SIZE, MAX_MODEL_LEN, characters)
            embeddings.append(engine_pb2.Embedding(values=embedding_of(tokens, params.dimensions),
                                                   prompt_tokens=len(tokens)))
        return embeddings

    def Score(self, request, context):
        with self._lock:
            self.score_requests.append(request)
            self.metadata[request.request_id] = dict(context.invocation_metadata())
        done = threading.Event()
        context.add_callback(lambda: None if done.is_set() else self._on_cancel(request.request_id))
        texts = [request.query, *request.documents]
        try:
            for key, (code, details) in ERRORS.items():
                if any(text.endswith(key) for text in texts):
                    context.abort(code, details)
            error = score_error(request)
            if error is not None:
                context.abort_with_status(rpc_status_of(error))
            while any(text.endswith("slow") for text in texts) and context.is_active():
                time.sleep(0.02)
            scores = [engine_pb2.DocumentScore(score=score_of(request.query, document), prompt_tokens=score_tokens(
                request.query, document, request.instruction)) for document in request.documents]
            return engine_pb2.ScoreResponse(request_id=request.request_id, scores=scores)
        finally:
            done.set()

    def Tokenize(self, request, context):  # one id per character; a chat: its contents joined
        text = request.text if request.HasField("text") else "".join(m.content for m in request.chat.messages)
        return engine_pb2.TokenizeResponse(token_ids=[ord(c) for c in text])

    def Detokenize(self, request, context):  # as Generate, no vocabulary check (the real engine's is e2e-tested)
        return engine_pb2.DetokenizeResponse(text="".join(chr(0x20 + t % 0xD000) for t in request.token_ids))

    def GetTokenizerInfo(self, request, context):
        return engine_pb2.GetTokenizerInfoResponse(eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                                   chat_template="{{ messages }}", vocab_size=151936)

    def GetModelInfo(self, request, context):
        with self._lock:
            self.model_info_calls += 1
            adapters = list(self.adapters.values())
        return engine_pb2.GetModelInfoResponse(model_id=MODEL_ID, max_model_len=MAX_MODEL_LEN, vocab_size=151936,
                                               kv_blocks_total=64, kv_blocks_free=64, block_size=16,
                                               embedding_size=EMBEDDING_SIZE, lora_adapters=adapters,
                                               lora_enabled=self.lora_enabled,
                                               max_lora_rank=MAX_LORA_RANK if self.lora_enabled else 0,
                                               random_weights=self.random_weights,
                                               max_images_per_prompt=self.reported_image_limit)

    def LoadLoraAdapter(self, request, context):
        with self._lock:
            if not self.lora_enabled:
                context.abort_with_status(rpc_status_of(Unsupported(NO_LORA)))
            for field in ("lora_name", "lora_path"):
                if getattr(request, field).endswith("error:invalid"):
                    context.abort_with_status(rpc_status_of(InvalidRequest(field, "cannot be loaded")))
            adapter = engine_pb2.LoraAdapter(name=request.lora_name, path=request.lora_path, rank=8)
            self.adapters[request.lora_name] = adapter
        return engine_pb2.LoadLoraAdapterResponse(adapter=adapter)

    def UnloadLoraAdapter(self, request, context):
        with self._lock:
            if not self.lora_enabled:
                context.abort_with_status(rpc_status_of(Unsupported(NO_LORA)))
            if self.adapters.pop(request.lora_name, None) is None:
                context.abort_with_status(rpc_status_of(not_loaded(request.lora_name)))
        return engine_pb2.UnloadLoraAdapterResponse()

    def wait_cancelled(self, request_id_prefix: str, timeout_s: float) -> float | None:
        """Seconds from now until a call whose id starts with the prefix was cancelled, or None."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                hits = [t for rid, t in self.cancelled.items() if rid.startswith(request_id_prefix)]
            if hits:
                return hits[0]
            time.sleep(0.02)
        return None


class TokenCheck(grpc.ServerInterceptor):
    """Refuses EngineService calls without "authorization: Bearer <token>" while a token is set."""

    def __init__(self):
        self.token: str | None = None

    def intercept_service(self, continuation, handler_call_details):
        metadata = dict(handler_call_details.invocation_metadata)
        if (self.token is None or not handler_call_details.method.startswith("/xserv.v1.EngineService/")
                or metadata.get("authorization") == f"Bearer {self.token}"):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)

        def refuse(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong engine token")

        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                refuse, handler.request_deserializer, handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(refuse, handler.request_deserializer, handler.response_serializer)


class FakeEngineServer:
    """The fake engine served on 127.0.0.1:<free port> (or `port`), SERVING, until stop();
    set_token() makes it demand a gRPC token."""

    def __init__(self, port: int = 0):
        self.engine = FakeEngine()
        self.health = health.HealthServicer()
        self.token_check = TokenCheck()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=320), interceptors=[self.token_check])
        engine_pb2_grpc.add_EngineServiceServicer_to_server(self.engine, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.address = f"127.0.0.1:{self.port}"
        self.server.start()
        self.set_serving(True)

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set("", status)

    def set_token(self, token: str | None) -> None:
        self.token_check.token = token

    def stop(self) -> None:
        self.server.stop(grace=None)
