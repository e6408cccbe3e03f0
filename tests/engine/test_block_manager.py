"""BlockManager's prefix cache under the real Scheduler: what stays cached, what is evicted first,
what is shared, and that the block counts stay right through aborts and preemptions."""

import random

from tests.engine.test_scheduler import BS, seq, step
from xserv_engine.engine.block_manager import BlockManager
from xserv_engine.engine.scheduler import Scheduler
from xserv_engine.engine.sequence import Sequence, SequenceStatus
from xserv_engine.sampling_params import SamplingParams


def serve(scheduler: Scheduler, s: Sequence) -> int:
    """Prefill s alone, finish it, and return what its usage reports as cached."""
    scheduler.add(s)
    step(scheduler)
    scheduler.finish(s, "stop")
    return s.num_prompt_cached_tokens


def check_invariants(manager: BlockManager, live: list[Sequence]) -> None:
    """No block a live sequence holds is free (so none can be evicted), each block's refcount is
    the number of tables that hold it, and every cached hash leads to a block with those tokens."""
    holders: dict[int, int] = {}
    for s in live:
        for block_id in s.block_table:
            holders[block_id] = holders.get(block_id, 0) + 1
    assert not set(holders) & set(manager.free_block_ids)
    assert all(manager.blocks[b].ref_count == n for b, n in holders.items())
    assert len(manager.free_block_ids) + len(holders) == manager.num_total_blocks
    for h, block_id in manager.hash_to_block_id.items():
        assert manager.blocks[block_id].hash == h and len(manager.blocks[block_id].token_ids) == BS


def test_every_repeat_of_a_prompt_hits_all_its_full_blocks():
    scheduler = Scheduler(BlockManager(32, BS), max_num_seqs=4, max_num_batched_tokens=64)
    # 13 tokens: 3 full blocks, all before the last token
    assert [serve(scheduler, seq(13)) for _ in range(6)] == [0, 12, 12, 12, 12, 12]
    # 12 tokens: the last full block holds the last token, which is always computed
    assert [serve(scheduler, seq(12, 500)) for _ in range(3)] == [0, 8, 8]
    manager = scheduler.block_manager
    assert manager.num_free_blocks == manager.num_total_blocks
    assert (manager.cache_hits, manager.cache_queries) == (5 * 3 + 2 * 2, 6 * 3 + 3 * 2)


def test_identical_prompts_in_one_step_share_their_blocks():
    manager = BlockManager(16, BS)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64)
    twins = [seq(13) for _ in range(3)]
    for s in twins:
        scheduler.add(s)
    batch = step(scheduler)
    assert batch.prefills == twins
    assert [s.num_prompt_cached_tokens for s in twins] == [0, 12, 12]
    assert twins[1].block_table[:3] == twins[0].block_table[:3] == twins[2].block_table[:3]
    assert manager.num_free_blocks == 16 - 3 - 3  # 3 shared blocks + one last block each
    check_invariants(manager, twins)


def test_a_hit_on_a_free_cached_block_counts_against_the_free_blocks():
    manager = BlockManager(4, BS)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64)
    assert serve(scheduler, seq(9)) == 0  # blocks 0-1 cached and free
    holder = seq(5, 900)  # takes the 2 uncached blocks (evicted first): the 2 cached ones stay free
    scheduler.add(holder)
    step(scheduler)
    assert manager.num_free_blocks == 2
    again = seq(9)  # 2 hits on free blocks + 1 new block: 3 free blocks needed, 2 there
    assert not manager.can_allocate(again)
    scheduler.finish(holder, "stop")
    assert manager.can_allocate(again) and serve(scheduler, again) == 8


def test_the_least_recently_used_prefix_is_evicted_first():
    manager = BlockManager(7, BS)  # room for two 3-block prompts and one spare block
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64)
    a, b, c, d = (list(range(k, k + 9)) for k in (0, 100, 200, 300))
    for prompt in (a, b, c, a):  # a was used again after b and c: b is now the oldest
        serve(scheduler, Sequence(prompt, SamplingParams(), BS))
    assert serve(scheduler, Sequence(d, SamplingParams(), BS)) == 0  # needs 3 blocks: evicts b
    cached = [serve(scheduler, Sequence(p, SamplingParams(), BS)) for p in (a, c, d, b)]
    assert cached == [8, 8, 8, 0]


