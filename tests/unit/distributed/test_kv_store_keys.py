"""Store keys and checksums of the store-backed KV connectors (`kv_transfer/storage.py`)."""

from __future__ import annotations

import torch

from pagedinfer.distributed.kv_transfer.storage import entry_checksum, prompt_store_key


def test_a_salted_prompt_has_keys_of_its_own() -> None:
    ids = list(range(100, 140))
    plain, aligned = prompt_store_key("m", 16, ids)
    assert aligned == 32
    assert prompt_store_key("m", 16, ids, None) == (plain, 32)
    tenant_a = prompt_store_key("m", 16, ids, "tenant-a")[0]
    assert tenant_a != plain
    assert tenant_a != prompt_store_key("m", 16, ids, "tenant-b")[0]


def test_checksums_cover_key_layer_dtype_shape_and_secret() -> None:
    kv = torch.arange(64, dtype=torch.float16).reshape(2, 4, 2, 4)
    base = entry_checksum(kv, "k", "layer.0", None)
    assert base == entry_checksum(kv.clone(), "k", "layer.0", None)
    relabelled = kv.view(torch.bfloat16)  # the same bytes read as another dtype
    others = [
        entry_checksum(kv, "other-key", "layer.0", None),
        entry_checksum(kv, "k", "layer.1", None),
        entry_checksum(relabelled, "k", "layer.0", None),
        entry_checksum(kv.reshape(2, 2, 4, 4), "k", "layer.0", None),
        entry_checksum(kv, "k", "layer.0", b"secret"),
    ]
    assert base not in others and len(set(others)) == len(others)
