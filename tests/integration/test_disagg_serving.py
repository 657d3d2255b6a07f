"""Disaggregated serving end to end, per connector: a prefill server, a decode server and
`pagedinfer disagg-proxy`, three real processes on loopback (plus a real redis-server for
the RedisConnector).

- Greedy outputs through the proxy equal one instance's; the decode instance reports the
  prompt as externally cached and computes only the rest.
- KV deleted or corrupted between the two phases: the decode instance recomputes.
- A prefill instance that is down: the proxy answers 503 at once.
- 200 requests, some dropped by their clients at random points: afterwards neither instance
  holds a KV block, and both still serve.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.integration.conftest import free_port
from tests.integration.server_proc import ServerProcess, small_engine_flags

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

aiohttp = pytest.importorskip("aiohttp")

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 12
BLOCK_SIZE = 16
CONNECTORS = ["SharedStorageConnector", "RedisConnector", "ZmqConnector"]
LEASE_S = 4.0
SECRET = "disagg-test-secret"


def prompt(i: int) -> str:
    """Distinct from its first token on (no shared prefix blocks between requests)."""
    return (
        f"Request {i}. Rivers, deserts, forests and mountains each have animals suited to "
        f"them. Name one animal that lives in the {['rivers', 'deserts', 'forests'][i % 3]} "
        "and explain in two sentences what helps it survive there."
    )


@pytest.fixture(scope="module")
def reference() -> list[str]:
    """Greedy texts of prompts 0..7 from one engine in this process (freed before any
    server starts)."""
    from pagedinfer import LLM, SamplingParams

    with LLM(dtype="float32", kv_cache_memory_bytes=64 * 2**20, max_model_len=512) as llm:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate([prompt(i) for i in range(8)], params, use_tqdm=False)
    return [o.outputs[0].text for o in outs]


@dataclass
class Deployment:
    connector: str
    prefill: ServerProcess
    decode: ServerProcess
    proxy: ServerProcess
    extra: dict[str, Any]


@pytest.fixture(scope="module", params=CONNECTORS)
def deployment(request, reference, tmp_path_factory) -> Iterator[Deployment]:
    connector = request.param
    extra: dict[str, Any] = {}
    producer: dict[str, Any] = {}
    if connector == "SharedStorageConnector":
        extra["shared_storage_path"] = str(tmp_path_factory.mktemp("kv"))
    elif connector == "RedisConnector":
        extra["redis_url"] = request.getfixturevalue("redis_url")
    else:
        extra["lease_timeout_s"] = LEASE_S
        extra["secret"] = SECRET  # the servers then take clients' kv_transfer_params
        producer["kv_port"] = free_port()
    consumer_extra = dict(extra)
    if connector == "ZmqConnector":
        consumer_extra["trusted_producers"] = [f"127.0.0.1:{producer['kv_port']}"]

    def config(role: str, extra: dict[str, Any], **kw: Any) -> str:
        return json.dumps({"kv_connector": connector, "kv_role": role,
                           "kv_connector_extra_config": extra, **kw})  # fmt: skip

    servers: list[ServerProcess] = []
    try:
        flags = [*small_engine_flags(512), "--block-size", str(BLOCK_SIZE)]  # prompts of few blocks
        if connector != "ZmqConnector":
            # No secret: only the proxy (this test) reaches them.
            flags.append("--trust-kv-transfer-params")
        avoid = tuple(producer.values())  # the ZMQ producer's kv_port
        servers.append(ServerProcess("--kv-transfer-config",
                                     config("kv_producer", extra, **producer), *flags,
                                     avoid_ports=avoid))  # fmt: skip
        servers.append(ServerProcess("--kv-transfer-config",
                                     config("kv_consumer", consumer_extra), *flags,
                                     avoid_ports=avoid))  # fmt: skip
        prefill, decode = servers
        servers.append(ServerProcess("--prefill", prefill.base, "--decode", decode.base,
                                     command="disagg-proxy", avoid_ports=avoid))  # fmt: skip
        yield Deployment(connector, prefill, decode, servers[2], extra)
    finally:
        for server in reversed(servers):
            server.stop()


def post(base: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def body(i: int, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt(i), "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, **kw}  # fmt: skip


def metrics(base: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.labels.keys() - {"model_name"}
    }


def expected_external(connector: str, num_prompt_tokens: int) -> int:
    """Store-backed connectors hold whole blocks short of the last token; a pull brings
    everything but the last token."""
    if connector == "ZmqConnector":
        return num_prompt_tokens - 1
    return (num_prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_outputs_equal_one_instance_and_decode_loads_the_prompt(deployment, reference) -> None:
    async def run() -> list[dict[str, Any]]:
        async with aiohttp.ClientSession() as session:

            async def one(i: int) -> dict[str, Any]:
                async with session.post(deployment.proxy.base + "/v1/completions",
                                        json=body(i)) as resp:  # fmt: skip
                    assert resp.status == 200, await resp.text()
                    return await resp.json()

            return await asyncio.gather(*(one(i) for i in range(4)))

    loaded_before = metrics(deployment.decode.base).get(
        "pagedinfer:kv_transfer_num_loaded_tokens_total", 0
    )
    results = asyncio.run(run())
    assert [r["choices"][0]["text"] for r in results] == reference[:4]
    external = []
    for r in results:
        usage = r["usage"]
        ext = usage["prompt_tokens_details"].get("external_cached_tokens", 0)
        assert ext == expected_external(deployment.connector, usage["prompt_tokens"]), usage
        # Nothing else was cached: the decode instance computed exactly the rest.
        assert usage["prompt_tokens_details"]["cached_tokens"] == ext
        external.append(ext)
    loaded = metrics(deployment.decode.base)["pagedinfer:kv_transfer_num_loaded_tokens_total"]
    assert loaded - loaded_before == sum(external)
    # A stream through the proxy: the same text, chunk by chunk.
    text = ""
    req = urllib.request.Request(
        deployment.proxy.base + "/v1/completions", json.dumps(body(4, stream=True)).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == reference[4]


def _damage(deployment: Deployment, prompt_ids: list[int], params: dict[str, Any] | None):
    """Break what the prefill instance left for the decode instance; the params to send."""
    from pagedinfer.distributed.kv_transfer.base import layer_name
    from pagedinfer.distributed.kv_transfer.storage import prompt_store_key

    key, _ = prompt_store_key(None, BLOCK_SIZE, prompt_ids)
    if deployment.connector == "SharedStorageConnector":
        path = os.path.join(deployment.extra["shared_storage_path"], key,
                            f"{layer_name(7)}.safetensors")  # fmt: skip
        with open(path, "r+b") as f:
            f.seek(-64, os.SEEK_END)
            f.write(b"\xff" * 8)
        return params
    if deployment.connector == "RedisConnector":
        import redis

        redis.Redis.from_url(deployment.extra["redis_url"]).delete(
            f"pagedinfer:kv:{key}:{layer_name(7)}"
        )
        return params
    assert params is not None
    return {**params, "remote_request_id": "no-such-request"}


def test_damaged_transfer_is_recomputed(deployment, reference, tokenizer) -> None:
    to_prefill = body(5, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    prefilled = post(deployment.prefill.base, to_prefill)
    params = prefilled.get("kv_transfer_params")
    assert (params is not None) == (deployment.connector == "ZmqConnector")
    params = _damage(deployment, tokenizer.encode(prompt(5)), params)
    failed = metrics(deployment.decode.base).get("pagedinfer:kv_transfer_num_failed_loads_total", 0)
    extra = {"kv_transfer_params": params} if params is not None else {}
    out = post(deployment.decode.base, body(5, **extra))
    assert out["choices"][0]["text"] == reference[5]
    assert "external_cached_tokens" not in out["usage"]["prompt_tokens_details"]
    after = metrics(deployment.decode.base).get("pagedinfer:kv_transfer_num_failed_loads_total", 0)
    # A changed request id breaks the ZmqConnector's tag: refused before any pull.
    assert after == failed + (0 if deployment.connector == "ZmqConnector" else 1)


def test_prefill_instance_down_gives_503(deployment) -> None:
    proxy = ServerProcess("--prefill", f"http://127.0.0.1:{free_port()}", "--decode",
                          deployment.decode.base, command="disagg-proxy",
                          ready_path="/v1/models")  # fmt: skip
    try:
        start = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as info:
            post(proxy.base, body(6))
        assert info.value.code == 503
        assert time.monotonic() - start < 10
    finally:
        proxy.stop()


def test_no_blocks_leak_after_requests_with_random_disconnects(deployment) -> None:
    """200 requests with the ZmqConnector (the one that holds blocks for a remote reader:
    a client that leaves between the phases strands them until the lease ends); 40 with
    the store-backed ones, which hold nothing (CI time)."""
    num_requests = 200 if deployment.connector == "ZmqConnector" else 40
    rng = random.Random(1234)

    async def one(session, i: int) -> None:
        stream = rng.random() < 0.5
        drop_after = rng.choice([None, None, 0.05, 0.2, 0.5, "chunk"])
        b = body(100 + i, max_tokens=rng.randint(2, 8), stream=stream)

        async def call() -> None:
            async with session.post(deployment.proxy.base + "/v1/completions", json=b) as resp:
                assert resp.status == 200, await resp.text()
                if stream:
                    async for raw in resp.content:
                        if drop_after == "chunk" and raw.startswith(b"data: {"):
                            return  # leave mid-stream
                else:
                    await resp.read()

        if isinstance(drop_after, float):
            try:
                await asyncio.wait_for(call(), drop_after)  # cancelled: the client goes away
            except asyncio.TimeoutError:
                pass
        else:
            await call()

    async def run() -> None:
        sem = asyncio.Semaphore(12)
        async with aiohttp.ClientSession() as session:

            async def limited(i: int) -> None:
                async with sem:
                    await one(session, i)

            await asyncio.gather(*(limited(i) for i in range(num_requests)))

    asyncio.run(run())
    # Held blocks (a prefill whose decode never came) go when their lease ends.
    deadline = time.monotonic() + LEASE_S + 30
    while True:
        usage = [metrics(s.base) for s in (deployment.prefill, deployment.decode)]
        busy = [
            (m["pagedinfer:kv_cache_usage_perc"], m["pagedinfer:num_requests_running"],
             m["pagedinfer:num_requests_waiting"])
            for m in usage
        ]  # fmt: skip
        if all(b == (0.0, 0.0, 0.0) for b in busy) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert busy == [(0.0, 0.0, 0.0), (0.0, 0.0, 0.0)]
    # Both still serve.
    assert post(deployment.proxy.base, body(7))["choices"][0]["text"]


def test_kv_transfer_params_need_one_prompt_and_n_1(deployment) -> None:
    """One prompt's KV belongs to one request on the other instance: n > 1 or several
    prompts with kv_transfer_params are refused (400), not half served."""
    params = {"kv_transfer_params": {"do_remote_decode": True}}
    for bad in (body(0, n=2, **params), {**body(0, **params), "prompt": [prompt(0), prompt(1)]}):
        with pytest.raises(urllib.error.HTTPError) as info:
            post(deployment.decode.base, bad)
        assert info.value.code == 400


@pytest.fixture(scope="module")
def plain() -> Iterator[ServerProcess]:
    """A server with no connector: what every answer must equal."""
    server = ServerProcess(*small_engine_flags(512), "--block-size", str(BLOCK_SIZE))
    yield server
    server.stop()


@pytest.mark.parametrize("deployment", ["ZmqConnector"], indirect=True)
def test_kv_poisoning_through_forged_params_fails(deployment, plain, tokenizer) -> None:
    """Issue 24's attack on three real servers (producer, consumer, plain): the France
    prompt sent to the consumer with the parameters of the producer's Germany hold. Whatever
    is changed in them (the prompt hash set to France's, the producer's address moved to a
    listener nobody trusts, nothing at all), the consumer loads nothing, connects nowhere
    else, and answers the France prompt as the plain server does, then and afterwards. The
    Germany parameters, untouched, still load for the Germany prompt."""
    import socket

    from pagedinfer.distributed.kv_transfer.trust import prompt_hash

    france, germany = "The capital of France is", "The capital of Germany is"

    def ask(base: str, text: str, **kw: Any) -> dict[str, Any]:
        return post(base, {"model": MODEL, "prompt": text, "max_tokens": 6,
                           "temperature": 0, **kw})  # fmt: skip

    expected = {text: ask(plain.base, text)["choices"][0]["text"] for text in (france, germany)}
    prefilled = ask(deployment.prefill.base, germany, max_tokens=1,
                    kv_transfer_params={"do_remote_decode": True})  # fmt: skip
    params = prefilled["kv_transfer_params"]
    ids = tokenizer.encode(france)
    n = min(len(ids), params["remote_num_tokens"])
    listener = socket.create_server(("127.0.0.1", 0))
    forged = [
        {**params, "remote_num_tokens": n, "remote_prompt_hash": prompt_hash(ids[:n])},
        {**params, "remote_port": listener.getsockname()[1]},
        params,
    ]
    try:
        for kv in forged:
            out = ask(deployment.decode.base, france, kv_transfer_params=kv)
            assert out["choices"][0]["text"] == expected[france]
            assert "external_cached_tokens" not in out["usage"]["prompt_tokens_details"]
        listener.settimeout(0.2)
        with pytest.raises(TimeoutError):
            listener.accept()  # the consumer never connected
    finally:
        listener.close()
    for _ in range(2):  # anyone's plain request afterwards
        assert ask(deployment.decode.base, france)["choices"][0]["text"] == expected[france]
    out = ask(deployment.decode.base, germany, kv_transfer_params=params)
    assert out["choices"][0]["text"] == expected[germany]
    assert out["usage"]["prompt_tokens_details"]["external_cached_tokens"] > 0
