"""Process memory settings (pagedinfer/platform.py) on this machine's glibc."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import pytest

from pagedinfer import platform


def test_matmul_cache_capacities_default_but_do_not_override(monkeypatch) -> None:
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "7")
    platform.configure_matmul_caches()
    assert os.environ["LRU_CACHE_CAPACITY"] == str(platform.MATMUL_CACHE_CAPACITY)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "7"


@pytest.mark.skipif(platform._LIBC is None, reason="needs glibc")
def test_heap_trimmer_returns_fragmented_heap_to_the_system() -> None:
    """160 MB of freed 64 KiB chunks between live small ones stay resident until trimmed."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    trimmer = platform.HeapTrimmer(growth_bytes=64 << 20)
    assert not trimmer.maybe_trim()  # first call: sets the baseline
    chunks, pins = [], []
    for _ in range(2560):
        p = libc.malloc(64 << 10)
        ctypes.memset(p, 1, 64 << 10)  # resident
        chunks.append(p)
        pins.append(libc.malloc(4000))  # live neighbours (too big for the small-chunk caches)
    for p in chunks:
        libc.free(p)
    before = platform._resident_bytes()
    assert trimmer.maybe_trim()
    after = platform._resident_bytes()
    for p in pins:
        libc.free(p)
    assert before - after > 100 << 20
    assert trimmer.num_trims == 1
    assert not trimmer.maybe_trim()  # nothing grew since
