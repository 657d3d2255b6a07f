"""ZmqConnector on the default model, offline API, in one process: a producer (prefill)
instance holds each prompt's KV and serves it over loopback TCP; a consumer (decode)
instance pulls it with the producer's `kv_transfer_params` and computes only the last prompt
token and the completion.

Greedy outputs must equal a plain instance's. A pull that cannot be served (the producer is
gone, a wrong request id, an expired lease, a corrupted reply) makes the consumer recompute
the prompt (or fail the request, with kv_load_failure_policy "fail"); the producer's held
blocks are all released once read or expired.

Trust (`distributed/kv_transfer/trust.py`): a pull naming another prompt is refused by the
producer; with a transfer secret only tagged parameters load, and a consumer connects only
to its `trusted_producers`."""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq

from pagedinfer import LLM, SamplingParams
from pagedinfer.config import build_engine_config
from pagedinfer.distributed.kv_transfer.base import KVConnectorRole
from pagedinfer.distributed.kv_transfer.storage import kv_checksum
from pagedinfer.distributed.kv_transfer.trust import prompt_hash
from pagedinfer.distributed.kv_transfer.zmq.connector import ZmqConnector
from pagedinfer.distributed.kv_transfer.zmq.wire import PullReply, PullRequest
from tests.integration.server_proc import free_port

pytestmark = pytest.mark.integration

# 16-token blocks (the default is 128): the prompts below are sized in blocks of 16.
ENGINE: dict[str, Any] = dict(dtype="float32", kv_cache_memory_bytes=64 << 20, block_size=16)
MAX_TOKENS = 8
TRANSFER_TIMEOUT_S = 4  # the consumer's; the "silent" relay test waits for it
DELAY_S = 1.0
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
PREFILL = SamplingParams(
    max_tokens=1, temperature=0.0, extra_args={"kv_transfer_params": {"do_remote_decode": True}}
)

# Distinct prompts per test: the consumer's prefix cache must not serve one test's prompt
# to another.
PROMPTS = {
    "roundtrip": [
        "The capital of France is a city that " * 6,  # several blocks
        "List three prime numbers.",  # less than one block
    ],
    "wrong_id": ["Describe how a bicycle works, gear by gear, for a curious child. " * 2],
    "fail": ["What is the boiling point of water on a high mountain, and why?"],
    "expired": ["Tell me a story about a lighthouse keeper and a storm. " * 2],
    "shutdown": ["Explain photosynthesis in simple terms for a ten-year-old."],
    "relay": {
        "float64": "Give me a recipe for pancakes with blueberries and honey.",
        "flip": "How do airplanes stay in the air? Explain lift and drag.",
        "shape": "Name the planets of the solar system, from the Sun outwards.",
        "silent": "Why is the sky blue during the day and red at sunset?",
    },
    "other_prompt": [
        "List three rivers in Europe and the seas they flow into.",
        "What is the boiling point of water at the top of a high mountain?",
    ],
    "abort_load": ["Summarise the plot of Romeo and Juliet in two sentences."],
    "poison": ["The capital of France is", "The capital of Germany is"],
    "signed": ["Explain why the Moon has phases, in three short sentences."],
    "abort_hold": ["Count from one to fifty, separated by commas."],
}
CONNECTOR_LOGGER = "pagedinfer.distributed.kv_transfer.zmq"  # every module of the package


def zmq_config(role: str, port: int = 0, **kw: Any) -> dict[str, Any]:
    return {"kv_connector": "ZmqConnector", "kv_role": role, "kv_port": port, **kw}


def decode_params(kv_params: dict[str, Any]) -> SamplingParams:
    return SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, extra_args={"kv_transfer_params": kv_params}
    )


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def kv_stat(llm: LLM, name: str) -> float:
    return llm.get_stats().get(f"kv_{name}", 0)


def free_blocks(llm: LLM) -> int:
    return llm.llm_engine.engine_core.scheduler.kv_cache_manager.get_num_free_blocks()


