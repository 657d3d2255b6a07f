"""`MessageQueue`: one writer broadcasting to many reader processes through shared memory.

The multiprocess executor sends every `SchedulerOutput` to all of its workers, and each worker
answers on a queue of its own (vLLM's `shm_broadcast.MessageQueue`, reference section 8). A
message is a list of byte buffers (what `serial.MsgpackEncoder` produces); small messages travel
through a shared-memory ring with a single copy in and a single copy out, large ones through a
ZMQ side channel. Callers: the executor (writer of the broadcast queue, reader of the response
queues) and the worker processes (the reverse).

Shared-memory layout (`SharedMemory`, one segment per queue, zero-filled at creation):

    [max_chunks x max_chunk_bytes: data]
    [max_chunks x (1 + n_reader) flag bytes: written, read_0 .. read_{n-1}]
    [control bytes: writer_closed, writer_sleeping, reader_sleeping_0 .. reader_sleeping_{n-1}]

A chunk starts with a header, `<BI` (overflow byte, number of buffers) then one `<Q` length per
buffer; inline messages follow it with the buffers, each starting on a 64-byte boundary. An
overflow message (too large for a chunk) carries only the header; its buffers go as one
multipart message on the side channel, sent before the chunk is published so that a reader
never waits long for it.

Protocol, per chunk (`current_idx` advances round the ring on both sides):
- Writer: wait until the chunk is free (`written == 0`: never used, or every `read_i == 1`);
  set `written = 0`; write the data; set every `read_i = 0`, *then* `written = 1`. Resetting
  the read flags while `written` is still 1 from the previous lap would let a reader that is
  already waiting at this index see "written, not yet read" and read a half-written chunk.
- Reader i: wait for `written == 1 and read_i == 0`; copy the data out; set `read_i = 1`.

Memory ordering: CPython has no fences. On x86 (TSO) stores become visible in program order
and loads are not reordered with older loads, and each flag and data access is a separate C
call the compiler cannot merge or reorder, so the order above is what other processes observe.
Weaker CPUs (ARM: Grace-Hopper hosts) may reorder; `_fence()` acquires and releases a lock,
whose atomic read-modify-write instructions order the data accesses around the flags there too
(the same trick as vLLM's newer `memory_fence`). It costs ~0.1 us, three times per call.

Waiting: a waiter spins (with `os.sched_yield`) for `SPIN_S` after its last message, then marks
itself sleeping in the control bytes, re-checks, and blocks on a ZMQ socket. Whoever makes
progress (the writer publishing a chunk, a reader freeing one) pokes the other side only when a
sleeping mark is set, so a busy queue never touches a socket. A fence sits between each side's
store and its load of the other's (sleeper: mark, then flags; waker: flags, then marks), which
rules out a lost poke where the lock's atomics are full barriers (x86); as a safety net on
other CPUs, sleepers also wake every `_SLEEP_MS` to re-check. That is also when they notice
cancellation, timeouts, a closed writer and, every `_PEER_CHECK_S`, a peer process that died.
An idle reader costs ~0.1% of a core.

Handshake (`wait_until_ready`, both sides, before the first message): readers subscribe to the
side channel (and announce their rank and pid with a second, unique subscription) and to the
notify channel; the writer waits for one of each per reader, so no overflow message or poke is
published before every reader can receive it, then sends READY on the side channel. The writer
thereby learns the readers' pids, and the readers know the writer's from the `Handle`.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from secrets import token_hex

import msgspec
import zmq

__all__ = ["DEFAULT_MAX_CHUNK_BYTES", "SPIN_S", "Handle", "MessageQueue", "MessageQueueClosed"]

DEFAULT_MAX_CHUNK_BYTES = 4 * 2**20
"""4 MiB: a `SchedulerOutput` with long new prompts (128k tokens ~ 0.5 MB of msgpack) and a
large guided-decoding bitmask still go inline; bigger messages take the ZMQ path, which moves
GB/s anyway. tmpfs commits only the pages a message touches, so an unused chunk tail costs no
memory, and 10 x 4 MiB fits Docker's default 64 MiB /dev/shm even when fully used (vLLM's
10 x 24 MiB needs --shm-size)."""

SPIN_S = 0.05
"""How long a waiter spins after its last message before it sleeps on a socket. Back-to-back
traffic (a decode step every few ms) stays on the spin path (~us latency); an idle queue falls
asleep quickly, because on small hosts a spinning process steals a core from real work."""

_SLEEP_MS = 20  # sleeper wake-up period: bounds a lost poke's and cancel()'s latency
_PEER_CHECK_S = 0.25  # how often a sleeper checks that the processes it waits on are alive
_HEADER = struct.Struct("<BI")  # overflow byte, number of buffers; then n x <Q lengths
_ALIGN = 64  # inline buffers start on cache lines (see _aligned)
_INLINE, _OVERFLOW = 0, 1
_HELLO = b"\xffpagedinfer-mq-hello"  # + <Iq rank, pid: a reader's handshake subscription
_READY = b"READY"
_FENCE_LOCK = threading.Lock()


class MessageQueueClosed(RuntimeError):
    """The queue cannot make progress: cancelled, closed, or the process on the other side died."""


class Handle(msgspec.Struct, frozen=True):
    """What a reader process needs to attach (msgspec, so it can cross a pipe as msgpack)."""

    shm_name: str
    n_reader: int
    max_chunk_bytes: int
    max_chunks: int
    data_address: str
    """Writer's XPUB: handshake and overflow payloads."""
    notify_address: str
    """Writer's XPUB: pokes to sleeping readers."""
    poke_address: str
    """Writer's PULL: pokes from readers to a writer sleeping on a full ring."""
    writer_pid: int


