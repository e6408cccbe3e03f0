"""Image bytes -> the vision encoder's patches, exactly as transformers' image processor.

The reference is the processor `AutoImageProcessor` gives for a Qwen3-VL or Qwen3.5 checkpoint
when torchvision is absent (as in xserv's environment): `Qwen2VLImageProcessorPil`. Every step
is the same operation on the same dtype, so the patches are equal bit for bit:

- decode with pillow, apply the EXIF orientation (transformers' `load_image`), composite any
  transparency onto white and convert to RGB (its `convert_to_rgb`);
- `smart_resize` to multiples of patch x merge within min/max pixels, PIL bicubic on uint8;
- rescale in float64 then cast to float32, normalize in float32 ((x - mean) / std);
- patchify: [grid_t * grid_h * grid_w, C * T * P * P], patches ordered by merge window, the still
  image repeated to fill the temporal patch.
"""

import hashlib
import json
import math
import os
import warnings
from dataclasses import dataclass
from io import BytesIO

import numpy as np
import torch
from PIL import Image, ImageOps

from xserv_engine.errors import InvalidRequest

FIELD = "chat.messages"
MAX_ASPECT_RATIO = 200  # smart_resize refuses longer strips


@dataclass(frozen=True)
class ImageProcessorConfig:
    """The checkpoint's preprocessor_config.json (Qwen3-VL's defaults where it is silent)."""

    min_pixels: int = 65536
    max_pixels: int = 16777216
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255

    @classmethod
    def from_dir(cls, model_dir: str) -> "ImageProcessorConfig":
        path = os.path.join(model_dir, "preprocessor_config.json")
        if not os.path.exists(path):
            return cls()
        with open(path) as f:
            raw = json.load(f)
        size = raw.get("size") or {}
        fields = {
            "min_pixels": raw.get("min_pixels") or size.get("shortest_edge") or cls.min_pixels,
            "max_pixels": raw.get("max_pixels") or size.get("longest_edge") or cls.max_pixels,
        }
        for name in ("patch_size", "temporal_patch_size", "merge_size", "rescale_factor"):
            if name in raw:
                fields[name] = raw[name]
        for name in ("image_mean", "image_std"):
            if name in raw:
                fields[name] = tuple(raw[name])
        return cls(**fields)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


@dataclass(frozen=True, eq=False)  # eq=False: an ndarray field has no truth value to compare by
class ProcessedImage:
    """An image resized for the tower. It keeps the resized uint8 pixels, an eighth of its patches'
    bytes (float32, the still image twice over the temporal patch), for as long as its request
    lives; pixel_values makes the patches when the tower runs."""

    resized: np.ndarray  # [H, W, C] uint8, H and W multiples of patch x merge
    config: "ImageProcessorConfig"
    grid_thw: tuple[int, int, int]
    sha256: str  # of the bytes as sent: the encoder-output cache's and the prefix cache's key
    num_tokens: int  # tokens the image takes in the prompt: one per merge window of patches

    @property
    def pixel_values(self) -> torch.Tensor:
        """[grid_t * grid_h * grid_w, C * T * P * P] float32: rescaled, normalized, patchified."""
        cfg = self.config
        pixels = (self.resized.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
        mean = np.array(cfg.image_mean, dtype=np.float32)
        std = np.array(cfg.image_std, dtype=np.float32)
        pixels = ((pixels - mean) / std).transpose(2, 0, 1)  # [C, H, W]
        return patchify(torch.from_numpy(np.ascontiguousarray(pixels)), cfg)[0]


@dataclass(frozen=True, eq=False)
class RouterPatches:
    """An image a router preprocessed itself (SMG's mm_inputs): its patches go to the tower as
    they came; ImagePrompts checks them against this model's patch and merge sizes."""

    pixel_values: torch.Tensor  # [grid_t * grid_h * grid_w, C * T * P * P] float32
    grid_thw: tuple[int, int, int]
    sha256: str  # the router's content hash ("mm:" + it): the encoder-output and prefix cache key
    num_tokens: int  # the length of its placeholder in the prompt


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The size transformers resizes to: multiples of factor, aspect kept, pixels within bounds."""
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def decode_image(data: bytes) -> Image.Image:
    """The RGB image the bytes hold; InvalidRequest for anything pillow cannot read."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(BytesIO(data))
            image.load()
        image = ImageOps.exif_transpose(image)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise InvalidRequest(FIELD, f"too large to decode: {e}") from None
    except Exception as e:  # pillow raises many types (OSError, SyntaxError, ValueError, ...)
        raise InvalidRequest(FIELD, f"the bytes are not an image pillow can read ({type(e).__name__})") from None
    return _to_rgb(image)


def _to_rgb(image: Image.Image) -> Image.Image:
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image).convert("RGB")
    return image.convert("RGB")


def preprocess(data: bytes, cfg: ImageProcessorConfig) -> ProcessedImage:
    """Decode and resize one image (ProcessedImage.pixel_values normalizes and patchifies it)."""
    image = decode_image(data)
    width, height = image.size
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InvalidRequest(FIELD, f"{width}x{height} is too narrow: the longer side may be "
                                    f"at most {MAX_ASPECT_RATIO} times the shorter")
    h, w = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    pixels = np.asarray(image.resize((w, h), resample=Image.Resampling.BICUBIC))  # [H, W, C] uint8
    grid_h, grid_w = h // cfg.patch_size, w // cfg.patch_size
    num_tokens = grid_h * grid_w // cfg.merge_size**2
    return ProcessedImage(pixels, cfg, (1, grid_h, grid_w), hashlib.sha256(data).hexdigest(), num_tokens)


def patchify(image: torch.Tensor, cfg: ImageProcessorConfig) -> tuple[torch.Tensor, int, int]:
    """[C, H, W] -> [grid_h * grid_w, C * T * P * P], patches of one merge window adjacent."""
    c, height, width = image.shape
    p, m = cfg.patch_size, cfg.merge_size
    grid_h, grid_w = height // p, width // p
    patches = image.reshape(c, grid_h // m, m, p, grid_w // m, m, p)
    patches = patches.permute(1, 4, 2, 5, 0, 3, 6)  # [gh, gw, mh, mw, C, P, P]
    patches = patches.unsqueeze(5).expand(*patches.shape[:5], cfg.temporal_patch_size, p, p)
    return patches.reshape(grid_h * grid_w, -1).contiguous(), grid_h, grid_w
