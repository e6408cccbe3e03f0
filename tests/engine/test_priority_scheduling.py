"""The scheduler's priority policy on its own (vLLM's --scheduling-policy priority): admission by
(priority, arrival), the lowest-priority running sequence preempted first when blocks run out,
and running sequences of a lower priority preempted to admit a higher one."""

from xserv_engine.engine.block_manager import BlockManager
from xserv_engine.engine.scheduler import Scheduler
from xserv_engine.engine.sequence import Sequence, SequenceStatus
from xserv_engine.sampling_params import SamplingParams

from tests.engine.test_scheduler import BS, step


def seq(n: int, start: int = 0, priority: int = 0) -> Sequence:
    return Sequence(list(range(start, start + n)), SamplingParams(priority=priority), BS)


def by_priority(blocks: int = 64, max_num_seqs: int = 8, budget: int = 64, caching: bool = True) -> Scheduler:
    return Scheduler(BlockManager(blocks, BS, enable_prefix_caching=caching), max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=budget, policy="priority")


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    scheduler = by_priority(max_num_seqs=1)
    first, low, high, high_later, urgent = (seq(3, 0, 5), seq(3, 10, 9), seq(3, 20, 1), seq(3, 30, 1),
                                            seq(3, 40, -2))
    scheduler.add(first)
    step(scheduler)  # first runs; the others queue behind the one slot
    for s in (low, high, high_later, urgent):
        scheduler.add(s)
    assert list(scheduler.waiting) == [urgent, high, high_later, low]
    order = []
    while scheduler.waiting or scheduler.running:
        batch = step(scheduler)
        order += [s for s in batch.prefills if s is not first]
        for s in batch.sampled:  # the others end at their first token, first at its third
            if s is not first or s.num_completion_tokens == 3:
                scheduler.finish(s, "length")
    # urgent outranks first (5) and takes its slot at once; the rest in (priority, arrival) order
    assert order == [urgent, high, high_later, low]


def test_fcfs_admits_in_arrival_order_whatever_the_priority():
    scheduler = Scheduler(BlockManager(64, BS), max_num_seqs=1, max_num_batched_tokens=64)
    a, b = seq(3, 0, 5), seq(3, 10, -5)
    scheduler.add(a)
    scheduler.add(b)
    assert step(scheduler).prefills == [a] and list(scheduler.waiting) == [b]
    assert step(scheduler).decodes == [a]  # no preemption to admit b


def test_when_blocks_run_out_the_lowest_priority_running_sequence_is_preempted():
    scheduler = by_priority(blocks=6, caching=False)
    high, low, mid = seq(7, 0, 0), seq(7, 100, 3), seq(7, 200, 1)  # 2 blocks each: the cache is full
    for s in (high, low, mid):
        scheduler.add(s)
    step(scheduler)
    assert scheduler.block_manager.num_free_blocks == 0
    assert step(scheduler).decodes == [high, mid, low]  # admitted by priority; position 7 still fits
    batch = step(scheduler)  # position 8 needs a third block each: low gives its two, not the latest
    assert batch.decodes == [high, mid]
    assert low.status == SequenceStatus.WAITING and scheduler.num_preemptions == 1
    late_high = seq(3, 300, 0)
    scheduler.add(late_high)
    assert list(scheduler.waiting) == [late_high, low]  # waiting in priority order, preempted or not


def test_a_later_arrival_of_the_same_priority_is_preempted_before_an_earlier_one():
    scheduler = by_priority(blocks=4, caching=False)
    early, late = seq(7, 0, 2), seq(7, 100, 2)
    scheduler.add(early)
    scheduler.add(late)
    step(scheduler)
    step(scheduler)
    assert step(scheduler).decodes == [early] and late.status == SequenceStatus.WAITING


def test_a_higher_priority_request_preempts_a_lower_one_for_its_slot():
    scheduler = by_priority(max_num_seqs=2)
    batch_jobs = [seq(3, 10 * i, 10) for i in range(2)]
    for s in batch_jobs:
        scheduler.add(s)
    step(scheduler)
    interactive = seq(3, 100, 0)
    scheduler.add(interactive)
    batch = step(scheduler)
    assert batch.prefills == [interactive] and batch.decodes == [batch_jobs[0]]
    assert batch_jobs[1].status == SequenceStatus.WAITING and batch_jobs[1].block_table == []
    assert scheduler.num_preemptions == 1


def test_a_higher_priority_request_preempts_lower_ones_for_blocks_but_never_an_equal_one():
    scheduler = by_priority(blocks=5, caching=False)
    low, equal = seq(6, 0, 5), seq(6, 100, 0)  # 2 blocks each: one is left
    scheduler.add(low)
    scheduler.add(equal)
    step(scheduler)
    high = seq(5, 200, 0)
    scheduler.add(high)
    batch = step(scheduler)
    assert batch.prefills == [high] and batch.decodes == [equal]  # low gave its blocks, equal kept its
    assert low.status == SequenceStatus.WAITING
    another = seq(5, 300, 0)
    scheduler.add(another)
    batch = step(scheduler)
    assert another not in batch.prefills and another.status == SequenceStatus.WAITING
    assert list(scheduler.waiting) == [another, low]
