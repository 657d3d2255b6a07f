"""`RayMPClient`: an engine core in a Ray actor, driven over TCP sockets.

Data-parallel replicas with `data_parallel_backend="ray"` (see `dp_replicas`) run the same
engine core body (`core_proc.run_engine_core`) as `AsyncMPClient`'s child process, but in
a Ray actor, possibly on another machine; the same two sockets of `SocketClient` are bound
on TCP ports of this node's IP instead of ipc paths: the same messages, the same code on
both ends. Ray only starts the actor and tells us when it is gone; see `RayMPClient`.

`EngineCoreActor` is the actor's body and `engine_core_actor_class` its remote class
(made on first use, so that importing this module does not import Ray); `EngineCoreNode`
is where an actor runs.
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any, NamedTuple

from pagedinfer.config import EngineConfig
from pagedinfer.distributed.ray_utils import first_line, ray_is_connected
from pagedinfer.engine.core_client import SocketClient
from pagedinfer.engine.core_proc import run_engine_core

__all__ = ["EngineCoreActor", "EngineCoreNode", "RayMPClient", "engine_core_actor_class"]


class EngineCoreNode(NamedTuple):
    """Where an `EngineCoreActor` runs."""

    node_id: str
    """Ray's id of the node."""
    ip: str
    cpu_count: int
    pid: int


class EngineCoreActor:
    """The body of the Ray actor that runs one engine core (`engine_core_actor_class` makes
    it a remote class, so that importing this module does not import Ray). An actor is a
    process of its own: `run` is that process's engine core for as long as it lives."""

    def node_info(self) -> EngineCoreNode:
        import ray

        node_id = ray.get_runtime_context().get_node_id()
        return EngineCoreNode(
            node_id, ray.util.get_node_ip_address(), os.cpu_count() or 1, os.getpid()
        )

    def run(self, config_json: str, input_address: str, output_address: str) -> None:
        """`core_proc.run_engine_core`, connecting to the front end's TCP sockets; returns
        when the engine exits. No parent-process check: Ray kills this actor when the
        front end's process (its owner) is gone."""
        run_engine_core(config_json, input_address, output_address, parent_pid=None)


@cache
def engine_core_actor_class() -> Any:
    import ray

    # One call at a time (Ray's default for an actor): `node_info`, then `run` for good.
    return ray.remote(EngineCoreActor)


class RayMPClient(SocketClient):
    """The engine core in a Ray actor that is already placed (`dp_replicas` reserves its CPUs
    and creates it), over TCP sockets bound on this node's IP as Ray knows it (the address
    the other nodes reach this one at) and a port the OS picks.

    Liveness: `run` is the actor's one long call, and its ref stands for the engine's
    process: it fails the moment the actor dies (the watch-call pattern of
    `RayDistributedExecutor`), and the monitor thread marks the client dead then. The other
    direction needs nothing of ours: Ray kills the actor when this process, its owner,
    goes. A send to an engine that is gone would block for ever on a PUSH socket with no
    peer, so the input socket has a send timeout, and `_send` retries until the monitor
    has marked the engine dead (a live engine that is merely slow to read just takes
    longer). `shutdown` sends SHUTDOWN, gives the engine 10 s to exit, then kills the actor
    (a returned `run` leaves the actor's process idle, not gone) and joins the monitor.

    The ports take any peer that can reach them (msgpack, never pickle: a stranger can
    send requests, not code): run the cluster on a trusted network, as Ray itself requires.
    """

    _send_timeout_ms = 200

    def __init__(
        self,
        config: EngineConfig,
        actor: Any,
        node: EngineCoreNode,
        startup_timeout_s: float = 900.0,
    ) -> None:
        import ray

        self.actor = actor
        self.node = node
        self.engine_location = f"Ray actor pid {node.pid} on {node.ip}"
        self._host = ray.util.get_node_ip_address()
        self._run_ref: Any = None
        super().__init__(config, startup_timeout_s)

    def _bind(self, socket: Any, name: str) -> str:
        import zmq

        host = self._host
        if ":" in host:  # IPv6: bracketed, and ZMQ's IPv6 switch on
            socket.setsockopt(zmq.IPV6, 1)
            host = f"[{host}]"
        socket.bind(f"tcp://{host}:*")
        return socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def _start_engine(self, config_json: str, input_address: str, output_address: str) -> None:
        self._run_ref = self.actor.run.remote(config_json, input_address, output_address)

    def _run_outcome(self) -> str:
        """How the finished `run` call ended."""
        import ray

        try:
            ray.get(self._run_ref)
        except Exception as exc:
            return first_line(exc)
        return "its engine core exited"

    def _startup_failure(self) -> str | None:
        import ray

        if not ray.wait([self._run_ref], timeout=0)[0]:
            return None
        return f"Engine core ({self.engine_location}) died during startup: {self._run_outcome()}"

    def _wait_engine_gone(self) -> str:
        import ray

        # Polls `_closed`: `shutdown` joins this thread, which must make no Ray call after
        # the connection is closed (Ray would answer it by starting a local cluster).
        while not self._closed and ray_is_connected():
            try:
                done, _ = ray.wait([self._run_ref], timeout=1.0)
            except Exception as exc:  # pragma: no cover - the connection broke
                return f"Engine core ({self.engine_location}): Ray failed: {exc}"
            if done:
                return f"Engine core ({self.engine_location}) is gone: {self._run_outcome()}"
        # Disconnected from Ray: the actor went with this process's Ray job.
        return f"Engine core ({self.engine_location}): this process left the Ray cluster."

    def _stop_engine(self) -> None:
        import ray

        if not ray_is_connected():  # the actor went with the connection
            return
        try:
            if not ray.wait([self._run_ref], timeout=0)[0]:
                self._send_shutdown()  # zmq.Again (the engine is gone) skips the wait
                ray.wait([self._run_ref], timeout=10)
        except Exception:  # best effort: the actor is killed below
            pass
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # already gone
            pass
        if self._monitor is not None:
            self._monitor.join()
