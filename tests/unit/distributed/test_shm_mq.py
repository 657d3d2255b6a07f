"""MessageQueue across real processes (spawned; no mocks): order, wrap-around, overflow,
back-pressure, dead peers, timeouts, cancellation, cleanup of /dev/shm and idle CPU use.

Readers check every message against `_message(i)` themselves and report the first mismatch,
so a failure names the message that was lost or reordered. Small chunks (4 KiB x 4) make the
ring wrap and the overflow path trigger with little data."""

from __future__ import annotations

import array
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection

import msgspec
import pytest

from pagedinfer.distributed.shm_mq import Handle, MessageQueue, MessageQueueClosed

CHUNK_BYTES = 4096
NUM_CHUNKS = 4
SPAWN = mp.get_context("spawn")


def _message(i: int, big_every: int = 0, big_bytes: int = 0) -> list[bytes]:
    """Message i: 1-3 buffers of varying sizes (some empty); every `big_every`-th one has a
    buffer of `big_bytes` (larger than a chunk: the overflow path)."""
    size = big_bytes if big_every and i % big_every == 0 else (i * 37) % 300
    return [bytes([(i + j) % 256]) * (size + j) for j in range(1 + i % 3)]


def _reader_proc(
    handle: bytes,
    rank: int,
    num_msgs: int,
    big_every: int,
    big_bytes: int,
    delay_s: float,
    conn: Connection,
) -> None:
    mq = MessageQueue.create_from_handle(msgspec.msgpack.decode(handle, type=Handle), rank)
    mq.wait_until_ready(timeout=30)
    result = f"ok {num_msgs}"
    for i in range(num_msgs):
        got = [bytes(b) for b in mq.dequeue(timeout=30)]
        if got != _message(i, big_every, big_bytes):
            result = f"message {i} wrong: sizes {[len(b) for b in got]}"
            break
        if delay_s:
            time.sleep(delay_s)
    conn.send(result)
    mq.close()


def _stalled_reader_proc(handle: bytes, rank: int, conn: Connection) -> None:
    """Attaches, completes the handshake, then never reads."""
    mq = MessageQueue.create_from_handle(msgspec.msgpack.decode(handle, type=Handle), rank)
    mq.wait_until_ready(timeout=30)
    conn.send("ready")
    time.sleep(60)


def _writer_proc(conn: Connection) -> None:
    """Sends its handle, one message, then hangs until killed."""
    mq = MessageQueue(1, max_chunk_bytes=CHUNK_BYTES, max_chunks=NUM_CHUNKS)
    conn.send(msgspec.msgpack.encode(mq.export_handle()))
    mq.wait_until_ready(timeout=30)
    mq.enqueue([b"first"])
    time.sleep(60)


def _shm_exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


def _run_broadcast(
    n_reader: int,
    num_msgs: int,
    big_every: int = 0,
    big_bytes: int = 0,
    delays: tuple[float, ...] = (),
) -> float:
    """Writer here, readers in processes; returns the seconds the writer spent enqueueing."""
    mq = MessageQueue(n_reader, max_chunk_bytes=CHUNK_BYTES, max_chunks=NUM_CHUNKS)
    handle = msgspec.msgpack.encode(mq.export_handle())
    pipes, procs = [], []
    for rank in range(n_reader):
        recv, send = SPAWN.Pipe(duplex=False)
        delay = delays[rank] if rank < len(delays) else 0.0
        args = (handle, rank, num_msgs, big_every, big_bytes, delay, send)
        procs.append(SPAWN.Process(target=_reader_proc, args=args, daemon=True))
        procs[-1].start()
        pipes.append(recv)
    try:
        mq.wait_until_ready(timeout=60)
        start = time.monotonic()
        for i in range(num_msgs):
            mq.enqueue(_message(i, big_every, big_bytes), timeout=30)
        elapsed = time.monotonic() - start
        answers = [p.recv() if p.poll(60) else "no answer" for p in pipes]
        assert answers == [f"ok {num_msgs}"] * n_reader
    finally:
        mq.close()
        for proc in procs:
            proc.join(10)
    assert not _shm_exists(mq.export_handle().shm_name)
    return elapsed


