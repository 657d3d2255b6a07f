"""MessageQueue (shared-memory broadcast) against multiprocessing.Queue, one writer and
`--readers` reader processes: the evidence that the executor's broadcast path pays for itself.

Latency: the writer broadcasts one message and waits until every reader has acknowledged it
(a 1-byte reply on the same kind of channel: a per-reader MessageQueue(1), or a per-reader
multiprocessing.Queue); reported as the median and p99 of that round trip ("all acked"),
and the median / 2 as the one-way estimate. multiprocessing.Queue has one consumer per queue,
so its broadcast is one put per reader. Throughput: the writer streams `--stream` messages,
the readers acknowledge only the last one; messages/s and payload GB/s delivered to each
reader. Ratios are multiprocessing.Queue / MessageQueue (higher is better for MessageQueue).

Usage: .venv/bin/python benchmarks/bench_mq.py [--quick] [--readers 2] \
           [--sizes 1024,1048576] [--rounds 5] [--iters 2000] [--stream 4000]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection

import msgspec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pagedinfer.distributed.shm_mq import Handle, MessageQueue  # noqa: E402

ECHO, STREAM, QUIT = b"E", b"S", b"Q"  # message kinds: ack it, don't, exit
SPAWN = mp.get_context("spawn")


def _mq_reader(handle: bytes, rank: int, conn: Connection) -> None:
    inbox = MessageQueue.create_from_handle(msgspec.msgpack.decode(handle, type=Handle), rank)
    outbox = MessageQueue(1, max_chunk_bytes=4096)
    conn.send_bytes(msgspec.msgpack.encode(outbox.export_handle()))
    inbox.wait_until_ready()
    outbox.wait_until_ready()
    while (kind := bytes(inbox.dequeue()[0])) != QUIT:
        if kind == ECHO:
            outbox.enqueue([b"k"])
    outbox.close()
    inbox.close()


def _mp_reader(inbox: mp.Queue, outbox: mp.Queue) -> None:
    while (kind := inbox.get()[0]) != QUIT:
        if kind == ECHO:
            outbox.put(b"k")


class _MQTransport:
    name = "MessageQueue"

    def __init__(self, num_readers: int) -> None:
        self.bcast = MessageQueue(num_readers)
        handle = msgspec.msgpack.encode(self.bcast.export_handle())
        pipes = [SPAWN.Pipe(duplex=False) for _ in range(num_readers)]
        self.procs = [SPAWN.Process(target=_mq_reader, args=(handle, rank, send))
                      for rank, (_, send) in enumerate(pipes)]  # fmt: skip
        for proc in self.procs:
            proc.start()
        self.acks = [
            MessageQueue.create_from_handle(
                msgspec.msgpack.decode(recv.recv_bytes(), type=Handle), 0
            )
            for recv, _ in pipes
        ]
        self.bcast.wait_until_ready()
        for ack in self.acks:
            ack.wait_until_ready()

    def send(self, kind: bytes, payload: bytes) -> None:
        self.bcast.enqueue([kind, payload])

    def wait_acks(self) -> None:
        for ack in self.acks:
            ack.dequeue()

    def close(self) -> None:
        self.send(QUIT, b"")
        for proc in self.procs:
            proc.join()
        for ack in self.acks:
            ack.close()
        self.bcast.close()


class _MPTransport:
    name = "mp.Queue"

    def __init__(self, num_readers: int) -> None:
        self.inboxes = [SPAWN.Queue() for _ in range(num_readers)]
        self.outboxes = [SPAWN.Queue() for _ in range(num_readers)]
        self.procs = [SPAWN.Process(target=_mp_reader, args=queues)
                      for queues in zip(self.inboxes, self.outboxes)]  # fmt: skip
        for proc in self.procs:
            proc.start()
        self.send(ECHO, b"")  # wait until the readers run
        self.wait_acks()

    def send(self, kind: bytes, payload: bytes) -> None:
        for inbox in self.inboxes:
            inbox.put((kind, payload))

    def wait_acks(self) -> None:
        for outbox in self.outboxes:
            outbox.get()

    def close(self) -> None:
        self.send(QUIT, b"")
        for proc in self.procs:
            proc.join()


def _measure(
    transport: _MQTransport | _MPTransport, size: int, iters: int, stream: int
) -> dict[str, float]:
    payload = os.urandom(size)
    rtts = []
    for i in range(iters + iters // 10):  # the first tenth warms up
        start = time.perf_counter()
        transport.send(ECHO, payload)
        transport.wait_acks()
        if i >= iters // 10:
            rtts.append(time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(stream - 1):
        transport.send(STREAM, payload)
    transport.send(ECHO, payload)
    transport.wait_acks()
    elapsed = time.perf_counter() - start
    rtts.sort()
    return {
        "p50_us": statistics.median(rtts) * 1e6,
        "p99_us": rtts[int(0.99 * (len(rtts) - 1))] * 1e6,
        "msgs_s": stream / elapsed,
        "gb_s": stream * size / elapsed / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one short round (~5 s)")
    parser.add_argument("--readers", type=int, default=2)
    parser.add_argument("--sizes", default="1024,1048576", help="message sizes in bytes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=2000, help="latency round trips per round")
    parser.add_argument("--stream", type=int, default=4000, help="messages streamed per round")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rounds, iters, stream = (1, 200, 400) if args.quick else (args.rounds, args.iters, args.stream)
    budget_bytes = (64 if args.quick else 512) * 2**20  # what large messages stream per round

    print(
        f"Command: `.venv/bin/python {' '.join(sys.argv)}` ({args.readers} readers, "
        f"{os.cpu_count()} cores); round trip = broadcast until every reader acked; "
        f"medians over {rounds} rounds\n"
    )
    print("| transport | size | RTT p50 (us) | RTT p99 (us) | one-way ~ (us) | msgs/s | GB/s |")
    print("|---|---|---|---|---|---|---|")
    # Both transports stay up (an idle MessageQueue reader sleeps on its socket); they take
    # turns, in an order reversed every round, so the machine's drift hits both alike.
    transports = [_MQTransport(args.readers), _MPTransport(args.readers)]
    results: dict[tuple[str, int], dict[str, float]] = {}
    for size in sizes:
        n = min(stream, max(50, budget_bytes // size))
        runs: dict[str, list[dict[str, float]]] = {t.name: [] for t in transports}
        for r in range(rounds):
            for transport in transports if r % 2 == 0 else transports[::-1]:
                runs[transport.name].append(_measure(transport, size, iters, n))
        for name, measured in runs.items():
            res = results[name, size] = {
                key: statistics.median(m[key] for m in measured) for key in measured[0]
            }
            print(
                f"| {name} | {size} | {res['p50_us']:.1f} | {res['p99_us']:.1f} | "
                f"{res['p50_us'] / 2:.1f} | {res['msgs_s']:.0f} | {res['gb_s']:.3f} |",
                flush=True,
            )
    for transport in transports:
        transport.close()
    print("\nmp.Queue / MessageQueue:")
    for size in sizes:
        mq, mpq = results["MessageQueue", size], results["mp.Queue", size]
        print(
            f"  {size} B: latency p50 {mpq['p50_us'] / mq['p50_us']:.1f}x lower, "
            f"throughput {mq['msgs_s'] / mpq['msgs_s']:.1f}x higher"
        )


if __name__ == "__main__":
    main()
