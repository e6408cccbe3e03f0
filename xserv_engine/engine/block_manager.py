"""KV-cache blocks: allocation, refcounts and prefix caching by chained block hash.

A full block's hash covers its tokens and the hash of the block before it, so equal hashes
mean equal prefixes (token ids are compared too, so a hash collision is only a miss).

Free blocks wait in an eviction queue, least recently used first (as vLLM's free-block queue).
A freed block keeps its hash and contents: a later request with the same prefix finds it and
revives it. A block loses its hash only when it is evicted to hold new contents. Blocks freed
without a findable hash go to the front of the queue: evicting them loses nothing.

`events`, when set, hears of every hash that becomes findable (stored: hash, parent hash, token
ids) and every one that stops being findable (removed), on the engine thread: what a router
needs to know which prefixes this engine holds. It is None unless someone subscribed.

Hybrid models (Qwen3.5, Qwen3-Next) also keep, per running sequence, the states of their linear-
attention layers in a pool of num_state_slots slots: a sequence is allocated a slot with its
blocks and frees it with them, so the scheduler still asks one question (can_allocate).

Their prefix cache needs more than KV: a hit must also restore the linear-attention states at its
end, which no KV block can rebuild. A prompt chunk therefore leaves a snapshot of its states at
the end of every `snapshot_interval`-th full block it computes and at its prompt's last full
block, in one of `snapshot_slots` (slots of the same pool, beside the running sequences'). A
snapshot belongs to its block: it goes when the block is evicted for new contents, or when the
pool needs its slot (least recently used first, a chunk's inner ones, before its furthest, before
any other; one not yet written is never taken). A block that
decoding fills leaves one too: the step that filled it left the states exactly at its end, and
they are copied at once (copy_states). A lookup's
hit ends at the last hit block that has a written snapshot, and the sequence's states start as a
copy of it (seq.restore_slot). A snapshot is written by the step that computes its block, so it is
findable only after that step (snapshots_written).
"""

from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from xserv_engine.engine.sequence import Sequence

NO_DRAFT_LIMIT = 1 << 30

class CacheEvents(Protocol):
    def stored(self, block_hash: int, parent_hash: int, token_ids: list[int],
               images: tuple[tuple[str, int], ...] = ()) -> None:
        """images: (key, offset of its first token from the block's start) of each image with a
        token in the block, what went into the hash beside the token ids (vLLM's extra_keys)."""

    def removed(self, block_hash: int) -> None: ...


class Block:
    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids: list[int] = []

    def update(self, h: int, token_ids: list[int]) -> None:
        self.hash = h
        self.token_ids = token_ids

    def reset(self) -> None:
        self.ref_count = 1
        self.hash = -1
        self.token_ids = []


