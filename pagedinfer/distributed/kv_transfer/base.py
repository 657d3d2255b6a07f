"""The KV connector interface (vLLM V1's `KVConnectorBase_V1`), split by role.

A deployment has two connector objects per engine: one with `KVConnectorRole.SCHEDULER`
inside the scheduler, one with `KVConnectorRole.WORKER` inside each worker. They talk only
through `KVConnectorMetadata` (scheduler -> worker, once per step) and `KVConnectorOutput`
(worker -> scheduler).

One step, as the scheduler and the model runner drive it:

    scheduler                                   worker (model runner)
    ---------                                   ---------------------
    admit a waiting request:
      n_local = local prefix-cache hit
      n_ext, async = get_num_new_matched_tokens
      allocate_slots(... n_ext ...)
      update_state_after_alloc(req, blocks, n_ext)
    meta = build_connector_meta(output)  ---->  bind_connector_metadata(meta)
                                                start_load_kv()      (before the forward)
                                                per attention layer:
                                                  wait_for_layer_load(layer)
                                                  attention (writes the new KV)
                                                  save_kv_layer(layer, kv)
                                                wait_for_save()      (after the forward)
                                                get_finished() -> KVConnectorOutput
    update_from_output: finished_recving,  <----
      finished_sending, invalid blocks
    a request finishes:
      request_finished(req, blocks) -> (hold blocks?, kv_transfer_params for the client)

A producer (prefill instance, `kv_role="kv_producer"`) never loads; a consumer (decode
instance) never saves; "kv_both" does both.

`RoleSplitConnector` is the facade of connectors whose scheduler and worker sides are
objects of their own (vLLM's NixlConnector layout): it builds the side its role names and
forwards the interface's methods to it.
"""

from __future__ import annotations

import enum
import logging
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from pagedinfer.core.kv_transfer_metadata import KVConnectorMetadata, KVConnectorOutput

if TYPE_CHECKING:
    import torch

    from pagedinfer.config import EngineConfig, KVTransferConfig
    from pagedinfer.core.request import Request
    from pagedinfer.core.sched_output import SchedulerOutput

logger = logging.getLogger(__name__)

__all__ = [
    "KVConnectorBase",
    "KVConnectorRole",
    "RoleSplitConnector",
    "SchedulerSide",
    "WorkerSide",
    "layer_name",
]


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


def layer_name(layer_index: int) -> str:
    """The name under which a decoder layer's KV cache is registered and transferred."""
    return f"model.layers.{layer_index}.self_attn"


class KVConnectorBase(ABC):
    """Base of every connector. Scheduler-side methods are called only on the SCHEDULER
    instance, worker-side methods only on WORKER instances."""

    def __init__(self, config: EngineConfig, role: KVConnectorRole) -> None:
        assert config.kv_transfer_config is not None
        self.config = config
        self.kv_config: KVTransferConfig = config.kv_transfer_config
        self.role = role
        self.block_size = config.cache_config.block_size
        self._metadata: KVConnectorMetadata | None = None

    # ------------------------------------------------------------- scheduler side

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens of `request` beyond its first `num_computed_tokens` (the local prefix hit)
        that the connector can load, and whether the load is asynchronous (spans steps;
        the request then waits in WAITING_FOR_REMOTE_KVS). None: ask again next step. No
        side effects: it may be called more than once for a request."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """After every successful `allocate_slots` of a waiting request (its first
        admission, and again when it is scheduled after its asynchronous load arrived or
        after a preemption, then usually with `num_external_tokens == 0`): `block_ids` is
        its whole block table; the external tokens follow its local prefix hit."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's transfers; resets the per-step state. Must not modify the output."""

    def update_connector_output(self, output: KVConnectorOutput) -> None:  # noqa: B027
        """What the workers reported after a step (optional)."""

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Called once when `request` finishes, before its blocks are freed. Returns
        whether to hold the blocks (freed when a worker reports the request in
        `finished_sending`) and the `kv_transfer_params` returned to the client."""
        return False, None

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:  # noqa: B027
        """The worker's paged KV cache per layer name, each
        `[2, num_blocks, block_size, num_kv_heads, head_dim]`."""

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    def get_connector_metadata(self) -> KVConnectorMetadata:
        assert self._metadata is not None, "no metadata bound: called outside a step"
        return self._metadata

    def start_load_kv(self) -> None:  # noqa: B027
        """Before the forward pass: start (or do) this step's loads."""

    def wait_for_layer_load(self, layer_name: str) -> None:  # noqa: B027
        """Inside each attention layer, before it reads the cache."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:  # noqa: B027
        """Inside each attention layer, after it wrote this step's KV to `kv_layer`."""

    def wait_for_save(self) -> None:  # noqa: B027
        """After the forward pass: block until this step's saves no longer need the paged
        buffers (later steps may overwrite them)."""

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        """Called after every step (a step with nothing to compute included): asynchronous
        transfers that completed, load errors and transfer counters since the last call.
        `finished_req_ids`: requests the scheduler finished since the last step."""
        return KVConnectorOutput()

    def shutdown(self) -> None:  # noqa: B027
        """Release sockets, threads and clients."""


class SchedulerSide(Protocol):
    """The scheduler-side methods a `RoleSplitConnector` forwards."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]: ...

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None: ...

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata: ...


class WorkerSide(Protocol):
    """The worker-side methods a `RoleSplitConnector` forwards (with the bound metadata)."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None: ...

    def start_load_kv(self, meta: KVConnectorMetadata) -> None: ...

    def wait_for_save(self, meta: KVConnectorMetadata) -> None: ...

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput: ...

    def shutdown(self) -> None: ...


SchedulerSideT = TypeVar("SchedulerSideT", bound=SchedulerSide)
WorkerSideT = TypeVar("WorkerSideT", bound=WorkerSide)


class RoleSplitConnector(KVConnectorBase, Generic[SchedulerSideT, WorkerSideT]):
    """A connector that holds either its scheduler side or its worker side, by role, never
    both, and forwards the interface to it; calling a method of the other side is a bug
    (an assertion). Subclasses build the sides and forward any further method."""

    def __init__(self, config: EngineConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        self.connector_scheduler: SchedulerSideT | None = None
        self.connector_worker: WorkerSideT | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = self.make_scheduler_side()
        else:
            self.connector_worker = self.make_worker_side()

    @abstractmethod
    def make_scheduler_side(self) -> SchedulerSideT: ...

    @abstractmethod
    def make_worker_side(self) -> WorkerSideT: ...

    def scheduler_side(self) -> SchedulerSideT:
        assert self.connector_scheduler is not None, "a scheduler-side call on a worker"
        return self.connector_scheduler

    def worker_side(self) -> WorkerSideT:
        assert self.connector_worker is not None, "a worker-side call on the scheduler"
        return self.connector_worker

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler_side().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        self.scheduler_side().update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler_side().build_connector_meta(scheduler_output)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side().register_kv_caches(kv_caches)

    def start_load_kv(self) -> None:
        self.worker_side().start_load_kv(self.get_connector_metadata())

    def wait_for_save(self) -> None:
        self.worker_side().wait_for_save(self.get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        return self.worker_side().get_finished(finished_req_ids)

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
