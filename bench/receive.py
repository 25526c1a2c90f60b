"""The gateway's receive path alone: the copying decoder beside the ring.

Issue 7 replaced the gateway's receive path. Before, each read was a new
``bytes`` object (``asyncio.Protocol.data_received``) fed to
``FrameDecoder.feed``, which keeps a frame that spans reads in a buffer of its
own and copies it out again; each payload was then a ``bytes`` slice (another
copy). Now a connection reads into its preallocated ring
(``BufferedProtocol``), decodes in place (``FrameDecoder.decode_in_place``)
and hands the log writer slab headers that point into the ring.

This script runs both, in one process, on the same byte stream of batch
frames, cut into the same reads: the bytes of each read are copied into the
path's buffer (what the kernel's ``recv`` does), every batch is split
(``decode_batch``) and its records are copied once into a preallocated sink
(what the log's append does). No sockets, no log, no session: what differs
is only the receive path. It reports records/s and MB/s (best of the
rounds, which interleave the two paths) and, from a separate run under
``tracemalloc``, the peak of the Python heap above where it started, which
includes the ring itself (its first 128 KiB and what it grows to), and the
calls into CPython's allocators per record (``bench/alloccount.py``: a hook
in front of the allocators, which tracemalloc cannot count).

    .venv/bin/python bench/receive.py            # about 30 s
    .venv/bin/python bench/receive.py --quick    # about 6 s
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass

import alloccount
from alloccount import Hook
from headgate.gateway.ring import HANDLED, ReceiveRing
from headgate.gateway.server import RING_INITIAL, RING_MIN_READ, ring_limit
from headgate.protocol import messages as m
from headgate.protocol.codec import FrameDecoder, encode_frame
from headgate.protocol.frames import SendChannel
from headgate.protocol.records import encode_records

MAX_MESSAGE = 1 << 20
#: What ``asyncio``'s selector transport reads at most per ``data_received``.
READ_SIZE = 256 * 1024


@dataclass(frozen=True)
class Workload:
    name: str
    record_size: int
    batch_bytes: int
    records: int


def build(workload: Workload) -> tuple[bytes, int]:
    """The byte stream of batch frames on channel 2, and its record count."""
    per_batch = max(1, workload.batch_bytes // (workload.record_size + 4))
    values = [bytes([i % 251]) * workload.record_size for i in range(per_batch)]
    block = encode_records(values)
    out = bytearray()
    count = 0
    sequence = 0
    while count < workload.records:
        payload = m.encode_batch_header(sequence) + block
        out += encode_frame(SendChannel(channel=2, payload=payload))
        count += per_batch
        sequence += per_batch
    return bytes(out), count


def copying(stream: bytes, sink: bytearray) -> int:
    """Before issue 7: a bytes object per read, FrameDecoder.feed, bytes payloads."""
    decoder = FrameDecoder(max_payload=MAX_MESSAGE)
    source = memoryview(stream)
    records = 0
    for pos in range(0, len(stream), READ_SIZE):
        data = bytes(source[pos : pos + READ_SIZE])  # the read
        for frame in decoder.feed(data):
            assert isinstance(frame, SendChannel)
            _, count, block = m.decode_batch(frame.payload)
            sink[: len(block)] = block  # the append
            records += count
    return records


def ring(stream: bytes, sink: bytearray) -> int:
    """After issue 7: read into the ring, decode in place, headers from the slab."""
    receive = ReceiveRing(
        initial=RING_INITIAL, limit=ring_limit(MAX_MESSAGE), min_read=RING_MIN_READ
    )
    decoder = FrameDecoder(max_payload=MAX_MESSAGE)
    source = memoryview(stream)
    records = 0
    pos = 0
    total = len(stream)
    while pos < total:
        room = receive.writable()
        n = min(len(room), READ_SIZE, total - pos)
        room[:n] = source[pos : pos + n]  # the read
        del room
        pos += n
        view = receive.received(n)
        if view is None:
            continue
        frames, ends, consumed, need = decoder.decode_in_place(view)
        for frame, end in zip(frames, ends, strict=True):
            assert isinstance(frame, SendChannel)
            _, count, block = m.decode_batch(frame.payload)
            message = receive.message(end, len(block))
            sink[: len(block)] = block  # the append, by the writer
            message.status = HANDLED
            records += count
        del view, frames
        receive.consumed(consumed, need)
    return records


PATHS: dict[str, Callable[[bytes, bytearray], int]] = {"copying": copying, "ring": ring}


@dataclass
class Figures:
    rate: float  # records/s
    mbps: float
    heap_peak: int = 0  # bytes, tracemalloc
    calls: float | None = None  # allocator calls per record (None: no hook)
    call_bytes: float | None = None  # bytes those calls asked for, per record


def measure(workload: Workload, rounds: int) -> dict[str, Figures]:
    """Per path: records/s and MB/s, the best of rounds that interleave the paths."""
    stream, records = build(workload)
    sink = bytearray(MAX_MESSAGE)
    best = dict.fromkeys(PATHS, float("inf"))
    for _ in range(rounds):
        for name, path in PATHS.items():
            start = time.perf_counter()
            got = path(stream, sink)
            best[name] = min(best[name], time.perf_counter() - start)
            assert got == records, (name, got, records)
    return {name: Figures(records / best[name], len(stream) / best[name] / 1e6) for name in PATHS}


def count(workload: Workload, figures: dict[str, Figures], hook: Hook | None) -> None:
    """Fill in the heap peak (tracemalloc) and the allocator calls per record (hook)."""
    stream, records = build(workload)
    sink = bytearray(MAX_MESSAGE)
    for name, path in PATHS.items():
        if hook is not None:
            before = hook.counts()
            path(stream, sink)
            after = hook.counts()
            figures[name].calls = (after[0] - before[0]) / records
            figures[name].call_bytes = (after[1] - before[1]) / records
        tracemalloc.start()
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        path(stream, sink)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        figures[name].heap_peak = peak - base


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer records, one round")
    args = parser.parse_args()
    scale = 1 if args.quick else 4
    rounds = 3 if args.quick else 9
    workloads = [
        Workload("100 B records, 256 KiB batches", 100, 256 * 1024, 200_000 * scale),
        Workload("1 KiB records, 256 KiB batches", 1024, 256 * 1024, 40_000 * scale),
        Workload("100 B records, 4 KiB batches", 100, 4096, 100_000 * scale),
    ]
    load = os.getloadavg()
    print("## Receive path: copying decoder beside the ring (`bench/receive.py`)\n")
    print(
        f"- machine: nproc {os.cpu_count()}, Python {platform.python_version()}, "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at start"
    )
    print(f"- reads of at most {READ_SIZE // 1024} KiB; best of {rounds} round(s)\n")
    # Every timed round first: the counting hook, once installed, stays installed.
    results = [measure(workload, rounds) for workload in workloads]
    hook = alloccount.load()
    if hook is not None:
        hook.install()
    for workload, figures in zip(workloads, results, strict=True):
        count(workload, figures, hook)
    print(
        "| workload | path | records/s | MB/s | ratio | heap peak (tracemalloc) "
        "| allocations per record (bytes asked) |"
    )
    print("|---|---|--:|--:|--:|--:|--:|")
    for workload, figures in zip(workloads, results, strict=True):
        base_rate = figures["copying"].rate
        for name, f in figures.items():
            calls = "-" if f.calls is None else f"{f.calls:.4f} ({f.call_bytes or 0:,.1f} B)"
            print(
                f"| {workload.name} | {name} | {f.rate:,.0f} | {f.mbps:,.0f} | "
                f"{f.rate / base_rate:.2f} | {f.heap_peak / 1024:,.0f} KiB | {calls} |"
            )
    print(
        "\nallocations per record: calls into CPython's allocators (malloc, calloc and "
        "realloc, all domains) during one pass of the path, divided by its records, "
        "counted by bench/_alloc_hook.c (tracemalloc keeps live blocks, not a count of "
        "allocations); the bytes those calls asked for, per record, in brackets."
    )
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
