"""Token bitmasks -> logits: bit t of a row allows token t; every other logit becomes -inf.

A row that allows few tokens is not masked at all: the sampler draws among its allowed ids
(Candidates), which costs a gather instead of passes over the whole vocabulary.
"""

from dataclasses import dataclass

import numpy as np
import torch

BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)


@dataclass
class Candidates:
    """Rows of a batch that may only take one of a few tokens: row j of ids lists the allowed
    token ids of batch row rows[j], ascending, padded where valid is False."""
    rows: list[int]
    ids: torch.Tensor  # [R, K] int64, on the logits' device
    valid: torch.Tensor  # [R, K] bool

    def narrow(self, logits: torch.Tensor) -> torch.Tensor:
        """[R, K] logits of the candidates, -inf at the padding: the same distribution as the
        masked full rows (a blocked token has probability 0 either way)."""
        rows = torch.tensor(self.rows, device=logits.device)[:, None]
        return logits[rows, self.ids].masked_fill_(~self.valid, float("-inf"))


def new_bitmask(rows: int, words: int) -> torch.Tensor:
    return torch.zeros(rows, words, dtype=torch.int32)  # [R, words]; CPU, as the backends write it


def allow(bitmask: torch.Tensor, row: int, token_ids: tuple[int, ...]) -> None:
    for token_id in token_ids:
        word, bit = divmod(token_id, 32)
        value = 1 << bit
        bitmask[row, word] |= value - (1 << 32) if value >= 1 << 31 else value  # int32 two's complement


def count_allowed(bitmask: torch.Tensor) -> np.ndarray:
    """[R] allowed tokens per row."""
    return np.bitwise_count(bitmask.numpy().view(np.uint32)).sum(axis=1)


def allowed_ids(bitmask: torch.Tensor, rows: list[int], vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids [len(rows), K], valid [len(rows), K]): the allowed ids below vocab of each of the
    bitmask's rows, ascending, padded to the longest. Cheap when the rows allow few tokens: only
    the nonzero words are unpacked."""
    words = bitmask.numpy()[rows].view(np.uint32)  # [n, words]
    row, word = np.nonzero(words)  # row-major: by row, then by word
    bits = np.unpackbits(words[row, word].view(np.uint8).reshape(-1, 4), axis=1, bitorder="little")  # [m, 32]
    hit, bit = np.nonzero(bits)
    row, token = row[hit], word[hit] * 32 + bit  # by row, then by token
    keep = token < vocab
    row, token = row[keep], token[keep]
    counts = np.bincount(row, minlength=len(rows))
    col = np.arange(len(row)) - (np.cumsum(counts) - counts)[row]
    width = max(1, int(counts.max(initial=0)))
    ids = np.zeros((len(rows), width), dtype=np.int64)
    valid = np.zeros((len(rows), width), dtype=bool)
    ids[row, col], valid[row, col] = token, True
    return ids, valid


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
