"""Images past one machine: a real `xserv engine` on a tiny random Qwen3-VL behind a real SGLang
Model Gateway (`smg launch`, gRPC mode), spoken to with the openai SDK. By default the engine
tells SMG to forward image URLs (media_refs) and which schemes it loads; SMG renders and
tokenizes the chat, the engine loads, preprocesses and encodes the images. With `--mm-processor
router` SMG preprocesses them itself and sends the patches (mm_inputs)."""

import base64
from contextlib import contextmanager

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
def checkpoint(tmp_path_factory, demo_dir):
    path = tmp_path_factory.mktemp("qwen3_vl")
    write_vl_model(path, demo_dir, "qwen3_vl")
    return path


@contextmanager
def served(tmp_path_factory, checkpoint, *flags: str):
    """(engine, model id, the openai SDK on a gateway in front of it)."""
    flags = ("--model", str(checkpoint), "--dtype", "float32", "--block-size", "16", *flags)
    with started_engines(1, *flags, logs=tmp_path_factory.mktemp("engines")) as (started,):
        smg = Gateway([started.address], log_path=tmp_path_factory.mktemp("smg") / "smg.log")
        try:
            smg.wait_ready(checkpoint.name, workers=1)
            yield started, checkpoint.name, OpenAI(base_url=f"{smg.url}/v1", api_key="unused", max_retries=0,
                                                   timeout=120)
        finally:
            smg.stop()


@pytest.fixture(scope="module")
def engine(tmp_path_factory, checkpoint, media_dir):
    with served(tmp_path_factory, checkpoint, "--allowed-local-media-path", str(media_dir)) as (started, model, sdk):
        yield started, model, sdk


@pytest.fixture(scope="module")
def sdk(engine):
    return engine[2]


def ask(sdk, model: str, *urls: str, **fields):
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return sdk.chat.completions.create(
        model=model, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}, **fields,
        messages=[{"role": "user", "content": [*parts, {"type": "text", "text": "What is in these pictures?"}]}])


def test_images_through_the_gateway_answer_as_xserv_v1_does(engine, sdk, media_dir):
    process, model, _ = engine
    direct = list(engine_pb2_grpc.EngineServiceStub(process.channel).Generate(xserv_request(WIDE, TALL), timeout=120))
    wide = "data:image/png;base64," + base64.b64encode(WIDE).decode()
    reply = ask(sdk, model, wide, (media_dir / "tall.png").as_uri())
    assert reply.choices[0].message.content == "".join(r.text for r in direct)
    assert reply.usage.prompt_tokens == direct[-1].usage.prompt_tokens  # the images' tokens counted
    again = ask(sdk, model, wide, (media_dir / "tall.png").as_uri())
    assert again.usage.prompt_tokens_details.cached_tokens >= 16  # the same images hit the prefix cache
    chunks = list(ask(sdk, model, wide, (media_dir / "tall.png").as_uri(), stream=True,
                      stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == direct[-1].usage.prompt_tokens


def test_what_the_engine_will_not_load_is_a_400(engine, sdk):
    model = engine[1]
    with pytest.raises(openai.BadRequestError) as e:  # SMG reads the engine's schemes: no http(s)
        ask(sdk, model, "https://images.example.com/cat.png")
    assert "https" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:  # the engine refuses, naming the field
        ask(sdk, model, "data:image/png;base64," + base64.b64encode(b"not a picture").decode())
    assert "media_refs.items" in str(e.value)


def test_images_the_router_preprocesses_arrive_as_patches(tmp_path_factory, checkpoint):
    """--mm-processor router: SMG fetches and preprocesses (its resize differs from transformers'
    by up to 2/255 a pixel), the engine takes its patches; the images cost the same tokens as
    through xserv.v1, and a repeat is served from the cache under SMG's hashes."""
    with served(tmp_path_factory, checkpoint, "--mm-processor", "router") as (process, model, sdk):
        direct = list(engine_pb2_grpc.EngineServiceStub(process.channel).Generate(xserv_request(WIDE, TALL),
                                                                                  timeout=120))
        urls = ["data:image/png;base64," + base64.b64encode(image).decode() for image in (WIDE, TALL)]
        reply = ask(sdk, model, *urls)
        assert reply.usage.prompt_tokens == direct[-1].usage.prompt_tokens
        assert reply.usage.prompt_tokens_details.cached_tokens == 0  # not the engine's own keys for the images
        again = ask(sdk, model, *urls)
        assert again.choices[0].message.content == reply.choices[0].message.content
        assert again.usage.prompt_tokens_details.cached_tokens >= 16
