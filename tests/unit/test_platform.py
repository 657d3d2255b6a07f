"""Process memory settings (pagedinfer/platform.py) on this machine's glibc."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedinfer import platform


def test_matmul_cache_capacities_default_but_do_not_override(monkeypatch) -> None:
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "7")
    platform.configure_matmul_caches()
    assert os.environ["LRU_CACHE_CAPACITY"] == str(platform.MATMUL_CACHE_CAPACITY)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "7"


_SCENARIO = """
import ctypes, ctypes.util
from pagedinfer import platform
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
trimmer = platform.HeapTrimmer(growth_bytes=64 << 20)
first = trimmer.maybe_trim()  # sets the baseline
chunks, pins = [], []
for _ in range(2560):
    p = libc.malloc(64 << 10)
    ctypes.memset(p, 1, 64 << 10)  # resident
    chunks.append(p)
    pins.append(libc.malloc(4000))  # live neighbours (too big for the small-chunk caches)
for p in chunks:
    libc.free(p)
before = platform._resident_bytes()
trimmed = trimmer.maybe_trim()
after = platform._resident_bytes()
again = trimmer.maybe_trim()
print(first, trimmed, again, trimmer.num_trims, (before - after) >> 20)
"""


@pytest.mark.skipif(platform._LIBC is None, reason="needs glibc")
def test_heap_trimmer_returns_fragmented_heap_to_the_system() -> None:
    """160 MB of freed 64 KiB chunks between live small ones stay resident until trimmed
    (in a fresh process, so the heap starts in a known state)."""
    out = subprocess.run(
        [sys.executable, "-c", _SCENARIO], capture_output=True, text=True, check=True
    ).stdout.split()
    first, trimmed, again, num_trims, released_mb = out
    assert (first, trimmed, again, num_trims) == ("False", "True", "False", "1")
    assert int(released_mb) > 100
