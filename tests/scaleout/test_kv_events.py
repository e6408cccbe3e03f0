"""KV events for SMG's cache-aware routing: the block manager reports exactly the hashes a lookup
can find (stored with parent and token ids, removed when evicted), and the feed turns them into
numbered batches with a snapshot for late subscribers."""

import asyncio
import random
import threading

from smg_grpc_proto.generated import common_pb2

from tests.engine.test_scheduler import BS, seq, step
from xserv_engine.engine.block_manager import BlockManager, block_hash
from xserv_engine.engine.scheduler import Scheduler
from xserv_engine.server.vllm_worker.convert import kv_batch_to_pb
from xserv_engine.server.vllm_worker.kv_events import KvEventFeed


class Recorder:
    def __init__(self):
        self.live: dict[int, tuple[int, tuple[int, ...]]] = {}
        self.log: list[tuple] = []

    def stored(self, h, parent, token_ids, images=()):
        assert h not in self.live, "stored twice without a removal"
        self.live[h] = (parent, tuple(token_ids))
        self.log.append(("stored", h, parent, tuple(token_ids)))

    def removed(self, h):
        del self.live[h]
        self.log.append(("removed", h))


def serve(scheduler, s, decode_steps=0):
    scheduler.add(s)
    for _ in range(1 + decode_steps):
        step(scheduler)
    scheduler.finish(s, "stop")


def test_a_prompt_is_announced_once_as_a_chain_of_blocks_with_their_tokens():
    manager = BlockManager(32, BS)
    manager.events = recorder = Recorder()
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64)
    serve(scheduler, seq(13))
    h0 = block_hash([0, 1, 2, 3])
    h1 = block_hash([4, 5, 6, 7], h0)
    h2 = block_hash([8, 9, 10, 11], h1)
    assert recorder.log == [("stored", h0, -1, (0, 1, 2, 3)), ("stored", h1, h0, (4, 5, 6, 7)),
                            ("stored", h2, h1, (8, 9, 10, 11))]
    serve(scheduler, seq(13))  # a repeat hits the cache: nothing new to announce
    assert len(recorder.log) == 3


def test_the_announced_hashes_are_always_exactly_the_findable_ones():
    """Random prompts sharing prefixes, with decode filling blocks, under KV pressure: after each
    request, stored minus removed is the block manager's hash table, and each block's parent
    and tokens are what its hash covers."""
    rng = random.Random(0)
    manager = BlockManager(24, BS)
    manager.events = recorder = Recorder()
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64)
    for _ in range(200):
        start = rng.choice([0, 0, 100, 200, 300])
        serve(scheduler, seq(rng.randint(2, 30), start), decode_steps=rng.randint(0, 6))
        assert set(recorder.live) == set(manager.hash_to_block_id)
    assert any(event[0] == "removed" for event in recorder.log)
    for h, (parent, token_ids) in recorder.live.items():
        assert block_hash(list(token_ids), parent) == h


def test_nothing_is_reported_while_nobody_listens():
    manager = BlockManager(8, BS)
    serve(Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64), seq(13))
    assert manager.events is None and len(manager.hash_to_block_id) == 3


def test_feed_batches_events_from_the_engine_thread_and_snapshots_for_late_subscribers():
    async def scenario():
        feed = KvEventFeed(asyncio.get_running_loop())
        first = feed.subscribe()
        snapshot = await anext(first)
        assert snapshot.events == (("cleared",),)

        def engine_thread():
            feed.stored(11, -1, [1, 2])
            feed.stored(12, 11, [3, 4])
            feed.stored(21, -1, [9, 9])

        thread = threading.Thread(target=engine_thread)
        thread.start()
        thread.join()
        batch = await asyncio.wait_for(anext(first), 5)
        assert batch.sequence_number == 1 and len(batch.events) == 3
        proto = kv_batch_to_pb(batch, block_size=2)
        runs = [e.stored for e in proto.events]
        assert [[b.block_hash for b in run.blocks] for run in runs] == [[11, 12], [21]]
        assert not runs[0].HasField("parent_block_hash") and list(runs[0].blocks[1].token_ids) == [3, 4]
        assert [e.event_id for e in proto.events] == [1, 3]

        await asyncio.to_thread(feed.removed, 12)
        assert (await asyncio.wait_for(anext(first), 5)).events == (("removed", 12),)
        late = feed.subscribe()
        late_snapshot = kv_batch_to_pb(await anext(late), block_size=2)
        assert late_snapshot.events[0].HasField("cleared")
        assert [b.block_hash for e in late_snapshot.events[1:] for b in e.stored.blocks] == [11, 21]
        await first.aclose()
        await late.aclose()

    asyncio.run(scenario())


def test_removed_and_cleared_convert_to_their_messages():
    from xserv_engine.server.vllm_worker.kv_events import KvBatch

    proto = kv_batch_to_pb(KvBatch(7, 1.5, 10, (("cleared",), ("removed", -5))), block_size=16)
    assert proto.sequence_number == 7 and proto.timestamp == 1.5
    assert proto.events[0].cleared == common_pb2.KvCacheCleared()
    assert list(proto.events[1].removed.block_hashes) == [-5] and proto.events[1].event_id == 11
