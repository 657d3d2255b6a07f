"""The disaggregated prefill/decode proxy against stub upstreams, all on real loopback sockets.

Each stub is a small aiohttp server imitating `pagedinfer serve`: it records the bodies it
gets, answers a prefill call (`kv_transfer_params.do_remote_decode`) with a top-level
`kv_transfer_params`, and a decode call with a JSON completion or an SSE stream. The prompt
picks a stub's behaviour (see `Stub.handle`). The proxy runs under uvicorn in a thread; the
client is `http.client`, so a disconnect is a real closed socket.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import uvicorn
from aiohttp import web

from pagedinfer.entrypoints.cli import build_parser, main
from pagedinfer.entrypoints.disagg_proxy import build_app
from pagedinfer.entrypoints.proxy_upstream import UpstreamPool

pytestmark = pytest.mark.timeout(30)

KV = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_port": 5600}


# ---------------------------------------------------------------------------------------------
# Stub upstreams
# ---------------------------------------------------------------------------------------------


class StubLoop:
    """An event loop in a thread, hosting the stubs."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def stub_loop() -> Iterator[StubLoop]:
    loop = StubLoop()
    yield loop
    loop.close()


class Stub:
    """A fake pagedinfer server. Prompts: "slow-prefill" / "slow-decode" (that call takes
    1.5 s), "hang-prefill" (never answers the prefill call), "endless" (streams until the
    client goes away), "stall" (streams one chunk, then nothing), "nokv" (the prefill gives
    kv_transfer_params null). `status`: answer every call with this error status instead."""

    def __init__(self, name: str, log: list[tuple[str, str, str]], status: int = 200) -> None:
        self.name = name
        self.log = log  # (stub, role, prompt) in arrival order, shared by a test's stubs
        self.status = status
        self.bodies: list[dict[str, Any]] = []
        self.received = threading.Event()
        self.disconnected = threading.Event()  # a handler saw its client go away
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        # handler_cancellation: a handler is cancelled when its client disconnects.
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    async def stop(self) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    async def health(self, _: web.Request) -> web.Response:
        return web.json_response({})

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "stub"}]})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        prompt = body.get("prompt") or body["messages"][-1]["content"]
        is_prefill = (body.get("kv_transfer_params") or {}).get("do_remote_decode") is True
        role = "prefill" if is_prefill else "decode"
        self.log.append((self.name, role, prompt))
        self.received.set()
        if self.status != 200:
            error = {"error": {"message": f"stub {self.name}", "code": self.status}}
            return web.json_response(error, status=self.status)
        try:
            if prompt == f"slow-{role}":
                await asyncio.sleep(1.5)
            if prompt == f"hang-{role}":
                await asyncio.sleep(60)
            if is_prefill:
                kv = None if prompt == "nokv" else {**KV, "remote_engine_id": self.name}
                choices = [{"index": 0, "text": "x", "finish_reason": "length"}]
                return web.json_response({"choices": choices, "kv_transfer_params": kv})
            if body.get("stream"):
                return await self._stream(request, prompt)
            choices = [{"index": 0, "text": f"{self.name} says hi", "finish_reason": "stop"}]
            return web.json_response({"choices": choices, "served_by": self.name})
        except (asyncio.CancelledError, ConnectionResetError):
            self.disconnected.set()
            raise

    async def _stream(self, request: web.Request, prompt: str) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        count, gap = {"endless": (600, 0.05), "stall": (1, 0.0)}.get(prompt, (4, 0.3))
        for i in range(count):
            chunk = {"choices": [{"index": 0, "text": f"t{i}"}], "served_by": self.name}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(gap)
        if prompt == "stall":
            await asyncio.sleep(60)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@pytest.fixture
def stubs(stub_loop: StubLoop) -> Iterator[Any]:
    """`make(name, status=200)` starts a stub; all are stopped after the test."""
    log: list[tuple[str, str, str]] = []
    made: list[Stub] = []

    def make(name: str, status: int = 200) -> Stub:
        stub = Stub(name, log, status)
        stub_loop.run(stub.start())
        made.append(stub)
        return stub

    make.log = log  # type: ignore[attr-defined]
    yield make
    for stub in made:
        stub_loop.run(stub.stop())


