"""Images from SMG over its vLLM worker protocol, both ways SMG sends them: media_refs (the router
tokenized the chat with one <|image_pad|> per image and forwards each image's URL) and mm_inputs
(the router preprocessed the images: patches, grids, expanded ids, placeholders, hashes). Either
gives the same greedy tokens as the same images as xserv.v1 image parts, on Qwen3-VL and Qwen3.5;
what the engine cannot load or use is INVALID_ARGUMENT naming the field, and the engine keeps its
blocks."""

import base64
import hashlib

import torch

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc
from smg_grpc_proto.generated import common_pb2

from tests.engine.conftest import make_engine
from tests.multimodal.test_vl_engine import OTHER, TALL, WIDE, chat
from tests.multimodal.test_vl_grpc import request as xserv_request
from tests.server.harness import ServerThread
from tests.support.grpc_errors import bad_fields
from tests.support.vl_checkpoint import IMAGE_PAD, write_vl_model
from xserv_engine.config import EngineConfig
from xserv_engine.engine.engine_thread import EngineThread
from xserv_engine.engine.llm_engine import LLMEngine
from xserv_engine.errors import InvalidRequest
from xserv_engine.inputs import TokenImages
from xserv_engine.media import MediaPolicy
from xserv_engine.multimodal.image_processor import preprocess
from xserv_engine.sampling_params import SamplingParams

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_5"])
def served(request, tmp_path_factory, demo_dir):
    path = tmp_path_factory.mktemp(request.param)
    write_vl_model(path, demo_dir, request.param)
    media_dir = tmp_path_factory.mktemp("media")
    (media_dir / "tall.png").write_bytes(TALL)
    server = ServerThread(media=MediaPolicy(allowed_local_path=str(media_dir)))
    llm = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", block_size=16, num_kv_blocks=64),
                    progress=False)
    server.load(EngineThread(llm))
    yield server, llm, media_dir
    server.close()


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def smg_request(ids: list[int], *urls: str, stream: bool = False) -> pb.GenerateRequest:
    """As SMG sends it with worker-side multimodal processing: the chat rendered and tokenized
    by the router (one unexpanded <|image_pad|> per image), the URLs as the client gave them."""
    return pb.GenerateRequest(
        request_id="smg-images", tokenized=pb.TokenizedInput(input_ids=ids), stream=stream,
        sampling_params=pb.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
        media_refs=pb.MediaRefs(items=[pb.MediaRef(modality=common_pb2.IMAGE, url=url) for url in urls]))


def rendered_ids(llm, *images: bytes) -> list[int]:
    return llm.generate_requests.tokenize(chat(*images))[0]


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streaming"])
def test_media_refs_give_the_same_greedy_tokens_as_xserv_image_parts(served, stream):
    server, llm, media_dir = served
    want = [t for r in server.stub.Generate(xserv_request(WIDE, TALL), timeout=120) for t in r.token_ids]
    worker = pb_grpc.VllmEngineStub(server.channel)
    request = smg_request(rendered_ids(llm, WIDE, TALL), data_url(WIDE), (media_dir / "tall.png").as_uri(),
                          stream=stream)
    responses = list(worker.Generate(request, timeout=120))
    complete = responses[-1].complete
    got = [t for r in responses[:-1] for t in r.chunk.token_ids] if stream else list(complete.output_ids)
    assert got == want and len(want) == 6
    expanded = llm.generate_requests.image_prompts.expand(chat(WIDE, TALL), rendered_ids(llm, WIDE, TALL))[0]
    assert complete.prompt_tokens == len(expanded)  # the images' tokens counted, as vLLM counts them


def test_the_worker_advertises_media_refs(served):
    server = served[0]
    worker = pb_grpc.VllmEngineStub(server.channel)
    assert worker.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).supports_vision
    info = worker.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert info.mm_processor == "inprocess" and info.mm_media_ref_schemes == "data,file"
    assert info.mm_item_limits.startswith("image=")


