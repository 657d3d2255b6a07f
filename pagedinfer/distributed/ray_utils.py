"""Ray helpers shared by the Ray executor and the Ray data-parallel clients.

`connect_to_cluster` joins the existing cluster `RAY_ADDRESS` names and never starts one
(an unreachable address fails within seconds, naming `ray start --head`, instead of Ray's
minutes of retries); `ray_is_connected` tells the monitors when the connection, and with it
every actor of this job, is gone; `first_line` shortens a Ray error to its message.

Callers: `executor/ray_executor.py` (workers as actors), `engine/ray_client.py` and
`engine/dp_replicas.py` (engine cores as actors). Ray is imported inside the functions, so
importing this module does not import Ray.
"""

from __future__ import annotations

import logging
import socket

from pagedinfer import envs

__all__ = ["connect_to_cluster", "first_line", "placement_failure", "ray_is_connected"]

# A TCP connect to the cluster's GCS before ray.init, which retries an unreachable address
# for minutes instead of failing.
_CONNECT_TIMEOUT_S = 5.0


def first_line(exc: BaseException) -> str:
    """An exception's first line (a Ray error's message carries the remote traceback)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def placement_failure(
    what: str, per_bundle: str, strategy: str, timeout_s: float, lower: str
) -> str:
    """The error for a placement group the cluster could not place within `timeout_s`: what
    it asked for, what the cluster has, and the two ways out (more nodes, or lowering
    `lower`)."""
    import ray

    return (
        f"The Ray cluster could not place {what} ({per_bundle}, strategy {strategy}) within "
        f"{timeout_s:g} s: it has {ray.available_resources().get('CPU', 0):g} free CPUs of "
        f"{ray.cluster_resources().get('CPU', 0):g}. Add nodes (`ray start "
        f"--address=HEAD_IP:6379`) or lower the {lower}."
    )


def ray_is_connected() -> bool:
    """Whether this process is connected to a Ray cluster (a monitor's loop ends when not)."""
    import ray

    return ray.is_initialized()


def connect_to_cluster(who: str) -> bool:
    """Connect this process to the existing Ray cluster `RAY_ADDRESS` names (default
    "auto": the one `ray start` left on this machine), unless it is connected already.
    Never starts a cluster. True if this call made the connection (its caller then
    disconnects when done). `who`: for the error, e.g. "the ray executor connects to"."""
    import ray

    if ray.is_initialized():  # the caller connected already: use (and keep) it
        return False
    address = envs.ray_address()
    if address == "local":
        raise ValueError(
            f"RAY_ADDRESS=local would start a Ray cluster inside this process; {who} an "
            "existing one: start one with `ray start --head`."
        )
    _check_reachable(address)
    ray.init(address=address, logging_level=logging.WARNING)
    return True


def _check_reachable(address: str) -> None:
    """Fail fast, naming `ray start --head`, if no Ray cluster answers at `address`:
    `ray.init` itself would retry an unreachable address for minutes."""
    if address.startswith("ray://"):  # Ray Client: ray.init reports its own errors
        return
    try:
        # The address exactly as ray.init will resolve it ("auto": the cluster that `ray
        # start` left on this machine; a loopback IP: the node's own IP, as Ray does).
        from ray._private.services import canonicalize_bootstrap_address_or_die
    except ImportError:  # pragma: no cover - a Ray without this helper: ray.init decides
        return
    hint = (
        "start one with `ray start --head` (and `ray start --address=HEAD_IP:6379` on the "
        "other machines), or point RAY_ADDRESS at a running cluster"
    )
    try:
        bootstrap = canonicalize_bootstrap_address_or_die(address)
    except ConnectionError as exc:
        raise ConnectionError(f"No Ray cluster found (RAY_ADDRESS={address!r}): {hint}.") from exc
    host, _, port = bootstrap.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=_CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        raise ConnectionError(
            f"No Ray cluster reachable at {bootstrap} (RAY_ADDRESS={address!r}: {exc}): {hint}."
        ) from exc