def closed_port_url() -> str:
    """A loopback URL where nothing listens (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@contextmanager
def silent_listener() -> Iterator[str]:
    """A URL whose socket completes the TCP handshake (the kernel's backlog) and never
    answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


# ---------------------------------------------------------------------------------------------
# The proxy and its client
# ---------------------------------------------------------------------------------------------


class ProxyServer:
    def __init__(self, app: Any, port: int) -> None:
        self.app = app
        self.port = port

    @property
    def proxy(self) -> Any:
        return self.app.state.proxy

    def connect(self, timeout: float = 10.0) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any, float]:
        """(status, the decoded JSON body, seconds taken)."""
        start = time.monotonic()
        conn = self.connect()
        try:
            data = None if body is None else json.dumps(body)
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        return resp.status, json.loads(raw), time.monotonic() - start

    def post(self, body: dict[str, Any], path: str = "/v1/completions") -> tuple[int, Any, float]:
        return self.request("POST", path, body)

    def open_stream(
        self, body: dict[str, Any], path: str = "/v1/completions"
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = self.connect()
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "x/json"})
        return conn, conn.getresponse()


def read_event(resp: http.client.HTTPResponse) -> str | None:
    """The next SSE `data:` payload, or None at the end of the stream."""
    while True:
        line = resp.readline()
        if not line:
            return None
        if line.startswith(b"data: "):
            return line[len(b"data: ") :].decode().strip()


