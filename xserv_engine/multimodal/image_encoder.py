"""The vision tower as a step of the runner needs it: each image encoded once while its
output is cached (by the image's sha256, least recently used out first, a bound in tokens, as
vLLM's encoder cache), and a step's MRoPE positions and image embeddings laid out as
ModelRunner.prepare lays out its rows (prompt chunks, then decodes with their drafts)."""

from collections import OrderedDict

import torch

from xserv_engine.engine.sequence import Sequence
from xserv_engine.models.qwen3_vision import ImageEmbeddings, Qwen3VisionModel, VisionOutput
from xserv_engine.multimodal.image_processor import ProcessedImage

# image tokens whose tower outputs stay cached: 16 images of 1024 x 1024 at 32 x 32 pixels a token
CACHE_TOKENS = 16384


class ImageEncoder:
    def __init__(self, visual: Qwen3VisionModel, device: torch.device, dtype: torch.dtype,
                 capacity_tokens: int = CACHE_TOKENS):
        self.visual, self.device, self.dtype = visual, device, dtype
        self.capacity = capacity_tokens
        self.cache: OrderedDict[str, VisionOutput] = OrderedDict()
        self.cached_tokens = 0
        self.encoded_images = 0  # images the tower has run on (a cache hit runs nothing)

    @property
    def cache_bytes(self) -> int:
        """The cache when full: each image token's embedding and its DeepStack features."""
        config = self.visual.config
        return (self.capacity * config.out_hidden_size * (1 + len(config.deepstack_visual_indexes))
                * self.dtype.itemsize)

    def step_inputs(self, prefills: list[Sequence], decodes: list[Sequence],
                    positions: torch.Tensor) -> tuple[torch.Tensor, ImageEmbeddings | None]:
        """The step's positions (prepare's, plus each image prompt's rope delta; MRoPE's [3, T]
        where a chunk holds image tokens) and its image tokens' embeddings (None for none)."""
        if not any(seq.images is not None for seq in (*prefills, *decodes)):
            return positions, None
        rows, pieces, mask = [], [], []
        for seq in prefills:
            start, end = seq.num_cached_tokens, seq.num_cached_tokens + seq.num_scheduled_tokens
            rows.append(seq.images.positions_of(start, end) if seq.images is not None
                        else torch.arange(start, end).expand(3, -1))
            chunk_mask = torch.zeros(end - start, dtype=torch.bool)
            for placed, lo, hi in seq.images.in_range(start, end) if seq.images is not None else ():
                chunk_mask[placed.start + lo - start : placed.start + hi - start] = True
                pieces.append((placed.image, lo, hi))
            mask.append(chunk_mask)
        for seq in decodes:
            n = 1 + len(seq.spec_token_ids)
            delta = seq.images.rope_delta if seq.images is not None else 0
            rows.append((torch.arange(len(seq) - 1, len(seq) - 1 + n) + delta).expand(3, -1))
            mask.append(torch.zeros(n, dtype=torch.bool))
        mrope = torch.cat(rows, dim=1)
        if not pieces:  # text rows only: the three axes agree, one position per row does
            return mrope[0].to(positions.device), None
        return mrope.to(positions.device), self._embeddings(torch.cat(mask).to(positions.device), pieces)

    def _embeddings(self, mask: torch.Tensor, pieces: list[tuple[ProcessedImage, int, int]]) -> ImageEmbeddings:
        outputs = self.encode([image for image, _, _ in pieces])
        embeddings = torch.cat([outputs[image.sha256].embeddings[lo:hi] for image, lo, hi in pieces])
        depth = len(self.visual.config.deepstack_visual_indexes)
        deepstack = tuple(torch.cat([outputs[image.sha256].deepstack[d][lo:hi] for image, lo, hi in pieces])
                          for d in range(depth))
        return ImageEmbeddings(mask, embeddings, deepstack)

    def encode(self, images: list[ProcessedImage]) -> dict[str, VisionOutput]:
        """Each image's tower output: from the cache, or from one tower call over all the others."""
        out = {}
        missing: dict[str, ProcessedImage] = {}
        for image in images:
            if image.sha256 in self.cache:
                self.cache.move_to_end(image.sha256)
                out[image.sha256] = self.cache[image.sha256]
            else:
                missing[image.sha256] = image
        if missing:
            todo = list(missing.values())
            pixels = torch.cat([i.pixel_values for i in todo]).to(self.device, self.dtype)
            result = self.visual(pixels, [i.grid_thw for i in todo])
            sizes = [i.num_tokens for i in todo]
            per_layer = [d.split(sizes) for d in result.deepstack]
            for k, (image, embeddings) in enumerate(zip(todo, result.embeddings.split(sizes))):
                out[image.sha256] = VisionOutput(embeddings, tuple(layer[k] for layer in per_layer))
                self._keep(image, out[image.sha256])
            self.encoded_images += len(todo)
        return out

    def _keep(self, image: ProcessedImage, output: VisionOutput) -> None:
        if image.num_tokens > self.capacity:
            return
        while self.cached_tokens + image.num_tokens > self.capacity:
            _, old = self.cache.popitem(last=False)
            self.cached_tokens -= old.embeddings.shape[0]
        self.cache[image.sha256] = output
        self.cached_tokens += image.num_tokens
