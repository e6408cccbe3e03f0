"""What a step tells every attention layer: which tokens are prefills and which decodes, where
their keys and values go in the paged cache, and which blocks each sequence reads."""

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillMetadata:
    cu_seqlens_q: torch.Tensor  # [P+1] int32
    cu_seqlens_k: torch.Tensor  # [P+1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    block_tables: torch.Tensor  # [P, max_blocks] int32, padded with 0
    query_lens: list[int]  # host copies for the torch path (no device sync)
    context_lens: list[int]
    block_size: int = 0  # set by the torch backend's prepare


@dataclass
class DecodeMetadata:
    context_lens: torch.Tensor  # [D] int32: tokens in each context after this step
    block_tables: torch.Tensor  # [D, max_blocks] int32, padded with 0 (masked by context_lens)
    # torch path only, built once per step by TorchAttentionBackend.prepare
    block_size: int = 0
    key_bias: torch.Tensor | None = None  # [1, D, 1, W] float32: 0 inside the context, -inf past it
    key_index: torch.Tensor | None = None  # [Hkv * D * G * max_blocks * head_dim] rows of the k cache as [-1, bs]
    key_offsets: torch.Tensor | None = None  # [Hkv * D * G * max_blocks]: where each block's head_dim rows start
    value_index: torch.Tensor | None = None  # [Hkv * D * G * W] rows of the v cache as [-1, head_dim]
    value_offsets: torch.Tensor | None = None  # [Hkv * D * G]: where each query head's W rows start


@dataclass
class StateMetadata:
    """Where the step's sequences keep their linear-attention states (hybrid models: slots of the
    state pool that BlockManager hands out and ModelRunner.allocate_states holds): the prompt
    chunks' one by one, then the decodes' at once."""
    prefill_slots: list[int]  # host copies: each prompt chunk is its own call
    prefill_lens: list[int]
    prefill_fresh: list[bool]  # the chunk starts its sequence: its states start at zero
    decode_slots: torch.Tensor | None  # [D] int64, one token per decode
    # prefix caching: the snapshot slot each chunk's states start from (a hit), -1 for none; and the
    # (tokens into the chunk, snapshot slot) pairs whose states it leaves for later hits
    prefill_restore: list[int] = field(default_factory=list)
    prefill_snapshots: list[list[tuple[int, int]]] = field(default_factory=list)
    # speculative decoding: the decodes with drafts, each (its first decode row, its rows: the last
    # token then the drafts, its slot), run as a chunk whose state after each row is kept until the
    # verification says how many stood; decode_slots then holds the other decodes', at decode_rows
    verify_groups: list[tuple[int, int, int]] = field(default_factory=list)
    decode_rows: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    num_prefill_tokens: int  # tokens [0, num_prefill_tokens) are prefills, the rest decodes
    prefill: PrefillMetadata | None = None
    decode: DecodeMetadata | None = None
    slot_block_offset: tuple | None = None  # torch path: (block, offset in it) of each new token
    states: StateMetadata | None = None  # hybrid models' linear-attention layers; None for the others