@contextmanager
def running_proxy(prefill: list[str], decode: list[str], **options: Any) -> Iterator[ProxyServer]:
    app = build_app(prefill, decode, **options)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "proxy did not start"
            time.sleep(0.02)
        yield ProxyServer(app, sock.getsockname()[1])
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def wait_until(condition: Any, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def in_flight(proxy: ProxyServer) -> list[int]:
    pools = (proxy.proxy.prefill, proxy.proxy.decode)
    return [u.in_flight for pool in pools for u in pool.upstreams]


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


def test_prefill_and_decode_bodies(stubs: Any) -> None:
    p, d = stubs("p"), stubs("d")
    with running_proxy([p.url], [d.url]) as proxy:
        body = {"model": "m", "prompt": "hello", "max_tokens": 20, "temperature": 0.5}
        status, reply, _ = proxy.post(body)
        assert status == 200 and reply["served_by"] == "d"
        assert p.bodies == [
            {
                **body,
                "max_tokens": 1,
                "stream": False,
                "kv_transfer_params": {"do_remote_decode": True},
            }
        ]
        assert d.bodies == [{**body, "kv_transfer_params": {**KV, "remote_engine_id": "p"}}]

        # Chat: max_completion_tokens is cut too, stream_options go; decode gets them back.
        chat = {
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 30,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        conn, resp = proxy.open_stream(chat, "/v1/chat/completions")
        assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
        resp.read()
        conn.close()
        prefill_chat = p.bodies[-1]
        assert prefill_chat["max_completion_tokens"] == 1 and prefill_chat["max_tokens"] == 1
        assert prefill_chat["stream"] is False and "stream_options" not in prefill_chat
        assert d.bodies[-1] == {**chat, "kv_transfer_params": {**KV, "remote_engine_id": "p"}}

        # A prefill without kv_transfer_params: the decode body has no such key.
        status, _, _ = proxy.post({"prompt": "nokv", "max_tokens": 5})
        assert status == 200 and d.bodies[-1] == {"prompt": "nokv", "max_tokens": 5}
        assert in_flight(proxy) == [0, 0]

        # Not JSON: 400 from the proxy itself.
        conn = proxy.connect()
        conn.request("POST", "/v1/completions", body=b"{nope")
        resp = conn.getresponse()
        assert resp.status == 400 and json.loads(resp.read())["error"]["code"] == 400
        conn.close()


def test_stream_passes_chunks_through_in_order_as_they_arrive(stubs: Any) -> None:
    p, d = stubs("p"), stubs("d")
    with running_proxy([p.url], [d.url]) as proxy:
        conn, resp = proxy.open_stream({"prompt": "four chunks", "stream": True})
        events, times = [], []
        while (event := read_event(resp)) is not None:
            events.append(event)
            times.append(time.monotonic())
        conn.close()
    assert events[-1] == "[DONE]"
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["t0", "t1", "t2", "t3"]
    # The stub waits 0.3 s after each chunk: the first came long before the last.
    assert times[-1] - times[0] > 0.6


def test_round_robin_alternates(stubs: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="pagedinfer.entrypoints.disagg_proxy")
    ps, ds = [stubs("p0"), stubs("p1")], [stubs("d0"), stubs("d1")]
    with running_proxy([s.url for s in ps], [s.url for s in ds]) as proxy:
        for i in range(4):
            assert proxy.post({"prompt": f"r{i}"})[0] == 200
    assert stubs.log == [
        (name, role, f"r{i}")
        for i in range(4)
        for name, role in ((f"p{i % 2}", "prefill"), (f"d{i % 2}", "decode"))
    ]
    lines = [r.getMessage() for r in caplog.records if "-> decode" in r.getMessage()]
    assert len(lines) == 4 and ps[1].url in lines[1] and ds[1].url in lines[1]


@pytest.mark.parametrize("slow", ["slow-decode", "slow-prefill"])
def test_least_loaded_avoids_the_busy_instance(stubs: Any, slow: str) -> None:
    ps, ds = [stubs("p0"), stubs("p1")], [stubs("d0"), stubs("d1")]
    slow_role = slow.removeprefix("slow-")
    with running_proxy([s.url for s in ps], [s.url for s in ds], policy="least_loaded") as px:
        busy = threading.Thread(target=px.post, args=({"prompt": slow},))
        busy.start()  # p0 then d0 (rotation); the slow one of the two takes 1.5 s
        assert wait_until(lambda: (ps[0] if slow_role == "prefill" else ds[0]).received.is_set())
        assert px.post({"prompt": "B"})[0] == 200  # rotation: p1, d1
        assert px.post({"prompt": "C"})[0] == 200  # rotation says p0, d0: one is busy
        busy.join()
        assert in_flight(px) == [0, 0, 0, 0]
    served_c = {role: name for name, role, prompt in stubs.log if prompt == "C"}
    if slow_role == "decode":
        assert served_c == {"prefill": "p0", "decode": "d1"}  # round robin: d0
    else:
        assert served_c["prefill"] == "p1"  # round robin: p0


def test_least_loaded_ties_follow_the_rotation() -> None:
    pool = UpstreamPool("decode", ["http://a", "http://b", "http://c"], "least_loaded")
    assert [pool.order()[0].url for _ in range(4)] == [
        "http://a",
        "http://b",
        "http://c",
        "http://a",
    ]
    pool.upstreams[0].in_flight = 2
    pool.upstreams[1].in_flight = 1
    assert [u.url for u in pool.order()] == ["http://c", "http://b", "http://a"]  # rotation: b


def test_failover_to_the_next_instance(stubs: Any) -> None:
    p, d = stubs("p"), stubs("d")
    broken = stubs("p500", status=500)
    with running_proxy([closed_port_url(), broken.url, p.url], [closed_port_url(), d.url]) as px:
        for i in range(3):
            status, reply, _ = px.post({"prompt": f"f{i}"})
            assert status == 200 and reply["served_by"] == "d"
        assert [b["prompt"] for b in p.bodies] == ["f0", "f1", "f2"]
        assert in_flight(px) == [0, 0, 0, 0, 0]


def test_all_prefill_down_is_503_quickly(stubs: Any) -> None:
    d = stubs("d")
    down = [closed_port_url(), closed_port_url()]
    with running_proxy(down, [d.url]) as proxy:
        status, reply, seconds = proxy.post({"prompt": "x"})
    assert status == 503 and seconds < 5
    assert reply["error"]["type"] == "ServiceUnavailable" and reply["error"]["code"] == 503
    assert all(url in reply["error"]["message"] for url in down)
    assert d.bodies == []


def test_upstream_that_never_answers_times_out(stubs: Any) -> None:
    p, d = stubs("p"), stubs("d")
    with silent_listener() as silent:
        with running_proxy([silent], [d.url], request_timeout_s=1) as proxy:
            status, reply, seconds = proxy.post({"prompt": "x"})
            assert status == 503 and 0.9 < seconds < 3, seconds
            assert silent in reply["error"]["message"] and d.bodies == []
        # Streamed decode: the wait for the headers is bounded too.
        with running_proxy([p.url], [silent], request_timeout_s=1) as proxy:
            status, reply, seconds = proxy.post({"prompt": "x", "stream": True})
            assert status == 503 and 0.9 < seconds < 3, seconds
    # A stream that stops mid-way: an error event after request_timeout_s, then the end.
    with running_proxy([p.url], [d.url], request_timeout_s=1) as proxy:
        start = time.monotonic()
        conn, resp = proxy.open_stream({"prompt": "stall", "stream": True})
        assert json.loads(read_event(resp) or "")["choices"][0]["text"] == "t0"
        assert json.loads(read_event(resp) or "")["error"]["code"] == 503
        assert read_event(resp) is None and time.monotonic() - start < 3
        conn.close()
        assert wait_until(lambda: in_flight(proxy) == [0, 0])


def test_prefill_4xx_goes_back_without_decode(stubs: Any) -> None:
    p, d = stubs("p", status=400), stubs("d")
    with running_proxy([p.url], [d.url]) as proxy:
        status, reply, _ = proxy.post({"prompt": "x", "max_tokens": -3})
    assert status == 400 and reply == {"error": {"message": "stub p", "code": 400}}
    assert len(p.bodies) == 1 and d.bodies == []


def test_client_disconnect_mid_stream_closes_the_decode_connection(stubs: Any) -> None:
    p, d = stubs("p"), stubs("d")
    with running_proxy([p.url], [d.url]) as proxy:
        conn, resp = proxy.open_stream({"prompt": "endless", "stream": True})
        assert json.loads(read_event(resp) or "")["choices"][0]["text"] == "t0"
        conn.sock.shutdown(socket.SHUT_RDWR)
        resp.close()
        conn.close()
        assert d.disconnected.wait(3), "the decode stub never saw the disconnect"
        assert wait_until(lambda: in_flight(proxy) == [0, 0])


def test_client_disconnect_during_prefill_cancels_it(stubs: Any) -> None:
    p, d = stubs("p"), stubs("d")
    with running_proxy([p.url], [d.url]) as proxy:
        conn = proxy.connect()
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "hang-prefill"}))
        assert p.received.wait(3)
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        assert p.disconnected.wait(3), "the prefill stub never saw the disconnect"
        assert wait_until(lambda: in_flight(proxy) == [0, 0])
    assert d.bodies == []


