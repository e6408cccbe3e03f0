"""Continuous batching: which sequences run this step, and preemption when blocks run out.

A step decodes every running sequence and, in the same forward, prefills the waiting ones that
fit: new requests join without stalling the streams already running.
"""

from collections import deque
from dataclasses import dataclass

from xserv_engine.engine.block_manager import BlockManager
from xserv_engine.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    prefills: list[Sequence]  # whole prompts (or prompt + output after a preemption)
    decodes: list[Sequence]  # one token each

    @property
    def seqs(self) -> list[Sequence]:
        return self.prefills + self.decodes  # the order of the step's tokens and outputs

    def __bool__(self) -> bool:
        return bool(self.prefills or self.decodes)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        """Decode every running sequence (preempting when blocks run out), then add the
        waiting ones that fit the remaining blocks, sequence slots and token budget."""
        decodes = self._schedule_decode()
        return ScheduledBatch(self._schedule_prefill(num_tokens=len(decodes)), decodes)

    def _schedule_prefill(self, num_tokens: int) -> list[Sequence]:
        scheduled: list[Sequence] = []
        while self.waiting and len(self.running) + len(scheduled) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.block_manager.can_allocate(seq):
                break
            # the first prompt always goes, however long: nothing may starve behind decodes
            if scheduled and num_tokens + len(seq) > self.max_num_batched_tokens:
                break
            self.block_manager.allocate(seq)
            if seq.num_prompt_cached_tokens is None:
                seq.num_prompt_cached_tokens = seq.num_cached_tokens
            num_tokens += len(seq) - seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            scheduled.append(seq)
        self.running.extend(scheduled)
        return scheduled

    def _schedule_decode(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        while self.running:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                self.block_manager.may_append(seq)
                scheduled.append(seq)
        self.running.extend(scheduled)
        return scheduled

    def _preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks; it is prefilled again (prompt + output so far) later."""
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence wherever it is and free its blocks."""
        seq.finish_reason = reason
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.deallocate(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
