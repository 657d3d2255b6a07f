"""The scheduler's side of KV transfer, on hand-built outputs: external tokens, asynchronous
loads (WAITING_FOR_REMOTE_KVS), held blocks and load failures.

`ScriptedConnector` is a test double of the connector interface (the scheduler is what is
under test): it reports a fixed number of external tokens and records the calls."""

from __future__ import annotations

from typing import Any

import pytest

from pagedinfer.config import EngineConfig, KVTransferConfig
from pagedinfer.core.kv_transfer_metadata import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVTransferSpec,
)
from pagedinfer.core.kv_transfer_tracker import KVTransferTracker
from pagedinfer.core.request import Request, RequestStatus
from pagedinfer.core.sched_output import SchedulerOutput
from pagedinfer.distributed.kv_transfer.base import KVConnectorBase, KVConnectorRole

from .utils import create_requests, create_scheduler, make_hasher, make_output


class ScriptedConnector(KVConnectorBase):
    def __init__(self, num_external: int, load_async: bool = False, hold: bool = False) -> None:
        config = EngineConfig(kv_transfer_config=KVTransferConfig(kv_connector="Scripted"))
        super().__init__(config, KVConnectorRole.SCHEDULER)
        self.num_external, self.load_async, self.hold = num_external, load_async, hold
        self.allocs: list[tuple[str, list[int], int]] = []
        self.finished: list[str] = []
        self._loads: list[KVTransferSpec] = []
        self.none_for: set[str] = set()  # requests with nothing to load

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if request.request_id in self.none_for:
            return 0, False
        n = max(self.num_external - num_computed_tokens, 0)
        return n, self.load_async and n > 0

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        self.allocs.append((request.request_id, list(block_ids), num_external_tokens))
        if num_external_tokens:
            self._loads.append(KVTransferSpec(request.request_id, block_ids, 0, 0))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta, self._loads = KVConnectorMetadata(loads=self._loads), []
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.finished.append(request.request_id)
        return self.hold, {"remote_block_ids": block_ids}


def make_scheduler(connector: ScriptedConnector, failure_policy: str = "recompute", **kw: Any):
    sched = create_scheduler(**kw)
    sched.kv_transfer = KVTransferTracker(connector, sched.kv_cache_manager, failure_policy)
    return sched


def with_kv(output, kv: KVConnectorOutput):
    output.kv_connector_output = kv
    return output


def test_sync_external_tokens_are_counted_computed_and_loaded_in_the_same_step() -> None:
    conn = ScriptedConnector(num_external=32)
    sched = make_scheduler(conn)
    (req,) = create_requests(1, num_tokens=40, block_hasher=make_hasher())
    sched.add_request(req)
    so = sched.schedule()
    # 32 tokens come from outside: only the last 8 are computed.
    assert so.num_scheduled_tokens == {"0": 8}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 32
    assert len(so.scheduled_new_reqs[0].block_ids) == 3
    assert conn.allocs == [("0", so.scheduled_new_reqs[0].block_ids, 32)]
    assert [s.req_id for s in so.kv_connector_metadata.loads] == ["0"]
    out = sched.update_from_output(so, make_output(so, sched))
    assert out.outputs[0].num_cached_tokens == 32
    assert out.outputs[0].num_external_cached_tokens == 32
    # Loaded blocks enter the prefix cache only after the load proved valid (next alloc).
    assert sched.kv_cache_manager.num_cached_block.get("0", 0) == 0
    sched.schedule()
    assert sched.kv_cache_manager.num_cached_block["0"] == 2


def test_external_tokens_never_cover_the_last_prompt_token() -> None:
    sched = make_scheduler(ScriptedConnector(num_external=40))
    (req,) = create_requests(1, num_tokens=40)
    sched.add_request(req)
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"0": 1}
    assert req.num_external_computed_tokens == 39


def test_async_load_waits_then_schedules_the_rest() -> None:
    conn = ScriptedConnector(num_external=32, load_async=True)
    sched = make_scheduler(conn)
    (req,) = create_requests(1, num_tokens=40, block_hasher=make_hasher())
    sched.add_request(req)
    so = sched.schedule()
    # Blocks for the external tokens are allocated; nothing is computed yet.
    assert so.total_num_scheduled_tokens == 0
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(sched.kv_cache_manager.get_block_ids("0")) == 2
    assert [s.req_id for s in so.kv_connector_metadata.loads] == ["0"]
    assert sched.has_pending_kv_transfers()
    sched.update_from_output(so, make_output(so, sched))
    so = sched.schedule()  # not reported finished: still waiting
    assert so.total_num_scheduled_tokens == 0
    sched.update_from_output(so, with_kv(make_output(so, sched), KVConnectorOutput(
        finished_recving=["0"])))  # fmt: skip
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"0": 8}
    assert req.status == RequestStatus.RUNNING
    assert so.scheduled_new_reqs[0].num_computed_tokens == 32
    assert sched.kv_cache_manager.num_cached_block["0"] == 2  # loaded blocks now cached
    assert not sched.has_pending_kv_transfers()


