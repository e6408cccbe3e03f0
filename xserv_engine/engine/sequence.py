"""One sequence per choice: its tokens, its blocks and where it is in its life."""

from dataclasses import dataclass
from enum import Enum, auto
from itertools import count
from typing import TYPE_CHECKING

import torch

from xserv_engine.models.lora import LoraAdapter
from xserv_engine.models.pooling import EmbedParams
from xserv_engine.sampling_params import SamplingParams
from xserv_engine.structured.guide import SequenceGuide

if TYPE_CHECKING:
    from xserv_engine.engine.mtp_drafter import MtpState


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


BACKOFF_STEPS = 16  # steps a sequence without accepted drafts first pauses (engine/speculative.py)


@dataclass
class SeqSpecState:
    """A sequence's speculation: its counters (the request log's acceptance rate) and backoff."""
    draft_tokens: int = 0
    accepted_tokens: int = 0
    misses: int = 0
    probing: bool = True  # a draft model proposes one draft until one stands, and after a miss
    pause: int = 0
    backoff: int = BACKOFF_STEPS
    draft_cached: int = 0  # positions whose KV a draft model has computed (engine/speculative.py)
    # a draft model's distributions [k, V] of the drafts it sampled for an unseeded sampled row
    # (None for greedy and seeded ones), for the rejection test min(1, p/q)
    draft_probs: torch.Tensor | None = None
    mtp: "MtpState | None" = None  # method mtp: the hidden states its layer reads (engine/mtp_drafter.py)


class Sequence:
    _ids = count()

    def __init__(self, token_ids: list[int], params: SamplingParams, block_size: int, index: int = 0,
                 embed: EmbedParams | None = None, lora: LoraAdapter | None = None):
        self.seq_id = next(Sequence._ids)
        self.index = index  # choice index within its request
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        # tokens whose KV is in the cache: prefix-cache hits at (re)allocation, then every
        # computed prefill chunk and decode token; a prompt is being prefilled while more than
        # its last token is still to compute
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0  # tokens the current step computes (scheduler)
        # this step's proposed tokens (engine/speculative.py): the step computes the last token and
        # them, and keeps the ones the target model agrees with
        self.spec_token_ids: list[int] = []
        self.spec = SeqSpecState()
        self.block_hashes: list[int] = []  # prefix-cache hash of each prompt block, -1 where none
        self.num_shared_blocks = 0  # leading blocks whose hash is published to the prefix cache
        self.num_prompt_cached_tokens: int | None = None  # reported in usage, set at first prefill
        self.first_scheduled_at: float | None = None  # time.monotonic() of its first prefill (traces)
        self.block_size = block_size
        self.block_table: list[int] = []
        self.state_slot = -1  # hybrid models: its linear-attention states' slot in the pool (BlockManager)
        self.restore_slot = -1  # hybrid prefix-cache hit: the snapshot its states start from
        self.snapshots: list[tuple[int, int, int]] = []  # (tokens, snapshot slot, block id) the step leaves
        self.params = params
        self.priority = params.priority  # the priority policy's: lower runs first
        # a seeded row's draws are a function of this and the position (sampler.seeded_uniforms)
        self.seed = (params.seed + index) % 2**64 if params.seed is not None else None
        self.finish_reason: str | None = None
        self.guide: SequenceGuide | None = None  # its output constraint's state, if it has one
        # params.prompt_logprobs: the logprob of prompt token i at [i] (the first has none), filled
        # as prefill chunks run; handed to the first output, then None
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None
        self.embed = embed  # an embedding request's (the pooling runner's): its prompt is all it runs
        self.lora = lora  # the LoRA adapter it generates with; None: the base model
        # its blocks' prefix-cache hash chain starts here (an adapter's keys and values are its own)
        self.hash_root = -1 if lora is None else lora.hash_root
        # a prompt with images: their tokens, hashes and its MRoPE positions (multimodal/prompt_images.py
        # PromptImages, shared by a request's sequences); None for a text prompt
        self.images = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_blocks(self) -> int:
        return (len(self.token_ids) + self.block_size - 1) // self.block_size

    @property
    def num_uncomputed_tokens(self) -> int:
        """1 for a decode (the last sampled token); more while the prompt is being prefilled."""
        return len(self.token_ids) - self.num_cached_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed: its prompt must be computed, not
        taken from the prefix cache."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def last_block_num_tokens(self) -> int:
        return len(self.token_ids) - (self.num_blocks - 1) * self.block_size

    def block(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size : (i + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
