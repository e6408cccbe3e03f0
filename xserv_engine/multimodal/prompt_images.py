"""A prompt's images at admission: preprocessed, each <|image_pad|> expanded to the image's
tokens, and the prompt's MRoPE positions computed once (models/mrope.py).

PromptImages rides on every Sequence of the request (Sequence.images): the runner reads its
positions and the image tokens of each chunk it prefills, the block manager the image hashes
of each block (so a cached block of image tokens is found only for the same image).
"""

from dataclasses import dataclass

import torch

from xserv_engine.errors import InvalidRequest
from xserv_engine.inputs import ChatInput, PromptInput, TokenImages, image_parts
from xserv_engine.models.mrope import mrope_positions
from xserv_engine.multimodal.image_processor import (FIELD, ImageProcessorConfig, ProcessedImage, RouterPatches,
                                                      preprocess)


@dataclass(frozen=True)
class PlacedImage:
    image: ProcessedImage
    start: int  # the prompt index of its first token

    @property
    def end(self) -> int:
        return self.start + self.image.num_tokens


@dataclass(frozen=True)
class PromptImages:
    images: tuple[PlacedImage, ...]
    positions: torch.Tensor  # [3, prompt length] int64, on the CPU
    rope_delta: int  # a position past the prompt is its index plus this, on every axis

    def hashes_in(self, start: int, end: int) -> tuple[str, ...]:
        """The images with a token in [start, end): what a cache block of those tokens is keyed by."""
        return tuple(p.image.sha256 for p in self.images if p.start < end and p.end > start)

    def offsets_in(self, start: int, end: int) -> tuple[tuple[str, int], ...]:
        """(hash, its first token's index less start) of the images with a token in [start, end):
        what a KV event says of the block of those tokens (negative: the image began before)."""
        return tuple((p.image.sha256, p.start - start) for p in self.images if p.start < end and p.end > start)

    def in_range(self, start: int, end: int) -> list[tuple[PlacedImage, int, int]]:
        """(image, its first token, past its last token) of [start, end), in prompt order."""
        return [(p, max(p.start, start) - p.start, min(p.end, end) - p.start)
                for p in self.images if p.start < end and p.end > start]

    def positions_of(self, start: int, end: int) -> torch.Tensor:
        """[3, end - start] MRoPE positions of tokens [start, end), past the prompt included."""
        prompt = self.positions.shape[1]
        inside = self.positions[:, start : min(end, prompt)]
        if end <= prompt:
            return inside
        past = torch.arange(max(start, prompt), end) + self.rope_delta
        return torch.cat([inside, past.expand(3, -1)], dim=1)


class ImagePrompts:
    """Admission of a vision-language model's image prompts."""

    def __init__(self, processor: ImageProcessorConfig, image_token_id: int, merge_size: int):
        self.processor, self.image_token_id, self.merge_size = processor, image_token_id, merge_size

    def expand(self, prompt: PromptInput, token_ids: list[int]) -> tuple[list[int], PromptImages | None]:
        """The prompt's tokens with each image's placeholder expanded to its tokens, and its
        images; (token_ids, None) for a prompt without images. InvalidRequest for bytes that are
        not an image, or placeholders that do not match the images."""
        data = image_parts(prompt)
        pads = sum(1 for t in token_ids if t == self.image_token_id)
        if not data:
            if pads:
                field = FIELD if isinstance(prompt, ChatInput) else "text" if isinstance(prompt, str) else "token_ids"
                raise InvalidRequest(field, "the prompt holds image placeholder tokens (<|image_pad|>) but no image")
            return token_ids, None
        field = prompt.field if isinstance(prompt, TokenImages) else FIELD
        if pads != len(data):
            how = ("the token ids must hold one <|image_pad|> per image" if isinstance(prompt, TokenImages)
                   else "the chat template must render each image part once")
            raise InvalidRequest(field, f"the prompt holds {pads} image placeholder(s) for {len(data)} image(s); {how}")
        images = iter([self._preprocess(d, k, len(data), field) for k, d in enumerate(data, start=1)])
        expanded: list[int] = []
        placed = []
        for t in token_ids:
            if t == self.image_token_id:
                image = next(images)
                placed.append(PlacedImage(image, len(expanded)))
                expanded.extend([t] * image.num_tokens)
            else:
                expanded.append(t)
        grids = [p.image.grid_thw for p in placed]
        positions, delta = mrope_positions(expanded, grids, self.image_token_id, self.merge_size)
        return expanded, PromptImages(tuple(placed), positions, delta)

    def _preprocess(self, data: bytes | RouterPatches, ordinal: int, count: int,
                    field: str) -> ProcessedImage | RouterPatches:
        which = f"image {ordinal} of {count}" if count > 1 else "the image"
        if isinstance(data, RouterPatches):
            problem = self._mismatch(data)
            if problem:
                raise InvalidRequest(field, f"{which}: {problem}")
            return data
        try:
            return preprocess(data, self.processor)
        except InvalidRequest as e:
            raise InvalidRequest(field, f"{which}: {e.message}") from None

    def _mismatch(self, patches: RouterPatches) -> str | None:
        """What makes a router's patches unfit for this model's tower, or None."""
        cfg, (t, h, w) = self.processor, patches.grid_thw
        width = 3 * cfg.temporal_patch_size * cfg.patch_size**2
        if min(t, h, w) < 1 or h % self.merge_size or w % self.merge_size:
            return f"grid {patches.grid_thw} is not whole merge windows of {self.merge_size} x {self.merge_size} patches"
        if tuple(patches.pixel_values.shape) != (t * h * w, width):
            return (f"pixel_values of shape {tuple(patches.pixel_values.shape)} do not fit grid {patches.grid_thw}: "
                    f"this model takes [{t * h * w}, {width}]")
        if patches.num_tokens != t * h * w // self.merge_size**2:
            return (f"the placeholder holds {patches.num_tokens} tokens, grid {patches.grid_thw} makes "
                    f"{t * h * w // self.merge_size**2}")
        return None


def image_prompts(model_dir) -> ImagePrompts | None:
    """A loader.ModelDir's admission of image prompts; None for a model that takes none."""
    cfg = model_dir.config
    if not cfg.accepts_images:
        return None
    return ImagePrompts(ImageProcessorConfig.from_dir(str(model_dir.path)), cfg.image_token_id,
                        cfg.vision.spatial_merge_size)
