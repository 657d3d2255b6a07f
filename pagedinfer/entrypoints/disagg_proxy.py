"""Disaggregated prefill/decode proxy (`pagedinfer disagg-proxy`), after vLLM's design.

Clients talk to the proxy as to one OpenAI-compatible server. Behind it are two pools of
pagedinfer servers: *prefill* instances compute prompts, *decode* instances generate. For each
`POST /v1/completions` or `POST /v1/chat/completions`:

1. A prefill instance (chosen by the policy) gets a copy of the body with `max_tokens: 1`
   (and `max_completion_tokens: 1` where the body has it), `stream: false`, no
   `stream_options`, and `kv_transfer_params: {"do_remote_decode": true}`: it computes the
   prompt's KV cache, keeps it for a decode instance to pull, and answers with a top-level
   `kv_transfer_params` saying where the blocks are (or null).
2. A decode instance gets the client's original body plus that `kv_transfer_params` (left
   out when the prefill gave none: the decode instance then computes the prompt itself). Its
   answer is the client's: a JSON reply with its status code, or, for `stream: true`, its
   server-sent events passed through byte for byte as they arrive.

Policies (`round_robin`, `least_loaded`) pick separately in each pool; least_loaded takes the
instance with the fewest requests this proxy has in flight to it, ties broken by rotation.

Faults: an instance that refuses the connection, does not connect within
`connect_timeout_s`, closes the connection, answers 5xx or does not answer within
`request_timeout_s` is skipped for the next one in its pool (each is tried once); when all
fail the client gets 503 naming them. A 4xx is the client's fault and is returned as is (a
4xx from prefill: decode is not called). For a streamed decode, `request_timeout_s` bounds the
wait for the response headers and each gap between chunks, not the whole generation.

A client that goes away cancels whatever the proxy is waiting on: the prefill call, the decode
call, or the decode stream. The upstream connection is closed, so the upstream server sees the
disconnect and aborts the request (freeing its KV blocks).

Also: `GET /health` (each instance's `/health`, 503 unless at least one prefill and one
decode instance answer 200) and `GET /v1/models` (from the first decode instance that
answers). The client's `Authorization` header goes to the upstreams with every call, and the
prefill and decode calls of one request share an `X-Request-Id`.

The upstream side (pools, policies, failover, replies, the stream relay and the client's
disconnect) is `proxy_upstream`; this module routes each request through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import pagedinfer
from pagedinfer.entrypoints.proxy_upstream import (
    TRANSPORT_ERRORS,
    AllFailed,
    ClientGone,
    Policy,
    Relay,
    RelayResponse,
    Reply,
    Upstream,
    UpstreamFailed,
    UpstreamPool,
    describe,
    read_reply,
    try_each,
    until_disconnect,
)

__all__ = ["build_app", "run_proxy"]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Request bodies and errors
# ---------------------------------------------------------------------------------------------


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill call's body: one token, no streaming, KV kept for a remote decode."""
    out = copy.deepcopy(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out.pop("min_tokens", None)  # min_tokens > 1 would be an error with max_tokens 1
    out.pop("n", None)  # one prompt computed once (the servers refuse n > 1 with KV params)
    out["kv_transfer_params"] = {"do_remote_decode": True}
    return out


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """The decode call's body: the client's, plus where the prefill left the KV cache."""
    out = dict(body)
    out.pop("kv_transfer_params", None)
    if kv_transfer_params is not None:
        out["kv_transfer_params"] = kv_transfer_params
    return out


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "code": status}}, status_code=status
    )


def _unavailable(exc: AllFailed) -> JSONResponse:
    return _error(503, str(exc), "ServiceUnavailable")


# ---------------------------------------------------------------------------------------------
# The proxy
# ---------------------------------------------------------------------------------------------


