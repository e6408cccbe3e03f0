"""Token bitmasks -> logits: bit t of a row allows token t; every other logit becomes -inf."""

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
    bitmask = bitmask.to(logits.device, non_blocking=True)
    rows, vocab = logits.shape
    shifts = BIT_SHIFTS.to(logits.device)
    bits = ((bitmask.view(torch.uint8)[:, :, None] >> shifts) & 1).view(rows, -1)  # [R, words*32], little-endian
    width = min(vocab, bits.shape[1])
    logits[:, :width].masked_fill_(bits[:, :width].view(torch.bool).logical_not(), float("-inf"))
    logits[:, width:] = float("-inf")
