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


def test_run_queue_readings_on_this_kernel() -> None:
    """The governor's two readings work here (Linux): a busy thread of another process shows
    as runnable, and this process's run-queue delay is a growing total."""
    first = platform._run_delay_s()
    assert first is not None and first >= 0
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        seen = [platform._others_running() for _ in range(200)]
    finally:
        hog.kill()
        hog.wait()
    assert max(s for s in seen if s is not None) >= 1
    assert platform._run_delay_s() >= first


class _Machine:
    """What the governor reads, scripted: a clock, the run-queue delay total, other
    processes' runnable threads."""

    def __init__(self, monkeypatch) -> None:
        self.now, self.delay, self.others = 0.0, 0.0, 0
        monkeypatch.setattr(platform.time, "perf_counter", lambda: self.now)
        monkeypatch.setattr(platform, "_run_delay_s", lambda: self.delay)
        monkeypatch.setattr(platform, "_others_running", lambda: self.others)
        monkeypatch.setattr(platform.os, "cpu_count", lambda: 2)

    def window(self, governor, wait: float, steps: int = 9) -> None:
        """One window (9 steps of 30 ms: it closes on the last) in which the threads waited
        `wait` x wall time."""
        for _ in range(steps):
            self.now += 0.03
            self.delay += 0.03 * wait
            governor.after_step()


def test_thread_governor_drops_a_thread_under_contention_and_comes_back(monkeypatch) -> None:
    machine = _Machine(monkeypatch)
    calls: list[int] = []
    governor = platform.ThreadGovernor(calls.append, max_threads=2)
    governor.after_step()  # the first step sets the baseline
    machine.window(governor, wait=0.05)  # idle machine: threads barely wait
    assert governor.threads == 2 and calls == []
    machine.others = 1  # a busy process arrives: our threads wait for a CPU
    machine.window(governor, wait=0.9)
    assert governor.threads == 1 and calls == [1]
    for _ in range(12):  # still there: no core free, and the first blind try is 4 s away
        machine.window(governor, wait=0.0)
    assert calls == [1]
    for _ in range(4):  # 4 s after the drop: one try, which does not fit, and back down
        machine.window(governor, wait=0.9 if governor.threads == 2 else 0.0)
    assert calls == [1, 2, 1] and governor.backoff_s == 8.0
    machine.others = 0  # it leaves: the samples show a free core, the next window tries
    machine.window(governor, wait=0.0)
    machine.window(governor, wait=0.0)
    assert governor.threads == 2 and calls == [1, 2, 1, 2]
    assert governor.backoff_s == platform.MIN_BACKOFF_S  # the try held


def test_thread_governor_is_off_with_one_thread(monkeypatch) -> None:
    machine = _Machine(monkeypatch)
    calls: list[int] = []
    governor = platform.ThreadGovernor(calls.append, max_threads=1)
    machine.window(governor, wait=5.0)
    assert not governor.enabled and calls == []