def block_hash(token_ids: list[int], prefix: int = -1, images: tuple[str, ...] = ()) -> int:
    """images: the sha256 of each image with a token in the block (all image tokens share one id)."""
    return hash((prefix, tuple(token_ids), images)) if images else hash((prefix, tuple(token_ids)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_state_slots: int = 0, snapshot_slots: range = range(0), snapshot_interval: int = 1):
        self.block_size = block_size
        self.num_state_slots = num_state_slots
        self.free_state_slots = list(range(num_state_slots - 1, -1, -1))  # popped from the end: 0 first
        self.snapshot_interval = snapshot_interval  # in blocks
        self.free_snapshot_slots = list(reversed(snapshot_slots))
        self.snapshot_of: dict[int, int] = {}  # block id -> the slot of the states at its end
        self.snapshot_lru: OrderedDict[int, None] = OrderedDict()  # their block ids, least recently used first
        # the snapshots a chunk left before its furthest, never hit since: the first to go, and the
        # only ones a chunk's own inner snapshots may push out (another chat's furthest, the one its
        # next turn resumes from, stays)
        self.inner_snapshots: set[int] = set()
        self.unwritten: set[int] = set()  # block ids whose snapshot the scheduled step is still to write
        # (source slot, snapshot slot) -> None: copies a running sequence's states (the runner's),
        # for the snapshots decoding leaves; None without a snapshot pool
        self.copy_states: Callable[[int, int], None] | None = None
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # eviction order
        self.used_block_ids: set[int] = set()
        # full prompt blocks looked up and found at each sequence's first allocation (what its
        # usage reports); the lookups of a preempted sequence coming back are not counted
        self.cache_queries = 0
        self.cache_hits = 0
        self.events: CacheEvents | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_total_blocks(self) -> int:
        return len(self.blocks)

    def _is_cached(self, block_id: int) -> bool:
        return self.hash_to_block_id.get(self.blocks[block_id].hash) == block_id

    def _evict(self) -> Block:
        """Take the least recently used free block for new contents; its old hash is forgotten."""
        block_id, _ = self.free_block_ids.popitem(last=False)
        if self._is_cached(block_id):
            del self.hash_to_block_id[self.blocks[block_id].hash]
            if self.events is not None:
                self.events.removed(self.blocks[block_id].hash)
        self._drop_snapshot(block_id)
        block = self.blocks[block_id]
        block.reset()
        self.used_block_ids.add(block_id)
        return block

    def _drop_snapshot(self, block_id: int) -> None:
        slot = self.snapshot_of.pop(block_id, None)
        if slot is not None:
            del self.snapshot_lru[block_id]
            self.unwritten.discard(block_id)
            self.inner_snapshots.discard(block_id)
            self.free_snapshot_slots.append(slot)

    def _take_snapshot(self, block_id: int, inner: bool = False) -> int:
        """A slot for the states at the end of block_id: a free one, else the least recently used
        written inner snapshot's, else (not for an inner one) the least recently used written
        snapshot's; -1 when there is none to take."""
        if not self.free_snapshot_slots:
            victim = next((b for b in self.snapshot_lru if b in self.inner_snapshots and b not in self.unwritten), -1)
            if victim == -1 and not inner:
                victim = next((b for b in self.snapshot_lru if b not in self.unwritten), -1)
            if victim == -1:
                return -1
            self._drop_snapshot(victim)
        slot = self.free_snapshot_slots.pop()
        self.snapshot_of[block_id] = slot
        self.snapshot_lru[block_id] = None
        self.unwritten.add(block_id)
        if inner:
            self.inner_snapshots.add(block_id)
        return slot

    def _restorable(self, block_id: int) -> bool:
        return block_id in self.snapshot_of and block_id not in self.unwritten

    def _take(self, block_id: int) -> None:
        """One more user of a cached block: revived from the free queue if nobody held it."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_block_ids[block_id]
            self.used_block_ids.add(block_id)
        block.ref_count += 1

    def _free(self, block_id: int) -> None:
        assert self.blocks[block_id].ref_count == 0
        self.used_block_ids.remove(block_id)
        self.free_block_ids[block_id] = None
        if not self._is_cached(block_id):
            self.free_block_ids.move_to_end(block_id, last=False)

    def _publish(self, block: Block, h: int, parent: int, token_ids: list[int],
                 images: tuple[tuple[str, int], ...] = ()) -> None:
        """Make `block` the one a lookup of `h` finds; a free block it replaces is evicted first."""
        if self.events is not None and h not in self.hash_to_block_id:
            self.events.stored(h, parent, token_ids, images)
        old = self.hash_to_block_id.get(h, block.block_id)
        if old != block.block_id and old in self.free_block_ids:
            self.free_block_ids.move_to_end(old, last=False)
        block.update(h, token_ids)
        self.hash_to_block_id[h] = block.block_id

    def _lookup(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """(the hash of each of seq's blocks, -1 where none; the ids of its longest cached prefix).
        The last token is never served from the cache: the step needs at least one token to
        compute logits, so a block is a hit only if it ends before the last token; and none while
        the prompt's logprobs are still to come (they come from computing it)."""
        hashes: list[int] = []
        hits: list[int] = []
        h = seq.hash_root
        cacheable = not seq.needs_prompt_logprobs
        for i in range(seq.num_blocks):
            token_ids = seq.block(i)
            full = len(token_ids) == self.block_size
            images = seq.images.hashes_in(i * self.block_size, (i + 1) * self.block_size) if seq.images else ()
            h = block_hash(token_ids, h, images) if full and self.enable_prefix_caching else -1
            hashes.append(h)
            if len(hits) == i and h != -1 and (i + 1) * self.block_size < len(seq) and cacheable:
                block_id = self.hash_to_block_id.get(h, -1)
                if block_id != -1 and self.blocks[block_id].token_ids == token_ids:
                    hits.append(block_id)
        if self.num_state_slots:  # a hybrid model resumes only where it has the states
            while hits and not self._restorable(hits[-1]):
                hits.pop()
        return hashes, hits

    def can_allocate(self, seq: Sequence) -> bool:
        """Free blocks for every block of seq that is not a hit on a block in use (a hit on a
        free cached block takes that block out of the free queue)."""
        if self.num_state_slots and not self.free_state_slots:
            return False
        _, hits = self._lookup(seq)
        shared = sum(1 for block_id in hits if self.blocks[block_id].ref_count > 0)
        return len(self.free_block_ids) >= seq.num_blocks - shared

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` blocks for all its tokens, reusing the cached full blocks of its prefix. The
        other full blocks become shareable as they are computed (share_computed)."""
        assert not seq.block_table
        hashes, hits = self._lookup(seq)
        for block_id in hits:  # before any eviction: a hit must not be evicted for a miss
            self._take(block_id)
        if seq.num_prompt_cached_tokens is None and self.enable_prefix_caching:
            self.cache_queries += (len(seq) - 1) // self.block_size
            self.cache_hits += len(hits)
        misses = [self._evict().block_id for _ in range(seq.num_blocks - len(hits))]
        seq.block_hashes.extend(hashes)
        seq.block_table.extend(hits + misses)
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_shared_blocks = len(hits)
        if self.num_state_slots:
            seq.state_slot = self.free_state_slots.pop()
            if hits:
                seq.restore_slot = self.snapshot_of[hits[-1]]
                self.snapshot_lru.move_to_end(hits[-1])
                self.inner_snapshots.discard(hits[-1])  # a shared prefix's: worth a furthest's keep

    def share_computed(self, seq: Sequence, num_tokens: int) -> None:
        """Publish the hashes of the full blocks below `num_tokens`, called when the step that
        computes them is scheduled: a later prompt may then reuse them (in the same step too,
        since every layer writes the step's keys and values before it attends; a hybrid model's
        after the step, when its snapshots are written), and never a block whose prefill chunk
        has not run yet."""
        end = min(num_tokens // self.block_size, len(seq.block_hashes))
        published: list[int] = []
        for i in range(seq.num_shared_blocks, end):
            h = seq.block_hashes[i]
            if h == -1:
                break
            parent = seq.block_hashes[i - 1] if i > 0 else seq.hash_root
            start = i * self.block_size
            images = seq.images.offsets_in(start, start + self.block_size) if seq.images else ()
            self._publish(self.blocks[seq.block_table[i]], h, parent, seq.block(i), images)
            if self.free_snapshot_slots or self.snapshot_lru:
                published.append(i)
        seq.num_shared_blocks = max(seq.num_shared_blocks, end)
        self._snapshot(seq, published)

    def _snapshot(self, seq: Sequence, published: list[int]) -> None:
        """Which of the blocks the step computes leave the states at their end, and where: every
        snapshot_interval-th and the prompt's last full block; the last ones first when the pool is
        short (the furthest a later prompt can resume). The ones before the furthest are inner:
        they take free slots and other inner ones', never another prompt's furthest."""
        last = seq.num_prompt_tokens // self.block_size
        for i in reversed(published):
            if (i + 1) % self.snapshot_interval == 0 or i + 1 == last:
                block_id = seq.block_table[i]
                self._drop_snapshot(block_id)
                slot = self._take_snapshot(block_id, inner=bool(seq.snapshots))
                if slot < 0:
                    break
                seq.snapshots.insert(0, ((i + 1) * self.block_size, slot, block_id))
        for _, _, block_id in seq.snapshots:  # the furthest is the most recently used
            self.snapshot_lru.move_to_end(block_id)

    def snapshots_written(self, seq: Sequence) -> None:
        """After the step that ran seq's prompt chunk: its snapshots can be hit, its states were restored."""
        for _, _, block_id in seq.snapshots:
            self.unwritten.discard(block_id)
        seq.snapshots.clear()
        seq.restore_slot = -1

    def forget_uncomputed(self, seq: Sequence) -> None:
        """After a step that failed: the blocks it was to fill (published when it was scheduled)
        hold no valid KV, so no later lookup may find them. The blocks below num_cached_tokens
        were computed by earlier steps and stay cached."""
        first = seq.num_cached_tokens // self.block_size
        for block_id in seq.block_table[first:]:
            if self._is_cached(block_id):
                del self.hash_to_block_id[self.blocks[block_id].hash]
            self.blocks[block_id].update(-1, [])
            self._drop_snapshot(block_id)
        seq.snapshots.clear()
        seq.num_shared_blocks = min(seq.num_shared_blocks, first)

    def deallocate(self, seq: Sequence) -> None:
        """Release seq's blocks, its last block first: a prefix's tail is evicted before its head."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free(block_id)
        if seq.state_slot >= 0:
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = -1
        for _, _, block_id in seq.snapshots:  # scheduled, never run (a preemption): never written
            if block_id in self.unwritten:
                self._drop_snapshot(block_id)
        seq.snapshots.clear()
        seq.restore_slot = -1
        seq.num_cached_tokens = 0
        seq.num_shared_blocks = 0
        seq.block_hashes.clear()
        seq.block_table.clear()

    def can_append(self, seq: Sequence) -> bool:
        """Room for the KV of the token the next decode step feeds (the sequence's last token)."""
        return len(self.free_block_ids) >= (len(seq.block_table) < seq.num_blocks)

    def may_append(self, seq: Sequence) -> None:
        """Called before a decode step: the last token's KV needs a slot."""
        if len(seq.block_table) < seq.num_blocks:  # the last token starts a new block
            seq.block_table.append(self._evict().block_id)

    def reserve_drafts(self, seq: Sequence, num_drafts: int) -> int:
        """Blocks for the KV of a decode's drafts (positions len(seq) on), from free blocks only:
        how many of them have a slot. Blocks past the tokens it keeps stay in its table for the
        next ones."""
        bs = self.block_size
        for n in range(num_drafts, 0, -1):
            needed = -(-(len(seq) + n) // bs) - len(seq.block_table)
            if needed <= len(self.free_block_ids):
                for _ in range(needed):
                    seq.block_table.append(self._evict().block_id)
                return n
        return 0

    def drafts_to_snapshot(self, seq: Sequence) -> int:
        """How many drafts a hybrid's decode may have verified so that, if they all stand, its
        states end at its next snapshot's block end, not past it: a verification keeps the
        states after its last row only. 0 at that end itself (a plain step leaves the snapshot
        there); no limit without snapshots of decoded blocks."""
        if self.copy_states is None:
            return NO_DRAFT_LIMIT
        return -len(seq) % (self.block_size * self.snapshot_interval)

    def register_full_block(self, seq: Sequence, states_here: bool = True) -> None:
        """Called after a decode step, before each of its tokens is appended: if the last block
        just filled, make it shareable, and with states_here (seq's states are those at its end)
        leave a snapshot of them."""
        if not self.enable_prefix_caching or seq.last_block_num_tokens != self.block_size:
            return
        i = seq.num_blocks - 1
        if i >= len(seq.block_table):
            return
        prefix = self.blocks[seq.block_table[i - 1]].hash if i > 0 else seq.hash_root
        if i > 0 and prefix == -1:
            return
        token_ids = seq.block(i)
        block_id = seq.block_table[i]
        self._publish(self.blocks[block_id], block_hash(token_ids, prefix), prefix, token_ids)
        if self.copy_states is not None and states_here and (i + 1) % self.snapshot_interval == 0:
            # the step just run left seq's states exactly at the block's end: keep a copy now
            self._drop_snapshot(block_id)
            slot = self._take_snapshot(block_id)
            if slot >= 0:
                self.copy_states(seq.state_slot, slot)
                self.unwritten.discard(block_id)
