"""Owns the model and the KV cache; runs ONE batched forward per step over all scheduled sequences."""

import logging
from itertools import accumulate

import torch

from xserv_engine.engine.block_manager import BlockManager
from xserv_engine.engine.decode_buckets import BucketedDecode
from xserv_engine.engine.mtp_drafter import keep_hidden
from xserv_engine.engine.runner_kind import RunnerKind
from xserv_engine.engine.scheduler import ScheduledBatch
from xserv_engine.engine.sequence import Sequence
from xserv_engine.engine.speculative import verify
from xserv_engine.layers import int4, int8
from xserv_engine.layers.attention import (Attention, AttentionBackend, AttentionMetadata, DecodeMetadata,
                                           PrefillMetadata, StateMetadata)
from xserv_engine.layers.gated_delta_net import GatedDeltaNet
from xserv_engine.layers.linear import PackedLinear, pack_cpu_linears
from xserv_engine.layers.sampler import Sampler, SamplerOutput, argmax, prompt_logprobs
from xserv_engine.models.int4_formats import Int4Checkpoint
from xserv_engine.models.loader import ModelDir, load_model
from xserv_engine.models.lora import LoraBatch, install_lora
from xserv_engine.models.pooling import PoolingConfig
from xserv_engine.models.qwen3 import Qwen3ForCausalLM
from xserv_engine.multimodal.image_encoder import ImageEncoder
from xserv_engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)
startup = logging.getLogger("xserv.engine.startup")  # shown at the default level (server.cli.configure_logging)
WARMUP_ROUNDS = 3


