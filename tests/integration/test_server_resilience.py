"""The server under load and failure, as a real process on loopback:
- 64 concurrent streams, a quarter of them disconnected mid-stream: the rest complete with
  the same text as unstreamed requests, the disconnected ones are aborted (counted as
  "abort" in /metrics) and free their blocks (KV usage back to 0), and the server keeps
  serving;
- the engine process killed under load: in-flight requests fail at once with an error,
  /health turns 503, the gauges 0, new requests get 503, nothing hangs; the server then
  exits with status 1 (unless --keep-alive-on-engine-death) and no socket directory is
  left, nor when the server itself is killed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.integration.server_proc import ServerProcess

pytestmark = pytest.mark.integration

aiohttp = pytest.importorskip("aiohttp")

MODEL = "SmolLM2-135M-Instruct"
NUM_STREAMS = 64
MAX_TOKENS = 24


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _metrics(base: str) -> dict[str, float]:
    """Sample name (labels other than model_name joined in) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    status, body = _get(base + "/metrics")
    assert status == 200
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(
        "--dtype", "float32", "--kv-cache-memory-bytes", str(256 * 2**20),
        "--max-model-len", "512", "--max-num-seqs", "64",
    )  # fmt: skip
    yield srv.base
    srv.stop()


def _prompt(i: int) -> str:
    return f"Question {i}: name one animal that lives in {['rivers', 'deserts', 'forests'][i % 3]}."


