"""A vision-language checkpoint's whole model (vision tower, MRoPE, DeepStack, text layers)
gives transformers' logits on prompts with one and with two images of different sizes (fp32)."""

import pytest
import torch

from tests.engine.conftest import make_engine
from tests.support.vl_checkpoint import IMAGE_PAD, VISION_END, VISION_START, png, write_vl_model
from xserv_engine.engine.sequence import Sequence
from xserv_engine.models.mrope import mrope_positions
from xserv_engine.models.qwen3_vision import ImageEmbeddings
from xserv_engine.multimodal.image_processor import ImageProcessorConfig, preprocess
from xserv_engine.sampling_params import SamplingParams

pytest.importorskip("transformers")

IMAGES = [png(100, 70, seed=1), png(40, 130, seed=2)]  # grids 4 x 6 and 8 x 2 patches after resizing


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_vl_moe", "qwen3_5"])
def vl(request, tmp_path_factory, demo_dir):
    path = tmp_path_factory.mktemp(request.param)
    model = write_vl_model(path, demo_dir, request.param)
    engine = make_engine(path)
    yield path, model, engine
    engine.shutdown()


def prompt_with(images) -> list[int]:
    ids = [9707, 11, 1879]
    for image in images:
        ids += [VISION_START] + [IMAGE_PAD] * image.num_tokens + [VISION_END] + [3555, 374]
    return ids + [419, 30]


def reference_logits(model, ids, images) -> torch.Tensor:
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        return model(input_ids=input_ids, pixel_values=torch.cat([i.pixel_values for i in images]),
                     image_grid_thw=torch.tensor([i.grid_thw for i in images]),
                     mm_token_type_ids=(input_ids == IMAGE_PAD).int()).logits[0]


def our_logits(engine, ids, images, positions=None, deepstack: bool = True) -> torch.Tensor:
    runner, blocks = engine.runner, engine.block_manager
    model = runner.model
    grids = [i.grid_thw for i in images]
    if positions is None:
        positions, _ = mrope_positions(ids, grids, IMAGE_PAD, model.config.vision.spatial_merge_size)
    seq = Sequence(ids, SamplingParams(), blocks.block_size)
    blocks.allocate(seq)
    seq.num_scheduled_tokens = seq.num_uncomputed_tokens
    try:
        input_ids, _, meta, _ = runner.prepare([seq], [])
        with torch.inference_mode():
            vision = model.visual(torch.cat([i.pixel_values for i in images]), grids)
            embeds = ImageEmbeddings(input_ids == IMAGE_PAD, vision.embeddings, vision.deepstack if deepstack else ())
            return model.compute_logits(model(input_ids, positions, meta, embeds))
    finally:
        blocks.deallocate(seq)


@pytest.mark.parametrize("count", [1, 2])
def test_logits_with_images_equal_transformers(vl, count):
    path, model, engine = vl
    cfg = ImageProcessorConfig.from_dir(str(path))
    images = [preprocess(data, cfg) for data in IMAGES[:count]]
    assert [i.grid_thw for i in images][:count] == [(1, 4, 6), (1, 8, 2)][:count]
    ids = prompt_with(images)
    torch.testing.assert_close(our_logits(engine, ids, images), reference_logits(model, ids, images),
                               atol=2e-4, rtol=2e-4)


def test_qwen3_vl_moe_in_its_released_layout_loads_the_same(tmp_path, demo_dir):
    """Qwen3-VL-MoE's released checkpoints hold stacked experts transposed ([E, H, 2I], [E, I, H])."""
    from safetensors.torch import load_file, save_file

    model = write_vl_model(tmp_path, demo_dir, "qwen3_vl_moe")
    weights = load_file(tmp_path / "model.safetensors")
    assert weights["model.language_model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 48, 64)
    released = {n: t.transpose(1, 2).contiguous() if ".experts." in n else t for n, t in weights.items()}
    save_file(released, tmp_path / "model.safetensors", metadata={"format": "pt"})
    engine = make_engine(tmp_path)
    try:
        images = [preprocess(IMAGES[0], ImageProcessorConfig.from_dir(str(tmp_path)))]
        ids = prompt_with(images)
        torch.testing.assert_close(our_logits(engine, ids, images), reference_logits(model, ids, images),
                                   atol=2e-4, rtol=2e-4)
    finally:
        engine.shutdown()


def test_positions_after_an_image_resume_past_its_longer_side():
    ids = [1, 2, IMAGE_PAD, IMAGE_PAD, IMAGE_PAD, IMAGE_PAD, IMAGE_PAD, IMAGE_PAD, 3]
    positions, delta = mrope_positions(ids, [(1, 4, 6)], IMAGE_PAD, 2)  # 2 x 3 tokens
    assert positions[:, :2].tolist() == [[0, 1]] * 3
    assert positions[:, 2:8].tolist() == [[2] * 6, [2, 2, 2, 3, 3, 3], [2, 3, 4, 2, 3, 4]]
    assert positions[:, 8].tolist() == [5, 5, 5]  # 2 + max(2, 3)
    assert delta == 6 - len(ids)


def test_the_weights_show_mrope_and_deepstack(vl):
    """Text positions for the image tokens, or DeepStack left out, move the logits well past the
    tolerance above: the fixture's weights make those mistakes visible."""
    path, _, engine = vl
    images = [preprocess(IMAGES[0], ImageProcessorConfig.from_dir(str(path)))]
    ids = prompt_with(images)
    right = our_logits(engine, ids, images)
    model = engine.runner.model
    with torch.inference_mode():
        text_positions = torch.arange(len(ids)).expand(3, -1)
        assert (our_logits(engine, ids, images, positions=text_positions) - right).abs().max() > 1e-2
        if model.config.vision.deepstack_visual_indexes:
            assert (our_logits(engine, ids, images, deepstack=False) - right).abs().max() > 1e-2
