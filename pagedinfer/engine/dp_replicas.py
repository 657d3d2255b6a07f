"""Starting the engine cores of a data-parallel group (`dp_client.DPAsyncMPClient`).

`replica_config` gives each replica its config: with `num_threads` unset, the cores of the
replica's machine shared out among the replicas there. `start_replicas` starts every
replica at once and, if any fails, shuts down the ones that came up.

With `data_parallel_backend="ray"`, `RayReplicaGroup` places the replicas: it connects to
the cluster as `RayDistributedExecutor` does (`RAY_ADDRESS`, default the cluster `ray
start` left on this machine; never a new local one) and reserves a placement group of one
bundle per replica, `{"CPU": tensor x pipeline parallel size}` (the replica's workers are
processes on its actor's node: the "uni" or "mp" executor), spread over the nodes where it
can be ("SPREAD": replicas share nothing, so each gets the most cores). An engine core
actor is created in each bundle, and a `ray_client.RayMPClient` drives it. Closing the
group kills the actors and removes the placement group; if this process dies instead, Ray
ends both with its job.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pagedinfer.config import EngineConfig
from pagedinfer.distributed.ray_utils import (
    connect_to_cluster,
    placement_failure,
    ray_is_connected,
)
from pagedinfer.engine.core_client import EngineCoreClient, SocketClient
from pagedinfer.engine.ray_client import EngineCoreNode, RayMPClient, engine_core_actor_class

logger = logging.getLogger("pagedinfer")

__all__ = ["RayReplicaGroup", "replica_config", "start_replicas"]


def replica_config(
    config: EngineConfig, cpu_count: int | None = None, replicas_sharing: int | None = None
) -> EngineConfig:
    """The config each replica gets: the same, except that with `num_threads` unset the
    cores of the replica's machine are shared out (`cpu_count // replicas_sharing` torch
    threads, at least 1) instead of every replica starting one thread per core and all of
    them fighting. Defaults: this machine's cores, shared by all `data_parallel_size`
    replicas (the "mp" backend); a Ray replica passes its node's cores and the number of
    replicas placed on that node."""
    model = config.model_config
    if model.num_threads is not None:
        return config
    cpus = cpu_count if cpu_count is not None else os.cpu_count() or 1
    sharing = replicas_sharing or config.parallel_config.data_parallel_size
    return dataclasses.replace(
        config, model_config=dataclasses.replace(model, num_threads=max(1, cpus // sharing))
    )


def start_replicas(
    configs: list[EngineConfig], start: Callable[[int, EngineConfig], SocketClient]
) -> list[EngineCoreClient]:
    """All replicas at once (`start(rank, config)`; each loads its model in its own
    process); if any fails, the ones that came up are shut down again and the error names
    the replica."""
    num_replicas = len(configs)
    with ThreadPoolExecutor(num_replicas, thread_name_prefix="dp-start") as pool:
        futures = [pool.submit(start, rank, c) for rank, c in enumerate(configs)]
        results: list[SocketClient | BaseException] = []
        for future in futures:
            try:
                results.append(future.result())
            except BaseException as exc:  # collected: every replica's outcome is needed
                results.append(exc)
    failures = [(rank, r) for rank, r in enumerate(results) if isinstance(r, BaseException)]
    if failures:
        for r in results:
            if isinstance(r, SocketClient):
                r.shutdown()
        rank, error = failures[0]
        raise RuntimeError(f"Data-parallel engine core {rank} failed to start: {error}") from error
    replicas: list[EngineCoreClient] = []
    for rank, replica in enumerate(results):
        assert isinstance(replica, SocketClient)
        logger.info(
            "Data-parallel engine core %d of %d ready (%s, %d KV blocks, %s torch threads).",
            rank, num_replicas, replica.engine_location, replica.info.num_kv_blocks,
            configs[rank].model_config.num_threads,
        )  # fmt: skip
        replicas.append(replica)
    return replicas


class RayReplicaGroup:
    """The Ray side of `data_parallel_backend="ray"` (see the module docstring): the
    connection to the cluster, the placement group and the engine core actors."""

    placement_strategy: str = "SPREAD"
    """Ray placement strategy for the replicas' bundles: "SPREAD" (many nodes, best
    effort), "PACK" (few nodes) or "STRICT_SPREAD" (one replica per node)."""
    placement_timeout_s: float = 60.0
    """How long to wait for the cluster to have the CPUs of every replica."""

    def __init__(self) -> None:
        try:
            import ray  # noqa: F401 - fail early, with the install hint
        except ImportError as exc:
            raise ImportError(
                "data_parallel_backend='ray' needs Ray: pip install 'pagedinfer[ray]'"
            ) from exc
        self.placement_group: Any = None
        self.actors: list[Any] = []
        self._owns_ray_connection = connect_to_cluster(
            "data_parallel_backend='ray' places the engine cores on"
        )

    def start_replicas(
        self, config: EngineConfig, startup_timeout_s: float
    ) -> list[EngineCoreClient]:
        """Reserve the bundles, create one actor in each, and start an engine core in each
        (`RayMPClient`); the clients in rank order."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        parallel = config.parallel_config
        n = parallel.data_parallel_size
        cpus = max(1, parallel.world_size)
        self.placement_group = placement_group(
            [{"CPU": cpus}] * n, strategy=self.placement_strategy
        )
        if not self.placement_group.wait(self.placement_timeout_s):
            raise RuntimeError(
                placement_failure(
                    f"{n} data-parallel engine cores",
                    f"{cpus} CPUs each",
                    self.placement_strategy,
                    self.placement_timeout_s,
                    "data-parallel size",
                )  # fmt: skip
            )
        actor_class = engine_core_actor_class()
        for rank in range(n):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group, placement_group_bundle_index=rank
            )
            self.actors.append(
                actor_class.options(num_cpus=cpus, scheduling_strategy=strategy).remote()
            )
        try:
            nodes: list[EngineCoreNode] = ray.get(
                [a.node_info.remote() for a in self.actors], timeout=startup_timeout_s
            )
        except Exception as exc:
            raise RuntimeError(f"Data-parallel engine core actors failed to start: {exc}") from exc
        # The torch threads of a replica: its node's cores, shared by the replicas there.
        per_node = Counter(node.node_id for node in nodes)
        configs = [replica_config(config, node.cpu_count, per_node[node.node_id]) for node in nodes]
        return start_replicas(
            configs,
            lambda rank, c: RayMPClient(c, self.actors[rank], nodes[rank], startup_timeout_s),
        )

    def close(self) -> None:
        """Kill every actor (those of replicas that never started too), remove the placement
        group, and disconnect if the connection is ours; the cluster stays up."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray_is_connected():  # someone disconnected this process: all went with its job
            return
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        if self.placement_group is not None:
            try:
                remove_placement_group(self.placement_group)
            except Exception as exc:  # the connection is gone: so is the group, with the job
                logger.warning("removing the placement group failed: %s", exc)
        if self._owns_ray_connection:
            ray.shutdown()  # disconnects this driver; the cluster keeps running
