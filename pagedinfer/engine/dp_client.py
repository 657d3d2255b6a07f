"""Data parallelism behind one front end: `DPAsyncMPClient` drives several engine cores.

    AsyncLLM ── DPAsyncMPClient ──┬── AsyncMPClient ── engine core process (replica 0)
                                  ├── AsyncMPClient ── engine core process (replica 1)
                                  └── ...        (or RayMPClient ── Ray actor, per replica)

`AsyncLLM` builds this client instead of `AsyncMPClient` when
`parallel_config.data_parallel_size > 1` (`pagedinfer serve --data-parallel-size N`). It
starts N complete engine cores, each with its own copy of the config (scheduler, KV cache,
model weights), and presents the same interface as one `AsyncMPClient`, so input
processing, output processing and the server are unchanged. `data_parallel_backend` says
where the engine cores run:
- "mp" (default): child processes of this one (`AsyncMPClient`, ipc sockets);
- "ray": Ray actors on an existing Ray cluster, so that the replicas may sit on other
  machines (`RayMPClient`, tcp sockets, the same messages), placed in a placement group
  of one bundle per replica by `dp_replicas.RayReplicaGroup`. Shutdown kills the actors
  and removes the group; if this process dies instead, Ray ends both with its job.

Starting the replicas (their configs, the start-up in parallel, the Ray placement) is
`dp_replicas.py`; this module routes requests to them and merges what they send back.

Routing (vLLM's `DPLBAsyncMPClient.get_core_engine_for_request`, see `DPLoadRouter`): a new
request goes to the replica with the least `waiting * 4 + running`, from each replica's
latest `SchedulerStats` plus a local bump of the chosen replica's waiting count, so a burst
of requests between two stats updates does not herd onto one replica.

Invariants:
- every request id this client has routed and not yet seen finish (or aborted) maps to the
  replica that holds it; an abort goes only there;
- the `SchedulerStats` that `get_output` hands on are merged over replicas (running and
  waiting summed, KV usage averaged over all blocks, preemptions summed), so the front
  end's gauges describe the whole DP group rather than whichever replica reported last.
  The per-step counters of a message (prefix-cache lookups, speculative drafts) are left as
  they are: they are increments of one replica's step, and their sum over all messages is
  the group's total;
- one dead replica makes the whole client dead (`EngineDeadError` from `get_output`, as
  `AsyncMPClient` raises it); the requests still running on the other replicas are aborted
  there, so they stop using CPU for outputs nobody will read.

Deviations from vLLM: there is no coordinator process and no DP "waves" (those keep MoE
expert-parallel collectives in lockstep; a dense model's replicas share nothing, so each
one just steps when it has work). Load counts come from the outputs each replica already
sends (every busy step and once on going idle) instead of a coordinator's 100 ms broadcast.
The children of one `n > 1` request all go to one replica: they share the prompt (one
prefill, then prefix-cache hits) and draw from one random generator, where replicas that
all start from the same seed would give the first unseeded `n = 2` request two identical
samples. With the ray backend the engine cores' own workers cannot be Ray actors too
(`distributed_executor_backend="ray"` is refused there): a replica's bundle holds the CPUs
of the workers it starts beside itself, where a Ray executor would place its workers in a
placement group of its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from pagedinfer.config import EngineConfig
from pagedinfer.core.messages import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from pagedinfer.engine.core_client import AsyncMPClient, EngineCoreClient, EngineDeadError
from pagedinfer.engine.dp_replicas import RayReplicaGroup, replica_config, start_replicas
from pagedinfer.engine.protocol import UTILITY_METHODS, EngineCoreReady

logger = logging.getLogger("pagedinfer")

__all__ = ["DPAsyncMPClient", "DPLoadRouter"]


class DPLoadRouter:
    """Which replica gets the next request: the least loaded by `waiting * 4 + running`.

    Waiting requests weigh 4x: a waiting request still needs its whole prefill and a seat
    in the batch, a running one only its remaining decode steps. Counts are what each
    replica last reported (`record_stats`) plus one waiting request per request routed to
    it since (`assign`); the next report replaces both, as the replica then counts those
    requests itself. Ties go to the first replica scanning from a start index that moves on
    after every choice, so an idle group takes turns instead of filling replica 0 first.
    Pure bookkeeping: no I/O, no clock (unit-tested on its own).
    """

    WAITING_WEIGHT = 4

    def __init__(self, num_replicas: int) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.num_replicas = num_replicas
        self.num_waiting = [0] * num_replicas
        self.num_running = [0] * num_replicas
        self.num_routed = [0] * num_replicas
        """Requests routed to each replica since start (never decremented)."""
        self._start = 0

    def score(self, rank: int) -> int:
        return self.num_waiting[rank] * self.WAITING_WEIGHT + self.num_running[rank]

    def choose(self) -> int:
        """The least-loaded replica, counted as holding one more waiting request."""
        n = self.num_replicas
        best, best_score = -1, 0
        for i in range(n):
            rank = (self._start + i) % n
            score = self.score(rank)
            if best < 0 or score < best_score:
                best, best_score = rank, score
        self._start = (self._start + 1) % n
        self.assign(best)
        return best

    def assign(self, rank: int) -> None:
        """Count a request routed to `rank` (by `choose`, or pinned there by the caller)."""
        self.num_waiting[rank] += 1
        self.num_routed[rank] += 1

    def record_stats(self, rank: int, num_waiting: int, num_running: int) -> None:
        """`rank`'s own counts, fresh: they replace the local bumps."""
        self.num_waiting[rank] = num_waiting
        self.num_running[rank] = num_running


