"""Decode steps over preallocated inputs, padded to batch-size buckets; on CUDA each bucket's
forward is a captured CUDA graph, replayed (as nano-vllm and vLLM do). On the CPU each exact batch
size up to a few sequences is a TorchScript trace of the forward, replayed by torch's C++
interpreter: the same ops without the Python between them (~80 us a decoder layer, 2-3 ms a step
of a 28-layer model; docs/benchmarks-log.md).

A step of B decodes takes the smallest bucket >= B, writes its inputs into the first rows of
static buffers (one host->device copy per buffer) and pads the rest: padding rows write their
keys/values into a scratch block that no sequence owns (the KV cache has one block more than
the block manager hands out) and attend to that block alone. The hidden states of the first B
rows are the step's. A graph replays exactly the kernels it captured, reading whatever the
buffers hold, so nothing in the decode forward may depend on host values: only backends whose
decode reads the block tables on the device (`graph_safe`) are captured. A trace is the same
bargain on the CPU: it records the ops one forward ran and replays them on whatever the buffers
hold, so it is taken with the native ops on (their decode reads the tables in the op) and at
exact batch sizes (padding rows would cost CPU time); a forward that turns a tensor into a
Python value while traced (a TracerWarning) is not traced at all.

A hybrid model's decode also reads each row's state slot (a buffer like the others); padding rows
use the pool's scratch slot, as they use the scratch block.
"""

import logging
import time
import warnings

import torch
from torch import nn

from xserv_engine.engine.sequence import Sequence
from xserv_engine.layers.attention import AttentionBackend, AttentionMetadata, DecodeMetadata, StateMetadata

log = logging.getLogger(__name__)
MAX_CAPTURED_BATCH = 512
# CPU decode steps of up to this many sequences replay traces: above it the step's compute
# outweighs its Python (a 16-row step of the Qwen3-0.6B shape: ~2 ms of ~70)
CPU_TRACED_BATCH = 8


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_batch (and max_batch itself)."""
    buckets = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return buckets + [max_batch]


class BucketedDecode:
    def __init__(self, model: nn.Module, backend: AttentionBackend, block_size: int, max_batch: int,
                 max_blocks_per_seq: int, scratch_block: int, device: torch.device, exact: bool = False,
                 scratch_state_slot: int | None = None):
        """exact: a bucket for every batch size up to max_batch (no padding rows).
        scratch_state_slot: a hybrid model's (its state pool's spare slot); None for the others."""
        self.model, self.backend, self.block_size, self.device = model, backend, block_size, device
        limit = min(max_batch, MAX_CAPTURED_BATCH)
        self.buckets = list(range(1, limit + 1)) if exact else batch_buckets(limit)
        self.max_batch = self.buckets[-1]
        self.scratch_block = scratch_block
        m = self.max_batch
        self.input_ids = torch.zeros(m, dtype=torch.int64, device=device)
        self.positions = torch.zeros(m, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(m, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(m, dtype=torch.int32, device=device)
        self.block_tables = torch.full((m, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=device)
        self.scratch_state_slot = scratch_state_slot
        self.state_slots = None if scratch_state_slot is None else \
            torch.full((m,), scratch_state_slot, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> its graph's hidden states [bucket, H]
        self.traces: dict[int, torch._C.ScriptMethod] = {}  # CPU: bucket -> its traced forward

    def bucket(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def capture(self) -> float:
        """CUDA graphs, or on the CPU traces, of every bucket; returns the seconds taken."""
        return self._capture_graphs() if self.device.type == "cuda" else self._trace()

    @torch.inference_mode()
    def _trace(self) -> float:
        """One trace per bucket, the buffers holding a padding step (every row on the scratch
        block). Nothing is traced where a trace would not hold for other inputs (logged)."""
        start, forward = time.perf_counter(), _TracedForward(self)
        self._pad_all()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", torch.jit.TracerWarning)
                warnings.filterwarnings("ignore", message=".*torch.jit.trace.* is deprecated")
                # one module, a method per bucket: the model's submodules are scripted once
                traced = torch.jit.trace_module(forward, {_TracedForward.method(b): self._inputs(b)
                                                          for b in self.buckets}, check_trace=False)
                self.traces = {b: getattr(traced, _TracedForward.method(b)) for b in self.buckets}
        except (torch.jit.TracerWarning, RuntimeError) as exc:
            self.traces.clear()
            log.info("decode steps run op by op: the forward cannot be traced (%s)", exc)
        return time.perf_counter() - start

    @torch.inference_mode()
    def _capture_graphs(self) -> float:
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
        if b in self.traces:
            return self.traces[b](*self._inputs(b))[: len(seqs)]
        return self._forward(b)[: len(seqs)]

    def _inputs(self, b: int) -> tuple[torch.Tensor, ...]:
        """The first b rows of the buffers, as step() takes them."""
        rows = (self.input_ids[:b], self.positions[:b], self.slot_mapping[:b], self.context_lens[:b],
                self.block_tables[:b])
        return rows if self.state_slots is None else (*rows, self.state_slots[:b])

    def _forward(self, b: int) -> torch.Tensor:
        return self.step(*self._inputs(b))

    def step(self, input_ids, positions, slot_mapping, context_lens, block_tables, state_slots=None) -> torch.Tensor:
        """The decode forward over those rows -> hidden states [rows, H]."""
        meta = AttentionMetadata(slot_mapping=slot_mapping, num_prefill_tokens=0,
                                 decode=DecodeMetadata(context_lens=context_lens, block_tables=block_tables),
                                 states=None if state_slots is None else StateMetadata([], [], [], state_slots))
        self.backend.prepare(meta, self.block_size)  # tensor ops on the buffers: captured with the model
        return self.model(input_ids, positions, meta)

    def _pad_all(self) -> None:
        """Every row a padding row: its token written to, and read from, the scratch block."""
        self.slot_mapping.fill_(self.scratch_block * self.block_size)
        self.context_lens.fill_(1)
        self.block_tables.fill_(self.scratch_block)
        if self.state_slots is not None:
            self.state_slots.fill_(self.scratch_state_slot)

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
        # an image prompt's positions past it are shifted by its MRoPE delta (multimodal/prompt_images.py)
        self._copy(self.positions, [p + (seq.images.rope_delta if seq.images is not None else 0)
                                    for seq, p in zip(seqs, positions)] + [0] * pad)
        self._copy(self.slot_mapping, slots + [scratch] * pad)
        self._copy(self.context_lens, [p + 1 for p in positions] + [1] * pad)
        self._copy(self.block_tables[:, :width], tables)
        if self.state_slots is not None:
            self._copy(self.state_slots, [seq.state_slot for seq in seqs] + [self.scratch_state_slot] * pad)

    def _copy(self, buffer: torch.Tensor, rows: list) -> None:
        host = torch.tensor(rows, dtype=buffer.dtype, pin_memory=self.device.type == "cuda")
        buffer[: len(rows)].copy_(host, non_blocking=True)  # pinned: no sync with the device


class _TracedForward(nn.Module):
    """BucketedDecode.step as a module (the model its submodule), which is what torch.jit.trace_module
    takes: its weights stay the model's own tensors, not copies. It has a method per bucket, each
    the forward, traced at that batch size."""

    def __init__(self, decode: BucketedDecode):
        super().__init__()
        self.model = decode.model
        self.step = decode.step
        for b in decode.buckets:
            setattr(self, self.method(b), self.forward)

    @staticmethod
    def method(bucket: int) -> str:
        return f"rows_{bucket}"

    def forward(self, *rows: torch.Tensor) -> torch.Tensor:  # BucketedDecode._inputs
        return self.step(*rows)
