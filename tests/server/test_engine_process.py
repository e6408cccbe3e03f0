"""End to end: the real `xserv engine` process on the demo model, spoken to with the real stubs
and with grpcurl (no .proto file: server reflection)."""

import json
import subprocess
import threading

import grpc
import pytest
from tokenizers import Tokenizer
from xserv.v1 import engine_pb2

from tests.support.grpc_errors import bad_fields
from xserv_engine.demo import default_model_dir
from xserv_engine.layers import native
from xserv_engine.layers.linear import native_bf16

from .engine_process import GRPCURL, start_engine

pytestmark = pytest.mark.e2e

CONTEXT = 512  # the engine's --max-model-len in these tests


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    process = start_engine(tmp_path_factory)
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(f"{default_model_dir()}/tokenizer.json")


def test_the_start_says_its_slow_steps_at_the_default_level(engine):
    said = engine.log_text()  # --log-level warning, the default
    assert "INFO xserv.engine.startup: route: " in said
    assert "INFO xserv.engine.startup: warming up: " in said
    assert said.index("warming up: ") < said.index("SERVING model=")


def test_streamed_deltas_join_to_the_whole_output(engine, tokenizer):
    messages = list(engine.generate(max_tokens=12, ignore_eos=True))
    token_ids = [t for m in messages for t in m.token_ids]
    assert len(token_ids) == 12 and len(messages) >= 2
    assert "".join(m.text for m in messages) == tokenizer.decode(token_ids, skip_special_tokens=True)
    assert messages[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH
    assert messages[-1].usage.completion_tokens == 12
    assert messages[-1].usage.prompt_tokens == len(tokenizer.encode("Hello", add_special_tokens=False).ids)
    again = list(engine.generate(max_tokens=12, ignore_eos=True))
    assert [t for m in again for t in m.token_ids] == token_ids  # greedy is deterministic


def test_n2_interleaves_two_choices_each_with_its_end(engine):
    messages = list(engine.generate(max_tokens=6, n=2, temperature=1.0, seed=3, ignore_eos=True))
    for index in (0, 1):
        mine = [m for m in messages if m.index == index]
        assert mine[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH
        assert mine[-1].usage.completion_tokens == 6 == sum(len(m.token_ids) for m in mine)
        assert all(m.finish_reason == engine_pb2.FINISH_REASON_UNSPECIFIED for m in mine[:-1])
    first_end = next(i for i, m in enumerate(messages) if m.finish_reason)
    assert {m.index for m in messages[:first_end]} == {0, 1}


def test_32_concurrent_streams_all_complete(engine):
    results = {}

    def one(i: int) -> None:
        messages = list(engine.generate(max_tokens=4, text=f"Stream number {i}", ignore_eos=True))
        results[i] = (messages[-1].finish_reason, messages[-1].usage.completion_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert results == {i: (engine_pb2.FINISH_REASON_LENGTH, 4) for i in range(32)}


def test_cancel_frees_the_kv_blocks_and_the_engine_goes_on(engine):
    call = engine.generate(max_tokens=400, ignore_eos=True)
    next(call), next(call)
    busy = engine.model_info()
    assert busy.kv_blocks_free < busy.kv_blocks_total
    call.cancel()
    info = engine.wait_all_blocks_free()
    assert info.kv_blocks_free == info.kv_blocks_total and info.num_running == 0
    assert list(engine.generate(max_tokens=2))[-1].finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED


def test_deadline_frees_the_kv_blocks(engine):
    with pytest.raises(grpc.RpcError) as error:
        list(engine.generate(timeout=0.25, max_tokens=400, ignore_eos=True))
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    info = engine.wait_all_blocks_free()
    assert info.kv_blocks_free == info.kv_blocks_total


@pytest.mark.parametrize("request_fields, words, field", [
    ({"text": ""}, "text", "text"),
    ({"token_ids": engine_pb2.TokenIds()}, "token_ids", "token_ids"),
    ({"chat": engine_pb2.ChatInput()}, "chat.messages", "chat.messages"),
    ({"text": "Hi", "params": engine_pb2.SamplingParams(max_tokens=0)}, "max_tokens", "max_tokens"),
    ({"text": "Hi", "params": engine_pb2.SamplingParams(top_p=0.0)}, "top_p", "top_p"),
    ({"text": "Hi", "params": engine_pb2.SamplingParams(top_p=1.5)}, "top_p", "top_p"),
    ({"token_ids": engine_pb2.TokenIds(ids=[9, 4_000_000])}, "token_ids", "token_ids"),
    ({"text": "hello " * (CONTEXT + 10)}, f"this model's maximum context length is {CONTEXT}", "input"),
    ({"text": "Hi", "params": engine_pb2.SamplingParams(max_tokens=CONTEXT)}, "this model's maximum context",
     "max_tokens"),
])
def test_bad_requests_are_invalid_argument_and_others_go_on(engine, request_fields, words, field):
    running = engine.generate(max_tokens=30, ignore_eos=True)
    next(running)
    with pytest.raises(grpc.RpcError) as error:
        list(engine.stub.Generate(engine_pb2.GenerateRequest(**request_fields), timeout=30))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith(words)
    assert [name for name, _ in bad_fields(error.value)] == [field]
    rest = list(running)
    assert rest[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH
    assert rest[-1].usage.completion_tokens == 30


def test_tokenize_and_model_info(engine, tokenizer):
    tokens = engine.stub.Tokenize(engine_pb2.TokenizeRequest(text="Hello world"), timeout=10)
    assert list(tokens.token_ids) == tokenizer.encode("Hello world", add_special_tokens=False).ids
    chat = engine_pb2.ChatInput(messages=[engine_pb2.ChatMessage(role="user", content="Hi")],
                                enable_thinking=False)
    rendered = engine.stub.Tokenize(engine_pb2.TokenizeRequest(chat=chat), timeout=10)
    assert "Hi" in rendered.prompt and rendered.prompt.rstrip().endswith("</think>")
    info = engine.model_info()
    assert info.max_model_len == CONTEXT and info.vocab_size == 151936 and info.kv_blocks_total == 256
    assert 151645 in info.eos_token_ids and info.device == "cpu"
    assert (info.runner, info.embedding_size) == ("generate", 0)
    assert info.random_weights  # the demo model (its config.json says so)
    # the route engine_setup chose (the native ops build wherever this test's process builds them;
    # the demo model's decode is traced where its bf16 linears are the native kernel's)
    route = "cpu-torch"
    if native.load_torch_ops():
        route = "cpu-traced" if info.dtype == "bfloat16" and native_bf16() else "cpu-native"
    assert (info.decode_route, info.quantization) == (route, "")


def test_embed_on_a_generation_model_says_what_it_needs(engine):
    with pytest.raises(grpc.RpcError) as raised:
        engine.stub.Embed(engine_pb2.EmbedRequest(inputs=[engine_pb2.EmbedInput(text="Hi")]), timeout=10)
    assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "generation model" in raised.value.details() and "--runner pooling" in raised.value.details()


def test_abort_by_id_ends_the_stream(engine):
    call = engine.generate(request_id="abort-me", max_tokens=400, ignore_eos=True)
    next(call)
    assert engine.stub.Abort(engine_pb2.AbortRequest(request_id="abort-me"), timeout=5).found
    assert list(call)[-1].finish_reason == engine_pb2.FINISH_REASON_ABORT
    assert not engine.stub.Abort(engine_pb2.AbortRequest(request_id="abort-me"), timeout=5).found


def grpcurl(engine, *command: str, data: str | None = None) -> str:
    flags = ["-plaintext"] + (["-d", data] if data is not None else [])
    result = subprocess.run([GRPCURL, *flags, engine.address, *command],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_grpcurl_lists_describes_and_streams_without_a_proto_file(engine):
    assert {"xserv.v1.EngineService", "grpc.health.v1.Health"} <= set(grpcurl(engine, "list").split())
    description = grpcurl(engine, "describe", "xserv.v1.EngineService")
    assert "rpc Generate ( .xserv.v1.GenerateRequest ) returns ( stream .xserv.v1.GenerateResponse )" in description
    out = grpcurl(engine, "xserv.v1.EngineService/Generate",
                  data='{"text": "Hello", "params": {"max_tokens": 8}}')
    messages = [json.loads(chunk) for chunk in out.replace("}\n{", "}\x00{").split("\x00")]
    assert messages[-1]["finish_reason"] in ("FINISH_REASON_LENGTH", "FINISH_REASON_STOP")
    assert int(messages[-1]["usage"]["completion_tokens"]) <= 8
    assert json.loads(grpcurl(engine, "grpc.health.v1.Health/Check")) == {"status": "SERVING"}
