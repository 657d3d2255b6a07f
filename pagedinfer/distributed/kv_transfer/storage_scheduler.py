"""`StorageConnectorScheduler`: the scheduler side of the store-backed connectors
(`storage.py` describes them), called through the `StorageConnector` facade
(`storage_connector.py`) by the scheduler.

Invariants:
- A consumer loads a prompt's whole-block prefix beyond its local prefix hit when the store
  has a complete entry for it; the load is synchronous (placed before this step's
  attention layers run). A producer never loads.
- A producer saves each prompt once, in the step that computes its last chunk, unless the
  store has it or another request of the step saves the same key; a request whose KV was
  loaded is not saved again. The key is hashed once per request, not at every chunk.
- Finished and preempted requests are forgotten (a preempted one is watched again when it
  is scheduled anew).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedinfer.core.kv_transfer_metadata import KVConnectorMetadata, KVTransferSpec
from pagedinfer.distributed.kv_transfer.storage import prompt_store_key

if TYPE_CHECKING:
    from pagedinfer.config import EngineConfig
    from pagedinfer.core.request import Request
    from pagedinfer.core.sched_output import SchedulerOutput
    from pagedinfer.distributed.kv_transfer.storage import KVStore

__all__ = ["StorageConnectorScheduler"]


class StorageConnectorScheduler:
    """Decides each step's loads (consumer) and saves (producer) from the store's keys."""

    def __init__(self, config: EngineConfig, store: KVStore) -> None:
        assert config.kv_transfer_config is not None
        self.kv_config = config.kv_transfer_config
        self.model = config.model_config.model
        self.block_size = config.cache_config.block_size
        self.store = store
        self._pending_loads: list[KVTransferSpec] = []
        # Requests whose prompt KV is not saved yet: store key, tokens stored under it
        # and block table (the key hashed once, not at every chunk of the prompt).
        self._unsaved: dict[str, tuple[str, int, list[int]]] = {}

    def prompt_key(self, prompt_token_ids: list[int], cache_salt: str | None) -> tuple[str, int]:
        return prompt_store_key(self.model, self.block_size, prompt_token_ids, cache_salt)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self.kv_config.is_kv_consumer:
            return 0, False  # a prefill instance computes its prompts
        key, aligned = self.prompt_key(request.prompt_token_ids, request.cache_salt)
        if aligned <= num_computed_tokens or not self.store.exists(key):
            return 0, False
        return aligned - num_computed_tokens, False

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            return
        key, aligned = self.prompt_key(request.prompt_token_ids, request.cache_salt)
        self._pending_loads.append(
            KVTransferSpec(
                req_id=request.request_id,
                block_ids=list(block_ids),
                start=aligned - num_external_tokens,
                num_tokens=num_external_tokens,
                key=key,
            )
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        if not self.kv_config.is_kv_producer:
            return meta
        so = scheduler_output
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self._unsaved.pop(req_id, None)
        computed_before: dict[str, int] = {}
        loaded = {spec.req_id for spec in meta.loads}
        for new in so.scheduled_new_reqs:
            if new.req_id not in loaded:
                key, aligned = self.prompt_key(new.prompt_token_ids, new.cache_salt)
                self._unsaved[new.req_id] = (key, aligned, list(new.block_ids))
                computed_before[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            entry = self._unsaved.get(req_id)
            if entry is not None:
                entry[2].extend(cached.new_block_ids[i])
                computed_before[req_id] = cached.num_computed_tokens[i]
        keys_this_step: set[str] = set()
        for req_id, start in computed_before.items():
            key, aligned, block_ids = self._unsaved[req_id]
            if start + so.num_scheduled_tokens[req_id] < aligned:
                continue  # the prompt's KV is complete only after a later chunk
            del self._unsaved[req_id]
            if aligned == 0 or key in keys_this_step or self.store.exists(key):
                continue
            keys_this_step.add(key)
            num_blocks = -(-aligned // self.block_size)
            meta.saves.append(KVTransferSpec(req_id, block_ids[:num_blocks], 0, aligned, key))
        return meta
