"""Store-backed KV connectors on the default model, offline API: a producer (prefill)
instance stores each prompt's KV, a consumer (decode) instance loads it and computes only
the rest. SharedStorageConnector on a directory, RedisConnector on a real redis-server.

Greedy outputs must equal a single instance's; stored KV that is deleted, truncated or
corrupted between the two phases is detected and the prompt recomputed (or the request
failed, with kv_load_failure_policy "fail"); an entry that fails its load is discarded and
stored anew by the next producer run; another prompt's entry copied under a prompt's key
fails its checksum (which covers the key)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from pagedinfer import LLM, SamplingParams
from pagedinfer.distributed.kv_transfer.base import layer_name
from pagedinfer.distributed.kv_transfer.storage import prompt_store_key

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

# 16-token blocks (the default is 128): the prompts are a few blocks each, and the damage
# cases pick which block's entry to break.
BLOCK_SIZE = 16
ENGINE = dict(dtype="float32", kv_cache_memory_bytes=96 << 20, block_size=BLOCK_SIZE)
MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@dataclass
class Store:
    """One connector's configuration and ways to damage what it stored."""

    name: str
    extra: dict[str, Any]
    delete: Callable[[str, str], None]
    truncate: Callable[[str, str], None]
    flip_byte: Callable[[str, str], None]
    copy_entry: Callable[[str, str], None]
    """Write every layer of one key's entry, checksums included, under another key."""
    has_entry: Callable[[str], bool]

    def config(self, role: str, **kw: Any) -> dict[str, Any]:
        return {
            "kv_connector": self.name,
            "kv_role": role,
            "kv_connector_extra_config": self.extra,
            **kw,
        }


def _shared_storage(root: str) -> Store:
    def path(key: str, layer: str) -> str:
        return os.path.join(root, key, f"{layer}.safetensors")

    def truncate(key: str, layer: str) -> None:
        with open(path(key, layer), "r+b") as f:
            f.truncate(os.path.getsize(path(key, layer)) // 2)

    def flip_byte(key: str, layer: str) -> None:
        with open(path(key, layer), "r+b") as f:
            f.seek(-100, os.SEEK_END)  # inside the tensor data
            byte = f.read(1)
            f.seek(-100, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0x40]))

    def copy_entry(src: str, dst: str) -> None:
        for name in os.listdir(os.path.join(root, src)):
            shutil.copyfile(os.path.join(root, src, name), os.path.join(root, dst, name))

    return Store(
        "SharedStorageConnector",
        {"shared_storage_path": root},
        lambda key, layer: os.remove(path(key, layer)),
        truncate,
        flip_byte,
        copy_entry,
        lambda key: os.path.isdir(os.path.join(root, key)),
    )


