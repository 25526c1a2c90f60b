"""What deleting many freed terms at once does to a group commit's fdatasync, beside pacing it.

    .venv/bin/python bench/discard.py                   # 48 terms of 16 MiB, both ways, twice
    .venv/bin/python bench/discard.py --terms 96 --rounds 3

A writer appends 200 KiB and fdatasyncs every 2 ms (about 100 MB/s, a group
commit's shape) for 4 s in a file of the data directory's disk; after 1 s a
second thread deletes ``--terms`` files of 16 MiB written beforehand, either
at once (``os.unlink``, as freed terms were deleted before) or as the
gateway's deleter thread does now (``headgate.log.term.delete_gradually``:
cut down 4 MiB at a time, 2 ms apart, then unlinked). It prints the
fdatasync p50 / p99 / max and the syncs over 10 ms for each way, the two
ways alternating, and how long the deletion took.

On a file system mounted with ``discard`` the blocks a deletion frees are
trimmed as it happens (ext4 without a journal: in the deleting thread) and
the disk serves the fdatasync behind the trim. Nothing here is a target; it
is the measurement behind ``delete_gradually``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from headgate.log.term import delete_gradually

TERM = 16 << 20
CHUNK = 1 << 20
WRITE = 200 << 10
SYNC_EVERY_S = 0.002
SECONDS = 4.0
DELETE_AFTER_S = 1.0
SLOW_S = 0.010


def _unlink(path: Path) -> None:
    os.unlink(path)


def _one(directory: Path, terms: int, delete: Callable[[Path], None]) -> tuple[list[float], float]:
    """fdatasync durations while ``terms`` files are deleted by ``delete``; how long it took."""
    ones = b"\1" * CHUNK
    paths = [directory / f"freed-{i}" for i in range(terms)]
    for path in paths:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
        try:
            for offset in range(0, TERM, CHUNK):
                os.pwrite(fd, ones, offset)
        finally:
            os.close(fd)
    os.sync()
    time.sleep(0.5)
    writer = os.open(directory / "writer", os.O_CREAT | os.O_RDWR, 0o644)
    os.posix_fallocate(writer, 0, 1 << 30)
    os.fsync(writer)
    took = [0.0]

    def deleter() -> None:
        time.sleep(DELETE_AFTER_S)
        started = time.monotonic()
        for path in paths:
            delete(path)
        took[0] = time.monotonic() - started

    thread = threading.Thread(target=deleter)
    thread.start()
    durations: list[float] = []
    offset = 0
    started = time.monotonic()
    try:
        while time.monotonic() - started < SECONDS:
            os.pwrite(writer, ones[:WRITE], offset)
            offset += WRITE
            before = time.monotonic()
            os.fdatasync(writer)
            durations.append(time.monotonic() - before)
            time.sleep(SYNC_EVERY_S)
    finally:
        thread.join()
        os.close(writer)
        os.unlink(directory / "writer")
    return durations, took[0]


def _line(name: str, durations: list[float], took: float) -> str:
    ordered = sorted(durations)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    slow = sum(1 for d in ordered if d >= SLOW_S)
    return (
        f"| {name} | {len(ordered)} | {statistics.median(ordered) * 1e3:.2f} | "
        f"{p99 * 1e3:.2f} | {ordered[-1] * 1e3:.2f} | {slow} | {took:.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--terms", type=int, default=48, help="16 MiB files deleted (48)")
    parser.add_argument("--rounds", type=int, default=2, help="pairs of runs (2)")
    parser.add_argument(
        "--dir", type=Path, default=None, help="where to write (a temporary directory)"
    )
    args = parser.parse_args()
    if args.terms < 1 or args.rounds < 1:
        parser.error("--terms and --rounds must be at least 1")
    base = Path(tempfile.mkdtemp(prefix="headgate-bench-discard-", dir=args.dir))
    print(
        f"{args.terms} files of 16 MiB deleted 1 s into 4 s of 200 KiB writes, "
        "each fdatasynced, every 2 ms"
    )
    print("| deletion | syncs | p50 ms | p99 ms | max ms | syncs >= 10 ms | deletion took s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    try:
        for _ in range(args.rounds):
            for name, delete in (("at once (unlink)", _unlink), ("paced", delete_gradually)):
                print(_line(name, *_one(base, args.terms, delete)), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
