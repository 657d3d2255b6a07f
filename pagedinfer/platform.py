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
- Intra-op threads under contention: every parallel op (torch's, oneDNN's, our kernels')
  ends when its slowest thread does, and libgomp's threads spin between ops, so a thread
  whose core another process takes stalls the whole step for scheduler slices at a time.
  Measured on 2 cores (`benchmarks/bench_contention.py`), one decode stream: 17.9 ms per
  token idle with 2 threads, 1,153 ms (64x) beside one busy process, 24.0 ms with 1 thread.
  `ThreadGovernor` watches how long this process's threads wait for a CPU (the kernel's
  per-thread run-queue delay) and drops a thread when they wait much, then returns to
  the configured count once the other processes are gone (probing, with back-off);
  `ModelConfig.adapt_threads`, on by default for `pagedinfer serve`, off offline.
  Passive waiting (`OMP_WAIT_POLICY=PASSIVE`) also ends the stalls but costs 2.2x when
  idle (38.7 ms per token), so the spin stays.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import statistics
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

__all__ = ["configure_matmul_caches", "release_free_heap", "HeapTrimmer", "ThreadGovernor"]

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


def _run_delay_s() -> float | None:
    """Seconds this process's threads have spent runnable but waiting for a CPU, in all
    (the second field of /proc/self/task/*/schedstat); None where the kernel does not say."""
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
                total += int(f.read().split()[1])
        except (OSError, ValueError, IndexError):
            continue  # a thread that just ended
    return total / 1e9


def _others_running() -> int | None:
    """Runnable threads of other processes right now: the system's count (/proc/loadavg)
    less this process's threads in state R."""
    try:
        with open("/proc/loadavg", "rb") as f:
            running = int(f.read().split()[3].split(b"/")[0])
        ours = 0
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                    ours += f.read().rsplit(b")", 1)[1].split()[0] == b"R"
            except (OSError, IndexError):
                continue
    except (OSError, ValueError, IndexError):
        return None
    return max(0, running - ours)


MIN_BACKOFF_S = 4.0
"""After a drop, the first blind try of one more thread comes this late (a try beside a busy
process can cost a step of ~1 s on 2 cores); the run-queue samples may call one earlier."""


class ThreadGovernor:
    """Fewer intra-op threads while other processes take the cores (see the module
    docstring). Call `after_step()` after each engine step; it acts once per `window_s`.

    Per window: `wait` = the threads' run-queue delay over the window's wall time (in
    threads' worth). Above `drop_at`, one thread fewer (down to 1). Below the configured
    count, each step also samples how many other threads are runnable; once the median
    sample of a window leaves a core free for one more thread, or the back-off time has
    passed, it tries one more (the back-off doubles, up to `max_backoff_s`, each time a try
    has to be undone)."""

    def __init__(
        self,
        set_threads: Callable[[int], None],
        max_threads: int,
        window_s: float = 0.25,
        drop_at: float = 0.25,
        max_backoff_s: float = 64.0,
    ) -> None:
        self.set_threads = set_threads
        self.max_threads = max_threads
        self.threads = max_threads
        self.window_s = window_s
        self.drop_at = drop_at
        self.max_backoff_s = max_backoff_s
        self.backoff_s = MIN_BACKOFF_S
        self._cores = os.cpu_count() or 1
        self._trying = False
        self._start: float | None = None  # the window's start: set by the first step
        self._delay = _run_delay_s()
        self._next_try = 0.0
        self._free_samples: list[int] = []

    @property
    def enabled(self) -> bool:
        return self._delay is not None and self.max_threads > 1

    def after_step(self) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if self._start is None:
            self._start, self._delay = now, _run_delay_s()
            return
        if self.threads < self.max_threads:
            others = _others_running()
            if others is not None:
                self._free_samples.append(self._cores - others - self.threads)
        if now - self._start < self.window_s:
            return
        delay = _run_delay_s()
        if delay is None or self._delay is None:
            return
        wait = (delay - self._delay) / (now - self._start)
        self._start, self._delay = now, delay
        free = self._free_samples
        self._free_samples = []
        if wait > self.drop_at and self.threads > 1:
            if self._trying:  # the extra thread did not fit: wait longer before the next try
                self.backoff_s = min(2 * self.backoff_s, self.max_backoff_s)
            self._set(self.threads - 1, f"threads waited {wait:.2f}x the wall time for a CPU")
            self._trying = False
            self._next_try = now + self.backoff_s
        elif self.threads < self.max_threads and (
            (free and statistics.median(free) >= 1) or now >= self._next_try
        ):
            self._trying = True
            self._next_try = now + self.backoff_s
            self._set(self.threads + 1, "trying one more thread")
        elif self._trying:
            self._trying = False  # the try held: the next drop starts from a short back-off
            self.backoff_s = MIN_BACKOFF_S

    def _set(self, threads: int, why: str) -> None:
        self.threads = threads
        self.set_threads(threads)
        logger.info("Intra-op threads: %d of %d (%s).", threads, self.max_threads, why)