def _aligned(n: int) -> int:
    """`n` rounded up to `_ALIGN`. Copies into a destination that is not 16-byte aligned run
    at half speed or worse on some CPUs (measured: AMD EPYC, 1 MB at offset 22 of a chunk
    took 45 instead of 22 us, and ~400 us under contention), so every inline buffer starts
    on a cache line; the readers' copies then read aligned sources too."""
    return (n + _ALIGN - 1) & -_ALIGN


def _sleep_ms(deadline: float | None) -> int:
    """How long a sleeper may block: `_SLEEP_MS`, or less to wake at its deadline."""
    if deadline is None:
        return _SLEEP_MS
    return max(0, min(_SLEEP_MS, int((deadline - time.monotonic()) * 1000) + 1))


def _fence() -> None:
    _FENCE_LOCK.acquire()
    _FENCE_LOCK.release()


def _pid_alive(pid: int) -> bool:
    """False once `pid` has exited, zombies included: a dead child stays a zombie until its
    parent reaps it, and `os.kill(pid, 0)` would still succeed. Linux (/proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    # "pid (comm) S ...": comm may itself contain ')', the state follows the last one.
    state_at = stat.rindex(b")") + 2
    return stat[state_at : state_at + 1] not in (b"Z", b"X")


def _attach_untracked(name: str) -> SharedMemory:
    """Attach to an existing segment without registering it with this process's resource
    tracker. Python < 3.13 registers every attach, and the tracker unlinks what is registered
    when the process exits, so a reader exiting would destroy the writer's live ring
    (CPython gh-82300). Only the writer (or a reader that saw it die) unlinks."""
    register = resource_tracker.register
    resource_tracker.register = lambda name, rtype: None
    try:
        return SharedMemory(name=name)
    finally:
        resource_tracker.register = register


def _as_bytes(buffer: bytes | bytearray | memoryview) -> bytes | bytearray | memoryview:
    """`buffer` as something whose len() is its size in bytes."""
    if isinstance(buffer, (bytes, bytearray)):
        return buffer
    view = memoryview(buffer)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _bind(ctx: zmq.Context, kind: int) -> tuple[zmq.Socket, str]:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == zmq.PULL:
        sock.setsockopt(zmq.CONFLATE, 1)  # pokes carry no data: one pending is enough
    else:
        sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # pass every reader's subscription up
        # Unbounded: the ring already bounds what is in flight (at most max_chunks messages),
        # and a PUB socket silently drops what exceeds its high-water mark.
        sock.setsockopt(zmq.SNDHWM, 0)
    sock.bind("tcp://127.0.0.1:*")
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


class MessageQueue:
    """A broadcast ring from one writer to `n_reader` readers (see the module docstring).

    The writer constructs it and passes `export_handle()` to the readers, which attach with
    `create_from_handle`; both sides then call `wait_until_ready()`. One thread per side uses
    the queue, except `cancel()`, which any thread may call.
    """

    def __init__(
        self,
        n_reader: int,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        max_chunks: int = 10,
    ) -> None:
        if n_reader < 1 or max_chunks < 1 or max_chunk_bytes < _ALIGN:
            raise ValueError(f"bad queue geometry: {n_reader=} {max_chunks=} {max_chunk_bytes=}")
        shm = SharedMemory(
            name=f"pagedinfer_mq_{token_hex(8)}",
            create=True,
            size=max_chunks * (max_chunk_bytes + 1 + n_reader) + 2 + n_reader,
        )
        ctx = zmq.Context.instance()
        self._data_sock, data_address = _bind(ctx, zmq.XPUB)
        self._notify_sock, notify_address = _bind(ctx, zmq.XPUB)
        self._poke_sock, poke_address = _bind(ctx, zmq.PULL)
        handle = Handle(
            shm.name, n_reader, max_chunk_bytes, max_chunks, data_address, notify_address,
            poke_address, os.getpid(),
        )  # fmt: skip
        self._setup(shm, handle, rank=None)

    @classmethod
    def create_from_handle(cls, handle: Handle, reader_rank: int) -> MessageQueue:
        """Attach as reader `reader_rank` (0 <= rank < n_reader, each rank exactly once)."""
        if not 0 <= reader_rank < handle.n_reader:
            raise ValueError(f"reader_rank {reader_rank} outside [0, {handle.n_reader})")
        self = cls.__new__(cls)
        self._setup(_attach_untracked(handle.shm_name), handle, rank=reader_rank)
        ctx = zmq.Context.instance()
        self._data_sock = ctx.socket(zmq.SUB)
        self._data_sock.setsockopt(zmq.LINGER, 0)
        self._data_sock.setsockopt(zmq.RCVHWM, 0)  # overflow payloads: never dropped
        self._data_sock.connect(handle.data_address)
        self._data_sock.setsockopt(zmq.SUBSCRIBE, b"")
        hello = _HELLO + struct.pack("<Iq", reader_rank, os.getpid())
        self._data_sock.setsockopt(zmq.SUBSCRIBE, hello)
        self._notify_sock = ctx.socket(zmq.SUB)
        self._notify_sock.setsockopt(zmq.LINGER, 0)
        self._notify_sock.setsockopt(zmq.CONFLATE, 1)
        self._notify_sock.connect(handle.notify_address)
        self._notify_sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._poke_sock = ctx.socket(zmq.PUSH)
        self._poke_sock.setsockopt(zmq.LINGER, 0)
        self._poke_sock.setsockopt(zmq.SNDHWM, 1)  # a poke already queued is as good as two
        self._poke_sock.connect(handle.poke_address)
        return self

    def _setup(self, shm: SharedMemory, handle: Handle, rank: int | None) -> None:
        self.spin_s = SPIN_S
        """How long a waiter spins after its last message before it sleeps (settable: a
        side that usually waits long, e.g. for a whole forward pass, spins less)."""
        self._shm = shm
        self._buf = shm.buf
        self._handle = handle
        self._rank = rank
        self._n = handle.n_reader
        self._chunk_bytes = handle.max_chunk_bytes
        self._flags_base = handle.max_chunks * handle.max_chunk_bytes
        self._ctrl = self._flags_base + handle.max_chunks * (1 + self._n)
        self._all_read = b"\x01" * self._n
        self._none_read = b"\x00" * self._n
        self._idx = 0
        self._is_ready = False
        self._cancelled = False
        self._closed = False
        self._writer_died = False
        self._last_active = time.monotonic()
        self._next_peer_check = 0.0
        self._reader_pids: list[int] = []  # the writer learns them in the handshake

    @property
    def is_writer(self) -> bool:
        return self._rank is None

    def export_handle(self) -> Handle:
        return self._handle

    # ---------------------------------------------------------------- handshake

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Block until every reader is subscribed (writer) / the writer said READY (reader).
        Every party calls it once, before its first message."""
        if self._is_ready:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.is_writer:
            pids: dict[int, int] = {}
            num_notify = 0
            while len(pids) < self._n or num_notify < self._n:
                sock = self._poll_any([self._data_sock, self._notify_sock], deadline)
                msg = sock.recv()
                if msg[:1] != b"\x01":  # an unsubscription (a reader going away)
                    continue
                if sock is self._notify_sock:
                    num_notify += 1
                elif msg[1:].startswith(_HELLO):
                    rank, pid = struct.unpack("<Iq", msg[1 + len(_HELLO) :])
                    pids[rank] = pid
            self._reader_pids = [pids[rank] for rank in range(self._n)]
            self._data_sock.send(_READY)
        else:
            msg = self._poll_any([self._data_sock], deadline).recv()
            if msg != _READY:
                raise MessageQueueClosed(f"handshake: expected READY, got {msg[:32]!r}")
        self._is_ready = True
        self._last_active = time.monotonic()

    def _poll_any(self, socks: list[zmq.Socket], deadline: float | None) -> zmq.Socket:
        poller = zmq.Poller()
        for sock in socks:
            poller.register(sock, zmq.POLLIN)
        while not (events := poller.poll(_sleep_ms(deadline))):
            self._check_interrupts(deadline, check_peers=True)
        return events[0][0]

    # ---------------------------------------------------------------- writer

    def enqueue(
        self, buffers: Sequence[bytes | bytearray | memoryview], timeout: float | None = None
    ) -> None:
        """Publish one message (a list of buffers) to every reader; blocks while the ring is
        full. The buffers may be reused as soon as this returns."""
        self._require("enqueue", writer=True)
        views = [_as_bytes(b) for b in buffers]
        lengths = [len(v) for v in views]
        header_bytes = _HEADER.size + 8 * len(views)
        if header_bytes > self._chunk_bytes:
            raise ValueError(f"{len(views)} buffers: their header does not fit in a chunk")
        # Inline if it fits with the worst-case alignment padding.
        is_inline = header_bytes + sum(lengths) + _ALIGN * len(views) <= self._chunk_bytes
        buf, flag = self._buf, self._flags_base + self._idx * (1 + self._n)
        if not self._chunk_free(flag):
            deadline = None if timeout is None else time.monotonic() + timeout
            self._wait(lambda: self._chunk_free(flag), deadline, self._ctrl + 1, self._poke_sock)
        # No fence before the data stores: they depend on the flag loads just done, and no CPU
        # makes a store visible before the load that decided it.
        buf[flag] = 0
        _fence()  # release: `written = 0` is visible before any read flag is reset below
        trackers = None if is_inline else self._send_overflow(views)
        pos = self._idx * self._chunk_bytes
        kind = _INLINE if is_inline else _OVERFLOW
        struct.pack_into(f"<BI{len(views)}Q", buf, pos, kind, len(views), *lengths)
        if is_inline:
            pos += _aligned(header_bytes)
            for view, n in zip(views, lengths):
                buf[pos : pos + n] = view
                pos += _aligned(n)
        buf[flag + 1 : flag + 1 + self._n] = self._none_read
        _fence()  # release: data and reset read flags are visible before `written = 1`
        buf[flag] = 1
        self._idx = (self._idx + 1) % self._handle.max_chunks
        self._last_active = time.monotonic()
        _fence()  # order the store above before the loads of the sleeping marks
        if buf[self._ctrl + 2 : self._ctrl + 2 + self._n] != self._none_read:
            self._notify_sock.send(b"", zmq.NOBLOCK)
        if trackers:
            self._wait_sent(trackers)

    def _chunk_free(self, flag: int) -> bool:
        buf = self._buf
        return buf[flag] == 0 or buf[flag + 1 : flag + 1 + self._n] == self._all_read

    def _send_overflow(
        self, views: list[bytes | bytearray | memoryview]
    ) -> list[zmq.MessageTracker]:
        # Zero-copy frames (send_multipart would track only the last one): zmq reads them
        # straight from the caller's memory, so enqueue() waits until zmq released them all.
        trackers = []
        for i, view in enumerate(views):
            more = zmq.SNDMORE if i < len(views) - 1 else 0
            trackers.append(self._data_sock.send(view, more, copy=False, track=True))
        return trackers

    def _wait_sent(self, trackers: list[zmq.MessageTracker]) -> None:
        # No deadline: the message is already published, so a TimeoutError would lie. This
        # takes as long as handing the bytes to the kernel (the readers' zmq threads drain
        # their sockets whatever the readers do), unless a reader process is stopped.
        for tracker in trackers:
            while not tracker.done:
                self._check_interrupts(None, check_peers=True)
                try:
                    tracker.wait(_SLEEP_MS / 1000)
                except zmq.NotDone:
                    pass

    # ---------------------------------------------------------------- reader

    def dequeue(self, timeout: float | None = None) -> list[bytearray]:
        """The next message, in order: its buffers, copied out (the caller owns them)."""
        self._require("dequeue", writer=False)
        assert self._rank is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        buf, flag = self._buf, self._flags_base + self._idx * (1 + self._n)
        mine = flag + 1 + self._rank
        if not (buf[flag] == 1 and buf[mine] == 0):
            self._wait(
                lambda: buf[flag] == 1 and buf[mine] == 0,
                deadline,
                self._ctrl + 2 + self._rank,
                self._notify_sock,
            )
        _fence()  # acquire: read the data only after seeing it published
        pos = self._idx * self._chunk_bytes
        kind, num = _HEADER.unpack_from(buf, pos)
        lengths = struct.unpack_from(f"<{num}Q", buf, pos + _HEADER.size)
        if kind == _OVERFLOW:
            out = self._recv_overflow(lengths, deadline)
        else:
            pos += _aligned(_HEADER.size + 8 * num)
            out = []
            for n in lengths:
                out.append(bytearray(buf[pos : pos + n]))
                pos += _aligned(n)
        _fence()  # release: the copies above are complete before the writer may reuse the chunk
        buf[mine] = 1
        self._idx = (self._idx + 1) % self._handle.max_chunks
        self._last_active = time.monotonic()
        _fence()
        if buf[self._ctrl + 1]:  # the writer sleeps on a full ring
            try:
                self._poke_sock.send(b"", zmq.NOBLOCK)
            except zmq.Again:  # a poke is already queued
                pass
        return out

    def _recv_overflow(self, lengths: Sequence[int], deadline: float | None) -> list[bytearray]:
        out = [bytearray(n) for n in lengths]
        self._poll_any([self._data_sock], deadline)
        # A multipart message arrives whole: once its first frame is there, all are.
        for part in out:
            if (got := self._data_sock.recv_into(part)) != len(part):
                raise MessageQueueClosed(f"side channel: frame of {got} bytes, {len(part)} due")
        return out

    # ---------------------------------------------------------------- waiting

    def _wait(
        self,
        is_ready: Callable[[], bool],
        deadline: float | None,
        sleep_mark: int,
        notify_sock: zmq.Socket,
    ) -> None:
        """Return once `is_ready()`: spin for a while after the last message, then sleep on
        `notify_sock` with this side's sleeping mark set (see the module docstring)."""
        spin_until = self._last_active + self.spin_s
        while time.monotonic() < spin_until:
            os.sched_yield()
            if is_ready():
                return
            self._check_interrupts(deadline, check_peers=False)
        buf = self._buf
        try:
            while True:
                buf[sleep_mark] = 1
                _fence()  # the mark is visible before the re-check (a lost poke costs a wake)
                if is_ready():
                    return
                self._check_interrupts(deadline, check_peers=True)
                if notify_sock.poll(_sleep_ms(deadline)):
                    notify_sock.recv()  # conflated: at most one poke is pending
        finally:
            buf[sleep_mark] = 0

    def _check_interrupts(self, deadline: float | None, check_peers: bool) -> None:
        if self._cancelled:
            raise MessageQueueClosed("message queue cancelled")
        now = time.monotonic()
        if deadline is not None and now > deadline:
            raise TimeoutError("message queue: timed out")
        if not self.is_writer and self._buf[self._ctrl]:
            raise MessageQueueClosed("the writer closed the message queue")
        if check_peers and now >= self._next_peer_check:
            self._next_peer_check = now + _PEER_CHECK_S
            if self.is_writer:
                for rank, pid in enumerate(self._reader_pids):
                    if not _pid_alive(pid):
                        raise MessageQueueClosed(f"reader {rank} (process {pid}) died")
            elif not _pid_alive(self._handle.writer_pid):
                self._writer_died = True
                raise MessageQueueClosed(f"writer process {self._handle.writer_pid} died")

    def _require(self, op: str, writer: bool) -> None:
        if (self._rank is None) != writer:
            raise RuntimeError(f"{op}() is for the {'writer' if writer else 'readers'}")
        if self._closed or self._cancelled:
            raise MessageQueueClosed("message queue closed or cancelled")
        if not self._is_ready:
            raise RuntimeError("call wait_until_ready() first")

    # ---------------------------------------------------------------- teardown

    def cancel(self) -> None:
        """Make a blocked (or later) enqueue/dequeue raise MessageQueueClosed within ~20 ms;
        safe from any thread."""
        self._cancelled = True

    def close(self) -> None:
        """Detach (and, on the writer, unlink the segment: readers keep their mapping until
        they close). A reader that saw the writer die unlinks it, as nobody else will. Call
        cancel() and join a thread blocked in this queue before closing it."""
        if self._closed:
            return
        self._closed = self._cancelled = True
        if self.is_writer:
            self._buf[self._ctrl] = 1  # readers waiting on this queue raise instead of hanging
        for sock in (self._data_sock, self._notify_sock, self._poke_sock):
            sock.close(linger=0)
        self._shm.close()  # releases self._buf (the same memoryview) and unmaps
        if self.is_writer or self._writer_died:
            try:
                self._shm.unlink()
            except FileNotFoundError:  # another reader of a dead writer got there first
                pass