class ModelRunner:
    def __init__(self, model_dir: ModelDir, device: torch.device, dtype: torch.dtype,
                 backend: AttentionBackend, block_size: int, progress: bool = True,
                 pooling: PoolingConfig | None = None, lora: bool = False, quantization: str | None = None,
                 mtp: bool = False):
        """pooling: the pooling or score runner's (embeddings: the model has no LM head; scores: two
        of its rows are read); None: generate. lora: the decoder's linears take LoRA adapters
        (models/lora.py), per sequence (Sequence.lora). quantization "int8": the linears run
        W8A8 int8 (layers/int8.py), as they do for a compressed-tensors int8 checkpoint; "int4":
        4-bit weights quantized at load (layers/int4.py), as a 4-bit checkpoint's are served.
        mtp: with the checkpoint's multi-token-prediction layer, whose drafts (engine/mtp_drafter.py)
        read the hidden states each step leaves (keep_hidden)."""
        self.device, self.dtype, self.block_size = device, dtype, block_size
        self.backend = backend
        self.pooling = pooling
        self.kind = RunnerKind.of(pooling)
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                lm_head = self.kind is not RunnerKind.POOLING  # an embedding model has no LM head
                self.model = Qwen3ForCausalLM(model_dir.config, self.backend, lm_head=lm_head, mtp=mtp)
        finally:
            torch.set_default_dtype(torch.float32)
        prequantized = load_model(model_dir, self.model, progress=progress)
        self.model.eval()
        # a vision-language model's tower, run on the images of each step's prompt chunks
        self.images = ImageEncoder(self.model.visual, device, dtype) if self.model.visual is not None else None
        self.classifier: torch.Tensor | None = None  # the score runner's [2, H]: the head's "no" and "yes" rows
        if self.kind is RunnerKind.SCORE:
            self.classifier = self.model.lm_head.weight.detach()[list(pooling.classify)].clone()
            self.model.lm_head = None  # the rest of the head is never read
        # the weights' format when it is not the dtype: int8 | int4 | None
        self.quantization = quantization or ("int4" if isinstance(model_dir.quantization, Int4Checkpoint)
                                             else "int8" if prequantized else None)
        if self.quantization == "int8":
            int8.quantize_model(self.model, dtype, prequantized, quantize_rest=quantization == "int8",
                                progress=progress)
        elif self.quantization == "int4":
            int4.quantize_model(self.model, prequantized, quantize_rest=quantization == "int4", progress=progress)
        if device.type == "cpu":
            pack_cpu_linears(self.model, dtype)
        self.lora: LoraBatch | None = install_lora(self.model) if lora else None
        self.sampler = Sampler(model_dir.eos_token_ids)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.linear_layers = [m for m in self.model.modules() if isinstance(m, GatedDeltaNet)]  # hybrid models
        self.num_blocks = 0
        self.num_state_slots = 0
        self.decode_buckets: BucketedDecode | None = None  # decode-only steps: CUDA graphs, CPU traces

    def has_packed_linears(self) -> bool:
        """Whether a linear holds oneDNN's packed weight (float32, or bf16 without AVX512-BF16)."""
        return any(isinstance(m, PackedLinear) for m in self.model.modules())

    def kv_block_bytes(self) -> int:
        layer = self.attention_layers[0]
        per_layer = 2 * self.block_size * layer.num_kv_heads * layer.head_dim * self.dtype.itemsize
        return per_layer * len(self.attention_layers)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """One k and one v cache per layer, in the attention backend's layout, with one block
        more than the block manager hands out: the scratch block padded decode rows write to."""
        self.num_blocks = num_blocks
        for layer in self.attention_layers:
            shape = self.backend.kv_cache_shape(num_blocks + 1, self.block_size, layer.num_kv_heads, layer.head_dim)
            layer.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.block_size = self.block_size

    def state_slot_bytes(self) -> int:
        """One sequence's linear-attention states over all layers (0 for a model without them)."""
        return sum(layer.shape.state_bytes(self.dtype) for layer in self.linear_layers)

    def allocate_states(self, num_slots: int, num_snapshots: int = 0) -> range:
        """The pool of linear-attention states: per layer, conv [slots, C, K-1] in the model's dtype
        and recurrent [slots, Hv, Dk, Dv] in fp32: num_slots for running sequences, one for the
        warm-up (slot num_slots), then num_snapshots for the prefix cache's snapshots, whose slots
        it returns."""
        self.num_state_slots = num_slots
        total = num_slots + 1 + num_snapshots
        for layer in self.linear_layers:
            s = layer.shape
            layer.conv_state = torch.zeros(total, s.conv_dim, s.conv_kernel - 1, dtype=self.dtype, device=self.device)
            layer.ssm_state = torch.zeros(total, s.num_value_heads, s.key_head_dim, s.value_head_dim,
                                          dtype=torch.float32, device=self.device)
        return range(num_slots + 1, total)

    def copy_states(self, source: int, target: int) -> None:
        """Slot `source`'s linear-attention states into slot `target`, in every layer."""
        for layer in self.linear_layers:
            layer.conv_state[target] = layer.conv_state[source]
            layer.ssm_state[target] = layer.ssm_state[source]

    def use_bucketed_decode(self, max_num_seqs: int, max_model_len: int, capture: bool) -> float:
        """Decode-only steps of up to max_num_seqs sequences go through BucketedDecode from now
        on; with capture, as CUDA graphs (padded to buckets) or on the CPU as traces (one per batch
        size). Returns the capture's seconds."""
        max_blocks = -(-max_model_len // self.block_size)
        traced = capture and self.device.type == "cpu"
        self.decode_buckets = BucketedDecode(self.model, self.backend, self.block_size, max_num_seqs, max_blocks,
                                             scratch_block=self.num_blocks, device=self.device, exact=traced,
                                             scratch_state_slot=self.num_state_slots if self.linear_layers else None)
        if not capture:
            return 0.0
        buckets = self.decode_buckets
        seconds = buckets.capture()
        made = len(buckets.traces if traced else buckets.graphs)
        if traced and not made:  # logged by BucketedDecode: steps run op by op, as without it
            self.decode_buckets = None
            return seconds
        startup.info("%s %d %s (decode batches %d..%d) in %.1f s", "traced" if traced else "captured", made,
                 "forwards" if traced else "CUDA graphs", buckets.buckets[0], buckets.max_batch, seconds)
        return seconds

    @torch.inference_mode()
    def warmup(self, num_tokens: int, num_seqs: int, rounds: int = WARMUP_ROUNDS) -> None:
        """Dummy steps of the largest prefill the scheduler may send (num_tokens over num_seqs
        equal prompts, as vLLM's profile run), with logits and argmax for each prompt. On the CPU
        the first few such steps are slow (docs/benchmarks-log.md): their temporaries are fresh
        memory, page-faulted in, and glibc then keeps it (retain_freed_memory). Run here, that
        cost is paid at start, not by the first burst of users. The dummy tokens are written to
        cache slots no request owns yet."""
        num_seqs = max(1, min(num_seqs, num_tokens))
        seq_len = num_tokens // num_seqs
        total = seq_len * num_seqs
        meta = AttentionMetadata(
            slot_mapping=torch.arange(total, device=self.device) % (self.num_blocks * self.block_size),
            num_prefill_tokens=total,
            prefill=PrefillMetadata(
                cu_seqlens_q=torch.arange(0, total + 1, seq_len, dtype=torch.int32, device=self.device),
                cu_seqlens_k=torch.arange(0, total + 1, seq_len, dtype=torch.int32, device=self.device),
                max_seqlen_q=seq_len, max_seqlen_k=seq_len,
                block_tables=torch.zeros(num_seqs, 1, dtype=torch.int32, device=self.device),
                query_lens=[seq_len] * num_seqs, context_lens=[seq_len] * num_seqs),
            states=StateMetadata([self.num_state_slots] * num_seqs, [seq_len] * num_seqs, [True] * num_seqs, None)
            if self.linear_layers else None,
        )
        self.backend.prepare(meta, self.block_size)
        input_ids = torch.zeros(total, dtype=torch.int64, device=self.device)
        positions = torch.arange(seq_len, device=self.device).repeat(num_seqs)
        last = torch.arange(seq_len - 1, total, seq_len, device=self.device)
        for _ in range(rounds):
            hidden = self.model(input_ids, positions, meta)
            if self.kind is RunnerKind.GENERATE:
                argmax(self.model.compute_logits(hidden[last]))

    @torch.inference_mode()
    def prompt_logits(self, blocks: BlockManager, prompts: list[list[int]]) -> torch.Tensor:
        """float32 logits [sum of the lengths, V] of every position of `prompts`, prefilled in one
        varlen forward on KV blocks borrowed from `blocks` and given back; the engine idle, prefix
        caching off. For accuracy checks (tests/engine/test_int8.py, benchmarks/int8_accuracy.py,
        benchmarks/acceptance_steps.py)."""
        seqs = [Sequence(p, SamplingParams(), blocks.block_size) for p in prompts]
        try:
            for seq in seqs:
                blocks.allocate(seq)
                seq.num_scheduled_tokens = seq.num_uncomputed_tokens
            input_ids, positions, meta, _ = self.prepare(seqs, [])
            return self.model.compute_logits(self.model(input_ids, positions, meta)).float()
        finally:
            for seq in seqs:
                if seq.block_table:
                    blocks.deallocate(seq)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> SamplerOutput:
        # decode-only steps of up to the largest captured batch replay CUDA graphs (the cuda-graphs
        # route, engine_setup.choose_route); everything else runs the model's forward
        fast = self.decode_buckets
        if (fast is not None and not batch.prefills and len(batch.decodes) <= fast.max_batch
                and not batch.verifies and not self._has_lora(batch.decodes)):  # adapters run op by op
            hidden = fast.run(batch.decodes)
            output = self.sampler(self.model.compute_logits(hidden), batch.sampled)
            if self.model.mtp is not None:
                self._keep_hidden([], batch.decodes, hidden, output)
            return output
        input_ids, positions, meta, logit_indices = self.prepare(batch.prefills, batch.decodes)
        images = None
        if self.images is not None:
            positions, images = self.images.step_inputs(batch.prefills, batch.decodes, positions)
        hidden = self._forward(input_ids, positions, meta, batch.seqs, images)  # [T, H]
        if self.model.mtp is not None and not batch.decodes:  # else with the decodes' tokens, below
            self._keep_hidden(batch.prefills, [], hidden, None)
        if self.kind is not RunnerKind.GENERATE:  # embeddings, scores: the prompts' last rows pooled, no token
            return SamplerOutput([], [], embeddings=self._pooled(batch.pooled, hidden[logit_indices]))
        prompt = self._prompt_logprobs(batch.prefills, hidden)
        if not batch.sampled:  # only prompt chunks that end no prompt: the cache is all they fill
            return SamplerOutput([], [], prompt)
        logits = self.model.compute_logits(hidden[logit_indices])  # [rows, V]
        if batch.verifies:  # the target's token at every drafted position, then which drafts stand
            output = verify(self.sampler, logits, batch.sampled, batch.rows)
            if self.linear_layers:
                self._keep_verified_states(batch.decodes, meta.states, output)
        else:
            output = self.sampler(logits, batch.sampled)
        output.prompt_logprobs = prompt
        if self.model.mtp is not None and batch.decodes:
            self._keep_hidden(batch.prefills, batch.decodes, hidden, output)
        return output

    @staticmethod
    def _keep_hidden(prefills: list[Sequence], decodes: list[Sequence], hidden: torch.Tensor,
                     output: SamplerOutput | None) -> None:
        """For the multi-token-prediction layer (engine/mtp_drafter.py): the hidden states [T, H]
        of each prompt chunk's positions, each decode's last token's and its drafts' that stood,
        laid out as prepare() lays the step out."""
        row = 0
        for seq in prefills:
            keep_hidden(seq, seq.num_cached_tokens, hidden[row : row + seq.num_scheduled_tokens])
            row += seq.num_scheduled_tokens
        for seq in decodes:
            stood = len(output.spec_tokens.get(seq.seq_id, ())) if seq.spec_token_ids else 0
            keep_hidden(seq, len(seq) - 1, hidden[row : row + 1 + stood])
            row += 1 + len(seq.spec_token_ids)

    def _keep_verified_states(self, decodes: list[Sequence], states: StateMetadata, output: SamplerOutput) -> None:
        """A hybrid model's verification ran each drafted sequence's rows through its states; keep
        them as they were after the rows that stood (its last token and the accepted drafts)."""
        kept = [1 + len(output.spec_tokens.get(seq.seq_id, ())) for seq in decodes if seq.spec_token_ids]
        for layer in self.linear_layers:
            layer.keep_verified(states.verify_groups, kept)

    def _forward(self, input_ids, positions, meta, seqs: list[Sequence], images=None) -> torch.Tensor:
        """The model's forward, with the sequences' LoRA adapters on their rows (seqs in the
        step's order: prompt chunks, then decodes) and the image tokens' embeddings."""
        if not self._has_lora(seqs):
            return self.model(input_ids, positions, meta, images)
        self.lora.groups = self._lora_groups(seqs)
        try:
            return self.model(input_ids, positions, meta, images)
        finally:
            self.lora.groups = []

    def _has_lora(self, seqs: list[Sequence]) -> bool:
        """Whether a sequence has an adapter: never looked at when LoRA is off."""
        return self.lora is not None and any(seq.lora is not None for seq in seqs)

    def _lora_groups(self, seqs: list[Sequence]) -> list:
        """LoraBatch.groups of a step laid out as prepare() lays it out (seqs in that order): each
        adapter's weights and its rows (None when every row has that one adapter)."""
        rows: dict[int, list[int]] = {}
        adapters, start = {}, 0
        sizes = [seq.num_scheduled_tokens for seq in seqs]
        for seq, size in zip(seqs, sizes):
            if seq.lora is not None:
                adapters[seq.lora.id] = seq.lora
                rows.setdefault(seq.lora.id, []).extend(range(start, start + size))
            start += size
        if len(rows) == 1 and len(next(iter(rows.values()))) == start:
            return [(next(iter(adapters.values())).weights, None)]
        return [(adapters[i].weights, self.tensor(r, torch.int64)) for i, r in rows.items()]

    def _pooled(self, seqs: list[Sequence], last: torch.Tensor) -> dict:
        """SamplerOutput.embeddings: each finished prompt's last-token hidden state (float32, on
        the CPU), cut to the dimensions it asks for, then L2-normalized if the model normalizes;
        for the score runner, [P(yes)] from the LM head's "no" and "yes" logits."""
        if self.kind is RunnerKind.SCORE:
            logits = last @ self.classifier.T  # [N, 2]: no, yes
            yes = logits.float().softmax(dim=-1)[:, 1:].cpu()
            return {seq.seq_id: row for seq, row in zip(seqs, yes)}
        out = {}
        for seq, row in zip(seqs, last.float().cpu()):
            if seq.embed.dimensions is not None:
                row = row[: seq.embed.dimensions]
            if self.pooling.normalize:
                row = torch.nn.functional.normalize(row, dim=0)
            out[seq.seq_id] = row
        return out

    def _prompt_logprobs(self, prefills: list[Sequence], hidden: torch.Tensor) -> dict:
        """SamplerOutput.prompt_logprobs for the step's prompt chunks that ask for them: the row
        of position p predicts token p + 1, while that is a prompt token."""
        out, offset = {}, 0
        for seq in prefills:
            start = seq.num_cached_tokens
            rows = min(seq.num_scheduled_tokens, seq.num_prompt_tokens - 1 - start)
            if seq.needs_prompt_logprobs and rows > 0:
                lm_head, targets = self.model.compute_logits, seq.token_ids[start + 1 : start + 1 + rows]
                entries = prompt_logprobs(lm_head, hidden[offset : offset + rows], targets, seq.params.prompt_logprobs)
                out[seq.seq_id] = (start + 1, entries)
            offset += seq.num_scheduled_tokens
        return out

    def prepare(self, prefills: list[Sequence], decodes: list[Sequence]):
        """Token ids, positions, attention metadata and the rows that need logits, for a step
        of prompt chunks (seq.num_scheduled_tokens from seq.num_cached_tokens on) followed by
        decodes. Only a chunk that ends its prompt needs logits. A decode with drafts is one
        decode row per token it feeds (its last token, then each draft), each attending to the
        cache up to its own position: the same attention as plain decoding, which a draft's row
        must match token for token."""
        input_ids, positions, slots, last_indices = [], [], [], []
        for seq in prefills:
            start, end = seq.num_cached_tokens, seq.num_cached_tokens + seq.num_scheduled_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(self.slots(seq, start, end))
            if end == len(seq):
                last_indices.append(len(input_ids) - 1)
        num_prefill_tokens = len(input_ids)
        rows: list[Sequence] = []  # a decode's sequence, once per row
        for seq in decodes:
            for i, token_id in enumerate([seq.last_token, *seq.spec_token_ids]):
                input_ids.append(token_id)
                positions.append(len(seq) - 1 + i)
                slots.append(self.slot(seq, len(seq) - 1 + i))
                rows.append(seq)
        last_indices.extend(range(num_prefill_tokens, len(input_ids)))
        meta = AttentionMetadata(
            slot_mapping=self.tensor(slots, torch.int64), num_prefill_tokens=num_prefill_tokens,
            prefill=self.prefill_metadata(prefills, [seq.num_cached_tokens for seq in prefills],
                                          [seq.num_cached_tokens + seq.num_scheduled_tokens for seq in prefills])
            if prefills else None,
            decode=self.decode_metadata(rows, positions[num_prefill_tokens:]) if decodes else None,
            states=self.state_metadata(prefills, decodes) if self.linear_layers else None,
        )
        self.backend.prepare(meta, self.block_size)
        return (self.tensor(input_ids, torch.int64), self.tensor(positions, torch.int64), meta,
                self.tensor(last_indices, torch.int64))

    def prefill_metadata(self, seqs: list[Sequence], starts: list[int], ends: list[int]) -> PrefillMetadata:
        """Chunks of positions [starts[i], ends[i]) of seqs[i], attending to the cache before them."""
        query_lens = [end - start for start, end in zip(starts, ends)]
        context_lens = list(ends)
        return PrefillMetadata(
            cu_seqlens_q=self.tensor(list(accumulate(query_lens, initial=0)), torch.int32),
            cu_seqlens_k=self.tensor(list(accumulate(context_lens, initial=0)), torch.int32),
            max_seqlen_q=max(query_lens), max_seqlen_k=max(context_lens),
            block_tables=self._block_tables(seqs), query_lens=query_lens, context_lens=context_lens,
        )

    def state_metadata(self, prefills: list[Sequence], decodes: list[Sequence]) -> StateMetadata:
        """Each sequence's state slot; a chunk from position 0 starts from zero states (a new
        prompt, or one prefilled again after a preemption), one after a prefix-cache hit from a
        copy of the hit's snapshot; the snapshots each chunk leaves (BlockManager)."""
        groups, plain, rows, row = [], [], [], 0
        for seq in decodes:
            n = 1 + len(seq.spec_token_ids)
            if n > 1:
                groups.append((row, n, seq.state_slot))
            else:
                plain.append(seq.state_slot)
                rows.append(row)
            row += n
        return StateMetadata(
            prefill_slots=[seq.state_slot for seq in prefills],
            prefill_lens=[seq.num_scheduled_tokens for seq in prefills],
            prefill_fresh=[seq.num_cached_tokens == 0 for seq in prefills],
            decode_slots=self.tensor(plain, torch.int64) if plain else None,
            verify_groups=groups, decode_rows=self.tensor(rows, torch.int64) if groups and plain else None,
            prefill_restore=[seq.restore_slot for seq in prefills],
            prefill_snapshots=[[(at - seq.num_cached_tokens, slot) for at, slot, _ in seq.snapshots] for seq in prefills])

    def decode_metadata(self, seqs: list[Sequence], positions: list[int]) -> DecodeMetadata:
        return DecodeMetadata(context_lens=self.tensor([p + 1 for p in positions], torch.int32),
                              block_tables=self._block_tables(seqs))

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Cache slots of positions [start, end): one range per block, not a call per token."""
        bs, slots = self.block_size, []
        for i in range(start // bs, (end - 1) // bs + 1):
            base = seq.block_table[i] * bs
            slots.extend(range(base + max(start - i * bs, 0), base + min(end - i * bs, bs)))
        return slots

    def slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(seq.block_table) for seq in seqs)
        rows = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs]
        return self.tensor(rows, torch.int32)

    def tensor(self, data, dtype) -> torch.Tensor:
        if self.device.type == "cpu":
            return torch.tensor(data, dtype=dtype)
        # pinned host buffer + non_blocking copy: no sync with the device
        return torch.tensor(data, dtype=dtype, pin_memory=True).to(self.device, non_blocking=True)
