"""Process-level memory settings for CPU inference.

- oneDNN caches: torch's bf16/fp32 matmuls go through oneDNN, which keeps one compiled
  primitive per distinct shape in two caches (ideep's, `LRU_CACHE_CAPACITY`, and oneDNN's
  own, `ONEDNN_PRIMITIVE_CACHE_CAPACITY`), 1,024 entries each by default. An engine step's
  matmuls have as many rows as the step has tokens, which changes nearly every step, so
  the caches fill with shapes never seen again: measured +744 MB resident after 300
  distinct row counts of the model's four matrices, +36 MB with 16 entries each. Both are
  read on first use, so setting them when pagedinfer is imported works even after torch;
  a value the user already exported wins.
- The heap: glibc keeps freed heap memory mapped. After loading (the GGUF is dequantised
  through temporaries) `release_free_heap()` returns ~150 MB to the system. While serving,
  steps allocate activations and logits whose sizes change with the batch; glibc cannot
  reuse the freed chunks for the next, slightly larger ones, and on the 200-request
  benchmark ~330 MB of free heap piled up during the prefill-heavy first steps.
  `HeapTrimmer` reads the resident set after each step (/proc/self/statm, microseconds)
  and trims when it grew by 64 MB since the last trim.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

__all__ = ["configure_matmul_caches", "release_free_heap", "HeapTrimmer"]

MATMUL_CACHE_CAPACITY = 16


def configure_matmul_caches() -> None:
    for name in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(MATMUL_CACHE_CAPACITY))


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):  # not glibc >= 2.33 (musl, macOS): nothing to do
        return None
    return libc


_LIBC = _glibc()


def release_free_heap() -> None:
    """Return freed heap pages to the OS (glibc's malloc_trim); a no-op elsewhere."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


class HeapTrimmer:
    """Trims the heap when the resident set grew by more than `growth_bytes` since the last
    trim (glibc and /proc only). Free heap bytes (mallinfo2) are no trigger: trimmed pages
    stay on the free lists, and a step's transient working set is reused by the next step
    anyway; only growth of the resident set is the fragmentation worth undoing."""

    def __init__(self, growth_bytes: int = 64 << 20) -> None:
        self.growth_bytes = growth_bytes
        self.num_trims = 0
        self._limit: int | None = None

    def maybe_trim(self) -> bool:
        rss = _resident_bytes()
        if _LIBC is None or rss is None:
            return False
        if self._limit is None:  # first call: the baseline
            self._limit = rss + self.growth_bytes
            return False
        if rss <= self._limit:
            return False
        _LIBC.malloc_trim(0)
        self.num_trims += 1
        self._limit = (_resident_bytes() or rss) + self.growth_bytes
        return True


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _resident_bytes() -> int | None:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return None
