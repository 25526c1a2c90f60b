"""Benchmark: StreamLog appends and reads beside a plain buffered file in the same run.

    .venv/bin/python bench/log.py            # about a minute
    .venv/bin/python bench/log.py --quick    # a few seconds
    HEADGATE_PURE_PYTHON_LOG=1 .venv/bin/python bench/log.py   # without the C frame writer

The first lines say which frame writer was measured: the optional C extension
``headgate.log._frame_writer`` (the default when it is built), or the pure-Python
path (when it is not built, or with HEADGATE_PURE_PYTHON_LOG=1).

Workloads: payloads of 100 bytes and of 16 KiB.

* headgate ``append``: ``StreamLog.append``, one frame per call (16 MiB terms,
  capacity large enough that nothing is released); read back with
  ``LogReader.read`` by position.
* headgate ``append_many``: ``StreamLog.append_many`` with groups of
  BATCH_GROUP frames per call, as the gateway has when several batches of one
  stream arrive in one socket read: one call and one publish per group. The
  list of frame tuples is built inside the timed loop, as a caller must.
* baseline: ``open(path, "wb")`` (a buffered writer), one ``write`` of a
  40-byte header packed with ``struct`` (plus the frame's alignment padding,
  so both write the same number of bytes) and one ``write`` of the payload
  per record; no checksum. Read back by reading the file and slicing
  ``memoryview``s at the header lengths.

Each is run without durability and with group commit: a second thread that
every 2 ms (the gateway's default ``group_commit_interval_ms``) makes what was
appended durable, ``StreamLog.sync`` for headgate and ``flush`` plus
``fdatasync`` for the baseline. Timing covers the appends and, with group
commit, the final commit that makes the last one durable.

In both modes headgate also runs its own helper thread that reserves each next
term ahead of need (see LOG.md); the baseline's file simply grows.

The machine may be shared, so rounds interleave headgate and the baseline and
the best round of each is reported. MB/s counts log bytes (header, payload,
alignment) for both.
"""

from __future__ import annotations

import argparse
import os
import shutil
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from headgate.log import HEADER_LENGTH, LogReader, StreamLog, frame_cost
from headgate.log.appender import _write_frame, frame_writer

COMMIT_INTERVAL = 0.002
BATCH_GROUP = 16
TERM_LENGTH = 16 * 1024 * 1024
_BASE_HEADER = struct.Struct("<IIHBBIQQq")


@dataclass(frozen=True)
class Workload:
    name: str
    payload_length: int
    count: int


@dataclass
class Best:
    """Best (shortest) time seen for one measurement over the rounds."""

    seconds: float = float("inf")

    def add(self, seconds: float) -> None:
        self.seconds = min(self.seconds, seconds)


class Committer:
    """Calls ``commit`` every COMMIT_INTERVAL seconds on its own thread until stopped."""

    def __init__(self, commit: Callable[[], object]) -> None:
        self._commit = commit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.commits = 0

    def __enter__(self) -> Committer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(COMMIT_INTERVAL):
            self._commit()
            self.commits += 1


def headgate_append(
    directory: Path, workload: Workload, group_commit: bool, batched: bool = False
) -> float:
    payload = b"p" * workload.payload_length
    capacity = (workload.count + 16) * frame_cost(workload.payload_length) + 4 * TERM_LENGTH
    capacity -= capacity % 8
    log = StreamLog.open(directory, term_length=TERM_LENGTH, capacity=capacity)
    try:
        append = log.append
        count = workload.count
        if batched:
            append_many = log.append_many
            group = BATCH_GROUP

            def run() -> None:
                for first in range(0, count, group):
                    last = min(first + group, count)
                    append_many([(payload, 1, seq, 1, seq) for seq in range(first, last)])

            started = time.perf_counter()
            if group_commit:
                with Committer(log.sync):
                    run()
                log.sync()
            else:
                run()
            return time.perf_counter() - started
        started = time.perf_counter()
        if group_commit:
            with Committer(log.sync):
                for seq in range(count):
                    append(
                        payload, producer_id=1, first_sequence=seq, record_count=1, timestamp_us=seq
                    )
            log.sync()
        else:
            for seq in range(count):
                append(payload, producer_id=1, first_sequence=seq, record_count=1, timestamp_us=seq)
        return time.perf_counter() - started
    finally:
        log.close()


