"""Decode steps over preallocated inputs, padded to batch-size buckets; on CUDA each bucket's
forward is a captured CUDA graph, replayed (as nano-vllm and vLLM do).

A step of B decodes takes the smallest bucket >= B, writes its inputs into the first rows of
static buffers (one host->device copy per buffer) and pads the rest: padding rows write their
keys/values into a scratch block that no sequence owns (the KV cache has one block more than
the block manager hands out) and attend to that block alone. The hidden states of the first B
rows are the step's. A graph replays exactly the kernels it captured, reading whatever the
buffers hold, so nothing in the decode forward may depend on host values: only backends whose
decode reads the block tables on the device (`graph_safe`) are captured.
"""

import logging
import time

import torch
from torch import nn

from xserv_engine.engine.sequence import Sequence
from xserv_engine.layers.attention import AttentionBackend, AttentionMetadata, DecodeMetadata

log = logging.getLogger(__name__)
MAX_CAPTURED_BATCH = 512


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_batch (and max_batch itself)."""
    buckets = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return buckets + [max_batch]


class BucketedDecode:
    def __init__(self, model: nn.Module, backend: AttentionBackend, block_size: int, max_batch: int,
                 max_blocks_per_seq: int, scratch_block: int, device: torch.device):
        self.model, self.backend, self.block_size, self.device = model, backend, block_size, device
        self.buckets = batch_buckets(min(max_batch, MAX_CAPTURED_BATCH))
        self.max_batch = self.buckets[-1]
        self.scratch_block = scratch_block
        m = self.max_batch
        self.input_ids = torch.zeros(m, dtype=torch.int64, device=device)
        self.positions = torch.zeros(m, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(m, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(m, dtype=torch.int32, device=device)
        self.block_tables = torch.full((m, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> its graph's hidden states [bucket, H]

    def bucket(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    @torch.inference_mode()
    def capture(self) -> float:
        """One CUDA graph per bucket, largest first, sharing one memory pool; returns seconds taken."""
        start, pool = time.perf_counter(), None
        for b in reversed(self.buckets):
            self._forward(b)  # outside the capture: Triton compiles, lazy weights are built
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.outputs[b] = self._forward(b)
            pool = pool or graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> torch.Tensor:
        """The decode forward of seqs (one token each) -> hidden states [len(seqs), H]."""
        b = self.bucket(len(seqs))
        self._load_inputs(seqs, b)
        if b in self.graphs:
            self.graphs[b].replay()
            return self.outputs[b][: len(seqs)]
        return self._forward(b)[: len(seqs)]

    def logits(self, seqs: list[Sequence]) -> torch.Tensor:
        """The decode step's logits [len(seqs), V] (the LM head runs after the graph, unpadded)."""
        return self.model.compute_logits(self.run(seqs))

    def _forward(self, b: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:b], num_prefill_tokens=0,
            decode=DecodeMetadata(context_lens=self.context_lens[:b], block_tables=self.block_tables[:b]))
        self.backend.prepare(meta, self.block_size)  # tensor ops on the buffers: captured with the model
        return self.model(self.input_ids[:b], self.positions[:b], meta)

    def _load_inputs(self, seqs: list[Sequence], b: int) -> None:
        pad = b - len(seqs)
        bs, scratch = self.block_size, self.scratch_block * self.block_size
        positions = [len(seq) - 1 for seq in seqs]
        slots = [seq.block_table[p // bs] * bs + p % bs for seq, p in zip(seqs, positions)]
        width = max(len(seq.block_table) for seq in seqs)
        # columns past a row's context are never read: they keep what earlier steps left there
        tables = [seq.block_table + [self.scratch_block] * (width - len(seq.block_table)) for seq in seqs]
        tables += [[self.scratch_block] * width] * pad
        self._copy(self.input_ids, [seq.last_token for seq in seqs] + [0] * pad)
        self._copy(self.positions, positions + [0] * pad)
        self._copy(self.slot_mapping, slots + [scratch] * pad)
        self._copy(self.context_lens, [p + 1 for p in positions] + [1] * pad)
        self._copy(self.block_tables[:, :width], tables)

    def _copy(self, buffer: torch.Tensor, rows: list) -> None:
        host = torch.tensor(rows, dtype=buffer.dtype, pin_memory=self.device.type == "cuda")
        buffer[: len(rows)].copy_(host, non_blocking=True)  # pinned: no sync with the device