class DPAsyncMPClient(EngineCoreClient):
    """N engine cores behind the `EngineCoreClient` interface; see the module docstring."""

    def __init__(self, config: EngineConfig, startup_timeout_s: float = 900.0) -> None:
        parallel = config.parallel_config
        if parallel.data_parallel_size < 2:
            raise ValueError(
                f"DPAsyncMPClient needs data_parallel_size >= 2, got "
                f"{parallel.data_parallel_size} (use AsyncMPClient)."
            )
        ray_group: RayReplicaGroup | None = None
        if parallel.data_parallel_backend == "ray":
            if parallel.executor_backend == "ray":
                raise ValueError(
                    "data_parallel_backend='ray' runs each engine core's workers beside it, "
                    "on its actor's node: use distributed_executor_backend 'mp' (or 'uni'), "
                    "not 'ray'."
                )
            ray_group = RayReplicaGroup()
            try:
                replicas = ray_group.start_replicas(config, startup_timeout_s)
            except BaseException:
                ray_group.close()
                raise
        else:
            replicas = start_replicas(
                [replica_config(config)] * parallel.data_parallel_size,
                lambda _, c: AsyncMPClient(c, startup_timeout_s),
            )
        self._setup(replicas, config.observability_config.log_stats_interval_s)
        self._ray_group = ray_group

    @classmethod
    def from_replicas(
        cls, replicas: Sequence[EngineCoreClient], log_stats_interval_s: float = 0.0
    ) -> DPAsyncMPClient:
        """Over clients that are already up (the unit tests pass in-process fakes)."""
        self = cls.__new__(cls)
        self._setup(list(replicas), log_stats_interval_s)
        return self

    def _setup(self, replicas: list[EngineCoreClient], log_stats_interval_s: float) -> None:
        self.replicas = replicas
        self.router = DPLoadRouter(len(replicas))
        infos = [r.info for r in replicas]
        # The group as one engine: requests must fit every replica, and the KV capacity is
        # the sum (a request still needs its blocks in one replica).
        self.info = EngineCoreReady(
            max_model_len=min(i.max_model_len for i in infos),
            vocab_size=infos[0].vocab_size,
            num_kv_blocks=sum(i.num_kv_blocks for i in infos),
            block_size=infos[0].block_size,
            dtype=infos[0].dtype,
            load_time_s=max(i.load_time_s for i in infos),
        )
        self._num_kv_blocks = [i.num_kv_blocks for i in infos]
        self._replica_of: dict[str, int] = {}
        self._latest_stats: list[SchedulerStats | None] = [None] * len(replicas)
        # The prompt list of the last request routed, and where it went: the children of
        # one `n > 1` request share that very list object (`split_request` copies the
        # struct shallowly), which is how they are kept together without a new interface.
        self._last_prompt: tuple[list[int], int] | None = None
        self._dead_error: EngineDeadError | None = None
        self._closed = False
        self._merged: asyncio.Queue | None = None
        self._pumps: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._log_interval_s = log_stats_interval_s
        self._last_log = time.monotonic()
        self._ray_group = None

    # ------------------------------------------------------------------------- health

    @property
    def is_dead(self) -> bool:
        return self._dead_error is not None or any(r.is_dead for r in self.replicas)

    def _check_alive(self) -> None:
        if self._dead_error is not None:
            raise self._dead_error
        for rank, replica in enumerate(self.replicas):
            if replica.is_dead:
                raise EngineDeadError(f"Data-parallel engine core {rank} is dead.")

    # ------------------------------------------------------------------------- inputs

    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        last = self._last_prompt
        if last is not None and last[0] is request.prompt_token_ids:
            rank = last[1]  # a sibling of the previous request (same n > 1 parent)
            self.router.assign(rank)
        else:
            rank = self.router.choose()
        self._last_prompt = (request.prompt_token_ids, rank)
        self._replica_of[request.request_id] = rank
        self.replicas[rank].add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        by_rank: dict[int, list[str]] = {}
        for request_id in request_ids:
            # Unknown ids finished in their engine already (their last output was seen).
            rank = self._replica_of.pop(request_id, None)
            if rank is not None:
                by_rank.setdefault(rank, []).append(request_id)
        for rank, ids in by_rank.items():
            if not self.replicas[rank].is_dead:
                self.replicas[rank].abort_requests(ids)

    # ------------------------------------------------------------------------ outputs

    def _ensure_pumps(self) -> None:
        """One task per replica moves its outputs into one queue (in the running loop)."""
        if self._merged is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._merged = asyncio.Queue()
        self._pumps = [
            self._loop.create_task(self._pump(rank, replica), name=f"dp-outputs-{rank}")
            for rank, replica in enumerate(self.replicas)
        ]

    async def _pump(self, rank: int, replica: EngineCoreClient) -> None:
        assert self._merged is not None
        while True:
            try:
                outputs = await replica.get_output()
            except EngineDeadError as exc:
                self._merged.put_nowait(
                    EngineDeadError(f"Data-parallel engine core {rank} is dead: {exc}")
                )
                return
            self._merged.put_nowait((rank, outputs))

    async def get_output(self) -> EngineCoreOutputs:
        self._ensure_pumps()
        assert self._merged is not None
        item = await self._merged.get()
        if isinstance(item, EngineDeadError):
            self._merged.put_nowait(item)  # every later call fails the same way
            if self._dead_error is None:
                self._dead_error = item
                self._abort_on_survivors()
            raise self._dead_error
        rank, outputs = item
        for output in outputs.outputs:
            if output.finished:
                self._replica_of.pop(output.request_id, None)
        if outputs.scheduler_stats is not None:
            outputs.scheduler_stats = self._merge_stats(rank, outputs.scheduler_stats)
        self._maybe_log()
        return outputs

    def _abort_on_survivors(self) -> None:
        """The front end fails every request once one replica is dead: stop the others'."""
        self.abort_requests(list(self._replica_of))

    def _merge_stats(self, rank: int, stats: SchedulerStats) -> SchedulerStats:
        self._latest_stats[rank] = stats
        self.router.record_stats(rank, stats.num_waiting_reqs, stats.num_running_reqs)
        latest = [s for s in self._latest_stats if s is not None]
        used_blocks = sum(
            s.kv_cache_usage * blocks
            for s, blocks in zip(self._latest_stats, self._num_kv_blocks)
            if s is not None
        )
        return msgspec.structs.replace(
            stats,
            num_running_reqs=sum(s.num_running_reqs for s in latest),
            num_waiting_reqs=sum(s.num_waiting_reqs for s in latest),
            kv_cache_usage=used_blocks / max(sum(self._num_kv_blocks), 1),
            num_preemptions=sum(s.num_preemptions for s in latest),
        )

    # ------------------------------------------------------------------------ utility

    async def call_utility(self, method: str, *args: Any) -> Any:
        """Asks every replica and combines the answers as one engine would give them."""
        if method not in UTILITY_METHODS:
            raise ValueError(f"unknown utility method {method!r}")
        self._check_alive()
        self._ensure_pumps()  # a replica's utility answers arrive through its output reader
        results = await asyncio.gather(*(r.call_utility(method, *args) for r in self.replicas))
        if method == "reset_prefix_cache":
            return all(bool(r) for r in results)
        if method == "get_kv_cache_usage":
            return self._mean_usage([float(r) for r in results])
        if method == "get_scheduler_stats":
            for rank, r in enumerate(results):  # fresh counts: better than the last step's
                self.router.record_stats(rank, r["num_waiting_reqs"], r["num_running_reqs"])
            combined = {
                key: sum(r[key] for r in results) for key in results[0] if key != "kv_cache_usage"
            }
            combined["kv_cache_usage"] = self._mean_usage([r["kv_cache_usage"] for r in results])
            return combined
        # `ping` and any method without a rule above: one answer if all replicas agree.
        if any(r != results[0] for r in results[1:]):
            raise RuntimeError(
                f"Data-parallel engine cores disagree on {method!r}: {results!r} "
                "(dp_client.DPAsyncMPClient.call_utility has no rule to combine them)."
            )
        return results[0]

    def _mean_usage(self, usages: list[float]) -> float:
        """Fraction of the group's KV blocks in use (replicas weighted by their blocks)."""
        total = sum(self._num_kv_blocks)
        return sum(u * b for u, b in zip(usages, self._num_kv_blocks)) / max(total, 1)

    # --------------------------------------------------------------------- inspection

    def replica_loads(self) -> list[dict[str, int]]:
        """Per replica: requests routed to it since start, and its waiting / running counts
        as the router sees them now (for tests, logs and metrics)."""
        r = self.router
        return [
            {
                "num_routed_reqs": r.num_routed[rank],
                "num_waiting_reqs": r.num_waiting[rank],
                "num_running_reqs": r.num_running[rank],
            }
            for rank in range(r.num_replicas)
        ]

    def _maybe_log(self) -> None:
        """Every `log_stats_interval_s` while outputs flow, one line of per-replica load next
        to the front end's merged stats line (vLLM logs one line per engine instead)."""
        now = time.monotonic()
        if not 0 < self._log_interval_s <= now - self._last_log:
            return
        self._last_log = now
        usage = [s.kv_cache_usage if s is not None else 0.0 for s in self._latest_stats]
        logger.info(
            "Data parallel: routed %s requests, running %s, waiting %s, KV cache usage [%s].",
            self.router.num_routed, self.router.num_running, self.router.num_waiting,
            ", ".join(f"{u * 100:.1f}%" for u in usage),
        )  # fmt: skip

    # ----------------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            for task in self._pumps:
                loop.call_soon_threadsafe(task.cancel)
        logger.info("Data parallel: requests routed per engine core: %s.", self.router.num_routed)
        # In parallel: each replica's shutdown waits up to ~10 s for its process to exit.
        with ThreadPoolExecutor(len(self.replicas), thread_name_prefix="dp-stop") as pool:
            for future in [pool.submit(r.shutdown) for r in self.replicas]:
                try:
                    future.result()
                except Exception:  # best effort: one replica's failure must not keep others
                    logger.exception("Shutting down a data-parallel engine core failed.")
        if self._ray_group is not None:
            self._ray_group.close()