async def _stream(session, base: str, i: int, disconnect_after: int | None) -> dict:
    """One streaming completion; with `disconnect_after`, drop the connection after that
    many text chunks (those ask for 480 tokens: if their abort did not reach the engine,
    they would still be running long after the others are done)."""
    max_tokens = MAX_TOKENS if disconnect_after is None else 480
    body = {
        "model": MODEL, "prompt": _prompt(i), "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    text, chunks, usage, finish = [], 0, None, None
    resp = await session.post(base + "/v1/completions", json=body)
    assert resp.status == 200, await resp.text()
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        assert "error" not in event, event
        if event.get("usage"):
            usage = event["usage"]
        for choice in event["choices"]:
            text.append(choice["text"])
            finish = choice["finish_reason"] or finish
            chunks += 1
        if disconnect_after is not None and chunks >= disconnect_after:
            resp.close()  # the client goes away mid-stream
            return {"disconnected": True}
    resp.release()
    return {"text": "".join(text), "usage": usage, "finish": finish}


async def _complete(session, base: str, i: int) -> str:
    body = {"model": MODEL, "prompt": _prompt(i), "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    async with session.post(base + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        return (await resp.json())["choices"][0]["text"]


def test_64_streams_with_a_quarter_disconnected(server) -> None:
    before = _metrics(server)
    dropped = {i for i in range(NUM_STREAMS) if i % 4 == 1}

    async def run():
        timeout = aiohttp.ClientTimeout(total=600)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            streams = await asyncio.gather(
                *(
                    _stream(session, server, i, 3 if i in dropped else None)
                    for i in range(NUM_STREAMS)
                )
            )
            # The same prompts unstreamed, also all at once: the reference texts.
            kept = [i for i in range(NUM_STREAMS) if i not in dropped]
            reference = await asyncio.gather(*(_complete(session, server, i) for i in kept))
            return streams, dict(zip(kept, reference))

    streams, reference = asyncio.run(run())
    for i, result in enumerate(streams):
        if i in dropped:
            assert result == {"disconnected": True}
            continue
        assert result["finish"] == "length", (i, result)
        assert result["usage"]["completion_tokens"] == MAX_TOKENS
        assert result["text"] == reference[i], i

    # The aborts reached the engine core at once: nothing is left running.
    deadline = time.monotonic() + 5
    while True:
        after = _metrics(server)
        if after["pagedinfer:kv_cache_usage_perc"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert after["pagedinfer:kv_cache_usage_perc"] == 0
    assert after["pagedinfer:num_requests_running"] == 0
    assert after["pagedinfer:num_requests_waiting"] == 0
    aborts = "pagedinfer:request_success_total{finished_reason=abort}"
    lengths = "pagedinfer:request_success_total{finished_reason=length}"
    assert after[aborts] - before[aborts] == len(dropped)
    assert after[lengths] - before[lengths] == 2 * (NUM_STREAMS - len(dropped))
    # Still serving.
    assert _get(server + "/health")[0] == 200
    assert asyncio.run(_one_completion(server))


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_dropped_non_streaming_request_is_aborted(server, route) -> None:
    """A client that gives up on a non-streaming request (440 tokens to go: with the chat
    template's ~42 prompt tokens it must fit in 512) frees it in the engine within a second
    or so, not when the generation would have ended."""
    before = _metrics(server)
    body = {"model": MODEL, "max_tokens": 440, "temperature": 0, "ignore_eos": True}
    if route == "/v1/completions":
        body["prompt"] = _prompt(1)
    else:
        body["messages"] = [{"role": "user", "content": _prompt(1)}]

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            with pytest.raises(asyncio.TimeoutError):  # the client gives up after 1 s
                await asyncio.wait_for(session.post(server + route, json=body), 1.0)

    asyncio.run(run())
    gone = time.monotonic()
    while True:
        after = _metrics(server)
        if after["pagedinfer:num_requests_running"] == 0 or time.monotonic() - gone > 10:
            break
        time.sleep(0.1)
    assert after["pagedinfer:num_requests_running"] == 0
    assert time.monotonic() - gone < 3
    aborts = "pagedinfer:request_success_total{finished_reason=abort}"
    assert after[aborts] - before[aborts] == 1
    assert after["pagedinfer:kv_cache_usage_perc"] == 0


async def _one_completion(base: str) -> str:
    async with aiohttp.ClientSession() as session:
        return await _complete(session, base, 0)


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(p) for p in f.read().split()]
    return out


def _engine_pid(server_pid: int) -> int:
    for child in _children(server_pid):
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"pagedinfer.engine.core_proc" in f.read():
                return child
    raise AssertionError("no engine core process under the server")


def _small_server(max_model_len: int, *flags: str) -> ServerProcess:
    return ServerProcess("--dtype", "float32", "--kv-cache-memory-bytes", str(64 * 2**20),
                         "--max-model-len", str(max_model_len), *flags)  # fmt: skip


def _socket_dir(engine_pid: int) -> str:
    """The `pagedinfer-*` directory of the engine's ipc sockets (from its command line)."""
    with open(f"/proc/{engine_pid}/cmdline", "rb") as f:
        args = f.read().decode().split("\0")
    (address,) = [a for a in args if a.startswith("ipc://")][:1]
    path = os.path.dirname(address.removeprefix("ipc://"))
    assert os.path.basename(path).startswith("pagedinfer-") and os.path.isdir(path)
    return path


def test_killing_the_engine_fails_in_flight_requests_fast() -> None:
    """With --keep-alive-on-engine-death the server stays up to answer 503s."""
    srv = _small_server(512, "--keep-alive-on-engine-death")
    base, proc = srv.base, srv.proc
    try:
        engine_pid = _engine_pid(proc.pid)

        async def run():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
                long = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400,
                        "ignore_eos": True}  # fmt: skip
                unstreamed = asyncio.ensure_future(
                    session.post(base + "/v1/completions", json=long)
                )
                resp = await session.post(base + "/v1/completions", json={**long, "stream": True})
                assert resp.status == 200
                events = []
                async for raw in resp.content:  # a few tokens in: kill the engine
                    line = raw.decode().strip()
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 3:
                            os.kill(engine_pid, signal.SIGKILL)
                            killed_at = time.monotonic()
                stream_done = time.monotonic() - killed_at
                plain = await unstreamed
                plain_status, plain_body = plain.status, await plain.json()
                after = await session.post(
                    base + "/v1/completions", json={"model": MODEL, "prompt": "hi"}
                )
                return events, stream_done, plain_status, plain_body, after.status

        events, stream_done, plain_status, plain_body, after_status = asyncio.run(run())
        assert stream_done < 10, stream_done
        errors = [json.loads(e)["error"] for e in events if e != "[DONE]" and "error" in e]
        assert errors and "died" in errors[0]["message"]
        assert events[-1] == "[DONE]"
        assert plain_status == 503 and "died" in plain_body["error"]["message"]
        assert after_status == 503
        status, body = _get(base + "/health")
        assert status == 503 and b"dead" in body
        time.sleep(3)
        assert proc.poll() is None  # the server itself stays up to report it
    finally:
        srv.stop()


def test_after_the_engine_dies_the_server_reports_it_and_exits_clean() -> None:
    """Engine SIGKILLed mid-request: /health 503 and every gauge 0 at once, then the
    server exits with status 1 and leaves no socket directory."""
    srv = _small_server(512)
    try:
        engine_pid = _engine_pid(srv.pid)
        socket_dir = _socket_dir(engine_pid)
        body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400,
                "ignore_eos": True}  # fmt: skip
        busy = threading.Thread(target=lambda: _post_ignoring_errors(srv.base, body))
        busy.start()
        deadline = time.monotonic() + 30
        while _metrics(srv.base)["pagedinfer:num_requests_running"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(engine_pid, signal.SIGKILL)
        while _get(srv.base + "/health")[0] != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        gauges = _metrics(srv.base)
        assert gauges["pagedinfer:num_requests_running"] == 0
        assert gauges["pagedinfer:num_requests_waiting"] == 0
        assert gauges["pagedinfer:kv_cache_usage_perc"] == 0
        assert srv.proc.wait(timeout=30) == 1
        busy.join()
        assert not os.path.exists(socket_dir)
    finally:
        srv.stop()


def _post_ignoring_errors(base: str, body: dict) -> None:
    req = urllib.request.Request(
        base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            resp.read()
    except OSError:
        pass  # a 503, or the server gone


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not yet reaped
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_the_engine_process_goes_with_the_server(sig) -> None:
    """Stopped (SIGTERM: the app's lifespan shuts the engine down) or killed (SIGKILL: the
    engine notices its parent is gone), the server leaves no engine process and no socket
    directory behind."""
    srv = _small_server(256)
    try:
        engine_pid = _engine_pid(srv.pid)
        socket_dir = _socket_dir(engine_pid)
        os.kill(srv.pid, sig)
        srv.proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while not _gone(engine_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(engine_pid)
        assert not os.path.exists(socket_dir)  # removed by the server, or by the orphan
    finally:
        srv.stop()
