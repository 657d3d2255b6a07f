"""The upstream side of `pagedinfer disagg-proxy`: the prefill and decode instances, the calls
to them and the relay of their bytes back to the client.

An `UpstreamPool` holds one role's instances and orders them per request by the policy
(`round_robin`, or `least_loaded`: the fewest calls this proxy has in flight to it, ties broken
by rotation). `try_each` runs one call on a pool's instances in that order until one succeeds:
a transport error (refused, connect or read timeout, closed connection) or an `UpstreamFailed`
(5xx, or a 2xx the proxy cannot use) moves on to the next instance, and `AllFailed` names each
one's error when none succeeds. A complete answer is a `Reply`; an open streamed answer is a
`Relay`, sent on to the client by a `RelayResponse`. `until_disconnect` cancels whatever the
proxy waits on when the client goes away (`ClientGone`), and closing an upstream connection
makes the upstream server see the disconnect and abort the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

import aiohttp
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

__all__ = [
    "POLICIES",
    "TRANSPORT_ERRORS",
    "AllFailed",
    "ClientGone",
    "Policy",
    "Relay",
    "RelayResponse",
    "Reply",
    "Upstream",
    "UpstreamFailed",
    "UpstreamPool",
    "describe",
    "read_reply",
    "try_each",
    "until_disconnect",
]

logger = logging.getLogger(__name__)

Policy = Literal["round_robin", "least_loaded"]
POLICIES: tuple[str, ...] = ("round_robin", "least_loaded")

T = TypeVar("T")

# What makes an instance "failed" (try the next one): refused, connect timeout, connection
# closed, read timeout (aiohttp's timeouts are TimeoutError subclasses), a broken body.
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientError, asyncio.TimeoutError)


# ---------------------------------------------------------------------------------------------
# Upstream instances and the policies over them
# ---------------------------------------------------------------------------------------------


@dataclass
class Upstream:
    """One pagedinfer server; `in_flight` counts the proxy's open calls to it."""

    url: str
    in_flight: int = 0

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1


class UpstreamPool:
    """The prefill or the decode instances, and the policy that orders them per request."""

    def __init__(self, role: str, urls: Sequence[str], policy: Policy) -> None:
        if not urls:
            raise ValueError(f"at least one {role} URL is needed")
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; expected one of {POLICIES}")
        self.role = role
        self.policy = policy
        self.upstreams = [Upstream(url.rstrip("/")) for url in urls]
        self._next = 0  # rotation index: round robin, and least_loaded's tie break

    def order(self) -> list[Upstream]:
        """Every instance once, in the order to try them for one request: the policy's choice
        first, then the rest (failover)."""
        n = len(self.upstreams)
        start, self._next = self._next, (self._next + 1) % n
        rotated = [self.upstreams[(start + i) % n] for i in range(n)]
        if self.policy == "least_loaded":
            rotated.sort(key=lambda u: u.in_flight)  # stable: equal loads keep the rotation
        return rotated


class UpstreamFailed(Exception):
    """One instance could not serve the call (5xx, or a 2xx the proxy cannot use)."""


class AllFailed(Exception):
    """Every instance of a pool failed; the message names each with its error."""

    def __init__(self, role: str, errors: list[str]) -> None:
        super().__init__(f"No {role} instance could serve the request: " + "; ".join(errors))


class ClientGone(Exception):
    """The client disconnected while the proxy was waiting on an upstream."""


def describe(exc: BaseException) -> str:
    """A short reason for an instance's failure, for the logs and the client's 503."""
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    if isinstance(exc, aiohttp.ClientConnectorError):
        if isinstance(exc.os_error, ConnectionRefusedError):
            return "connection refused"
        return f"cannot connect: {exc.os_error}"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "closed the connection"
    return str(exc) or type(exc).__name__


async def try_each(pool: UpstreamPool, attempt: Callable[[Upstream], Awaitable[T]]) -> T:
    """`attempt(instance)` on the pool's instances in the policy's order until one succeeds;
    AllFailed when none does."""
    errors: list[str] = []
    for upstream in pool.order():
        try:
            return await attempt(upstream)
        except (UpstreamFailed, *TRANSPORT_ERRORS) as exc:
            logger.warning("%s instance %s failed: %s", pool.role, upstream.url, describe(exc))
            errors.append(f"{upstream.url} ({describe(exc)})")
    raise AllFailed(pool.role, errors)


# ---------------------------------------------------------------------------------------------
# Upstream answers: complete, or relayed as they stream
# ---------------------------------------------------------------------------------------------


@dataclass
class Reply:
    """A complete upstream answer."""

    status: int
    body: bytes
    content_type: str

    def response(self) -> Response:
        return Response(self.body, status_code=self.status, media_type=self.content_type)


async def read_reply(resp: aiohttp.ClientResponse) -> Reply:
    """The whole answer; UpstreamFailed for a 5xx."""
    body = await resp.read()
    reply = Reply(resp.status, body, resp.headers.get("Content-Type", "application/json"))
    if reply.status >= 500:
        raise UpstreamFailed(f"HTTP {reply.status}: {body[:200].decode(errors='replace')}")
    return reply


def _sse_error(message: str) -> bytes:
    body = {"error": {"message": message, "type": "ServiceUnavailable", "code": 503}}
    return f"data: {json.dumps(body)}\n\n".encode()


class Relay:
    """An open streamed decode response: its chunks as they arrive; `close()` (idempotent)
    closes the upstream connection, so the upstream server sees a disconnect."""

    def __init__(self, upstream: Upstream, resp: aiohttp.ClientResponse) -> None:
        self.upstream = upstream
        self.resp = resp
        self._closed = False
        upstream.in_flight += 1

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.resp.content.iter_any():
                yield chunk
        except TRANSPORT_ERRORS as exc:
            # The status line is sent: all that is left is to tell the client in the stream.
            logger.warning(
                "decode instance %s failed mid-stream: %s", self.upstream.url, describe(exc)
            )
            yield _sse_error(f"decode instance {self.upstream.url}: {describe(exc)}")
        finally:
            self.close()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.resp.close()
            self.upstream.in_flight -= 1


class RelayResponse(StreamingResponse):
    """Streams a Relay to the client until it ends or the client disconnects; the relay is
    closed however the response ends."""

    def __init__(self, relay: Relay) -> None:
        super().__init__(
            relay.chunks(), status_code=relay.resp.status, media_type="text/event-stream"
        )
        self.relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await until_disconnect(receive, self.stream_response(send))
        except (ClientGone, OSError):
            logger.debug("client went away during the stream from %s", self.relay.upstream.url)
        finally:
            self.relay.close()
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------
# The client going away
# ---------------------------------------------------------------------------------------------


async def _wait_for_disconnect(receive: Receive) -> None:
    # The request body is read: the next ASGI message is the disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive: Receive, call: Awaitable[T]) -> T:
    """`await call`, but cancel it and raise ClientGone if the client disconnects first
    (`receive`: the request's ASGI receive, its body already read)."""
    task = asyncio.ensure_future(call)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # cancelled ourselves
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientGone
