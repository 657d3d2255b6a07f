"""Physical KV-cache blocks: the block objects, the LRU free queue and the pool.

Invariants (checked by `BlockPool.check_integrity()` and the property tests):
- every block is either in the free queue (ref_cnt == 0) or referenced (ref_cnt > 0);
- ref counts never go below zero;
- the free queue is ordered least-recently-freed first: `get_new_blocks` takes from the
  front, `free_blocks` appends at the back, so a request's blocks (freed tail first) are
  evicted tail first; with caching on, freed blocks without a hash (nothing to hit) go to
  the front instead, to be reused before any cached block (as vLLM's newer pools do);
- a free block may still carry a hash and stay hittable by the prefix cache until it is
  handed out again (lazy eviction); only then is its hash dropped.

Called by `KVCacheManager` only; pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedinfer.core.trace import StepTracer

__all__ = ["KVCacheBlock", "FreeKVCacheBlockQueue", "BlockPool"]


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    """Set once the block is full and cached; cleared when the block is evicted."""
    # Intrusive links owned by FreeKVCacheBlockQueue (O(1) removal from the middle).
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks threaded through the blocks themselves.

    A deque cannot remove a block from the middle in O(1), which a prefix-cache hit on a
    free block needs; separate node objects would cost an allocation per operation.
    Sentinel head and tail blocks (id -1) remove every edge case from the link updates.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("No free blocks available.")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"Asked for {n} blocks but only {self.num_free_blocks} are free.")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue.")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        first = self._head.next_free_block
        assert first is not None
        self._head.next_free_block = block
        block.prev_free_block = self._head
        block.next_free_block = first
        first.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        out = []
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            out.append(block)
            block = block.next_free_block
        return out


class BlockPool:
    """Owns all `num_blocks` blocks, their ref counts and the hash -> block map."""

    def __init__(self, num_blocks: int, enable_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"A block pool needs at least one block, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # Block hash -> {block_id: block}. Equal blocks are not de-duplicated, so block
        # tables stay append-only and ids already handed to a worker never change.
        self.cached_block_hash_to_block: dict[bytes, dict[int, KVCacheBlock]] = {}
        # Optional observer of block events (core/trace.py's StepTracer).
        self.tracer: StepTracer | None = None

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the front (least recently used) of the free queue."""
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            assert block.ref_cnt == 0, block
            if self.enable_caching:
                self._maybe_evict_cached_block(block)
            block.ref_cnt = 1
        return blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        cached = self.cached_block_hash_to_block.get(block_hash)
        if not cached:
            return None
        return next(iter(cached.values()))

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        assert block.block_hash is None, f"{block} is already cached"
        block.block_hash = block_hash
        self.cached_block_hash_to_block.setdefault(block_hash, {})[block.block_id] = block
        if self.tracer is not None:
            self.tracer.note_block_stored(block.block_id)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on (possibly free) cached blocks hit by a new request."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero go to the back of the
        free queue in the given order (callers pass a request's blocks tail first), or,
        with caching on and no hash to keep, to the front."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"Double free of {block}.")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if self.tracer is not None:
                    self.tracer.note_block_freed(block.block_id)
                if self.enable_caching and block.block_hash is None:
                    self.free_block_queue.appendleft(block)
                else:
                    self.free_block_queue.append(block)

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        block_hash = block.block_hash
        if block_hash is None:
            return False
        cached = self.cached_block_hash_to_block.get(block_hash)
        if cached is not None:
            cached.pop(block.block_id, None)
            if not cached:
                del self.cached_block_hash_to_block[block_hash]
        block.block_hash = None
        if self.tracer is not None:
            self.tracer.note_block_evicted(block.block_id)
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        self.cached_block_hash_to_block = {}
        for block in self.blocks:
            block.block_hash = None
        return True

    def check_integrity(self) -> None:
        """Assert the pool's invariants (used by tests; O(num_blocks))."""
        free = self.free_block_queue.get_all_free_blocks()
        assert len(free) == self.free_block_queue.num_free_blocks
        free_ids = {b.block_id for b in free}
        assert len(free_ids) == len(free), "a block is in the free queue twice"
        for block in self.blocks:
            assert block.ref_cnt >= 0, block
            assert (block.ref_cnt == 0) == (block.block_id in free_ids), block
        for block_hash, cached in self.cached_block_hash_to_block.items():
            for block in cached.values():
                assert block.block_hash == block_hash, block
