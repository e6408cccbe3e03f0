"""Continuous batching: which sequences run this step, and preemption when blocks run out.

A step decodes every running sequence and, in the same forward, prefills what fits the token
budget: first the next chunk of prompts already being prefilled, then new requests. A prompt
longer than the budget left is prefilled a chunk at a time over several steps (chunked prefill),
so a long prompt never stalls the streams already running for more than one step's budget.

Two policies (--scheduling-policy, vLLM's): fcfs admits in arrival order and, when blocks run
out, preempts the most recently admitted sequence. priority admits by (priority, arrival), lower
first, preempts the lowest-priority running sequence (largest number, latest arrival) first, and
also preempts running sequences of a strictly lower priority to admit a waiting one when there is
no slot or no blocks for it, so that interactive traffic is not stuck behind batch jobs.
"""

import bisect
import time
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property

from xserv_engine.engine.block_manager import BlockManager
from xserv_engine.engine.sequence import Sequence, SequenceStatus
from xserv_engine.engine.speculative import Speculator, verify_rows


@dataclass
class ScheduledBatch:
    prefills: list[Sequence]  # prompt chunks (of prompt + output after a preemption): seq.num_scheduled_tokens each
    decodes: list[Sequence]  # one token each, or the last token and its drafts (seq.spec_token_ids)
    # the sequences that get a token this step, in the order of the step's logits: prefills whose
    # chunk ends their prompt, then every decode (1 + k rows with k drafts)
    sampled: list[Sequence] = field(init=False)
    # embedding requests whose prompt this step ends (the pooling runner's; they get no token)
    pooled: list[Sequence] = field(init=False)

    def __post_init__(self):
        done = [s for s in self.prefills if s.num_scheduled_tokens == s.num_uncomputed_tokens]
        self.pooled = [s for s in done if s.embed is not None]
        self.sampled = [s for s in done if s.embed is None] + self.decodes

    @cached_property
    def rows(self) -> list:
        """The step's rows of logits as the Sampler sees them: each sampled sequence, or with
        drafts one view of it per position (speculative.verify_rows)."""
        return [row for seq in self.sampled for row in verify_rows(seq)]

    @cached_property
    def verifies(self) -> list[Sequence]:
        """Decodes with drafts."""
        return [s for s in self.decodes if s.spec_token_ids]

    @property
    def seqs(self) -> list[Sequence]:
        return self.prefills + self.decodes

    def __bool__(self) -> bool:
        return bool(self.prefills or self.decodes)


POLICIES = ("fcfs", "priority")
MAX_LEFT = 1 << 62  # a sequence without max_tokens (only in tests: requests have it fitted)


