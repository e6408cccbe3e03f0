"""The vision tower equals transformers' (Qwen3-VL with DeepStack, Qwen3.5 without) on random
weights drawn large enough that a wrong position table or rope axis shows."""

import pytest
import torch

from xserv_engine.models.qwen3_vision import Qwen3VisionModel, VisionConfig, vision_views

transformers = pytest.importorskip("transformers")

VISION = dict(depth=3, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=48,
              num_position_embeddings=36, patch_size=4, temporal_patch_size=2, spatial_merge_size=2)
GRIDS = [(1, 6, 10), (1, 14, 4), (1, 2, 2)]  # landscape, portrait, a single merge window


def randomized(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if name.endswith("norm.weight") or ".norm1.weight" in name or ".norm2.weight" in name else 0.0
            p.copy_(base + torch.randn(p.shape, generator=g) * (0.3 if base else 0.15))
    return model.eval()


def reference(kind: str):
    if kind == "qwen3_vl":
        cfg = transformers.Qwen3VLConfig(vision_config=dict(VISION, deepstack_visual_indexes=[0, 1]))
        return randomized(transformers.models.qwen3_vl.modeling_qwen3_vl.Qwen3VLVisionModel(cfg.vision_config))
    cfg = transformers.Qwen3_5Config(vision_config=VISION)
    return randomized(transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5VisionModel(cfg.vision_config))


def ours_from(ref, model_class=Qwen3VisionModel):
    model = model_class(VisionConfig.from_hf(ref.config.to_dict()))
    weights = {name.removeprefix("visual."): t
               for name, t in (vision_views("model.visual." + n, t) for n, t in ref.state_dict().items())}
    model.load_state_dict(weights, strict=True)
    return model.eval()


def inputs(grids, seed=1):
    g = torch.Generator().manual_seed(seed)
    patches = sum(t * h * w for t, h, w in grids)
    return torch.randn(patches, 3 * 2 * 4 * 4, generator=g), grids


@pytest.mark.parametrize("kind", ["qwen3_vl", "qwen3_5"])
def test_embeddings_and_deepstack_equal_transformers(kind):
    ref = reference(kind)
    ours = ours_from(ref)
    pixels, grids = inputs(GRIDS)
    with torch.no_grad():
        want = ref(pixels, grid_thw=torch.tensor(grids))
        got = ours(pixels, grids)
    assert got.embeddings.shape == (sum(t * h * w for t, h, w in grids) // 4, 48)
    torch.testing.assert_close(got.embeddings, want.pooler_output, atol=1e-5, rtol=1e-5)
    want_deepstack = getattr(want, "deepstack_features", None) or []
    assert len(got.deepstack) == len(want_deepstack) == (2 if kind == "qwen3_vl" else 0)
    for ours_features, want_features in zip(got.deepstack, want_deepstack):
        torch.testing.assert_close(ours_features, want_features, atol=1e-5, rtol=1e-5)


def test_an_image_attends_only_to_itself():
    ours = ours_from(reference("qwen3_5"))
    pixels, grids = inputs(GRIDS)
    with torch.no_grad():
        together = ours(pixels, grids).embeddings
        alone = ours(pixels[: 6 * 10], grids[:1]).embeddings
    torch.testing.assert_close(together[: 6 * 10 // 4], alone, atol=1e-5, rtol=1e-5)


class SwappedRopeAxes(Qwen3VisionModel):
    def _rotary(self, rows, cols):
        return super()._rotary(cols, rows)


class TransposedPositionTable(Qwen3VisionModel):
    def _interpolated_positions(self, rows, cols, grid_thw):
        return super()._interpolated_positions(cols, rows, [(t, w, h) for t, h, w in grid_thw])


@pytest.mark.parametrize("wrong", [SwappedRopeAxes, TransposedPositionTable])
def test_the_weights_show_a_wrong_rope_axis_or_position_table(wrong):
    ref = reference("qwen3_5")
    pixels, grids = inputs(GRIDS)
    with torch.no_grad():
        right = ours_from(ref)(pixels, grids).embeddings
        mistaken = ours_from(ref, wrong)(pixels, grids).embeddings
    assert (right - mistaken).abs().max() > 1e-2


def test_in_bf16_with_native_ops_the_tower_is_as_close_to_fp32_as_transformers():
    # bf16 serving runs the native attention (layers/ops.py vision_attention): our bf16 tower may
    # differ from transformers' bf16 one by rounding, but must stay as near the exact (fp32) tower
    from xserv_engine.layers import linear, native, ops
    if not (native.load_torch_ops() and linear.native_bf16()):
        pytest.skip("the native vision attention needs the native ops and AVX512-BF16 (no AMX)")
    ref = reference("qwen3_5")
    pixels, grids = inputs(GRIDS)
    with torch.no_grad():
        exact = ref(pixels, grid_thw=torch.tensor(grids)).pooler_output
        ours = ours_from(ref).to(torch.bfloat16)
        ops.set_native(True)
        try:
            mine = ours(pixels, grids).embeddings.float()
        finally:
            ops.set_native(False)
        theirs = ref.to(torch.bfloat16)(pixels.to(torch.bfloat16), grid_thw=torch.tensor(grids)).pooler_output.float()
    mine_err, their_err = (mine - exact).abs().mean(), (theirs - exact).abs().mean()
    assert mine_err <= 1.5 * their_err, (mine_err, their_err)
