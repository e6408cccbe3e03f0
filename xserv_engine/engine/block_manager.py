"""KV-cache blocks: allocation, refcounts and prefix caching by chained block hash.

A full block's hash covers its tokens and the hash of the block before it, so equal hashes
mean equal prefixes (token ids are compared too, so a hash collision is only a miss). Freed
blocks keep their hash and contents until they are reused: a later request with the same
prefix revives them.
"""

from collections import deque

from xserv_engine.engine.sequence import Sequence


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


def block_hash(token_ids: list[int], prefix: int = -1) -> int:
    return hash((prefix, tuple(token_ids)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()
        self.cache_queries = 0  # full prompt blocks looked up
        self.cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_total_blocks(self) -> int:
        return len(self.blocks)

    def _allocate_block(self, block_id: int) -> Block:
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.reset()
        self.free_block_ids.remove(block_id)
        self.used_block_ids.add(block_id)
        return block

    def _deallocate_block(self, block_id: int) -> None:
        assert self.blocks[block_id].ref_count == 0
        self.used_block_ids.remove(block_id)
        self.free_block_ids.append(block_id)

    def can_allocate(self, seq: Sequence) -> bool:
        return len(self.free_block_ids) >= seq.num_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` blocks for all its tokens, reusing cached full blocks of its prefix. The last
        token is never served from the cache: the step needs at least one token to compute
        logits. The other full blocks become shareable as they are computed (share_computed)."""
        assert not seq.block_table
        h, cache_miss = -1, False
        cacheable_tokens = len(seq) - 1
        for i in range(seq.num_blocks):
            token_ids = seq.block(i)
            full = len(token_ids) == self.block_size
            h = block_hash(token_ids, h) if full and self.enable_prefix_caching else -1
            block_id = self.hash_to_block_id.get(h, -1)
            if full and (i + 1) * self.block_size <= cacheable_tokens and h != -1:
                self.cache_queries += 1
            if block_id == -1 or self.blocks[block_id].token_ids != token_ids or (i + 1) * self.block_size > cacheable_tokens:
                cache_miss = True
            if cache_miss:
                block = self._allocate_block(self.free_block_ids[0])
            else:
                seq.num_cached_tokens += self.block_size
                seq.num_shared_blocks += 1
                self.cache_hits += 1
                if block_id in self.used_block_ids:
                    block = self.blocks[block_id]
                    block.ref_count += 1
                else:
                    block = self._allocate_block(block_id)
                block.update(h, token_ids)
            seq.block_hashes.append(h)
            seq.block_table.append(block.block_id)

    def share_computed(self, seq: Sequence, num_tokens: int) -> None:
        """Publish the hashes of the full blocks below `num_tokens`, called when the step that
        computes them is scheduled: a later prompt may then reuse them (in the same step too,
        since every layer writes the step's keys and values before it attends), and never a
        block whose prefill chunk has not run yet."""
        end = min(num_tokens // self.block_size, len(seq.block_hashes))
        for i in range(seq.num_shared_blocks, end):
            h = seq.block_hashes[i]
            if h == -1:
                break
            block = self.blocks[seq.block_table[i]]
            block.update(h, seq.block(i))
            self.hash_to_block_id[h] = block.block_id
        seq.num_shared_blocks = max(seq.num_shared_blocks, end)

    def deallocate(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._deallocate_block(block_id)
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
            block = self._allocate_block(self.free_block_ids[0])
            seq.block_table.append(block.block_id)

    def register_full_block(self, seq: Sequence) -> None:
        """Called after a decode step: if the last block just filled, make it shareable."""
        if not self.enable_prefix_caching or seq.last_block_num_tokens != self.block_size:
            return
        i = seq.num_blocks - 1
        if i >= len(seq.block_table):
            return
        prefix = self.blocks[seq.block_table[i - 1]].hash if i > 0 else -1
        if i > 0 and prefix == -1:
            return
        token_ids = seq.block(i)
        h = block_hash(token_ids, prefix)
        block = self.blocks[seq.block_table[i]]
        block.update(h, token_ids)
        self.hash_to_block_id[h] = block.block_id