@pytest.fixture
def local_pair() -> Iterator[tuple[MessageQueue, MessageQueue]]:
    """Writer and one reader in this process (the handshake needs no second thread)."""
    writer = MessageQueue(1, max_chunk_bytes=CHUNK_BYTES, max_chunks=NUM_CHUNKS)
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    writer.wait_until_ready(timeout=10)
    reader.wait_until_ready(timeout=10)
    yield writer, reader
    reader.close()
    writer.close()
    assert not _shm_exists(writer.export_handle().shm_name)


def test_three_readers_get_every_message_in_order_across_wraps() -> None:
    _run_broadcast(n_reader=3, num_msgs=400)  # 100 laps of the 4-chunk ring


def test_overflow_messages_mixed_with_small_ones_keep_order() -> None:
    # Every 5th message carries a 1 MB buffer (256 chunks' worth) over the side channel.
    _run_broadcast(n_reader=2, num_msgs=60, big_every=5, big_bytes=2**20)


def test_lagging_reader_blocks_writer_without_loss() -> None:
    # Reader 1 sleeps 10 ms per message: the writer must wait for it at least
    # (messages - chunks) x 10 ms, and both readers still see every message in order.
    elapsed = _run_broadcast(n_reader=2, num_msgs=40, big_every=7, big_bytes=10_000,
                             delays=(0.0, 0.01))  # fmt: skip
    assert elapsed >= (40 - NUM_CHUNKS) * 0.01 * 0.9


def test_reader_raises_promptly_when_writer_is_killed() -> None:
    recv, send = SPAWN.Pipe(duplex=False)
    proc = SPAWN.Process(target=_writer_proc, args=(send,), daemon=True)
    proc.start()
    assert recv.poll(30)
    handle = msgspec.msgpack.decode(recv.recv(), type=Handle)
    reader = MessageQueue.create_from_handle(handle, 0)
    try:
        reader.wait_until_ready(timeout=30)
        assert [bytes(b) for b in reader.dequeue(timeout=10)] == [b"first"]
        threading.Timer(0.3, proc.kill).start()  # kill it while we are blocked below
        start = time.monotonic()
        with pytest.raises(MessageQueueClosed, match=f"writer process {proc.pid} died"):
            reader.dequeue(timeout=20)
        assert time.monotonic() - start < 3.0
    finally:
        reader.close()  # the writer cannot unlink any more: the reader does
        proc.join(10)
    assert not _shm_exists(handle.shm_name)


def test_writer_raises_when_reader_dies_on_full_ring() -> None:
    mq = MessageQueue(1, max_chunk_bytes=CHUNK_BYTES, max_chunks=NUM_CHUNKS)
    recv, send = SPAWN.Pipe(duplex=False)
    handle = msgspec.msgpack.encode(mq.export_handle())
    proc = SPAWN.Process(target=_stalled_reader_proc, args=(handle, 0, send), daemon=True)
    proc.start()
    try:
        mq.wait_until_ready(timeout=30)
        assert recv.poll(30) and recv.recv() == "ready"
        for i in range(NUM_CHUNKS):  # fill the ring
            mq.enqueue(_message(i), timeout=5)
        threading.Timer(0.3, proc.kill).start()
        start = time.monotonic()
        with pytest.raises(MessageQueueClosed, match=f"reader 0 \\(process {proc.pid}\\) died"):
            mq.enqueue([b"one too many"], timeout=20)
        assert time.monotonic() - start < 3.0
    finally:
        mq.close()
        proc.join(10)
    assert not _shm_exists(mq.export_handle().shm_name)


