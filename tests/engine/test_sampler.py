"""The sampler's greedy pick is torch.argmax exactly, ties included, at any vocabulary size."""

import pytest
import torch

from xserv_engine.layers.sampler import ARGMAX_CHUNK, argmax


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [151936, 151931, 3 * ARGMAX_CHUNK, 5 * ARGMAX_CHUNK + 1, 1000])
def test_argmax_equals_torch_argmax(dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(16, vocab, generator=gen).to(dtype)
    # ties: the same maximum in two chunks, inside one chunk, and in the ragged last column
    top = logits.max() + 1
    logits[0, [7, vocab - 1]] = top
    logits[1, [min(ARGMAX_CHUNK, vocab - 1) - 1, min(ARGMAX_CHUNK, vocab - 1)]] = top  # across a chunk edge
    logits[2, [vocab - 2, vocab - 1]] = top
    logits[3, vocab - 1] = top
    logits[4] = float("-inf")
    logits[5] = 0.0
    assert torch.equal(argmax(logits), logits.argmax(dim=-1))