def test_a_prompt_tail_is_evicted_before_its_head():
    manager = BlockManager(4, BS)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64)
    serve(scheduler, seq(13))  # 3 full cached blocks + 1 partial, all free
    serve(scheduler, seq(5, 900))  # 2 blocks: the uncached partial one, then the cached tail
    assert serve(scheduler, seq(13)) == 8  # the head survives


def test_nothing_in_use_is_evicted_and_a_prompt_that_does_not_fit_waits():
    manager = BlockManager(6, BS)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64)
    serve(scheduler, seq(9, 500))  # a free cached prefix
    running = seq(9)
    scheduler.add(running)
    step(scheduler)
    cached_before = dict(manager.hash_to_block_id)
    late = seq(9, 100)
    scheduler.add(late)
    step(scheduler)  # evicts the free cached prefix, never the running prompt
    assert late.status == SequenceStatus.RUNNING and not set(late.block_table) & set(running.block_table)
    blocked = seq(9, 200)
    scheduler.add(blocked)
    step(scheduler)
    assert list(scheduler.waiting) == [blocked]  # no free block left: it waits
    for h in (running.block_hashes[0], running.block_hashes[1]):
        assert manager.hash_to_block_id[h] == cached_before[h]
    check_invariants(manager, [running, late])


def test_a_preempted_sequence_comes_back_through_its_own_cached_blocks():
    manager = BlockManager(4, BS)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = seq(7), seq(7, 100)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)
    step(scheduler)  # both decode: token 8 fills each second block, which becomes cached
    step(scheduler)  # a third block each is needed: b is preempted
    assert b.status == SequenceStatus.WAITING and scheduler.num_preemptions == 1
    queries = manager.cache_queries
    scheduler.finish(a, "stop")
    batch = step(scheduler)
    # of its 9 tokens, its first block was still cached; its second (the tail, freed first) went to a
    assert batch.prefills == [b] and b.num_scheduled_tokens == 9 - 4
    assert b.num_prompt_cached_tokens == 0  # usage reports the first prefill
    assert manager.cache_queries == queries  # and so do the counters
    scheduler.finish(b, "stop")
    assert manager.num_free_blocks == manager.num_total_blocks


def test_disabled_prefix_caching_never_hits():
    scheduler = Scheduler(BlockManager(16, BS, enable_prefix_caching=False), max_num_seqs=4, max_num_batched_tokens=64)
    assert [serve(scheduler, seq(13)) for _ in range(3)] == [0, 0, 0]
    assert not scheduler.block_manager.hash_to_block_id


def test_random_traffic_keeps_counts_and_cache_consistent():
    rng = random.Random(0)
    manager = BlockManager(16, BS)
    scheduler = Scheduler(manager, max_num_seqs=6, max_num_batched_tokens=24)
    prefixes = [list(range(k, k + 8)) for k in (0, 100, 200)]
    for _ in range(300):
        if rng.random() < 0.4:
            prompt = rng.choice(prefixes) + [rng.randrange(1000, 1010) for _ in range(rng.randrange(1, 12))]
            scheduler.add(Sequence(prompt, SamplingParams(), BS))
        step(scheduler, token=rng.randrange(5))
        live = list(scheduler.running)
        check_invariants(manager, live)
        for s in live:
            if rng.random() < 0.05 or len(s) > 40:
                scheduler.finish(s, rng.choice(["stop", "abort"]))
        if scheduler.waiting and rng.random() < 0.05:
            scheduler.finish(scheduler.waiting[-1], "abort")
    for s in list(scheduler.running) + list(scheduler.waiting):
        scheduler.finish(s, "abort")
    assert manager.num_free_blocks == manager.num_total_blocks
    assert scheduler.num_preemptions > 0 and manager.cache_hits > 0


def test_a_failed_step_leaves_none_of_its_blocks_findable():
    manager = BlockManager(16, BS)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=8)
    first = seq(17)
    scheduler.add(first)
    step(scheduler)  # tokens 0-7 computed: blocks 0-1
    batch = scheduler.schedule()  # tokens 8-15 scheduled (blocks 2-3 published), then the model raises
    for s in batch.seqs:
        manager.forget_uncomputed(s)
        scheduler.finish(s, "abort")
    assert manager.num_free_blocks == manager.num_total_blocks
    assert serve(scheduler, seq(17)) == 8  # blocks 0-1 only
