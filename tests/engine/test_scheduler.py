"""Scheduler and BlockManager on their own: batching, budgets, preemption, block accounting."""

from xserv_engine.engine.block_manager import BlockManager
from xserv_engine.engine.scheduler import Scheduler
from xserv_engine.engine.sequence import Sequence, SequenceStatus
from xserv_engine.sampling_params import SamplingParams

BS = 4


def seq(n: int, start: int = 0) -> Sequence:
    return Sequence(list(range(start, start + n)), SamplingParams(), BS)


def step(scheduler: Scheduler, token: int = 7):
    """What the engine does after a forward: count the computed tokens; register full blocks
    and append one token to each sequence that was sampled."""
    batch = scheduler.schedule()
    for s in batch.seqs:
        s.num_cached_tokens += s.num_scheduled_tokens
    for s in batch.sampled:
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


def test_a_prompt_longer_than_the_budget_is_prefilled_in_chunks_beside_running_decodes():
    scheduler = Scheduler(BlockManager(64, BS), max_num_seqs=2, max_num_batched_tokens=10)
    running, long, late = seq(3), seq(30, 100), seq(3, 200)
    scheduler.add(running)
    step(scheduler)
    scheduler.add(long)
    scheduler.add(late)
    chunks = []
    while len(long) == 30:  # until the prompt's last chunk made its first token
        batch = step(scheduler)
        assert batch.decodes == [running]  # the running stream never waits for the long prompt
        assert batch.prefills == [long] and sum(s.num_scheduled_tokens for s in batch.seqs) <= 10
        chunks.append(long.num_scheduled_tokens)
        assert batch.sampled == ([long] if len(long) == 31 else []) + [running]
    assert chunks == [9, 9, 9, 3] and long.num_prompt_cached_tokens == 0
    batch = step(scheduler)
    assert (batch.prefills, batch.decodes) == ([], [running, long])  # max_num_seqs: late waits
    assert list(scheduler.waiting) == [late]


def test_the_first_prefill_of_a_step_always_gets_a_token_so_nothing_starves():
    scheduler = Scheduler(BlockManager(64, BS), max_num_seqs=4, max_num_batched_tokens=2)
    a, b, c = seq(2), seq(2, 100), seq(5, 200)
    for s in (a, b):
        scheduler.add(s)
    step(scheduler)
    step(scheduler)  # a and b decode: the budget of 2 is used up by them
    scheduler.add(c)
    batch = step(scheduler)
    assert batch.decodes == [a, b] and batch.prefills == [c] and c.num_scheduled_tokens == 1


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
    assert b.num_prompt_cached_tokens == 8 and a.block_table[:2] == b.block_table[:2]
    assert manager.num_free_blocks == 16 - 4
    scheduler.finish(a, "stop")
    scheduler.finish(b, "abort")
    assert manager.num_free_blocks == manager.num_total_blocks


def test_a_prompt_aborted_mid_prefill_leaves_only_computed_blocks_in_the_prefix_cache():
    manager = BlockManager(32, BS)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=6)
    first, twin = seq(17), seq(17)
    scheduler.add(first)
    step(scheduler)  # tokens 0-5 through the model: block 0 (tokens 0-3) is the only full one
    scheduler.finish(first, "abort")
    assert manager.num_free_blocks == manager.num_total_blocks
    scheduler.add(twin)
    step(scheduler)
    assert twin.num_prompt_cached_tokens == 4  # blocks 1-3 were never computed: not reused