def test_health_and_models(stubs: Any) -> None:
    p, d = stubs("p"), stubs("d")
    with running_proxy([p.url], [closed_port_url(), d.url]) as proxy:
        status, reply, _ = proxy.request("GET", "/health")
        assert status == 200 and reply["status"] == "ok"
        assert [u["healthy"] for u in reply["prefill"] + reply["decode"]] == [True, False, True]
        assert proxy.request("GET", "/v1/models")[:2] == (200, {"data": [{"id": "stub"}]})
    with running_proxy([closed_port_url(), closed_port_url()], [d.url]) as proxy:
        status, reply, _ = proxy.request("GET", "/health")
        assert status == 503 and reply["status"] == "unavailable"
        assert [u["healthy"] for u in reply["prefill"]] == [False, False]
        assert [u["healthy"] for u in reply["decode"]] == [True]


def test_cli_parser_and_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["disagg-proxy", "--prefill", "http://a:1", "http://b:2", "--decode", "http://c:3"]
    ns = build_parser().parse_args(argv)
    assert (ns.prefill, ns.decode) == (["http://a:1", "http://b:2"], ["http://c:3"])
    assert (ns.host, ns.port, ns.policy) == ("127.0.0.1", 8000, "round_robin")
    assert (ns.request_timeout_s, ns.connect_timeout_s) == (600.0, 5.0)
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--policy", "random"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["disagg-proxy", "--prefill", "http://a:1"])  # no --decode

    calls: list[tuple[Any, ...]] = []
    import pagedinfer.entrypoints.disagg_proxy as disagg_proxy

    monkeypatch.setattr(disagg_proxy, "run_proxy", lambda *a, **k: calls.append((a, k)) or 0)
    extra = ["--policy", "least_loaded", "--port", "9000", "--request-timeout-s", "2.5"]
    assert main([*argv, *extra]) == 0
    assert calls == [
        (
            (["http://a:1", "http://b:2"], ["http://c:3"]),
            {
                "host": "127.0.0.1",
                "port": 9000,
                "policy": "least_loaded",
                "request_timeout_s": 2.5,
                "connect_timeout_s": 5.0,
            },
        )
    ]