def release_step(producer: LLM) -> None:
    """One more (tiny) producer run: the offline engine steps only inside generate, so the
    reads and expiries since its last run are reported (and the blocks freed) here."""
    producer.generate(["Hi"], SamplingParams(max_tokens=1), use_tqdm=False)


class Producer:
    def __init__(self, role: str = "kv_producer", **extra: Any) -> None:
        self.port = free_port()
        self.llm = LLM(kv_transfer_config=zmq_config(role, self.port, **extra), **ENGINE)
        self.all_free = free_blocks(self.llm)
        self.closed = False
        self.num_tokens: dict[str, int] = {}

    def prefill(self, prompts: list[str]) -> list[dict[str, Any]]:
        """The prompts' kv_transfer_params (and their lengths in `self.num_tokens`)."""
        outs = self.llm.generate(prompts, PREFILL, use_tqdm=False)
        params = [o.kv_transfer_params for o in outs]
        assert all(p is not None for p in params)
        for prompt, o in zip(prompts, outs, strict=True):
            self.num_tokens[prompt] = len(o.prompt_token_ids)
        return params  # type: ignore[return-value]

    def shutdown(self) -> None:
        if not self.closed:
            self.closed = True
            self.llm.shutdown()


def _values(group: list[str] | dict[str, str]) -> list[str]:
    return list(group.values()) if isinstance(group, dict) else group


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    """Greedy token ids of every prompt from a plain instance."""
    prompts = [p for group in PROMPTS.values() for p in _values(group)]
    with LLM(**ENGINE) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return {p: o.outputs[0].token_ids for p, o in zip(prompts, outs, strict=True)}


@pytest.fixture(scope="module")
def producer() -> Iterator[Producer]:
    p = Producer()
    yield p
    p.shutdown()


@pytest.fixture(scope="module")
def both() -> Iterator[Producer]:
    """A "kv_both" instance: a producer with a short lease, and a consumer that fails its
    requests when a load fails. Shut down by the last test."""
    p = Producer(
        role="kv_both",
        kv_connector_extra_config={"lease_timeout_s": 0.5},
        kv_load_failure_policy="fail",
    )
    yield p
    p.shutdown()


@pytest.fixture(scope="module")
def consumer() -> Iterator[LLM]:
    llm = LLM(
        kv_transfer_config=zmq_config(
            "kv_consumer", kv_connector_extra_config={"transfer_timeout_s": TRANSFER_TIMEOUT_S}
        ),
        **ENGINE,
    )
    yield llm
    llm.shutdown()


def test_producer_needs_a_port() -> None:
    config = build_engine_config(kv_transfer_config=zmq_config("kv_producer", 0))
    with pytest.raises(ValueError, match="kv_port"):
        ZmqConnector(config, KVConnectorRole.SCHEDULER)


def test_roundtrip(producer: Producer, consumer: LLM, reference) -> None:
    prompts = PROMPTS["roundtrip"]
    params = producer.prefill(prompts)
    for prompt, p in zip(prompts, params, strict=True):
        assert p["do_remote_prefill"] is True
        assert (p["remote_host"], p["remote_port"]) == ("127.0.0.1", producer.port)
        assert p["remote_num_tokens"] == producer.num_tokens[prompt]
    assert free_blocks(producer.llm) < producer.all_free  # held for the consumer

    loaded = kv_stat(consumer, "num_loaded_tokens")
    outs = consumer.generate(prompts, [decode_params(p) for p in params], use_tqdm=False)
    assert token_ids(outs) == [reference[p] for p in prompts]
    expected = [producer.num_tokens[p] - 1 for p in prompts]
    assert [o.num_external_cached_tokens for o in outs] == expected
    assert kv_stat(consumer, "num_loaded_tokens") - loaded == sum(expected)
    assert kv_stat(consumer, "num_loaded_bytes") > 0
    assert kv_stat(consumer, "num_failed_loads") == 0

    release_step(producer.llm)
    assert free_blocks(producer.llm) == producer.all_free


