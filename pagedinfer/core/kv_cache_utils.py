"""Block hashing for prefix caching.

A full block's hash certifies the whole prefix up to its end: it chains the parent block's
hash, the block's token ids and optional extra keys (only `cache_salt` today, in the first
block only, which through the chain isolates every later block of that salt):

    hash(block i) = H((hash(block i-1) or ROOT, tuple(block i's token ids), extra keys))

Only full blocks are hashed. A `Request` keeps `block_hashes` for its full blocks, extended
as tokens are appended (`BlockHasher`), so the scheduler never rehashes a prefix.

Hash functions (`CacheConfig.prefix_caching_hash_algo`):
- "sha256" (default): SHA-256 of the pickled tuple; 32 bytes, collisions not a concern.
- "builtin": Python's `hash` of a tuple of ints (8 bytes); faster, 64-bit collision odds.
  Only ints go in (the parent hash and salt are turned into ints first), because Python
  salts the hashes of str and bytes per process and instances must agree.

The root hash is derived from a seed: `PYTHONHASHSEED` when set, else "0". vLLM seeds with
random bytes when the variable is unset, which protects tenants from crafted collisions but
makes separate instances disagree; we pick reproducibility by default (the disaggregated
prefill/decode and data-parallel issues need instances to agree on hashes) and let
operators who need the protection set `PYTHONHASHSEED` to a secret.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from pagedinfer import envs

if TYPE_CHECKING:
    from pagedinfer.core.request import Request

__all__ = [
    "BlockHash",
    "HASH_FUNCTIONS",
    "get_hash_fn",
    "root_hash",
    "hash_block_tokens",
    "BlockHasher",
]

BlockHash = bytes
# What a block's hash covers: (parent hash, the block's token ids, extra keys such as the
# cache salt). Extra keys may be any picklable value.
HashInput = tuple[object, tuple[int, ...], tuple[object, ...] | None]
HashFn = Callable[[HashInput], bytes]


def sha256_hash(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _as_int(value: object) -> int:
    """A process-independent int for a hash input (ints pass through)."""
    if isinstance(value, int):
        return value
    if isinstance(value, bytes):
        return int.from_bytes(value[:8], "little")
    return int.from_bytes(sha256_hash(value)[:8], "little")


def builtin_hash(obj: HashInput) -> bytes:
    parent, token_ids, extra_keys = obj
    ints = (_as_int(parent), *token_ids, *(_as_int(k) for k in extra_keys or ()))
    return hash(ints).to_bytes(8, "little", signed=True)


HASH_FUNCTIONS: dict[str, HashFn] = {"sha256": sha256_hash, "builtin": builtin_hash}


def get_hash_fn(name: str) -> HashFn:
    try:
        return HASH_FUNCTIONS[name]
    except KeyError:
        raise ValueError(
            f"Unknown prefix caching hash {name!r}; choose from {sorted(HASH_FUNCTIONS)}."
        ) from None


def root_hash(hash_fn: HashFn) -> BlockHash:
    """The parent of every first block (vLLM's NONE_HASH), seeded reproducibly."""
    return hash_fn((b"pagedinfer-root", (), (envs.block_hash_seed(),)))


def hash_block_tokens(
    hash_fn: HashFn,
    parent_block_hash: BlockHash | None,
    block_token_ids: Sequence[int],
    extra_keys: tuple[object, ...] | None = None,
) -> BlockHash:
    parent = parent_block_hash if parent_block_hash else root_hash(hash_fn)
    return hash_fn((parent, tuple(block_token_ids), extra_keys))


class BlockHasher:
    """Computes a request's full-block hashes, incrementally (`request.block_hashes`)."""

    def __init__(self, block_size: int, hash_fn: HashFn) -> None:
        self.block_size = block_size
        self.hash_fn = hash_fn
        self.root = root_hash(hash_fn)

    def __call__(self, request: Request) -> list[BlockHash]:
        """Hashes of the blocks of `request` that became full since the last call."""
        bs = self.block_size
        start = len(request.block_hashes)
        token_ids = request.all_token_ids
        parent = request.block_hashes[-1] if start else self.root
        new: list[BlockHash] = []
        for i in range(start, len(token_ids) // bs):
            extra = (request.cache_salt,) if i == 0 and request.cache_salt is not None else None
            parent = self.hash_fn((parent, tuple(token_ids[i * bs : (i + 1) * bs]), extra))
            new.append(parent)
        return new
