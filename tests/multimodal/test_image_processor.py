"""Preprocessing equals transformers' image processor for a Qwen3-VL checkpoint, bit for bit."""

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from xserv_engine.errors import InvalidRequest
from xserv_engine.multimodal.image_processor import ImageProcessorConfig, preprocess

transformers = pytest.importorskip("transformers")

QWEN3_VL_PREPROCESSOR = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast",
}


def encoded(width: int, height: int, mode: str = "RGB", fmt: str = "PNG", seed: int = 0) -> bytes:
    """A noisy image (smooth gradients hide resampling mistakes less well than noise)."""
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = rng.integers(0, 256, size=(height, width, channels), dtype=np.uint8).squeeze(-1 if channels == 1 else ())
    out = io.BytesIO()
    Image.fromarray(pixels, mode=mode).save(out, format=fmt)
    return out.getvalue()


def checkpoint_dir(tmp_path, **overrides) -> str:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({**QWEN3_VL_PREPROCESSOR, **overrides}))
    return str(tmp_path)


def reference(model_dir: str, data: bytes):
    processor = transformers.AutoImageProcessor.from_pretrained(model_dir)
    # exif_transpose as transformers' load_image does; the processor itself composites alpha on white
    image = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    out = processor(images=[image], return_tensors="pt")
    return out["pixel_values"], tuple(out["image_grid_thw"][0].tolist())


@pytest.mark.parametrize("width,height,mode,fmt", [
    (640, 480, "RGB", "PNG"),       # landscape, not a multiple of 32
    (300, 901, "RGB", "JPEG"),      # tall, lossy
    (257, 257, "RGBA", "PNG"),      # transparency composited on white
    (500, 123, "L", "PNG"),         # grayscale
    (16, 24, "RGB", "WEBP"),        # tiny: scaled up to min_pixels
])
def test_patches_equal_transformers(tmp_path, width, height, mode, fmt):
    model_dir = checkpoint_dir(tmp_path)
    data = encoded(width, height, mode, fmt)
    image = preprocess(data, ImageProcessorConfig.from_dir(model_dir))
    want_pixels, want_grid = reference(model_dir, data)
    assert image.grid_thw == want_grid
    assert image.num_tokens == want_grid[0] * want_grid[1] * want_grid[2] // 4
    assert torch.equal(image.pixel_values, want_pixels)


def test_huge_image_resized_within_max_pixels(tmp_path):
    max_pixels = 1024 * 768
    model_dir = checkpoint_dir(tmp_path, size={"longest_edge": max_pixels, "shortest_edge": 65536})
    data = encoded(4000, 3000, fmt="JPEG")
    image = preprocess(data, ImageProcessorConfig.from_dir(model_dir))
    want_pixels, want_grid = reference(model_dir, data)
    assert image.grid_thw == want_grid
    _, h, w = image.grid_thw
    assert h * w * 16 * 16 <= max_pixels
    assert torch.equal(image.pixel_values, want_pixels)


def test_qwen2_5_style_min_max_pixels_keys(tmp_path):
    model_dir = checkpoint_dir(tmp_path, min_pixels=3136, max_pixels=200704, size=None, patch_size=14)
    cfg = ImageProcessorConfig.from_dir(model_dir)
    assert (cfg.min_pixels, cfg.max_pixels, cfg.patch_size) == (3136, 200704, 14)
    data = encoded(1000, 700)
    want_pixels, want_grid = reference(model_dir, data)
    image = preprocess(data, cfg)
    assert image.grid_thw == want_grid and torch.equal(image.pixel_values, want_pixels)


@pytest.mark.parametrize("data", [b"", b"not an image at all", encoded(64, 64)[:40]])
def test_unreadable_bytes_are_an_invalid_request(data):
    with pytest.raises(InvalidRequest) as e:
        preprocess(data, ImageProcessorConfig())
    assert e.value.field == "chat.messages"
    assert "not an image" in e.value.message


def test_a_thin_strip_is_refused_by_name():
    with pytest.raises(InvalidRequest, match="too narrow"):
        preprocess(encoded(2000, 5), ImageProcessorConfig())


def test_same_bytes_same_hash_other_bytes_other_hash():
    a, b = encoded(64, 64, seed=1), encoded(64, 64, seed=2)
    cfg = ImageProcessorConfig()
    assert preprocess(a, cfg).sha256 == preprocess(a, cfg).sha256
    assert preprocess(a, cfg).sha256 != preprocess(b, cfg).sha256


def test_exif_orientation_is_applied(tmp_path):
    model_dir = checkpoint_dir(tmp_path)
    out = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees: a 640x320 file shows as 320x640
    Image.open(io.BytesIO(encoded(640, 320))).save(out, format="JPEG", exif=exif)
    data = out.getvalue()
    image = preprocess(data, ImageProcessorConfig.from_dir(model_dir))
    want_pixels, want_grid = reference(model_dir, data)
    assert image.grid_thw == want_grid == (1, 40, 20)
    assert torch.equal(image.pixel_values, want_pixels)
