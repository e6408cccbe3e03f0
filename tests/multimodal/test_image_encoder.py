"""The encoder-output cache: an image is encoded once while it stays cached, the cache holds at
most its bound in image tokens, least recently used out first."""

import torch

from tests.support.vl_checkpoint import png
from xserv_engine.models.qwen3_vision import Qwen3VisionModel, VisionConfig
from xserv_engine.multimodal.image_encoder import ImageEncoder
from xserv_engine.multimodal.image_processor import ImageProcessorConfig, preprocess

SMALL = ImageProcessorConfig(min_pixels=32 * 32, max_pixels=256 * 256)


TOWER = Qwen3VisionModel(VisionConfig(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=16,
                                      num_position_embeddings=64, deepstack_visual_indexes=(0,))).eval()
with torch.no_grad():  # the tower is built uninitialized (a loader fills it): weights of its own
    _gen = torch.Generator().manual_seed(0)
    for _parameter in TOWER.parameters():
        _parameter.copy_(torch.randn(_parameter.shape, generator=_gen) * 0.1)


def encoder(capacity_tokens: int) -> ImageEncoder:
    return ImageEncoder(TOWER, torch.device("cpu"), torch.float32, capacity_tokens)


def test_outputs_are_cached_by_content_within_a_token_bound():
    a, b, c = (preprocess(png(100, 70, seed=s), SMALL) for s in (1, 2, 3))  # 6 tokens each
    enc = encoder(capacity_tokens=12)
    with torch.inference_mode():
        first = enc.encode([a, b])
        assert enc.encoded_images == 2 and enc.cached_tokens == 12
        again = enc.encode([a])  # a hit, and now the most recently used
        assert enc.encoded_images == 2
        assert torch.equal(again[a.sha256].embeddings, first[a.sha256].embeddings)
        enc.encode([c])  # evicts b, the least recently used
        assert enc.encoded_images == 3 and enc.cached_tokens == 12
        enc.encode([a])
        assert enc.encoded_images == 3
        enc.encode([b])
        assert enc.encoded_images == 4


def test_one_call_encodes_each_image_as_alone():
    a, b = preprocess(png(100, 70, seed=1), SMALL), preprocess(png(40, 130, seed=2), SMALL)
    with torch.inference_mode():
        together = encoder(64).encode([a, b])
        alone = encoder(64).encode([b])
    torch.testing.assert_close(together[b.sha256].embeddings, alone[b.sha256].embeddings, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(together[b.sha256].deepstack[0], alone[b.sha256].deepstack[0], atol=1e-5, rtol=1e-5)


def test_the_cache_bytes_the_engine_reserves_are_what_a_full_cache_holds():
    a, b = (preprocess(png(100, 70, seed=s), SMALL) for s in (1, 2))  # 6 tokens each
    enc = encoder(capacity_tokens=12)
    with torch.inference_mode():
        outputs = enc.encode([a, b])
    held = sum(t.nbytes for out in outputs.values() for t in (out.embeddings, *out.deepstack))
    assert enc.cached_tokens == enc.capacity and held == enc.cache_bytes == 12 * 16 * 2 * 4
