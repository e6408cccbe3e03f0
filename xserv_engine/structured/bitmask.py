"""Token bitmasks -> logits: bit t of a row allows token t; every other logit becomes -inf."""

import numpy as np
import torch

BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)


def new_bitmask(rows: int, words: int) -> torch.Tensor:
    return torch.zeros(rows, words, dtype=torch.int32)  # [R, words]; CPU, as the backends write it


def allow(bitmask: torch.Tensor, row: int, token_ids: tuple[int, ...]) -> None:
    for token_id in token_ids:
        word, bit = divmod(token_id, 32)
        value = 1 << bit
        bitmask[row, word] |= value - (1 << 32) if value >= 1 << 31 else value  # int32 two's complement


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place on logits [R, V]. V may exceed the bitmask's width (a model's padded vocabulary
    rows): those tokens are never allowed."""
    rows, vocab = logits.shape
    blocked_words = ~bitmask  # [R, words] on the CPU; a set bit now blocks its token
    if logits.device.type == "cpu":  # numpy unpacks the bits in one C pass
        bits = np.unpackbits(blocked_words.numpy().view(np.uint8), axis=1, bitorder="little")
        blocked = torch.from_numpy(bits).view(torch.bool)  # [R, words*32]
    else:  # the small bitmask crosses to the device, the bits are unpacked there
        words = blocked_words.to(logits.device, non_blocking=True).view(torch.uint8)
        blocked = ((words[:, :, None] >> BIT_SHIFTS.to(logits.device)) & 1).view(rows, -1).view(torch.bool)
    width = min(vocab, blocked.shape[1])
    logits[:, :width].masked_fill_(blocked[:, :width], float("-inf"))
    logits[:, width:] = float("-inf")
