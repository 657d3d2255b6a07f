"""Data-parallel routing and the DP client's bookkeeping, without processes: the load score
(`waiting * 4 + running`), the local bump that keeps a burst from herding onto one replica,
the rotating tie-break, and `DPAsyncMPClient` over in-process fake replicas (aborts reach
the replica that holds the request, stats are merged over replicas, utilities combined,
one dead replica kills the client)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pagedinfer.config import build_engine_config
from pagedinfer.core.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from pagedinfer.engine.core_client import EngineCoreClient, EngineDeadError
from pagedinfer.engine.dp_client import DPAsyncMPClient, DPLoadRouter
from pagedinfer.engine.dp_replicas import replica_config
from pagedinfer.engine.output_processor import split_request
from pagedinfer.engine.protocol import EngineCoreReady
from pagedinfer.sampling_params import SamplingParams

# ------------------------------------------------------------------------------ router


def test_score_weighs_waiting_four_times_running() -> None:
    router = DPLoadRouter(2)
    router.record_stats(0, num_waiting=1, num_running=0)  # score 4
    router.record_stats(1, num_waiting=0, num_running=3)  # score 3
    assert [router.score(0), router.score(1)] == [4, 3]
    assert router.choose() == 1
    router.record_stats(1, num_waiting=0, num_running=5)  # score 5 > 4
    assert router.choose() == 0


def test_local_bump_spreads_a_burst_between_stats_updates() -> None:
    router = DPLoadRouter(2)
    router.record_stats(0, num_waiting=0, num_running=2)
    router.record_stats(1, num_waiting=0, num_running=0)
    # No stats arrive during the burst: only the bumps (one waiting request each) count.
    # Replica 1 takes the first (0 < 2); after that it scores 4 > 2, so 0 takes the next.
    chosen = [router.choose() for _ in range(6)]
    assert chosen == [1, 0, 1, 0, 1, 0]
    assert router.num_routed == [3, 3]
    assert router.num_waiting == [3, 3]


def test_stats_replace_the_bumps() -> None:
    router = DPLoadRouter(2)
    assert router.choose() == 0
    assert router.num_waiting == [1, 0]
    # Replica 0's next report already counts that request (now running): the bump is gone.
    router.record_stats(0, num_waiting=0, num_running=1)
    assert router.num_waiting == [0, 0] and router.score(0) == 1
    assert router.num_routed == [1, 0]  # the routed total is never decremented
    assert router.choose() == 1


def test_ties_rotate_the_start_of_the_scan() -> None:
    router = DPLoadRouter(3)
    chosen = []
    for _ in range(6):
        for rank in range(3):  # equal loads before every choice
            router.record_stats(rank, num_waiting=1, num_running=2)
        chosen.append(router.choose())
    assert chosen == [0, 1, 2, 0, 1, 2]


def test_tie_break_scans_from_the_start_index_not_from_zero() -> None:
    router = DPLoadRouter(3)
    assert router.choose() == 0  # start moves to 1
    router.record_stats(0, 0, 0)
    router.record_stats(1, 0, 5)
    router.record_stats(2, 0, 0)
    # 0 and 2 tie at 0; the scan starts at 1, so 2 comes before 0.
    assert router.choose() == 2


def test_router_needs_a_replica() -> None:
    with pytest.raises(ValueError):
        DPLoadRouter(0)


# ---------------------------------------------------------------------- replica config


def test_replica_config_shares_the_cores(monkeypatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    config = build_engine_config(data_parallel_size=3)
    assert replica_config(config).model_config.num_threads == 2
    assert replica_config(config).model_config.model == config.model_config.model
    pinned = build_engine_config(data_parallel_size=3, num_threads=4)
    assert replica_config(pinned).model_config.num_threads == 4
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert replica_config(config).model_config.num_threads == 1  # never 0


# ----------------------------------------------------------------- client, with fakes


class FakeReplica(EngineCoreClient):
    """An engine core that records its inputs; the test feeds its outputs."""

    def __init__(self, num_kv_blocks: int = 100, max_model_len: int = 512) -> None:
        self.info = EngineCoreReady(max_model_len, 256, num_kv_blocks, 16, "float32", 1.0)
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.utility: dict[str, Any] = {}
        self.dead = False
        self.closed = False
        self._outputs: asyncio.Queue | None = None

    @property
    def is_dead(self) -> bool:
        return self.dead

    def queue(self) -> asyncio.Queue:
        if self._outputs is None:
            self._outputs = asyncio.Queue()
        return self._outputs

    def add_request(self, request: EngineCoreRequest) -> None:
        self.added.append(request.request_id)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)

    async def get_output(self) -> EngineCoreOutputs:
        item = await self.queue().get()
        if isinstance(item, EngineDeadError):
            raise item
        return item

    async def call_utility(self, method: str, *args: Any) -> Any:
        return self.utility[method]

    def shutdown(self) -> None:
        self.closed = True


def _request(request_id: str, n: int = 1) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id, [1, 2, 3], SamplingParams(max_tokens=4, n=n), None, arrival_time=0.0
    )


def _stats(waiting: int, running: int, usage: float, preemptions: int = 0) -> SchedulerStats:
    return SchedulerStats(
        num_running_reqs=running,
        num_waiting_reqs=waiting,
        kv_cache_usage=usage,
        num_preemptions=preemptions,
        prefix_cache_queries=10,
        prefix_cache_hits=4,
    )


def test_info_describes_the_group() -> None:
    client = DPAsyncMPClient.from_replicas(
        [FakeReplica(100, max_model_len=512), FakeReplica(60, max_model_len=256)]
    )
    assert client.info.num_kv_blocks == 160
    assert client.info.max_model_len == 256  # a request must fit whichever replica gets it


def test_requests_spread_and_aborts_reach_their_replica() -> None:
    a, b = FakeReplica(), FakeReplica()
    client = DPAsyncMPClient.from_replicas([a, b])
    for i in range(4):
        client.add_request(_request(f"r{i}"))
    assert a.added == ["r0", "r2"] and b.added == ["r1", "r3"]
    client.abort_requests(["r3", "r0", "unknown"])
    assert a.aborted == ["r0"] and b.aborted == ["r3"]
    client.abort_requests(["r3"])  # already aborted: forgotten, sent nowhere
    assert b.aborted == ["r3"]
    assert [load["num_routed_reqs"] for load in client.replica_loads()] == [2, 2]


def test_children_of_one_request_stay_on_one_replica() -> None:
    a, b = FakeReplica(), FakeReplica()
    client = DPAsyncMPClient.from_replicas([a, b])
    _, children = split_request(_request("parent", n=3))
    for child in children:
        client.add_request(child)
    client.add_request(_request("next"))
    assert a.added == ["0_parent", "1_parent", "2_parent"] and b.added == ["next"]


def test_outputs_merge_stats_and_forget_finished_requests() -> None:
    a, b = FakeReplica(num_kv_blocks=100), FakeReplica(num_kv_blocks=300)
    client = DPAsyncMPClient.from_replicas([a, b])
    client.add_request(_request("r0"))
    client.add_request(_request("r1"))

    async def run() -> tuple[EngineCoreOutputs, EngineCoreOutputs]:
        a.queue().put_nowait(
            EngineCoreOutputs(
                [EngineCoreOutput("r0", [7], finish_reason=FinishReason.LENGTH)],
                scheduler_stats=_stats(waiting=2, running=3, usage=0.5, preemptions=1),
            )
        )
        first = await client.get_output()
        b.queue().put_nowait(
            EngineCoreOutputs(
                [EngineCoreOutput("r1", [8])],
                scheduler_stats=_stats(waiting=1, running=4, usage=0.1, preemptions=2),
            )
        )
        second = await client.get_output()
        return first, second

    first, second = asyncio.run(run())
    # Replica 1 had not reported yet: it counts as empty.
    s = first.scheduler_stats
    assert s is not None
    assert (s.num_waiting_reqs, s.num_running_reqs, s.num_preemptions) == (2, 3, 1)
    assert s.kv_cache_usage == pytest.approx(0.5 * 100 / 400)
    s = second.scheduler_stats
    assert s is not None
    assert (s.num_waiting_reqs, s.num_running_reqs, s.num_preemptions) == (3, 7, 3)
    assert s.kv_cache_usage == pytest.approx((0.5 * 100 + 0.1 * 300) / 400)
    # Per-step counters stay this step's (summing them over messages gives the total).
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (10, 4)
    # The router now sees the reported counts.
    assert [client.router.score(0), client.router.score(1)] == [2 * 4 + 3, 1 * 4 + 4]
    # r0 finished: its id is forgotten, an abort of it goes nowhere; r1 is still tracked.
    client.abort_requests(["r0", "r1"])
    assert a.aborted == [] and b.aborted == ["r1"]


def _counts(running: int, waiting: int, usage: float) -> dict[str, Any]:
    """What `EngineCore.get_scheduler_stats` answers."""
    return {"num_running_reqs": running, "num_waiting_reqs": waiting, "kv_cache_usage": usage}


def test_utilities_combine_over_replicas() -> None:
    a, b = FakeReplica(num_kv_blocks=100), FakeReplica(num_kv_blocks=100)
    client = DPAsyncMPClient.from_replicas([a, b])
    a.utility = {
        "reset_prefix_cache": True,
        "get_kv_cache_usage": 0.2,
        "get_scheduler_stats": _counts(running=1, waiting=2, usage=0.2),
        "ping": "pong",
    }
    b.utility = {
        "reset_prefix_cache": False,
        "get_kv_cache_usage": 0.4,
        "get_scheduler_stats": _counts(running=3, waiting=0, usage=0.4),
        "ping": "pong",
    }

    async def run() -> list[Any]:
        return [
            await client.call_utility(m)
            for m in ("reset_prefix_cache", "get_kv_cache_usage", "get_scheduler_stats", "ping")
        ]

    reset, usage, stats, ping = asyncio.run(run())
    assert reset is False  # True only if every replica reset
    assert usage == pytest.approx(0.3)
    assert stats["num_running_reqs"] == 4 and stats["num_waiting_reqs"] == 2
    assert stats["kv_cache_usage"] == pytest.approx(0.3)
    assert ping == "pong"
    assert client.router.num_waiting == [2, 0] and client.router.num_running == [1, 3]
    with pytest.raises(ValueError, match="unknown utility"):
        asyncio.run(client.call_utility("shutdown"))


def test_a_dead_replica_kills_the_client_and_stops_the_others() -> None:
    a, b = FakeReplica(), FakeReplica()
    client = DPAsyncMPClient.from_replicas([a, b])
    client.add_request(_request("r0"))  # -> a
    client.add_request(_request("r1"))  # -> b

    async def run() -> None:
        a.dead = True
        a.queue().put_nowait(EngineDeadError("exit code -9"))
        with pytest.raises(EngineDeadError, match="engine core 0 is dead: exit code -9"):
            await client.get_output()
        with pytest.raises(EngineDeadError):  # and every later call
            await client.get_output()

    asyncio.run(run())
    assert client.is_dead
    assert b.aborted == ["r1"] and a.aborted == []  # the survivor's requests are stopped
    with pytest.raises(EngineDeadError):
        client.add_request(_request("r2"))
    client.shutdown()
    assert a.closed and b.closed


# ------------------------------------------------------------------ where DP is refused


def test_ray_replicas_refuse_ray_workers_before_anything_starts() -> None:
    """Ray replicas hold their workers' CPUs in their own bundle; a Ray executor inside one
    would reserve a second placement group (refused before any connection is made)."""
    config = build_engine_config(
        data_parallel_size=2,
        data_parallel_backend="ray",
        tensor_parallel_size=3,
        distributed_executor_backend="ray",
    )
    with pytest.raises(ValueError, match="use distributed_executor_backend 'mp'"):
        DPAsyncMPClient(config)


def test_offline_engine_and_inproc_async_refuse_dp() -> None:
    from pagedinfer.engine.async_llm import _make_engine_core_client
    from pagedinfer.engine.llm_engine import LLMEngine

    config = build_engine_config(data_parallel_size=2)
    with pytest.raises(ValueError, match="pagedinfer serve --data-parallel-size"):
        LLMEngine(config)
    with pytest.raises(ValueError, match="needs multiprocess=True"):
        _make_engine_core_client(config, multiprocess=False)
