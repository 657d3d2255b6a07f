"""Bounds on what one HTTP client can make the server hold: the size of a request body, the
time it may take to send its head and its body.

- `RequestBodyLimits` (ASGI middleware): reads a request's whole body before the app sees it,
  answering 413 (OpenAI's error shape) when it passes `max_bytes` (the excess is read and
  dropped, holding no memory, so that the client reads the answer rather than a reset
  connection) and 408 when it has not arrived within `timeout_s`; the app then gets the
  body in one message, and the connection's later messages (a disconnect) as they come.
  Without it, a client sending half a body holds a connection and a handler forever, and a
  10 MB body is parsed and tokenized before anything looks at its size.
- `protocol_with_head_timeout` (uvicorn's h11 protocol): closes a connection whose request
  head (line and headers) is not complete `timeout_s` after its first byte. uvicorn times out
  idle keep-alive connections but not one that sends a partial head (slowloris): its own
  `timeout_keep_alive` is disarmed by the first byte.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedinfer.entrypoints.anthropic.serving_messages import anthropic_error
from pagedinfer.entrypoints.openai.serving_engine import error_response

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = [
    "DEFAULT_CLIENT_TIMEOUT_S",
    "DEFAULT_MAX_REQUEST_BYTES",
    "RequestBodyLimits",
    "protocol_with_head_timeout",
]

DEFAULT_MAX_REQUEST_BYTES = 8 << 20
DEFAULT_CLIENT_TIMEOUT_S = 30.0


class RequestBodyLimits:
    """ASGI middleware: a request's body, whole, within `max_bytes` and `timeout_s`."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except asyncio.TimeoutError:
                text = f"The request body did not arrive within {self.timeout_s:g} s."
                await self._refuse(scope, receive, send, 408, text)
                return
            if message["type"] == "http.disconnect":
                # The client left before its body was complete: the answer goes nowhere,
                # but the middlewares above expect one (and a 400 is no server error).
                text = "The client closed the connection before the body was complete."
                await self._refuse(scope, receive, send, 400, text)
                return
            size += len(message.get("body", b""))
            if size <= self.max_bytes:
                chunks.append(message.get("body", b""))
            else:
                chunks = []  # too large: read on (within the time limit) but keep nothing
            if not message.get("more_body", False):
                break
        if size > self.max_bytes:
            # Answered once the body is read: a connection closed with unread data resets,
            # and the client would see that instead of the 413.
            await self._refuse(scope, receive, send, 413, self._too_large(size))
            return
        whole: list[Message] = [{"type": "http.request", "body": b"".join(chunks)}]

        async def replay() -> Message:
            return whole.pop() if whole else await receive()

        await self.app(scope, replay, send)

    def _too_large(self, size: int) -> str:
        return (
            f"The request body is {size} bytes; this server takes at most "
            f"{self.max_bytes} (--max-request-bytes)."
        )

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, status: int, text: str) -> None:
        if scope.get("path") == "/v1/messages":
            response = anthropic_error(status, text)
        else:
            response = error_response(status, text)
        # The rest of the body is never read: the connection cannot carry another request.
        response.headers["Connection"] = "close"
        await response(scope, receive, send)


def protocol_with_head_timeout(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request head is incomplete
    `timeout_s` after the request's first byte, or after the connection opened for its
    first request (uvicorn's keep-alive timeout covers the wait between requests, nothing
    the wait for the first: an idle connection was held forever). Pass as
    `uvicorn.Config(http=...)`."""

    class HeadTimeoutH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._head_timer = self.loop.call_later(timeout_s, self._head_timed_out)

        def data_received(self, data: bytes) -> None:
            between_requests = self.cycle is None or self.cycle.response_complete
            if between_requests and self._head_timer is None:
                self._head_timer = self.loop.call_later(timeout_s, self._head_timed_out)
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:
                self._cancel_head_timer()  # the head is in: the body has its own limit

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            super().connection_lost(exc)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return HeadTimeoutH11Protocol