def test_wrong_request_id_recomputes(producer: Producer, consumer: LLM, reference) -> None:
    prompts = PROMPTS["wrong_id"]
    (params,) = producer.prefill(prompts)
    failed = kv_stat(consumer, "num_failed_loads")
    wrong = {**params, "remote_request_id": "no-such-request"}
    outs = consumer.generate(prompts, decode_params(wrong), use_tqdm=False)
    assert token_ids(outs) == [reference[prompts[0]]]
    assert outs[0].num_external_cached_tokens == 0
    assert kv_stat(consumer, "num_failed_loads") - failed == 1

    # The real id still works: the prompt's first blocks are now in the consumer's prefix
    # cache, so only the tail past them is pulled.
    loaded = kv_stat(consumer, "num_loaded_tokens")
    outs = consumer.generate(prompts, decode_params(params), use_tqdm=False)
    assert token_ids(outs) == [reference[prompts[0]]]
    assert 0 < kv_stat(consumer, "num_loaded_tokens") - loaded < producer.num_tokens[prompts[0]] - 1
    assert outs[0].num_cached_tokens == producer.num_tokens[prompts[0]] - 1

    release_step(producer.llm)
    assert free_blocks(producer.llm) == producer.all_free


def test_fail_policy(producer: Producer, both: Producer, reference) -> None:
    """`both` consumes (policy "fail") what `producer` holds."""
    prompts = PROMPTS["fail"]
    (params,) = producer.prefill(prompts)
    wrong = {**params, "remote_request_id": "no-such-request"}
    (out,) = both.llm.generate(prompts, decode_params(wrong), use_tqdm=False)
    assert out.outputs[0].finish_reason == "error"
    assert kv_stat(both.llm, "num_failed_loads") == 1
    (out,) = both.llm.generate(prompts, decode_params(params), use_tqdm=False)
    assert out.outputs[0].token_ids == reference[prompts[0]]
    assert out.num_external_cached_tokens == producer.num_tokens[prompts[0]] - 1
    release_step(producer.llm)
    assert free_blocks(producer.llm) == producer.all_free
    assert free_blocks(both.llm) == both.all_free


def test_params_of_another_prompt_are_not_used(
    producer: Producer, consumer: LLM, reference
) -> None:
    """A request whose kv_transfer_params name another prompt's KV (a mixed-up or replayed
    remote_request_id) computes its own prompt and leaves that KV alone: the prompt hash
    in the params does not match."""
    mine, other = PROMPTS["other_prompt"]
    (params,) = producer.prefill([other])
    failed = kv_stat(consumer, "num_failed_loads")
    (out,) = consumer.generate([mine], decode_params(params), use_tqdm=False)
    assert out.outputs[0].token_ids == reference[mine]
    assert out.num_external_cached_tokens == 0
    assert kv_stat(consumer, "num_failed_loads") == failed  # not even tried
    # The other prompt's KV is still held for its own request.
    (out,) = consumer.generate([other], decode_params(params), use_tqdm=False)
    assert out.outputs[0].token_ids == reference[other]
    assert out.num_external_cached_tokens == producer.num_tokens[other] - 1
    release_step(producer.llm)
    assert free_blocks(producer.llm) == producer.all_free


def test_pull_naming_another_prompt_is_refused_by_the_producer(
    producer: Producer, consumer: LLM, reference
) -> None:
    """Issue 24's poisoning, offline and with neither a secret nor a trusted list: the
    France prompt sent with the parameters of the producer's Germany hold, its prompt hash
    replaced by the France prompt's own. The consumer's check passes (the hash is its
    prompt's), but the pull names that hash and the producer holds another prompt: refused.
    The consumer computes France itself, caches nothing foreign, and the Germany hold stays
    for its own reader."""
    france, germany = PROMPTS["poison"]
    (params,) = producer.prefill([germany])
    ids = consumer.get_tokenizer().encode(france)
    n = min(len(ids), params["remote_num_tokens"])
    forged = {**params, "remote_num_tokens": n, "remote_prompt_hash": prompt_hash(ids[:n])}
    failed = kv_stat(consumer, "num_failed_loads")
    with Warnings() as warnings:
        (out,) = consumer.generate([france], decode_params(forged), use_tqdm=False)
    assert out.outputs[0].token_ids == reference[france]
    assert out.num_external_cached_tokens == 0
    assert kv_stat(consumer, "num_failed_loads") - failed == 1
    assert any("holds the KV of another prompt" in m for m in warnings.messages), warnings.messages
    (out,) = consumer.generate([france], GREEDY, use_tqdm=False)  # anyone's plain request
    assert out.outputs[0].token_ids == reference[france]
    (out,) = consumer.generate([germany], decode_params(params), use_tqdm=False)
    assert out.outputs[0].token_ids == reference[germany]
    assert out.num_external_cached_tokens == producer.num_tokens[germany] - 1
    release_step(producer.llm)
    assert free_blocks(producer.llm) == producer.all_free


