"""The block manager's prefix-cache changes as numbered batches for SubscribeKvEvents.

The block manager calls stored() / removed() on the engine thread; events cross to the event
loop with one call_soon_threadsafe per batch (the first event of a batch schedules the flush,
the rest join it). On the loop each batch gets the next sequence number and goes to every
subscriber. The feed keeps a mirror of what is stored, so that a subscriber that arrives late
(a router replica started later, a reconnect) first gets "cleared" and a snapshot of the cache:
what it holds is then exact, whatever it missed.

The feed is attached to the block manager at the first subscription: until then the engine
does no work for it. Blocks cached before that are not in the mirror.
"""

import asyncio
import threading
import time
from dataclasses import dataclass

from xserv_engine.errors import EngineUnavailable

MAX_QUEUED_BATCHES = 10_000  # per subscriber; one that falls this far behind is cut off


@dataclass(frozen=True)
class KvBatch:
    sequence_number: int
    timestamp: float
    first_event_id: int
    # ("stored", hash, parent_hash, token_ids, images) | ("removed", hash) | ("cleared",); images as
    # CacheEvents.stored has them
    events: tuple


class SubscriberTooSlow(EngineUnavailable):
    """A subscriber's queue overflowed: its view of the cache is no longer exact. UNAVAILABLE:
    the router resubscribes and gets a fresh snapshot."""


class KvEventFeed:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple] = []
        self._sequence = 0
        self._event_id = 0
        self._stored: dict[int, tuple] = {}  # hash -> (parent, token ids, images), in store order
        self._subscribers: set[_Subscriber] = set()

    # ---- engine thread (the block manager's CacheEvents) ----

    def stored(self, block_hash: int, parent_hash: int, token_ids: list[int],
               images: tuple[tuple[str, int], ...] = ()) -> None:
        self._add(("stored", block_hash, parent_hash, tuple(token_ids), images))

    def removed(self, block_hash: int) -> None:
        self._add(("removed", block_hash))

    def _add(self, event: tuple) -> None:
        with self._lock:
            self._pending.append(event)
            if len(self._pending) > 1:
                return  # a flush is already on its way
        try:
            self._loop.call_soon_threadsafe(self._flush)
        except RuntimeError:
            pass  # the loop is closed: the server is gone

    # ---- event loop ----

    def _flush(self) -> None:
        with self._lock:
            events, self._pending = self._pending, []
        for event in events:
            if event[0] == "stored":
                self._stored[event[1]] = event[2:]
            else:
                self._stored.pop(event[1], None)
        batch = self._next_batch(tuple(events))
        for subscriber in list(self._subscribers):
            try:
                subscriber.queue.put_nowait(batch)
            except asyncio.QueueFull:
                self._subscribers.discard(subscriber)
                subscriber.overflowed = True  # it ends once it has read what it has

    def _next_batch(self, events: tuple) -> KvBatch:
        self._sequence += 1
        batch = KvBatch(self._sequence, time.time(), self._event_id + 1, events)
        self._event_id += len(events)
        return batch

    def snapshot(self) -> KvBatch:
        """"cleared", then every stored block in store order (a parent before its children)."""
        events = (("cleared",),) + tuple(("stored", h, *rest) for h, rest in self._stored.items())
        return KvBatch(self._sequence, time.time(), 0, events)

    async def subscribe(self):
        """The snapshot, then each batch as it is flushed; SubscriberTooSlow if it falls behind."""
        subscriber = _Subscriber(asyncio.Queue(MAX_QUEUED_BATCHES))
        self._subscribers.add(subscriber)
        try:
            yield self.snapshot()
            while True:
                if subscriber.overflowed and subscriber.queue.empty():
                    raise SubscriberTooSlow(f"more than {MAX_QUEUED_BATCHES} KV event batches behind")
                yield await subscriber.queue.get()
        finally:
            self._subscribers.discard(subscriber)


@dataclass(eq=False)
class _Subscriber:
    queue: asyncio.Queue
    overflowed: bool = False