@pytest.mark.parametrize("field, urls, images", [
    ("media_refs.items", [data_url(b"\x89PNG\r\n\x1a\n but cut short")], 1),  # not an image
    ("media_refs.items[0].url", ["https://images.example.com/cat.png"], 1),  # no --allowed-media-domains
    ("media_refs.items[0].url", ["file:///etc/hostname"], 1),  # outside --allowed-local-media-path
    ("media_refs.items", [data_url(WIDE), data_url(TALL)], 1),  # two refs, one anchor
], ids=["not-an-image", "host-not-allowed", "file-outside", "anchors-not-refs"])
def test_what_cannot_be_served_is_invalid_argument_naming_the_field(served, field, urls, images):
    server, llm, _ = served
    free = llm.block_manager.num_free_blocks
    worker = pb_grpc.VllmEngineStub(server.channel)
    with pytest.raises(grpc.RpcError) as e:
        list(worker.Generate(smg_request(rendered_ids(llm, *[WIDE] * images), *urls), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in bad_fields(e.value)] == [field]
    assert llm.block_manager.num_free_blocks == free


def test_a_text_only_model_refuses_media_refs(demo_dir):
    engine = make_engine(demo_dir, num_kv_blocks=16)
    try:
        with pytest.raises(InvalidRequest) as e:
            engine.add_request("r", TokenImages([1, 2, 3], (WIDE,)), SamplingParams(max_tokens=2), lambda out: None)
        assert e.value.field == "media_refs.items[0]" and "does not accept images" in e.value.message
    finally:
        engine.shutdown()


def tensor(values: torch.Tensor, dtype: str) -> pb.TensorData:
    return pb.TensorData(shape=list(values.shape), dtype=dtype, inline=values.numpy().tobytes())


def preprocessed_request(llm, *images: bytes, grid_of=lambda grid: grid, offset_by: int = 0,
                         width: int | None = None) -> pb.GenerateRequest:
    """As smg 1.13 sends router-preprocessed images (captured from it on a Qwen3-VL worker): the
    expanded ids, the patches back to back split by patches_per_image, the grids, placeholders
    over each image's tokens, one content hash per image. Here the patches are the engine's own,
    so the answer must equal xserv.v1's exactly; grid_of / offset_by / width spoil them for the refusals."""
    processed = [preprocess(image, llm.generate_requests.image_prompts.processor) for image in images]
    ids = llm.generate_requests.image_prompts.expand(chat(*images), rendered_ids(llm, *images))[0]
    starts = [i for i, t in enumerate(ids) if t == IMAGE_PAD and (i == 0 or ids[i - 1] != IMAGE_PAD)]
    grids = torch.tensor([grid_of(p.grid_thw) for p in processed], dtype=torch.int64)
    mm = pb.MultimodalInputs(
        pixel_values=tensor(torch.cat([p.pixel_values[:, :width] for p in processed]), "float32"),
        model_specific_tensors={"image_grid_thw": tensor(grids, "int64"),
                                "patches_per_image": tensor(grids.prod(dim=1), "int64")},
        im_token_id=IMAGE_PAD, modality=common_pb2.IMAGE,
        mm_placeholders=[pb.PlaceholderRange(offset=start + offset_by, length=p.num_tokens)
                         for start, p in zip(starts, processed)],
        mm_hashes=[hashlib.sha256(image).hexdigest() for image in images],
        batched_keys=["patches_per_image", "image_grid_thw"], flat_keys={"pixel_values": "patches_per_image"},
        keep_on_cpu_keys=["image_grid_thw", "video_grid_thw"])
    return pb.GenerateRequest(request_id="smg-preprocessed", tokenized=pb.TokenizedInput(input_ids=ids), mm_inputs=mm,
                              sampling_params=pb.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))


def test_router_preprocessed_images_give_the_same_greedy_tokens_and_hit_the_cache(served):
    server, llm, _ = served
    want = [t for r in server.stub.Generate(xserv_request(TALL, WIDE), timeout=120) for t in r.token_ids]
    worker = pb_grpc.VllmEngineStub(server.channel)
    first = list(worker.Generate(preprocessed_request(llm, TALL, WIDE), timeout=120))[-1].complete
    assert list(first.output_ids) == want and len(want) == 6
    again = list(worker.Generate(preprocessed_request(llm, TALL, WIDE), timeout=120))[-1].complete
    assert list(again.output_ids) == want and again.cached_tokens >= 16  # keyed by the router's hashes


@pytest.mark.parametrize("field, spoil", [
    ("mm_inputs.pixel_values", {"grid_of": lambda grid: (grid[0], grid[1] + 2, grid[2])}),  # patches short
    ("mm_inputs.mm_placeholders", {"offset_by": -1}),  # the run starts on a text token
    ("mm_inputs", {"width": 768}),  # patches of another patch size than this model's
], ids=["grid-not-patches", "placeholder-off-the-image", "another-patch-size"])
def test_preprocessed_images_that_do_not_fit_are_invalid_argument(served, field, spoil):
    server, llm, _ = served
    free = llm.block_manager.num_free_blocks
    worker = pb_grpc.VllmEngineStub(server.channel)
    with pytest.raises(grpc.RpcError) as e:
        list(worker.Generate(preprocessed_request(llm, WIDE, **spoil), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in bad_fields(e.value)] == [field]
    assert llm.block_manager.num_free_blocks == free


def cache_snapshot(worker) -> list:
    """The stored blocks of the engine's KV-event snapshot (what a router subscribing now gets)."""
    events = worker.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=30)
    try:
        first = next(events)
    finally:
        events.cancel()
    return [block for event in first.events if event.HasField("stored") for block in event.stored.blocks]


def test_kv_events_tell_a_router_which_image_a_block_holds(served):
    """Two images of one size behind the same text give blocks of the same token ids; the events
    carry each block's images as vLLM's extra_keys (identifier, offset in the block), so SMG's
    cache-aware routing does not take one image's blocks for the other's."""
    server, llm, _ = served
    worker = pb_grpc.VllmEngineStub(server.channel)
    cache_snapshot(worker)  # the engine reports from its first subscriber on
    for image in (WIDE, OTHER):
        list(worker.Generate(smg_request(rendered_ids(llm, image), data_url(image)), timeout=120))
    with_images = [b for b in cache_snapshot(worker) if IMAGE_PAD in b.token_ids]
    keys = {tuple(b.token_ids): set() for b in with_images}
    for block in with_images:
        assert [k.WhichOneof("key") for k in block.extra_keys] == ["multimodal"]
        start = list(block.token_ids).index(IMAGE_PAD)
        assert block.extra_keys[0].multimodal.offset == start  # the image begins inside this block
        keys[tuple(block.token_ids)].add(block.extra_keys[0].multimodal.identifier)
    assert {len(identifiers) for identifiers in keys.values()} == {2}  # same tokens, two images
    assert {i for identifiers in keys.values() for i in identifiers} == {
        hashlib.sha256(image).hexdigest() for image in (WIDE, OTHER)}
