"""Per-request KV block bookkeeping on top of `BlockPool`.

The scheduler talks only to this class: `allocate_slots` before it schedules tokens and
`free` when a request finishes or is preempted. A request's blocks form its block table;
token at position p lives in slot `block_ids[p // block_size] * block_size + p % block_size`.

Invariants:
- a request holds exactly `cdiv(num_tokens_with_KV, block_size)` blocks after allocation;
- a failed allocation (`None`) changes no state;
- `free` returns blocks tail first, so the LRU free queue evicts a request's last blocks
  first when prefix caching keeps freed blocks hittable.

Prefix caching (hash lookup in `get_computed_blocks`) plugs in here; without it every
request starts with zero computed tokens.
"""

from __future__ import annotations

from pagedinfer.core.block_pool import BlockPool, KVCacheBlock
from pagedinfer.core.request import Request

__all__ = ["KVCacheManager"]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


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

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Blocks of the longest cached prefix of `request` and its length in tokens."""
        return [], 0

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens of `request`.

        Layout of the request: | computed | new_computed (prefix hit) | new | lookahead |.
        Returns the newly allocated blocks, or None (and changes nothing) when the pool
        does not have enough free blocks.
        """
        if num_new_tokens <= 0:
            raise ValueError("num_new_tokens must be greater than 0")
        new_computed_blocks = new_computed_blocks or []
        num_computed = min(
            request.num_computed_tokens + num_new_computed_tokens, self.max_model_len
        )
        num_needed = min(num_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        held = self.req_to_blocks.get(request.request_id, [])
        num_to_allocate = cdiv(num_needed, self.block_size) - len(held) - len(new_computed_blocks)
        # Hit blocks that are currently free leave the free pool when touched.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(num_to_allocate, 0) + num_free_hits > self.block_pool.get_num_free_blocks():
            return None

        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
        if num_to_allocate <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_to_allocate)
        blocks.extend(new_blocks)
        return new_blocks

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()
