"""Images end to end, as issue 51's "done when" reads: `xserv up` (fp32) on random-weight Qwen3-VL
(DeepStack) and Qwen3.5 checkpoints, chat completions with one and with two images of different
sizes as data: URLs, greedy tokens equal transformers' generate. The reference prompt is built
apart from xserv: transformers' tokenizer renders the chat, and each <|image_pad|> is repeated as
many times as transformers' image processor says the image has tokens (what Qwen's processor does).
A repeated request reports its image tokens cached; bytes that are not an image are a 400."""

import base64
import io
import subprocess

import grpc
import openai
import pytest
import torch
from xserv.v1 import engine_pb2, engine_pb2_grpc

from tests.multimodal.test_vl_engine import TALL, WIDE
from tests.support.processes import served
from tests.support.vl_checkpoint import IMAGE_PAD, write_vl_model

pytestmark = pytest.mark.e2e
transformers = pytest.importorskip("transformers")

QUESTION = "What is in these pictures?"
MAX_TOKENS = 8


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_5"])
def up(request, tmp_path_factory, demo_dir):
    path = tmp_path_factory.mktemp(f"{request.param}-up")
    model = write_vl_model(path, demo_dir, request.param)
    with served("up", "--model", str(path), "--workers", "1", "--dtype", "float32", "--block-size", "16",
                "--log-level", "warning", stdout=subprocess.DEVNULL) as up:
        sdk = openai.OpenAI(base_url=up.url + "/v1", api_key="unused", max_retries=0, timeout=180)
        with grpc.insecure_channel(up.grpc_address) as channel:
            yield sdk, engine_pb2_grpc.EngineServiceStub(channel), path, model


def content(*images: bytes) -> list[dict]:
    urls = ["data:image/png;base64," + base64.b64encode(data).decode() for data in images]
    return [*({"type": "image_url", "image_url": {"url": url}} for url in urls), {"type": "text", "text": QUESTION}]


def transformers_greedy(path, model, images: list[bytes]) -> tuple[list[int], int]:
    from PIL import Image

    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    processor = transformers.AutoImageProcessor.from_pretrained(path)
    pixels = processor(images=[Image.open(io.BytesIO(data)) for data in images], return_tensors="pt")
    messages = [{"role": "user", "content": [*({"type": "image"} for _ in images), {"type": "text", "text": QUESTION}]}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pad = tokenizer.convert_ids_to_tokens(IMAGE_PAD)
    pieces = text.split(pad)
    assert len(pieces) == len(images) + 1
    counts = [int(grid.prod()) // 4 for grid in pixels["image_grid_thw"]]  # merge 2 x 2
    text = pieces[0] + "".join(pad * n + rest for n, rest in zip(counts, pieces[1:]))
    input_ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, pixel_values=pixels["pixel_values"],
                             image_grid_thw=pixels["image_grid_thw"], mm_token_type_ids=(input_ids == IMAGE_PAD).int(),
                             max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
    return out[0, input_ids.shape[1]:].tolist(), input_ids.shape[1]


def grpc_greedy(stub, images: list[bytes]) -> tuple[list[int], str]:
    """The answer's token ids and text from xserv up's engine, the images as gRPC bytes."""
    parts = [engine_pb2.ContentPart(image=engine_pb2.Image(data=data)) for data in images]
    request = engine_pb2.GenerateRequest(
        chat=engine_pb2.ChatInput(messages=[engine_pb2.ChatMessage(
            role="user", parts=[*parts, engine_pb2.ContentPart(text=QUESTION)])]),
        params=engine_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    responses = list(stub.Generate(request, timeout=180))
    return [t for r in responses for t in r.token_ids], "".join(r.text for r in responses)


def rest_greedy(sdk, images: list[bytes]):
    """The answer's text and usage through the REST front, the images as data: URLs."""
    response = sdk.chat.completions.create(
        model=sdk.models.list().data[0].id, messages=[{"role": "user", "content": content(*images)}],
        max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    return response.choices[0].message.content, response.usage


@pytest.mark.parametrize("images", [[WIDE], [WIDE, TALL]], ids=["one-image", "two-images"])
def test_greedy_answers_with_images_equal_transformers(up, images):
    sdk, stub, path, model = up
    want, prompt_tokens = transformers_greedy(path, model, images)
    ids, text = grpc_greedy(stub, images)
    assert ids == want
    answer, usage = rest_greedy(sdk, images)  # the same request through the front: cached now
    assert answer == text
    assert usage.prompt_tokens == prompt_tokens  # every image's tokens counted
    assert usage.prompt_tokens_details.cached_tokens >= 16  # the image's blocks hit


def test_bytes_that_are_not_an_image_are_a_400(up):
    sdk = up[0]
    with pytest.raises(openai.BadRequestError) as error:
        sdk.chat.completions.create(model=sdk.models.list().data[0].id, max_tokens=2,
                                    messages=[{"role": "user", "content": content(b"GIF89a but not really")}])
    assert error.value.body["param"].startswith("messages")
    assert "not an image" in error.value.body["message"]
