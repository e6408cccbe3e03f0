"""Owns the model and the KV cache; runs ONE batched forward per step over all scheduled sequences."""

import logging

import torch

from xserv_engine.engine.sequence import Sequence
from xserv_engine.layers.attention import Attention, AttentionBackend, AttentionMetadata
from xserv_engine.layers.sampler import Sampler, SamplerOutput
from xserv_engine.models.loader import ModelDir, load_model
from xserv_engine.models.qwen3 import Qwen3ForCausalLM

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model_dir: ModelDir, device: torch.device, dtype: torch.dtype,
                 backend: AttentionBackend, block_size: int, progress: bool = True):
        self.device, self.dtype, self.block_size = device, dtype, block_size
        self.backend = backend
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                self.model = Qwen3ForCausalLM(model_dir.config, self.backend)
        finally:
            torch.set_default_dtype(torch.float32)
        load_model(model_dir, self.model, progress=progress)
        self.model.eval()
        self.sampler = Sampler(model_dir.eos_token_ids)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.num_blocks = 0

    def kv_block_bytes(self) -> int:
        layer = self.attention_layers[0]
        per_layer = 2 * self.block_size * layer.num_kv_heads * layer.head_dim * self.dtype.itemsize
        return per_layer * len(self.attention_layers)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """k/v caches [num_blocks, block_size, Hkv, D] per layer (flash-attn's paged layout)."""
        self.num_blocks = num_blocks
        for layer in self.attention_layers:
            shape = (num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            layer.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> SamplerOutput:
        if is_prefill:
            input_ids, positions, meta, last_indices = self._prepare_prefill(seqs)
        else:
            input_ids, positions, meta = self._prepare_decode(seqs)
            last_indices = None
        hidden = self.model(input_ids, positions, meta)  # [T, H]
        if last_indices is not None:
            hidden = hidden[last_indices]  # [B, H]: only the last token of each sequence
        logits = self.model.compute_logits(hidden)
        return self.sampler(logits, seqs)

    def _prepare_prefill(self, seqs: list[Sequence]):
        input_ids, positions, slots = [], [], []
        query_lens, context_lens, cu_q, cu_k = [], [], [0], [0]
        for seq in seqs:
            start = seq.num_cached_tokens
            input_ids.extend(seq.token_ids[start:])
            positions.extend(range(start, len(seq)))
            slots.extend(self._slot(seq, pos) for pos in range(start, len(seq)))
            query_lens.append(len(seq) - start)
            context_lens.append(len(seq))
            cu_q.append(cu_q[-1] + query_lens[-1])
            cu_k.append(cu_k[-1] + len(seq))
        last_indices = [end - 1 for end in cu_q[1:]]
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=self._tensor(slots, torch.int64),
            context_lens=self._tensor(context_lens, torch.int32),
            block_tables=self._block_tables(seqs),
            cu_seqlens_q=self._tensor(cu_q, torch.int32),
            cu_seqlens_k=self._tensor(cu_k, torch.int32),
            max_seqlen_q=max(query_lens),
            max_seqlen_k=max(context_lens),
            query_lens=query_lens,
            context_lens_host=context_lens,
        )
        return (self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64), meta,
                self._tensor(last_indices, torch.int64))

    def _prepare_decode(self, seqs: list[Sequence]):
        input_ids = [seq.last_token for seq in seqs]
        positions = [len(seq) - 1 for seq in seqs]
        slots = [self._slot(seq, len(seq) - 1) for seq in seqs]
        meta = AttentionMetadata(
            is_prefill=False,
            slot_mapping=self._tensor(slots, torch.int64),
            context_lens=self._tensor([len(seq) for seq in seqs], torch.int32),
            block_tables=self._block_tables(seqs),
        )
        self.backend.prepare(meta, self.block_size)
        return self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64), meta

    def _slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(seq.block_table) for seq in seqs)
        rows = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs]
        return self._tensor(rows, torch.int32)

    def _tensor(self, data, dtype) -> torch.Tensor:
        if self.device.type == "cpu":
            return torch.tensor(data, dtype=dtype)
        # pinned host buffer + non_blocking copy: no sync with the device
        return torch.tensor(data, dtype=dtype, pin_memory=True).to(self.device, non_blocking=True)