def baseline_append(path: Path, workload: Workload, group_commit: bool) -> float:
    payload = b"p" * workload.payload_length
    length = HEADER_LENGTH + workload.payload_length
    padding = bytes(frame_cost(workload.payload_length) - length)
    pack = _BASE_HEADER.pack
    count = workload.count
    with open(path, "wb") as f:
        write = f.write
        fd = f.fileno()

        def commit() -> None:
            f.flush()
            os.fdatasync(fd)

        started = time.perf_counter()
        if group_commit:
            with Committer(commit):
                for seq in range(count):
                    write(pack(length, 0, 1, 0, 1, 1, 1, seq, seq) + padding)
                    write(payload)
            commit()
        else:
            for seq in range(count):
                write(pack(length, 0, 1, 0, 1, 1, 1, seq, seq) + padding)
                write(payload)
            f.flush()
        return time.perf_counter() - started


def headgate_read(directory: Path, workload: Workload) -> float:
    started = time.perf_counter()
    with LogReader.open(directory) as reader:
        position = reader.start_position()
        end = reader.published_position()
        frames = 0
        while position < end:
            batch = reader.read(position, end, max_bytes=1 << 20)
            frames += len(batch)
            position = batch[-1].end_position
            del batch
    elapsed = time.perf_counter() - started
    assert frames == workload.count, frames
    return elapsed


def baseline_read(path: Path, workload: Workload) -> float:
    started = time.perf_counter()
    with open(path, "rb") as f:
        data = memoryview(f.read())
    unpack = _BASE_HEADER.unpack_from
    offset = 0
    frames = 0
    payloads = []
    size = len(data)
    while offset < size:
        header = unpack(data, offset)
        length = header[0]
        payloads.append(data[offset + HEADER_LENGTH : offset + length])
        frames += 1
        offset += (length + 7) & -8
        if len(payloads) >= 4096:
            payloads.clear()
    payloads.clear()
    data.release()
    elapsed = time.perf_counter() - started
    assert frames == workload.count, frames
    return elapsed