SECRET = "test-transfer-secret"


@pytest.fixture(scope="module")
def signed_pair() -> Iterator[tuple[Producer, LLM]]:
    """A producer and a consumer sharing a transfer secret; the consumer trusts only that
    producer and fails a request whose parameters it refuses."""
    p = Producer(kv_connector_extra_config={"secret": SECRET})
    consumer = LLM(
        kv_transfer_config=zmq_config(
            "kv_consumer",
            kv_connector_extra_config={
                "secret": SECRET,
                "trusted_producers": [f"127.0.0.1:{p.port}"],
            },
            kv_load_failure_policy="fail",
        ),
        **ENGINE,
    )
    yield p, consumer
    consumer.shutdown()
    p.shutdown()


def test_signed_parameters_load_and_forgeries_are_refused(signed_pair, reference) -> None:
    producer, consumer = signed_pair
    (prompt,) = PROMPTS["signed"]
    ids = consumer.get_tokenizer().encode(prompt)
    (params,) = producer.prefill([prompt])
    assert isinstance(params["remote_tag"], str)
    listener = socket.create_server(("127.0.0.1", 0))  # an address nobody trusts
    elsewhere = listener.getsockname()[1]
    forgeries = {
        "no tag": ({k: v for k, v in params.items() if k != "remote_tag"}, "remote_tag"),
        "another secret's tag": ({**params, "remote_tag": "0" * 64}, "remote_tag"),
        "another request id": ({**params, "remote_request_id": "other"}, "remote_tag"),
        "a client's hash": (
            {**params, "remote_num_tokens": 3, "remote_prompt_hash": prompt_hash(ids[:3])},
            "remote_tag",
        ),
        "an untrusted producer": ({**params, "remote_port": elsewhere}, "trusted_producers"),
    }
    try:
        for what, (forged, reason) in forgeries.items():
            with pytest.raises(ValueError, match=reason):
                consumer.generate([prompt], decode_params(forged), use_tqdm=False)
            assert kv_stat(consumer, "num_failed_loads") == 0, what
        readable, _, _ = select.select([listener], [], [], 0.2)
        assert not readable  # no connection was attempted
    finally:
        listener.close()
    (out,) = consumer.generate([prompt], decode_params(params), use_tqdm=False)
    assert out.outputs[0].token_ids == reference[prompt]
    assert out.num_external_cached_tokens == producer.num_tokens[prompt] - 1
    release_step(producer.llm)
    assert free_blocks(producer.llm) == producer.all_free


def test_lease_expiry(both: Producer, consumer: LLM, reference) -> None:
    producer = both
    prompts = PROMPTS["expired"]
    (params,) = producer.prefill(prompts)
    assert free_blocks(producer.llm) < producer.all_free
    time.sleep(1.0)
    # Expired: the server refuses the pull at once, the consumer recomputes.
    failed = kv_stat(consumer, "num_failed_loads")
    outs = consumer.generate(prompts, decode_params(params), use_tqdm=False)
    assert token_ids(outs) == [reference[prompts[0]]]
    assert kv_stat(consumer, "num_failed_loads") - failed == 1
    release_step(producer.llm)
    assert free_blocks(producer.llm) == producer.all_free