def test_sizes_around_the_chunk_boundary(local_pair: tuple[MessageQueue, MessageQueue]) -> None:
    # Inline up to the chunk size (header and alignment padding included), overflow past it;
    # typed memoryviews (here of int32) travel as their bytes.
    writer, reader = local_pair
    for num_buffers in (1, 3):
        for total in range(CHUNK_BYTES - 300, CHUNK_BYTES + 20, 7):
            sizes = [total // num_buffers] * num_buffers
            message = [bytes([len(sizes) + i]) * n for i, n in enumerate(sizes)]
            writer.enqueue(message, timeout=5)
            assert reader.dequeue(timeout=5) == message
    ints = array.array("i", range(100))
    writer.enqueue([memoryview(ints)])
    assert reader.dequeue() == [ints.tobytes()]


def test_timeouts_raise_timeout_error(local_pair: tuple[MessageQueue, MessageQueue]) -> None:
    writer, reader = local_pair
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        reader.dequeue(timeout=0.2)
    assert 0.2 <= time.monotonic() - start < 1.0
    for i in range(NUM_CHUNKS):
        writer.enqueue(_message(i))
    with pytest.raises(TimeoutError):
        writer.enqueue([b"no room"], timeout=0.2)
    # Nothing was lost or half-written by the failed calls.
    assert [[bytes(b) for b in reader.dequeue()] for _ in range(NUM_CHUNKS)] == [
        _message(i) for i in range(NUM_CHUNKS)
    ]


def test_cancel_wakes_a_blocked_reader(local_pair: tuple[MessageQueue, MessageQueue]) -> None:
    _, reader = local_pair
    errors: list[BaseException] = []

    def blocked() -> None:
        try:
            reader.dequeue()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=blocked)
    thread.start()
    time.sleep(0.3)  # past the spin window: asleep on its socket
    start = time.monotonic()
    reader.cancel()
    thread.join(2)
    assert not thread.is_alive() and time.monotonic() - start < 0.5
    assert isinstance(errors[0], MessageQueueClosed)


def test_writer_close_unlinks_and_wakes_attached_reader() -> None:
    writer = MessageQueue(1, max_chunk_bytes=CHUNK_BYTES, max_chunks=NUM_CHUNKS)
    name = writer.export_handle().shm_name
    reader = MessageQueue.create_from_handle(writer.export_handle(), 0)
    writer.wait_until_ready(timeout=10)
    reader.wait_until_ready(timeout=10)
    writer.enqueue([b"last words"])
    assert _shm_exists(name)
    writer.close()
    assert not _shm_exists(name)  # unlinked although a reader is still attached
    assert [bytes(b) for b in reader.dequeue(timeout=1)] == [b"last words"]
    with pytest.raises(MessageQueueClosed, match="writer closed"):
        reader.dequeue(timeout=5)
    reader.close()


def _median_wake_s(
    waiter: Callable[[], float], waker: Callable[[], object], rounds: int = 7
) -> float:
    """Median delay between `waker()` and the return of a blocked `waiter()` (in a thread),
    each time after a pause long enough for the waiter to stop spinning and sleep."""
    woken: list[float] = []

    def wait_rounds() -> None:
        for _ in range(rounds):
            woken.append(waiter())

    thread = threading.Thread(target=wait_rounds)
    thread.start()
    delays = []
    for i in range(rounds):
        time.sleep(0.1)  # > SPIN_S: the waiter sleeps on its socket
        start = time.perf_counter()
        waker()
        while len(woken) <= i:
            time.sleep(0.0002)
        delays.append(woken[i] - start)
    thread.join(5)
    return sorted(delays)[rounds // 2]


def test_sleepers_are_woken_by_pokes_not_the_safety_timeout(
    local_pair: tuple[MessageQueue, MessageQueue],
) -> None:
    # A lost poke would cost up to _SLEEP_MS (20 ms), ~10 ms on average.
    writer, reader = local_pair

    def dequeue_time() -> float:
        reader.dequeue(timeout=5)
        return time.perf_counter()

    assert _median_wake_s(dequeue_time, lambda: writer.enqueue([b"x"])) < 0.002
    for _ in range(NUM_CHUNKS):  # a full ring: the writer sleeps until a reader frees a chunk
        writer.enqueue([b"fill"])

    def enqueue_time() -> float:
        writer.enqueue([b"y"], timeout=5)
        return time.perf_counter()

    assert _median_wake_s(enqueue_time, lambda: reader.dequeue(timeout=5)) < 0.002


def test_idle_blocked_reader_uses_little_cpu(local_pair: tuple[MessageQueue, MessageQueue]) -> None:
    writer, reader = local_pair
    writer.enqueue([b"wake up"])
    assert reader.dequeue() == [b"wake up"]
    done = threading.Event()

    def idle_reader() -> None:
        try:
            reader.dequeue(timeout=2.0)  # spins for SPIN_S, then sleeps on its socket
        except TimeoutError:
            done.set()

    cpu_start, wall_start = time.process_time(), time.monotonic()
    thread = threading.Thread(target=idle_reader)
    thread.start()
    thread.join(10)
    cpu, wall = time.process_time() - cpu_start, time.monotonic() - wall_start
    assert done.is_set() and wall >= 2.0
    assert cpu / wall < 0.10, f"idle reader used {cpu / wall:.1%} of a core"
