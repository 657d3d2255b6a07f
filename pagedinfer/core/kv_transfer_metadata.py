"""What KV connectors send between their scheduler side and their worker side.

The scheduler-side connector describes each step's transfers in a `KVConnectorMetadata`
(attached to `SchedulerOutput.kv_connector_metadata`); the worker-side connector reports
what finished in a `KVConnectorOutput` (attached to `ModelRunnerOutput`). Both are plain
dataclasses of Python data, so they cross to worker processes in the executor's typed
msgpack codec (no pickle). They live in `core/` beside `SchedulerOutput` because the codec
decodes that seam by its annotations at run time, and `core/` imports nothing above it; the
connectors themselves (`distributed/kv_transfer/`) build and read them.

Deviation from vLLM: there, each connector subclasses `KVConnectorMetadata` with fields of
its own, and the objects are pickled. Our codec decodes into declared types, so there is
one metadata type whose per-request record, `KVTransferSpec`, carries the fields every
connector here needs, plus `params` for connector-specific values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedinfer.core.messages import KVTransferStats

__all__ = ["KVConnectorMetadata", "KVConnectorOutput", "KVTransferSpec"]


@dataclass
class KVTransferSpec:
    """One request's KV transfer in one step: tokens `[start, start + num_tokens)` of the
    request, whose KV lives in the blocks `block_ids` (its whole block table: token p is in
    slot `block_ids[p // block_size] * block_size + p % block_size`)."""

    req_id: str
    block_ids: list[int]
    start: int
    num_tokens: int
    key: str = ""
    """Where the KV is stored (storage connectors: the prompt's hash)."""
    params: dict[str, object] = field(default_factory=dict)
    """Connector-specific values (a remote engine's address and block ids, ...)."""


@dataclass
class KVConnectorMetadata:
    """One step's transfers, built by `KVConnectorBase.build_connector_meta`."""

    loads: list[KVTransferSpec] = field(default_factory=list)
    """KV to bring into the paged cache (before or during the forward pass)."""
    saves: list[KVTransferSpec] = field(default_factory=list)
    """KV to store once this step's forward pass has written it (layer by layer)."""
    holds: list[KVTransferSpec] = field(default_factory=list)
    """Finished requests whose blocks are kept for a remote reader (a decode instance
    that pulls them); the worker reports each in `finished_sending` once read or expired."""


@dataclass
class KVConnectorOutput:
    """What the worker-side connector reports after a step."""

    finished_sending: list[str] = field(default_factory=list)
    """Held requests whose KV was read (or whose hold expired): their blocks can be freed."""
    finished_recving: list[str] = field(default_factory=list)
    """Requests whose asynchronous load finished (successfully or not)."""
    invalid_block_ids: list[int] = field(default_factory=list)
    """Blocks whose load failed (missing, partial or corrupted KV)."""
    stats: KVTransferStats = field(default_factory=KVTransferStats)
    """Tokens, bytes and time loaded and saved since the last report."""

    def is_empty(self) -> bool:
        return not (
            self.finished_sending
            or self.finished_recving
            or self.invalid_block_ids
            or not self.stats.is_empty()
        )
