"""Scheduler and BlockManager on their own: batching, budgets, preemption, block accounting."""

from xserv_engine.engine.block_manager import BlockManager
from xserv_engine.engine.scheduler import Scheduler
from xserv_engine.engine.sequence import Sequence, SequenceStatus
from xserv_engine.sampling_params import SamplingParams

BS = 4


def seq(n: int, start: int = 0) -> Sequence:
    return Sequence(list(range(start, start + n)), SamplingParams(), BS)


def step(scheduler: Scheduler, token: int = 7):
    """What the engine does after a forward: register full blocks, append one token each."""
    batch = scheduler.schedule()
    for s in batch.seqs:
        scheduler.block_manager.register_full_block(s)
        s.append_token(token)
    return batch


def test_a_joining_request_is_prefilled_in_the_same_step_as_running_decodes():
    scheduler = Scheduler(BlockManager(64, BS), max_num_seqs=8, max_num_batched_tokens=64)
    a, b = seq(5), seq(6, 100)
    scheduler.add(a)
    assert step(scheduler).prefills == [a]
    scheduler.add(b)
    batch = step(scheduler)
    assert (batch.prefills, batch.decodes) == ([b], [a])
    assert batch.seqs == [b, a]


def test_token_budget_and_sequence_limit_hold_but_a_long_prompt_still_runs_alone():
    scheduler = Scheduler(BlockManager(64, BS), max_num_seqs=2, max_num_batched_tokens=10)
    long, short1, short2 = seq(30), seq(3, 100), seq(3, 200)
    for s in (long, short1, short2):
        scheduler.add(s)
    assert step(scheduler).prefills == [long]  # over budget, but first: never starves
    batch = step(scheduler)
    assert (batch.prefills, batch.decodes) == ([short1], [long])
    assert step(scheduler).prefills == []  # max_num_seqs reached: short2 waits
    assert list(scheduler.waiting) == [short2]


def test_preemption_frees_blocks_and_requeues_at_the_front():
    manager = BlockManager(4, BS, enable_prefix_caching=False)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = seq(7), seq(7, 100)  # 2 blocks each: the cache is full
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)
    assert manager.num_free_blocks == 0
    assert step(scheduler).decodes == [a, b]  # position 7 still fits the second block
    batch = step(scheduler)  # position 8 needs a third block each: b is preempted for a
    assert batch.decodes == [a] and b.status == SequenceStatus.WAITING
    assert scheduler.num_preemptions == 1 and list(scheduler.waiting) == [b]
    scheduler.finish(a, "stop")
    assert manager.num_free_blocks == 4
    assert step(scheduler).prefills == [b]  # recomputed: prompt + its output so far
    assert len(b) == 10 and b.num_completion_tokens == 3


def test_shared_prefix_blocks_are_refcounted_and_all_return_when_done():
    manager = BlockManager(16, BS)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = seq(10), seq(10)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)
    assert b.num_cached_tokens == 8 and a.block_table[:2] == b.block_table[:2]
    assert manager.num_free_blocks == 16 - 4
    scheduler.finish(a, "stop")
    scheduler.finish(b, "abort")
    assert manager.num_free_blocks == manager.num_total_blocks