def _redis(url: str) -> Store:
    import redis

    client = redis.Redis.from_url(url)
    prefix = "pagedinfer:kv:"

    def truncate(key: str, layer: str) -> None:
        value = client.get(f"{prefix}{key}:{layer}")
        client.set(f"{prefix}{key}:{layer}", value[: len(value) // 2])

    def flip_byte(key: str, layer: str) -> None:
        name = f"{prefix}{key}:{layer}"
        value = bytearray(client.get(name))
        value[-100] ^= 0x40
        client.set(name, bytes(value))

    def copy_entry(src: str, dst: str) -> None:
        for name in client.keys(f"{prefix}{src}:*"):
            layer = name.decode().rsplit(":", 1)[1]
            client.set(f"{prefix}{dst}:{layer}", client.get(name))

    return Store(
        "RedisConnector",
        {"redis_url": url},
        lambda key, layer: client.delete(f"{prefix}{key}:{layer}"),
        truncate,
        flip_byte,
        copy_entry,
        lambda key: bool(client.exists(prefix + key)),
    )


@pytest.fixture(scope="module")
def reference(prompts) -> list[list[int]]:
    with LLM(**ENGINE) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module", params=["shared_storage", "redis"])
def store(request, tmp_path_factory) -> Store:
    if request.param == "shared_storage":
        return _shared_storage(str(tmp_path_factory.mktemp("kv")))
    return _redis(request.getfixturevalue("redis_url"))


@pytest.fixture(scope="module")
def producer(store) -> Iterator[LLM]:
    # A small token budget: long prompts are prefilled in chunks and stored once complete.
    with LLM(kv_transfer_config=store.config("kv_producer"), max_num_batched_tokens=256,
             **ENGINE) as llm:  # fmt: skip
        yield llm


@pytest.fixture(scope="module")
def consumer(store) -> Iterator[LLM]:
    # Without a local prefix cache, every request asks the connector (a loaded prompt
    # would otherwise be a local hit the second time).
    with LLM(kv_transfer_config=store.config("kv_consumer"), enable_prefix_caching=False,
             **ENGINE) as llm:  # fmt: skip
        yield llm


def prefill(producer: LLM, prompts: list[list[int]]) -> None:
    outs = producer.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


def stats(llm: LLM) -> dict[str, float]:
    """The instance's KV transfer counters since start (0 before any transfer)."""
    names = ("num_loaded_tokens", "num_saved_tokens", "num_failed_loads")
    got = llm.get_stats()
    return {f"kv_{n}": got.get(f"kv_{n}", 0) for n in names}


def test_decode_instance_loads_the_prompts_and_equals_one_instance(
    producer, consumer, prompts, reference
) -> None:
    prefill(producer, prompts)
    aligned = [prompt_store_key(None, BLOCK_SIZE, p)[1] for p in prompts]
    assert stats(producer)["kv_num_saved_tokens"] == sum(aligned)
    before = stats(consumer)
    outs = consumer.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    # Every prompt's stored part came from the connector; only the rest was computed.
    assert [o.num_external_cached_tokens for o in outs] == aligned
    assert [o.num_cached_tokens for o in outs] == aligned
    after = stats(consumer)
    assert after["kv_num_loaded_tokens"] - before["kv_num_loaded_tokens"] == sum(aligned)
    assert after["kv_num_failed_loads"] == before["kv_num_failed_loads"]


@pytest.mark.parametrize("damage, victim", [("delete", 8), ("truncate", 9), ("flip_byte", 10)])
def test_damaged_kv_is_detected_and_the_prompt_recomputed(
    damage, victim, store, producer, consumer, prompts, reference
) -> None:
    """The entries were stored by the first test; one layer of one is damaged."""
    key, _ = prompt_store_key(None, BLOCK_SIZE, prompts[victim])
    getattr(store, damage)(key, layer_name(17))
    failed = stats(consumer)["kv_num_failed_loads"]
    outs = consumer.generate([prompts[victim], prompts[11]], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [reference[victim], reference[11]]
    assert outs[0].num_external_cached_tokens == 0  # recomputed
    assert outs[1].num_external_cached_tokens > 0  # its neighbour still loaded
    assert stats(consumer)["kv_num_failed_loads"] == failed + 1


def test_fail_policy_fails_only_the_damaged_request(store, producer, prompts, reference) -> None:
    victim, intact = prompts[7], prompts[11]
    store.flip_byte(prompt_store_key(None, BLOCK_SIZE, victim)[0], layer_name(3))
    with LLM(kv_transfer_config=store.config("kv_consumer", kv_load_failure_policy="fail"),
             **ENGINE) as llm:  # fmt: skip
        outs = llm.generate([victim, intact], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert outs[1].outputs[0].token_ids == reference[11]
    assert outs[1].num_external_cached_tokens > 0


def test_missing_entry_is_a_plain_miss(consumer, prompts, reference) -> None:
    """A prompt nobody stored: computed locally, nothing counted as failed."""
    failed = stats(consumer)["kv_num_failed_loads"]
    prompt = prompts[0] + prompts[1]
    (out,) = consumer.generate([prompt], GREEDY, use_tqdm=False)
    assert out.num_external_cached_tokens == 0
    assert stats(consumer)["kv_num_failed_loads"] == failed


def test_poisoned_entry_fails_its_checksum_and_is_replaced(
    store, producer, consumer, prompts, reference
) -> None:
    """Another prompt's layers, valid checksums included, written under this prompt's key
    (someone with write access to the store): each checksum covers its key, so the load
    fails and the prompt is computed; the entry is discarded, and the producer's next run
    of the prompt stores it anew, which loads."""
    aligned = [prompt_store_key(None, BLOCK_SIZE, p)[1] for p in prompts[:7]]
    victim, donor = next(
        (v, d) for v in range(7) for d in range(7) if v != d and 0 < aligned[v] <= aligned[d]
    )
    key = prompt_store_key(None, BLOCK_SIZE, prompts[victim])[0]
    store.copy_entry(prompt_store_key(None, BLOCK_SIZE, prompts[donor])[0], key)
    failed = stats(consumer)["kv_num_failed_loads"]
    (out,) = consumer.generate([prompts[victim]], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == reference[victim]
    assert out.num_external_cached_tokens == 0
    assert stats(consumer)["kv_num_failed_loads"] == failed + 1
    assert not store.has_entry(key)  # discarded, not kept
    prefill(producer, [prompts[victim]])
    assert store.has_entry(key)
    (out,) = consumer.generate([prompts[victim]], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == reference[victim]
    assert out.num_external_cached_tokens == aligned[victim]