class Relay:
    """A man in the middle between the consumer and the producer: forwards each pull and
    alters the reply by `mode`: "float64" (the KV converted, checksums recomputed: a
    producer of another dtype), "flip" (one byte of the first layer changed), "shape" (the
    header's token count off by one), "silent" (no reply at all), "delay" (forwarded after
    `DELAY_S`)."""

    def __init__(self, upstream_port: int) -> None:
        self.port = free_port()
        self.upstream = f"tcp://127.0.0.1:{upstream_port}"
        self.mode = ""
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(f"tcp://127.0.0.1:{self.port}")
        self.pulls: list[PullRequest] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.upstream)
        try:
            while not self.stop.is_set():
                if not self.router.poll(50):
                    continue
                frames = self.router.recv_multipart()
                if len(frames) != 2:
                    continue
                identity, payload = frames
                self.pulls.append(msgspec.msgpack.decode(payload, type=PullRequest))
                if self.mode == "silent":
                    continue
                if self.mode == "delay":
                    time.sleep(DELAY_S)
                dealer.send(payload)
                if not dealer.poll(10_000):
                    continue
                header_bytes, *layers = dealer.recv_multipart()
                header = msgspec.msgpack.decode(header_bytes, type=PullReply)
                if self.mode == "float64":
                    layers = [np.frombuffer(x, np.float32).astype(np.float64) for x in layers]
                    header.checksums = [kv_checksum(torch.from_numpy(x)) for x in layers]
                    header.dtype = "float64"
                    layers = [x.tobytes() for x in layers]
                elif self.mode == "flip":
                    first = bytearray(layers[0])
                    first[len(first) // 2] ^= 0x40
                    layers[0] = bytes(first)
                elif self.mode == "shape":
                    header.shape[1] += 1
                self.router.send_multipart([identity, msgspec.msgpack.encode(header), *layers])
        finally:
            dealer.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.router.close()
        self.ctx.term()


class Warnings(logging.Handler):
    """The connector's log messages while in a `with` block."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> Warnings:
        logging.getLogger(CONNECTOR_LOGGER).addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger(CONNECTOR_LOGGER).removeHandler(self)


@pytest.mark.parametrize(
    ("mode", "loads", "error"),
    [
        ("float64", True, None),
        ("flip", False, "checksum mismatch"),
        ("shape", False, "shape"),
        ("silent", False, "no reply"),
    ],
)
def test_altered_replies(
    producer: Producer, consumer: LLM, reference, mode: str, loads: bool, error: str | None
) -> None:
    """KV in another dtype is converted; corrupted, mis-shaped or missing replies make the
    consumer recompute the prompt."""
    prompt = PROMPTS["relay"][mode]
    relay = Relay(producer.port)
    relay.mode = mode
    try:
        (params,) = producer.prefill([prompt])
        failed = kv_stat(consumer, "num_failed_loads")
        with Warnings() as warnings:
            outs = consumer.generate(
                [prompt], decode_params({**params, "remote_port": relay.port}), use_tqdm=False
            )
        assert token_ids(outs) == [reference[prompt]]
        assert len(relay.pulls) == 1
        assert relay.pulls[0].request_id == params["remote_request_id"]
        expected = producer.num_tokens[prompt] - 1 if loads else 0
        assert outs[0].num_external_cached_tokens == expected
        assert kv_stat(consumer, "num_failed_loads") - failed == (0 if loads else 1)
        if error is not None:
            assert any(error in m for m in warnings.messages), warnings.messages
    finally:
        relay.close()
    if mode == "silent":  # the hold was never read: release it through the real port
        consumer.generate([prompt], decode_params(params), use_tqdm=False)
    release_step(producer.llm)
    assert free_blocks(producer.llm) == producer.all_free


def test_local_prefix_hit_releases_the_hold(producer: Producer, consumer: LLM) -> None:
    """The consumer already has the whole prompt but its last token in its prefix cache:
    nothing to pull, but the producer's hold is released at once (not at the lease's end)."""
    ids = consumer.get_tokenizer().encode("The quick brown fox jumps over the lazy dog. " * 8)
    prompt = {"prompt_token_ids": ids[:33]}  # 2 whole blocks and one token
    (local,) = consumer.generate([prompt], GREEDY, use_tqdm=False)
    outs = producer.llm.generate([prompt], PREFILL, use_tqdm=False)
    params = outs[0].kv_transfer_params
    assert params is not None and params["remote_num_tokens"] == 33
    loaded = kv_stat(consumer, "num_loaded_tokens")
    (out,) = consumer.generate([prompt], decode_params(params), use_tqdm=False)
    assert out.outputs[0].token_ids == local.outputs[0].token_ids
    assert (out.num_cached_tokens, out.num_external_cached_tokens) == (32, 0)
    assert kv_stat(consumer, "num_loaded_tokens") == loaded
    # The release is a message of its own, not awaited by the consumer.
    deadline = time.monotonic() + 10
    while free_blocks(producer.llm) != producer.all_free and time.monotonic() < deadline:
        time.sleep(0.05)
        release_step(producer.llm)
    assert free_blocks(producer.llm) == producer.all_free


def _step_until(llm: LLM, done, what: str) -> None:
    deadline = time.monotonic() + 15
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        llm.llm_engine.step()


def test_abort_during_load(producer: Producer, consumer: LLM) -> None:
    """A request aborted while its KV is being pulled keeps its blocks until the pull ends
    (they are being written); then they are freed."""
    (prompt,) = PROMPTS["abort_load"]
    relay = Relay(producer.port)
    relay.mode = "delay"
    try:
        (params,) = producer.prefill([prompt])
        engine = consumer.llm_engine
        scheduler = engine.engine_core.scheduler
        all_free = free_blocks(consumer)
        engine.add_request("abort-me", prompt, decode_params({**params, "remote_port": relay.port}))
        _step_until(consumer, lambda: relay.pulls, "the pull")
        assert scheduler.requests["abort-me"].status.name == "WAITING_FOR_REMOTE_KVS"
        engine.abort_request("abort-me")
        assert "abort-me" in scheduler.kv_transfer.held_requests
        assert free_blocks(consumer) < all_free
        _step_until(consumer, lambda: not scheduler.has_pending_kv_transfers(), "the load")
        assert free_blocks(consumer) == all_free
    finally:
        relay.close()
    release_step(producer.llm)
    assert free_blocks(producer.llm) == producer.all_free


def test_abort_of_held_request(producer: Producer) -> None:
    """A producer request aborted after its prompt's KV was held (still decoding): the
    hold is cancelled and the blocks freed without waiting for the lease."""
    (prompt,) = PROMPTS["abort_hold"]
    engine = producer.llm.llm_engine
    scheduler = engine.engine_core.scheduler
    params = SamplingParams(
        max_tokens=200, temperature=0.0, ignore_eos=True,
        extra_args={"kv_transfer_params": {"do_remote_decode": True}},
    )  # fmt: skip
    engine.add_request("abort-hold", prompt, params)
    _step_until(
        producer.llm,
        lambda: scheduler.requests["abort-hold"].num_output_tokens >= 2,
        "two generated tokens",
    )
    engine.abort_request("abort-hold")
    assert "abort-hold" in scheduler.kv_transfer.held_requests  # the worker might be serving it
    _step_until(producer.llm, lambda: not scheduler.has_pending_kv_transfers(), "the release")
    assert free_blocks(producer.llm) == producer.all_free


def test_producer_gone_recomputes(both: Producer, consumer: LLM, reference) -> None:
    """Last in the file: shuts `both` down."""
    prompts = PROMPTS["shutdown"]
    (params,) = both.prefill(prompts)
    both.shutdown()
    failed = kv_stat(consumer, "num_failed_loads")
    with Warnings() as warnings:
        outs = consumer.generate(prompts, decode_params(params), use_tqdm=False)
    # A refused connection, told at once (not the transfer timeout).
    assert any("cannot connect" in m for m in warnings.messages), warnings.messages
    assert token_ids(outs) == [reference[prompts[0]]]
    assert outs[0].num_external_cached_tokens == 0
    assert kv_stat(consumer, "num_failed_loads") - failed == 1
