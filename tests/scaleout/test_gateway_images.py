"""Images past one machine: a real `xserv engine` on a tiny random Qwen3-VL behind a real SGLang
Model Gateway (`smg launch`, gRPC mode), spoken to with the openai SDK. The engine tells SMG to
forward image URLs (media_refs) and which schemes it loads; SMG renders and tokenizes the chat,
the engine loads, preprocesses and encodes the images."""

import base64

import openai
import pytest
from openai import OpenAI
from xserv.v1 import engine_pb2_grpc

from tests.multimodal.test_vl_engine import TALL, WIDE
from tests.multimodal.test_vl_grpc import request as xserv_request
from tests.scaleout.gateway import Gateway
from tests.server.engine_process import started_engines
from tests.support.vl_checkpoint import write_vl_model

pytestmark = pytest.mark.e2e
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("media")
    (path / "tall.png").write_bytes(TALL)
    return path


@pytest.fixture(scope="module")
def engine(tmp_path_factory, demo_dir, media_dir):
    path = tmp_path_factory.mktemp("qwen3_vl")
    write_vl_model(path, demo_dir, "qwen3_vl")
    flags = ("--model", str(path), "--dtype", "float32", "--block-size", "16",
             "--allowed-local-media-path", str(media_dir))
    with started_engines(1, *flags, logs=tmp_path_factory.mktemp("engines")) as (started,):
        yield started, path.name


@pytest.fixture(scope="module")
def sdk(engine, tmp_path_factory):
    smg = Gateway([engine[0].address], log_path=tmp_path_factory.mktemp("smg") / "smg.log")
    try:
        smg.wait_ready(engine[1], workers=1)
        yield OpenAI(base_url=f"{smg.url}/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        smg.stop()


def ask(sdk, model: str, *urls: str):
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return sdk.chat.completions.create(
        model=model, max_tokens=6, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [*parts, {"type": "text", "text": "What is in these pictures?"}]}])


def test_images_through_the_gateway_answer_as_xserv_v1_does(engine, sdk, media_dir):
    process, model = engine
    direct = list(engine_pb2_grpc.EngineServiceStub(process.channel).Generate(xserv_request(WIDE, TALL), timeout=120))
    wide = "data:image/png;base64," + base64.b64encode(WIDE).decode()
    reply = ask(sdk, model, wide, (media_dir / "tall.png").as_uri())
    assert reply.choices[0].message.content == "".join(r.text for r in direct)
    assert reply.usage.prompt_tokens == direct[-1].usage.prompt_tokens  # the images' tokens counted
    again = ask(sdk, model, wide, (media_dir / "tall.png").as_uri())
    assert again.usage.prompt_tokens_details.cached_tokens >= 16  # the same images hit the prefix cache


def test_what_the_engine_will_not_load_is_a_400(engine, sdk):
    model = engine[1]
    with pytest.raises(openai.BadRequestError) as e:  # SMG reads the engine's schemes: no http(s)
        ask(sdk, model, "https://images.example.com/cat.png")
    assert "https" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:  # the engine refuses, naming the field
        ask(sdk, model, "data:image/png;base64," + base64.b64encode(b"not a picture").decode())
    assert "media_refs.items" in str(e.value)