class Proxy:
    """The pools, the timeouts and the shared aiohttp session (open while the app runs)."""

    def __init__(
        self,
        prefill_urls: Sequence[str],
        decode_urls: Sequence[str],
        policy: Policy,
        request_timeout_s: float,
        connect_timeout_s: float,
    ) -> None:
        if request_timeout_s <= 0 or connect_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        self.prefill = UpstreamPool("prefill", prefill_urls, policy)
        self.decode = UpstreamPool("decode", decode_urls, policy)
        # Prefill and non-streamed calls: the whole call is bounded.
        self.call_timeout = aiohttp.ClientTimeout(
            total=request_timeout_s, sock_connect=connect_timeout_s
        )
        # Streamed decode: the headers and each gap between chunks are, the generation is not.
        self.stream_timeout = aiohttp.ClientTimeout(
            sock_read=request_timeout_s, sock_connect=connect_timeout_s
        )
        self.probe_timeout = aiohttp.ClientTimeout(total=connect_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # Idle connections are dropped before uvicorn's 5 s keep-alive closes them, so a
        # request never goes out on a connection the server is closing.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0)
        self._session = aiohttp.ClientSession(connector=connector)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the proxy's HTTP session is not open (app not started)")
        return self._session

    async def post(
        self, upstream: Upstream, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> Reply:
        """A complete call (5xx: UpstreamFailed)."""
        with upstream.busy():
            async with self.session.post(
                upstream.url + path, json=body, headers=headers, timeout=self.call_timeout
            ) as resp:
                return await read_reply(resp)

    async def prefill_call(
        self, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> tuple[Upstream, Reply, dict[str, Any] | None]:
        """The prefill call, with failover: the instance, its reply and its
        kv_transfer_params (None for a 4xx reply, which goes back to the client)."""

        async def attempt(upstream: Upstream) -> tuple[Upstream, Reply, dict[str, Any] | None]:
            reply = await self.post(upstream, path, prefill_body(body), headers)
            if reply.status >= 400:
                return upstream, reply, None
            try:
                data = json.loads(reply.body)
            except ValueError:
                raise UpstreamFailed(f"HTTP {reply.status} with a body that is not JSON") from None
            kv = data.get("kv_transfer_params") if isinstance(data, dict) else None
            if kv is not None and not isinstance(kv, dict):
                logger.warning(
                    "prefill instance %s: kv_transfer_params %r ignored (not an object)",
                    upstream.url,
                    kv,
                )
                kv = None
            return upstream, reply, kv

        return await try_each(self.prefill, attempt)

    async def decode_call(
        self, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> tuple[Upstream, Reply]:
        async def attempt(upstream: Upstream) -> tuple[Upstream, Reply]:
            return upstream, await self.post(upstream, path, body, headers)

        return await try_each(self.decode, attempt)

    async def decode_stream(
        self, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> Relay | tuple[Upstream, Reply]:
        """The streamed decode call, with failover: a Relay once an instance answers 2xx, or
        a complete 4xx reply."""

        async def attempt(upstream: Upstream) -> Relay | tuple[Upstream, Reply]:
            with upstream.busy():
                resp = await self.session.post(
                    upstream.url + path, json=body, headers=headers, timeout=self.stream_timeout
                )
                try:
                    if resp.status >= 300:
                        async with resp:
                            return upstream, await read_reply(resp)
                    return Relay(upstream, resp)
                except BaseException:
                    resp.close()
                    raise

        return await try_each(self.decode, attempt)

    async def probe(self, upstream: Upstream) -> bool:
        try:
            async with self.session.get(
                upstream.url + "/health", timeout=self.probe_timeout
            ) as resp:
                return resp.status == 200
        except TRANSPORT_ERRORS:
            return False

    async def health(self) -> JSONResponse:
        pools = (self.prefill, self.decode)
        ups = [u for pool in pools for u in pool.upstreams]
        healthy = dict(zip((u.url for u in ups), await asyncio.gather(*map(self.probe, ups))))
        report: dict[str, Any] = {
            pool.role: [
                {"url": u.url, "healthy": healthy[u.url], "in_flight": u.in_flight}
                for u in pool.upstreams
            ]
            for pool in pools
        }
        ok = all(any(healthy[u.url] for u in pool.upstreams) for pool in pools)
        report["status"] = "ok" if ok else "unavailable"
        return JSONResponse(report, status_code=200 if ok else 503)

    async def models(self, headers: dict[str, str]) -> Response:
        """`/v1/models` of the first decode instance that answers (in list order: this does
        not move the policy's rotation)."""
        errors: list[str] = []
        for upstream in self.decode.upstreams:
            try:
                async with self.session.get(
                    upstream.url + "/v1/models", headers=headers, timeout=self.call_timeout
                ) as resp:
                    return (await read_reply(resp)).response()
            except (UpstreamFailed, *TRANSPORT_ERRORS) as exc:
                errors.append(f"{upstream.url} ({describe(exc)})")
        return _unavailable(AllFailed("decode", errors))

    async def handle(self, request: Request, path: str) -> Response:
        """One completion request: prefill, then decode, then the decode's answer."""
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            return _error(400, f"The body is not valid JSON: {exc}", "BadRequestError")
        if not isinstance(body, dict):
            return _error(400, "The body must be a JSON object.", "BadRequestError")
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        headers = {"X-Request-Id": request_id}
        if (auth := request.headers.get("authorization")) is not None:
            headers["Authorization"] = auth

        try:
            prefill, reply, kv = await until_disconnect(
                request.receive, self.prefill_call(path, body, headers)
            )
            if reply.status >= 400:  # the client's mistake: decode is not called
                logger.debug(
                    "%s %s: prefill %s answered %d", request_id, path, prefill.url, reply.status
                )
                return reply.response()
            decode_req = decode_body(body, kv)
            if body.get("stream"):
                result = await until_disconnect(
                    request.receive, self.decode_stream(path, decode_req, headers)
                )
            else:
                result = await until_disconnect(
                    request.receive, self.decode_call(path, decode_req, headers)
                )
        except AllFailed as exc:
            return _unavailable(exc)
        except ClientGone:
            logger.debug("%s %s: the client went away", request_id, path)
            return Response(status_code=499)  # nobody reads it

        if isinstance(result, Relay):
            decode, response = result.upstream, RelayResponse(result)
        else:
            decode, response = result[0], result[1].response()
        logger.debug(
            "%s %s: prefill %s -> decode %s (kv_transfer_params: %s)",
            request_id,
            path,
            prefill.url,
            decode.url,
            "yes" if kv else "none",
        )
        return response


def build_app(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    policy: Policy = "round_robin",
    request_timeout_s: float = 600.0,
    connect_timeout_s: float = 5.0,
) -> FastAPI:
    """The proxy's app over these prefill and decode base URLs (e.g. http://127.0.0.1:8100).
    The app's lifespan opens and closes the shared HTTP session; `app.state.proxy` is the
    Proxy (its pools hold the instances' in-flight counts)."""
    proxy = Proxy(prefill_urls, decode_urls, policy, request_timeout_s, connect_timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await proxy.start()
        try:
            yield
        finally:
            await proxy.close()

    app = FastAPI(
        title="pagedinfer disagg-proxy", version=pagedinfer.__version__, lifespan=lifespan
    )
    app.state.proxy = proxy

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy.handle(request, "/v1/chat/completions")

    @app.get("/health")
    async def health() -> Response:
        return await proxy.health()

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        auth = request.headers.get("authorization")
        return await proxy.models({"Authorization": auth} if auth is not None else {})

    return app


def run_proxy(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    host: str = "127.0.0.1",
    port: int = 8000,
    policy: Policy = "round_robin",
    request_timeout_s: float = 600.0,
    connect_timeout_s: float = 5.0,
) -> int:
    """Serve the proxy until Ctrl-C; 0, or 1 if it could not start (e.g. the port is taken)."""
    import uvicorn

    app = build_app(prefill_urls, decode_urls, policy, request_timeout_s, connect_timeout_s)
    server = uvicorn.Server(
        uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
    )

    async def serve() -> None:
        task = asyncio.ensure_future(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            print(
                f"disagg-proxy on http://{host}:{port} ({policy}): prefill "
                f"{' '.join(prefill_urls)} -> decode {' '.join(decode_urls)} (Ctrl-C stops)",
                flush=True,
            )
        await task

    asyncio.run(serve())
    return 0 if server.started else 1
