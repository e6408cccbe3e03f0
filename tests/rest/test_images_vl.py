"""Images through the REST front into a real Qwen3-VL engine (random weights): chat completions'
image_url and the Responses API's input_image give the answer the engine gives the same images
over gRPC (which tests/multimodal/test_vl_grpc.py holds equal to transformers' generate), a repeat
reports its image tokens cached, and bytes that are not an image are a 400."""

import base64

import falcon.testing
import pytest
from xserv.v1 import engine_pb2

from tests.multimodal.test_vl_engine import OTHER, TALL, WIDE
from tests.server.harness import ServerThread
from tests.support.vl_checkpoint import write_vl_model
from xserv_engine.config import EngineConfig
from xserv_engine.engine.engine_thread import EngineThread
from xserv_engine.engine.llm_engine import LLMEngine
from xserv_rest.app import create_app
from xserv_rest.config import RestConfig
from xserv_rest.engine_client import EngineClient

pytest.importorskip("transformers")

QUESTION = "What is in these pictures?"
GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def vl(tmp_path_factory, demo_dir):
    """(REST test client, gRPC stub) of one Qwen3-VL engine."""
    path = tmp_path_factory.mktemp("qwen3_vl")
    write_vl_model(path, demo_dir, "qwen3_vl")
    server = ServerThread()
    server.load(EngineThread(LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", block_size=16,
                                                    num_kv_blocks=64), progress=False)))
    config = RestConfig(engines=(f"127.0.0.1:{server.server.port}",))
    yield falcon.testing.TestClient(create_app(config, EngineClient.from_config(config))), server.stub
    server.close()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def grpc_answer(stub, *images: bytes) -> str:
    parts = [engine_pb2.ContentPart(image=engine_pb2.Image(data=data)) for data in images]
    parts.append(engine_pb2.ContentPart(text=QUESTION))
    request = engine_pb2.GenerateRequest(
        chat=engine_pb2.ChatInput(messages=[engine_pb2.ChatMessage(role="user", parts=parts)]),
        params=engine_pb2.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    return "".join(message.text for message in stub.Generate(request, timeout=60))


def chat(client, *images: bytes):
    content = [{"type": "image_url", "image_url": {"url": data_url(data)}} for data in images]
    return client.simulate_post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": [*content, {"type": "text", "text": QUESTION}]}], **GREEDY})


def test_chat_images_answer_as_over_grpc_and_a_repeat_is_cached(vl):
    client, stub = vl
    assert stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=10).max_images_per_prompt == 999
    other = chat(client, OTHER, TALL)
    assert other.status_code == 200, other.text
    want = grpc_answer(stub, WIDE, TALL)
    answer = chat(client, WIDE, TALL)
    assert answer.json["choices"][0]["message"]["content"] == want
    usage = answer.json["usage"]
    assert usage["prompt_tokens"] == other.json["usage"]["prompt_tokens"]  # same sizes: as many image tokens
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 16  # the gRPC call's blocks, image tokens among them


def test_responses_input_images_answer_as_over_grpc(vl):
    client, stub = vl
    response = client.simulate_post("/v1/responses", json={
        "input": [{"role": "user", "content": [{"type": "input_image", "image_url": data_url(TALL)},
                                               {"type": "input_text", "text": QUESTION}]}],
        "max_output_tokens": 6, "temperature": 0, "store": False})
    assert response.status_code == 200, response.text
    assert response.json["output"][-1]["content"][0]["text"] == grpc_answer(stub, TALL)


def test_bytes_that_are_not_an_image_are_a_400(vl):
    client, _ = vl
    answer = chat(client, b"\x89PNG\r\n\x1a\n but cut short")
    assert answer.status_code == 400
    error = answer.json["error"]
    assert error["param"].startswith("messages") and "not an image" in error["message"]
