"""Images over gRPC into a real Qwen3-VL engine: greedy tokens equal transformers' generate,
a repeated request reports its image tokens cached, bytes that are not an image are
INVALID_ARGUMENT naming chat.messages, and Tokenize (and the REST front's /tokenize) counts each
image's tokens as vLLM's /tokenize does."""

import base64

import grpc
import pytest
from xserv.v1 import engine_pb2

from tests.multimodal.test_vl_engine import TALL, WIDE, chat, expanded_ids, reference
from tests.server.harness import ServerThread
from tests.support.grpc_errors import bad_fields
from tests.support.vl_checkpoint import IMAGE_PAD, write_vl_model
from xserv_engine.config import EngineConfig
from xserv_engine.engine.engine_thread import EngineThread
from xserv_engine.engine.llm_engine import LLMEngine

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def served(tmp_path_factory, demo_dir):
    path = tmp_path_factory.mktemp("qwen3_vl")
    model = write_vl_model(path, demo_dir, "qwen3_vl")
    server = ServerThread()
    llm = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", block_size=16, num_kv_blocks=64),
                    progress=False)
    server.load(EngineThread(llm))
    yield server, llm, path, model
    server.close()


def request(*images: bytes, max_tokens: int = 6) -> engine_pb2.GenerateRequest:
    parts = [engine_pb2.ContentPart(image=engine_pb2.Image(data=data)) for data in images]
    parts.append(engine_pb2.ContentPart(text="What is in these pictures?"))
    return engine_pb2.GenerateRequest(
        chat=engine_pb2.ChatInput(messages=[engine_pb2.ChatMessage(role="user", parts=parts)]),
        params=engine_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def test_two_images_greedy_equal_transformers_and_a_repeat_is_cached(served):
    server, llm, path, model = served
    prompt = chat(WIDE, TALL)
    want = reference(path, model, prompt, expanded_ids(llm, prompt), 6)
    first = list(server.stub.Generate(request(WIDE, TALL), timeout=60))
    assert [t for r in first for t in r.token_ids] == want
    assert first[-1].usage.cached_prompt_tokens == 0
    again = list(server.stub.Generate(request(WIDE, TALL), timeout=60))
    assert [t for r in again for t in r.token_ids] == want
    assert again[-1].usage.cached_prompt_tokens >= 16  # whole blocks, image tokens among them


def test_bytes_that_are_not_an_image_are_invalid_argument(served):
    server = served[0]
    with pytest.raises(grpc.RpcError) as e:
        list(server.stub.Generate(request(b"\x89PNG\r\n\x1a\n but cut short"), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    (field, message), = bad_fields(e.value)
    assert field == "chat.messages" and "not an image" in message


def test_tokenize_expands_each_image_to_its_tokens_over_grpc_and_rest(served):
    import falcon.testing

    from xserv_rest.app import create_app
    from xserv_rest.config import RestConfig
    from xserv_rest.engine_client import EngineClient

    server, llm, _, _ = served
    want = expanded_ids(llm, chat(WIDE, TALL))
    assert want.count(IMAGE_PAD) > 2  # the two placeholders, expanded
    tokenize = engine_pb2.TokenizeRequest(chat=request(WIDE, TALL).chat)
    assert list(server.stub.Tokenize(tokenize, timeout=60).token_ids) == want
    config = RestConfig(engines=(f"127.0.0.1:{server.server.port}",))
    client = falcon.testing.TestClient(create_app(config, EngineClient.from_config(config)))
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}
             for data in (WIDE, TALL)]
    body = {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "What is in these pictures?"}]}]}
    reply = client.simulate_post("/tokenize", json=body).json
    assert reply["tokens"] == want and reply["count"] == len(want)
