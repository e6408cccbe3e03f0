"""Images over gRPC: a ChatMessage's parts carry the encoded files to the engine as bytes, and the
engine's admission refuses the images a model cannot take with INVALID_ARGUMENT naming the part."""

import grpc
import pytest
from xserv.v1 import engine_pb2

from tests.support.grpc_errors import bad_fields
from tests.support.images import png
from xserv_engine.config import EngineConfig
from xserv_engine.engine.engine_thread import EngineThread
from xserv_engine.engine.llm_engine import LLMEngine
from xserv_engine.inputs import image_parts

from .fake_engine import FakeEngine
from .harness import ServerThread


def image(data: bytes) -> engine_pb2.ContentPart:
    return engine_pb2.ContentPart(image=engine_pb2.Image(data=data))


def text(words: str) -> engine_pb2.ContentPart:
    return engine_pb2.ContentPart(text=words)


def chat_request(*messages: engine_pb2.ChatMessage) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(chat=engine_pb2.ChatInput(messages=messages),
                                      params=engine_pb2.SamplingParams(max_tokens=2))


def refusal(call) -> tuple[grpc.StatusCode, list[tuple[str, str]]]:
    with pytest.raises(grpc.RpcError) as info:
        list(call())
    return info.value.code(), bad_fields(info.value)


def test_image_bytes_reach_the_engine_as_sent():
    server, engine = ServerThread(), FakeEngine()
    server.load(engine)
    try:
        red, blue = png(5, 4, (255, 0, 0)), png(7, 2, (0, 0, 255))
        request = chat_request(engine_pb2.ChatMessage(role="user", parts=[text("Which is red?"), image(red),
                                                                           image(blue)]))
        assert list(server.stub.Generate(request, timeout=10))[-1].finish_reason
        (_, prompt, _), = engine.received
        assert image_parts(prompt) == [red, blue]
        assert prompt.messages[0]["content"][0] == {"type": "text", "text": "Which is red?"}
    finally:
        server.close()


@pytest.fixture(scope="module")
def demo_engine(demo_dir):
    """The text-only demo model served with --limit-mm-per-prompt '{"image": 1}'."""
    server = ServerThread()
    config = EngineConfig(model=str(demo_dir), dtype="float32", device="cpu", max_model_len=256, num_kv_blocks=32,
                          limit_mm_per_prompt=1)
    llm = LLMEngine(config, progress=False)
    server.load(EngineThread(llm))
    yield server, llm
    server.close()


def test_a_text_only_model_refuses_images_naming_the_part(demo_engine):
    server, llm = demo_engine
    message = engine_pb2.ChatMessage(role="user", parts=[text("What is this?"), image(png())])
    code, fields = refusal(lambda: server.stub.Generate(chat_request(message), timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert fields == [("chat.messages[0].parts[1]", f"{llm.setup.model_id} does not accept images")]
    assert server.stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=10).max_images_per_prompt == 0
    tokenize = engine_pb2.TokenizeRequest(chat=engine_pb2.ChatInput(messages=[message]))
    code, fields = refusal(lambda: [server.stub.Tokenize(tokenize, timeout=30)])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and fields[0][0] == "chat.messages[0].parts[1]"


@pytest.mark.parametrize("messages, field, words", [
    ([engine_pb2.ChatMessage(role="user", parts=[image(png()), text("and"), image(png(2, 2))])],
     "chat.messages[0].parts[2]", "at most 1 image(s) per prompt"),
    ([engine_pb2.ChatMessage(role="system", parts=[image(png())]), engine_pb2.ChatMessage(role="user", content="hi")],
     "chat.messages[0].parts[0]", "a system message cannot hold images"),
])
def test_images_past_the_limit_or_in_a_system_message_are_refused(demo_engine, monkeypatch, messages, field, words):
    server, llm = demo_engine
    # stands in for a vision-language checkpoint: admission is what is tested, not the model
    monkeypatch.setattr(llm.generate_requests, "accepts_images", True)
    code, fields = refusal(lambda: server.stub.Generate(chat_request(*messages), timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert fields[0][0] == field and words in fields[0][1]