def explain_small_appends(directory: Path, count: int) -> list[tuple[str, float]]:
    """Nanoseconds per append, built up step by step on a mapped term, for the 100 B case.

    Each step runs the steps before it too, so the differences show what each
    one adds; the last line is the real ``StreamLog.append``.
    """
    import mmap
    import zlib

    body = struct.Struct("<HBBIQQq")
    payload = b"p" * 100
    fd = os.open(directory / "explain", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.ftruncate(fd, TERM_LENGTH)
    buffer = mmap.mmap(fd, TERM_LENGTH)
    view = memoryview(buffer)
    words = view.cast("Q")
    meta = mmap.mmap(-1, 4096)
    meta_words = memoryview(meta).cast("q")
    mask = TERM_LENGTH - 1

    class Stub:
        def append(
            self,
            payload: bytes,
            *,
            producer_id: int,
            first_sequence: int,
            record_count: int,
            timestamp_us: int,
        ) -> tuple[int, int]:
            return (0, 0)

    def call() -> None:
        append = Stub().append
        for seq in range(count):
            append(payload, producer_id=1, first_sequence=seq, record_count=1, timestamp_us=seq)

    def steps(upto: int) -> Callable[[], None]:
        def run() -> None:
            for seq in range(count):
                offset = (seq * 144) & mask
                body.pack_into(buffer, offset + 8, 1, 0, 1, 1, 1, seq, seq)
                if upto >= 2:
                    buffer[offset + 40 : offset + 140] = payload
                if upto >= 3:
                    checksum = zlib.crc32(view[offset + 8 : offset + 140], seq)
                if upto >= 4:
                    words[offset >> 3] = 140 | checksum << 32
                    meta_words[8] = offset

        return run

    def in_c() -> None:
        assert _write_frame is not None
        write = _write_frame
        for seq in range(count):
            offset = (seq * 144) & mask
            write(
                buffer,
                TERM_LENGTH,
                offset,
                offset,
                1 << 62,
                payload,
                1,
                seq,
                1,
                seq,
                meta,
                64,
                None,
            )

    def in_c_pwrite() -> None:
        assert _write_frame is not None
        write = _write_frame
        for seq in range(count):
            offset = (seq * 144) & mask
            write(fd, TERM_LENGTH, offset, offset, 1 << 62, payload, 1, seq, 1, seq, meta, 64, None)

    def real() -> None:
        log = StreamLog.open(directory / "explain-log", term_length=TERM_LENGTH)
        try:
            append = log.append
            started = time.perf_counter()
            for seq in range(count):
                append(payload, producer_id=1, first_sequence=seq, record_count=1, timestamp_us=seq)
            timings["append"].add(time.perf_counter() - started)
        finally:
            log.close()
            shutil.rmtree(directory / "explain-log")

    plan: list[tuple[str, Callable[[], None]]] = [
        ("method call with five arguments", call),
        ("+ pack the header (no call)", steps(1)),
        ("+ copy the payload into the map", steps(2)),
        ("+ CRC-32 of header and payload", steps(3)),
        ("+ commit word and published position", steps(4)),
    ]
    if _write_frame is not None:
        plan.append(("all of the above in C: one write_frame call", in_c))
        plan.append(
            ("the same call through the descriptor (pwritev; frames >= 1 KiB)", in_c_pwrite)
        )
    timings = {name: Best() for name, _ in plan} | {"append": Best()}
    try:
        for _ in range(3):
            for name, run in plan:
                started = time.perf_counter()
                run()
                timings[name].add(time.perf_counter() - started)
            real()
    finally:
        words.release()
        meta_words.release()
        view.release()
        buffer.close()
        meta.close()
        os.close(fd)
    names = [name for name, _ in plan] + ["StreamLog.append (all of it, and the bookkeeping)"]
    values = [timings[name].seconds for name, _ in plan] + [timings["append"].seconds]
    return [(name, value / count * 1e9) for name, value in zip(names, values, strict=True)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small counts, one round")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 3, quick 1)")
    parser.add_argument(
        "--dir", type=Path, default=None, help="where to write (default: a temp dir)"
    )
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    scale = 8 if args.quick else 1
    workloads = [
        Workload("100 B", 100, 400_000 // scale),
        Workload("16 KiB", 16 * 1024, 12_000 // scale),
    ]
    base_dir = Path(tempfile.mkdtemp(prefix="headgate-bench-", dir=args.dir))
    print(f"# headgate.log benchmark: {rounds} round(s), files in {base_dir}", flush=True)
    print(f"# group commit: a thread commits every {COMMIT_INTERVAL * 1000:g} ms", flush=True)
    print(
        f"# frame writer: {frame_writer()} (HEADGATE_PURE_PYTHON_LOG=1 forces Python)", flush=True
    )
    results: dict[tuple[str, str, str], Best] = {}
    try:
        for round_number in range(rounds):
            for workload in workloads:
                for group_commit in (False, True):
                    mode = "group commit" if group_commit else "no fsync"
                    log_dir = base_dir / "log"
                    base_file = base_dir / "baseline.bin"
                    hg = headgate_append(log_dir, workload, group_commit)
                    base = baseline_append(base_file, workload, group_commit)
                    results.setdefault((workload.name, mode, "headgate"), Best()).add(hg)
                    results.setdefault((workload.name, mode, "baseline"), Best()).add(base)
                    shutil.rmtree(log_dir)
                    many = headgate_append(log_dir, workload, group_commit, batched=True)
                    results.setdefault((workload.name, mode, "append_many"), Best()).add(many)
                    if group_commit:
                        read_hg = headgate_read(log_dir, workload)
                        read_base = baseline_read(base_file, workload)
                        results.setdefault((workload.name, "read", "headgate"), Best()).add(read_hg)
                        results.setdefault((workload.name, "read", "baseline"), Best()).add(
                            read_base
                        )
                    shutil.rmtree(log_dir)
                    base_file.unlink()
            print(f"# round {round_number + 1} done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(base_dir, ignore_errors=True)

    print()
    header = (
        f"{'payload':>7} | {'mode':<12} | {'call':<11} | {'headgate ops/s':>14} | {'MB/s':>7} | "
        f"{'baseline ops/s':>14} | {'MB/s':>7} | {'ratio':>5}"
    )
    print(header)
    print("-" * len(header))
    for workload in workloads:
        frame_bytes = frame_cost(workload.payload_length)
        for mode, call, kind in (
            ("no fsync", "append", "headgate"),
            ("no fsync", "append_many", "append_many"),
            ("group commit", "append", "headgate"),
            ("group commit", "append_many", "append_many"),
            ("read", "read", "headgate"),
        ):
            hg = results[(workload.name, mode, kind)].seconds
            base = results[(workload.name, mode, "baseline")].seconds
            hg_rate = workload.count / hg
            base_rate = workload.count / base
            print(
                f"{workload.name:>7} | {mode:<12} | {call:<11} | {hg_rate:>14,.0f} | "
                f"{hg_rate * frame_bytes / 1e6:>7,.1f} | {base_rate:>14,.0f} | "
                f"{base_rate * frame_bytes / 1e6:>7,.1f} | {hg_rate / base_rate:>5.2f}"
            )
    print()
    print("ratio = headgate / baseline (higher is better; appends, or frames read, per second)")
    print(f"append_many: {BATCH_GROUP} frames per call, one publish per call")
    print()
    print("where a 100-byte append's time goes (ns per append, cumulative):")
    explain_dir = Path(tempfile.mkdtemp(prefix="headgate-bench-", dir=args.dir))
    try:
        for name, nanoseconds in explain_small_appends(explain_dir, 100_000 // scale):
            print(f"  {nanoseconds:7.0f}  {name}")
    finally:
        shutil.rmtree(explain_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
