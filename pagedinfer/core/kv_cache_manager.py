"""Per-request KV block bookkeeping on top of `BlockPool`, with prefix caching.

The scheduler talks only to this class: `get_computed_blocks` when it admits a request
(the longest cached prefix), `allocate_slots` before it schedules tokens and `free` when a
request finishes or is preempted. A request's blocks form its block table; token at
position p lives in slot `block_ids[p // block_size] * block_size + p % block_size`.

Invariants:
- a request holds exactly `cdiv(num_tokens_with_KV, block_size)` blocks after allocation;
- a failed allocation (`None`) changes no state;
- a cache hit covers whole blocks only, stops at the first miss, and never covers the last
  known token (its logits must be computed), so at most `num_tokens - 1` tokens;
- a block is cached (hash -> block) once it is full of tokens that are known: scheduled
  tokens up to `request.num_tokens`, never speculative ones;
- `free` returns blocks tail first, so the LRU free queue evicts a request's last blocks
  first, and freed blocks stay hittable until handed out again (lazy eviction).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedinfer.core.block_pool import BlockPool, KVCacheBlock
from pagedinfer.core.request import Request

__all__ = ["KVCacheManager", "PrefixCacheStats"]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the last `make_prefix_cache_stats()`, in tokens."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    reset: bool = False


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = False,
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Number of leading blocks of each request already in the hash map.
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Blocks of the longest cached prefix of `request` and its length in tokens."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [], 0
        # Never the last token: it must run through the model to produce logits.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break  # the chain: nothing after a miss can match
            hit.append(block)
        num_hit_tokens = len(hit) * self.block_size
        stats = self.prefix_cache_stats
        stats.requests += 1
        stats.queries += request.num_tokens
        stats.hits += num_hit_tokens
        return hit, num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens of `request`.

        Layout of the request:
            | computed | new_computed (prefix hit) | external | new | lookahead |.
        External tokens are those a KV connector loads (fresh blocks, filled by the
        worker). Returns the newly allocated blocks, or None (and changes nothing) when the
        pool does not have enough free blocks. Hit blocks that sit in the free queue count
        against the free blocks: touching them takes them out of it. `delay_cache_blocks`:
        do not enter the blocks in the prefix cache yet (their KV is still being loaded, or
        may turn out invalid); a later `cache_blocks` does.
        """
        if num_new_tokens <= 0 and num_external_computed_tokens <= 0:
            raise ValueError("num_new_tokens must be greater than 0")
        new_computed_blocks = new_computed_blocks or []
        num_computed = min(
            request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens,
            self.max_model_len,
        )
        num_needed = min(num_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        held = self.req_to_blocks.get(request.request_id, [])
        num_to_allocate = cdiv(num_needed, self.block_size) - len(held) - len(new_computed_blocks)
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(num_to_allocate, 0) + num_free_hits > self.block_pool.get_num_free_blocks():
            return None

        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if new_computed_blocks:
            assert not held, "a request gets prefix hits only before its first allocation"
            self.block_pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            self.num_cached_block[request.request_id] = len(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_to_allocate) if num_to_allocate > 0 else []
        blocks.extend(new_blocks)
        if self.enable_caching and not delay_cache_blocks:
            # Tokens scheduled now count as computed for caching (vLLM does the same): a
            # later request in this very step reads them after this step's KV writes.
            self.cache_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Insert the request's newly full blocks (up to `num_computed_tokens`) in the map."""
        req_id = request.request_id
        num_cached = self.num_cached_block.get(req_id, 0)
        num_full = min(num_computed_tokens // self.block_size, len(request.block_hashes))
        if num_full <= num_cached:
            return
        blocks = self.req_to_blocks[req_id]
        for i in range(num_cached, num_full):
            block = blocks[i]
            if block.block_hash is None:
                self.block_pool.cache_block(block, request.block_hashes[i])
            else:
                assert block.block_hash == request.block_hashes[i], (block, i)
        self.num_cached_block[req_id] = num_full

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; False (nothing done) while any block is in use."""
        if not self.block_pool.reset_prefix_cache():
            return False
        self.prefix_cache_stats.reset = True
        return True

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The stats since the last call (and start new ones); None without caching."""
        if not self.enable_caching:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()
