"""Token bitmasks -> logits: bit t of a row allows token t; every other logit becomes -inf.

A row that allows few tokens is not masked at all: the sampler draws among its allowed ids
(Candidates), which costs a gather instead of passes over the whole vocabulary.
"""

from dataclasses import dataclass

import numpy as np
import torch

from xserv_engine.layers.ops import native

BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)
# [256, 8]: a bitmask byte -> what to add to its eight tokens' logits
BYTE_TO_BIAS = np.array([[0.0 if byte >> bit & 1 else -np.inf for bit in range(8)] for byte in range(256)],
                        dtype=np.float32)


@dataclass
class Candidates:
    """Rows of a batch that may only take one of a few tokens: row j of ids lists the allowed
    token ids of batch row rows[j], ascending, padded where valid is False."""
    rows: list[int]
    ids: torch.Tensor  # [R, K] int64, on the logits' device
    valid: torch.Tensor  # [R, K] bool

    @staticmethod
    def join(parts: list["Candidates | None"]) -> "Candidates | None":
        """One Candidates of several (of distinct rows), the narrower ones padded."""
        parts = [p for p in parts if p is not None]
        if len(parts) < 2:
            return parts[0] if parts else None
        width = max(p.ids.shape[1] for p in parts)
        pad = [(0, width - p.ids.shape[1]) for p in parts]
        return Candidates([r for p in parts for r in p.rows],
                          torch.cat([torch.nn.functional.pad(p.ids, w) for p, w in zip(parts, pad)]),
                          torch.cat([torch.nn.functional.pad(p.valid, w) for p, w in zip(parts, pad)]))

    def narrow(self, logits: torch.Tensor) -> torch.Tensor:
        """[R, K] logits of the candidates, -inf at the padding: the same distribution as the
        masked full rows (a blocked token has probability 0 either way)."""
        rows = torch.tensor(self.rows, device=logits.device)[:, None]
        return logits[rows, self.ids].masked_fill_(~self.valid, float("-inf"))


def new_bitmask(rows: int, words: int) -> np.ndarray:
    # numpy, not torch: it is filled on the fill thread, which must not start an OpenMP team
    return np.zeros((rows, words), dtype=np.int32)  # [R, words]; CPU, as the backends write it


def allow(bitmask: np.ndarray, row: int, token_ids: tuple[int, ...]) -> None:
    words = bitmask.view(np.uint32)
    for token_id in token_ids:
        word, bit = divmod(token_id, 32)
        words[row, word] |= np.uint32(1 << bit)


def count_allowed(bitmask: np.ndarray, native_op: bool = False) -> np.ndarray:
    """[R] allowed tokens per row (native_op: the native CPU op, ~4x faster)."""
    if native_op:
        return torch.ops.xserv_cpu.count_allowed(torch.from_numpy(bitmask)).numpy()
    return np.bitwise_count(bitmask.view(np.uint32)).sum(axis=1)


def allowed_ids(bitmask: np.ndarray, rows: list[int], vocab: int,
                native_op: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [len(rows), K] int64, valid [len(rows), K] bool) on the CPU: the allowed ids below
    vocab of each of the bitmask's rows, ascending, padded to the longest. Cheap when the rows
    allow few tokens: only the nonzero words are unpacked (native_op: the native CPU op)."""
    if native_op:
        return torch.ops.xserv_cpu.allowed_ids(torch.from_numpy(bitmask), torch.tensor(rows), vocab)
    words = bitmask[rows].view(np.uint32)  # [n, words]
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
    return torch.from_numpy(ids), torch.from_numpy(valid)


def apply_bitmask(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int] | None = None) -> None:
    """In place on logits [B, V] (float32): row rows[j] (default: row j) keeps only the tokens
    that bitmask row j allows. V may exceed the bitmask's width (a model's padded vocabulary
    rows): those tokens are never allowed."""
    rows = list(range(bitmask.shape[0])) if rows is None else rows
    if native(logits):  # ~8x faster than the table below
        torch.ops.xserv_cpu.apply_token_bitmask(logits, torch.from_numpy(bitmask), torch.tensor(rows))
        return
    width = min(logits.shape[1], bitmask.shape[1] * 32)
    if logits.device.type == "cpu":
        # Adds 0 or -inf, eight tokens per bitmask byte from a table, a row at a time (the
        # temporary stays in cache): a plain float pass, where masked_fill's bool mask is 3x slower.
        values = logits.numpy()
        for j, row in enumerate(rows):
            values[row, :width] += BYTE_TO_BIAS[bitmask[j].view(np.uint8)].reshape(-1)[:width]
            values[row, width:] = -np.inf
        return
    # the small bitmask crosses to the device, the bits are unpacked there
    words = torch.from_numpy(~bitmask).to(logits.device, non_blocking=True).view(torch.uint8)
    blocked = ((words[:, :, None] >> BIT_SHIFTS.to(logits.device)) & 1).view(len(rows), -1).view(torch.bool)
    index = torch.tensor(rows, device=logits.device)
    masked = logits.index_select(0, index)
    masked[:, :width].masked_fill_(blocked[:, :width], float("-inf"))
    masked[:, width:] = float("-inf")
    logits.index_copy_(0, index, masked)