def rank(seq: Sequence) -> tuple[int, int]:
    """The priority policy's order: lower priority number first, then earlier arrival."""
    return seq.priority, seq.seq_id


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: str = "fcfs", speculator: Speculator | None = None):
        assert policy in POLICIES, policy
        self.speculator = speculator
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.by_priority = policy == "priority"
        self.waiting: deque[Sequence] = deque()  # admission order: arrival, or rank() by priority
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        self._enqueue(seq, preempted=False)

    def schedule(self) -> ScheduledBatch:
        """Decode every running sequence whose prompt is done (preempting when blocks run out),
        then prefill within the remaining token budget and sequence slots."""
        decodes, partial = self._schedule_decode()
        drafts = self._add_drafts(decodes) if self.speculator is not None else 0
        prefills = self._schedule_prefill(partial, decodes, budget=self.max_num_batched_tokens - len(decodes) - drafts)
        return ScheduledBatch(prefills, decodes)

    def _add_drafts(self, decodes: list[Sequence]) -> int:
        """Drafts for the step's decodes (the Speculator's; none past its batch-size rule), each
        cut to the tokens its max_tokens leaves, the token budget, the free blocks (a draft never
        preempts) and a hybrid's next snapshot (BlockManager.drafts_to_snapshot). Returns how many
        tokens they add to the step."""
        k = self.speculator.budget(len(decodes))
        if not k:  # past the batch-size rule: nothing to look at (postprocess cleared the last drafts)
            return 0
        budget = self.max_num_batched_tokens - len(decodes)
        rooms = []
        for seq in decodes:
            left = (seq.params.max_tokens or MAX_LEFT) - seq.num_completion_tokens - 1  # tokens after this one
            rooms.append(max(0, min(k, left, budget, self.block_manager.drafts_to_snapshot(seq))))
            budget -= rooms[-1]
        self.speculator.propose(decodes, rooms, self.block_manager)
        for seq in decodes:
            seq.num_scheduled_tokens = 1 + len(seq.spec_token_ids)
        return sum(len(seq.spec_token_ids) for seq in decodes)

    def _enqueue(self, seq: Sequence, preempted: bool) -> None:
        if self.by_priority:
            self.waiting.insert(bisect.bisect_right(self.waiting, rank(seq), key=rank), seq)
        elif preempted:  # fcfs: a preempted sequence comes back first
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def _schedule_prefill(self, partial: list[Sequence], decodes: list[Sequence], budget: int) -> list[Sequence]:
        scheduled: list[Sequence] = []
        for seq in partial:  # prompts already being prefilled: their next chunk first
            if not self._take_chunk(seq, budget, first=not scheduled):
                return scheduled
            budget -= seq.num_scheduled_tokens
            scheduled.append(seq)
        new: list[Sequence] = []
        while self.waiting:
            seq = self.waiting[0]
            if scheduled and budget <= 0:
                break
            if not self._fits(seq, len(new)) and not self._preempt_for(seq, len(new), decodes, scheduled):
                break
            self.block_manager.allocate(seq)
            if seq.num_prompt_cached_tokens is None:
                seq.num_prompt_cached_tokens = seq.num_cached_tokens
                seq.first_scheduled_at = time.monotonic()
            self._take_chunk(seq, budget, first=not scheduled)
            budget -= seq.num_scheduled_tokens
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            new.append(seq)
            scheduled.append(seq)
        self.running.extend(new)
        return scheduled

    def _fits(self, seq: Sequence, num_new: int) -> bool:
        return len(self.running) + num_new < self.max_num_seqs and self.block_manager.can_allocate(seq)

    def _preempt_for(self, seq: Sequence, num_new: int, decodes: list[Sequence], prefills: list[Sequence]) -> bool:
        """priority: preempt running sequences of a lower priority than seq's, lowest first, until
        seq fits; False when it still does not (fcfs never preempts to admit). Prompt chunks this
        step prefills are not taken: their blocks' hashes are already published."""
        while self.by_priority and not self._fits(seq, num_new):
            candidates = [s for s in self.running if s.priority > seq.priority and s not in prefills]
            if not candidates:
                return False
            victim = max(candidates, key=rank)
            self.running.remove(victim)
            if victim in decodes:
                decodes.remove(victim)
            self._preempt(victim)
        return self._fits(seq, num_new)

    def _take_chunk(self, seq: Sequence, budget: int, first: bool) -> bool:
        """Schedule as much of seq's prompt as the budget allows; the step's first prefill gets at
        least one token, so nothing starves behind decodes. False when nothing fits."""
        n = min(seq.num_uncomputed_tokens, max(budget, 1 if first else 0))
        seq.num_scheduled_tokens = n
        if n:
            self.block_manager.share_computed(seq, seq.num_cached_tokens + n)
        return n > 0

    def _schedule_decode(self) -> tuple[list[Sequence], list[Sequence]]:
        """(decodes, running sequences still in their prompt's prefill)."""
        scheduled: list[Sequence] = []
        partial: list[Sequence] = []
        while self.running:
            seq = self.running.popleft()
            if seq.num_uncomputed_tokens > 1:
                partial.append(seq)
                continue
            while not self.block_manager.can_append(seq):
                victim = self._decode_victim(seq, scheduled, partial)
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.may_append(seq)
                seq.num_scheduled_tokens = 1
                scheduled.append(seq)
        self.running.extend(scheduled + partial)
        return scheduled, partial

    def _decode_victim(self, seq: Sequence, scheduled: list[Sequence], partial: list[Sequence]) -> Sequence:
        """Whom to preempt when seq has no block for its next token, taken out of its list. fcfs:
        the most recent first (those not yet looked at, then prompts, then seq); priority: the
        lowest-ranked of all running sequences, seq included."""
        if self.by_priority:
            victim = max((*self.running, *partial, *scheduled, seq), key=rank)
        else:
            victim = self.running[-1] if self.running else partial[-1] if partial else seq
        for group in (self.running, partial, scheduled):
            if victim in group:
                group.remove(victim)
        return victim

    def _preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks; it is prefilled again (prompt + output so far) later."""
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        seq.spec_token_ids = []
        seq.spec.draft_cached = 0  # its blocks, and the draft model's KV in them, are gone
        self.block_manager.deallocate(seq)
        self._enqueue(seq, preempted=True)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence wherever it is and free its blocks."""
        seq.finish_reason = reason
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.deallocate(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