@pytest.mark.parametrize("load_async", [False, True])
def test_invalid_blocks_recompute_the_prompt_without_the_connector(load_async: bool) -> None:
    conn = ScriptedConnector(num_external=32, load_async=load_async)
    sched = make_scheduler(conn)
    (req,) = create_requests(1, num_tokens=40)
    sched.add_request(req)
    so = sched.schedule()
    bad = sched.kv_cache_manager.get_block_ids("0")[1:2]
    kv = KVConnectorOutput(invalid_block_ids=bad, finished_recving=["0"] if load_async else [])
    out = sched.update_from_output(so, with_kv(make_output(so, sched), kv))
    assert out.outputs == []  # the token computed on bad KV is dropped
    assert req.kv_load_failed and req.output_token_ids == []
    so = sched.schedule()
    # The whole prompt is computed, sent to the worker anew; the connector is not asked.
    assert so.num_scheduled_tokens == {"0": 40}
    assert [n.req_id for n in so.scheduled_new_reqs] == ["0"]
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    assert conn.allocs[-1][2] == 0
    out = sched.update_from_output(so, make_output(so, sched))
    assert out.outputs[0].new_token_ids == [7]
    assert out.outputs[0].num_external_cached_tokens == 0


def test_invalid_blocks_with_fail_policy_finish_the_request_with_an_error() -> None:
    sched = make_scheduler(ScriptedConnector(num_external=32), failure_policy="fail")
    (req,) = create_requests(1, num_tokens=40)
    sched.add_request(req)
    so = sched.schedule()
    bad = sched.kv_cache_manager.get_block_ids("0")[:1]
    free_before = sched.kv_cache_manager.get_num_free_blocks()
    out = sched.update_from_output(
        so, with_kv(make_output(so, sched), KVConnectorOutput(invalid_block_ids=bad))
    )
    (o,) = out.outputs
    assert str(o.finish_reason) == "error" and o.new_token_ids == []
    assert "KV transfer failed" in o.stop_reason
    assert sched.kv_cache_manager.get_num_free_blocks() == free_before + 3
    assert not sched.has_unfinished_requests()


def test_held_blocks_are_freed_when_the_worker_reports_the_send_done() -> None:
    conn = ScriptedConnector(num_external=0, hold=True)
    sched = make_scheduler(conn)
    (req,) = create_requests(1, num_tokens=40, max_tokens=1)
    sched.add_request(req)
    free = sched.kv_cache_manager.get_num_free_blocks()
    so = sched.schedule()
    block_ids = sched.kv_cache_manager.get_block_ids("0")
    out = sched.update_from_output(so, make_output(so, sched))
    # Finished; the params go to the client, the blocks stay held.
    assert out.outputs[0].kv_transfer_params == {"remote_block_ids": block_ids}
    assert conn.finished == ["0"]
    assert sched.kv_cache_manager.get_num_free_blocks() == free - 3
    assert not sched.has_unfinished_requests() and sched.has_pending_kv_transfers()
    with pytest.raises(ValueError, match="in use"):  # its id too, until released
        sched.add_request(create_requests(1)[0])
    so = sched.schedule()
    sched.update_from_output(so, with_kv(make_output(so, sched), KVConnectorOutput(
        finished_sending=["0"])))  # fmt: skip
    assert sched.kv_cache_manager.get_num_free_blocks() == free
    assert not sched.has_pending_kv_transfers()


def test_request_aborted_during_its_async_load_is_held_until_the_load_ends() -> None:
    conn = ScriptedConnector(num_external=32, load_async=True, hold=True)
    sched = make_scheduler(conn)
    (req,) = create_requests(1, num_tokens=40)
    sched.add_request(req)
    free = sched.kv_cache_manager.get_num_free_blocks()
    so = sched.schedule()
    sched.finish_requests("0", RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache_manager.get_num_free_blocks() == free - 2  # still being written
    sched.update_from_output(so, with_kv(make_output(so, sched), KVConnectorOutput(
        finished_recving=["0"])))  # fmt: skip
    assert sched.kv_cache_manager.get_num_free_blocks() == free


def test_loaded_requests_run_when_the_head_of_the_queue_cannot_allocate() -> None:
    """A full pool whose blocks are held by waiting requests with loaded KV: the request at
    the head cannot allocate, but those behind it need one block each and must run (else
    nothing ever frees a block)."""
    conn = ScriptedConnector(num_external=32, load_async=True)
    sched = make_scheduler(conn, num_blocks=10, policy="priority")
    waiters = create_requests(4, num_tokens=40)
    for r in waiters:
        sched.add_request(r)
    so = sched.schedule()  # 4 loads of 2 blocks each: 2 blocks left
    assert sched.kv_cache_manager.get_num_free_blocks() == 2
    (head,) = create_requests(1, num_tokens=100, start=10)
    head.priority = -1  # ahead of the waiters; needs 7 blocks
    conn.none_for.add(head.request_id)
    sched.add_request(head)
    done = KVConnectorOutput(finished_recving=[r.request_id for r in waiters])
    sched.update_from_output(so, with_kv(make_output(so, sched), done))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"0": 8, "1": 8}  # one more block each
    assert sched.waiting.peek() is head  # it keeps its place
