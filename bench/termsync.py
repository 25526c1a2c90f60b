"""What a group commit that enters a new term waits for: each fsync of the log, timed alone.

    .venv/bin/python bench/termsync.py --seconds 20    # 125 MB/s of 130 KB frames, sync every 2 ms

A ``StreamLog`` (16 MiB terms) is appended to from this thread at a steady
rate, in frames of ``--frame`` bytes, and synced every 2 ms by a worker
thread, as the gateway does. Every ``fdatasync`` and ``fsync`` the process
makes is timed (``os.fdatasync`` and ``os.fsync`` are wrapped), with the
file it was for and the thread that made it: the group commit's syncs of
term files, its ``fsync`` of the stream's directory, and the term
preparer's ``fdatasync`` of the term it reserves ahead. The report splits
the commits into those that entered a new term, the next ones, and the rest.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

from headgate.log import StreamLog
from headgate.log.term import TermFile

TERM_LENGTH = 16 * 1024 * 1024
INTERVAL_S = 0.002

#: (thread name, what was synced, start, seconds)
_syncs: list[tuple[str, str, float, float]] = []


def _timed(real: object, kind: str) -> object:
    def wrapper(fd: int) -> None:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = "?"
        what = "directory" if kind == "fsync" else Path(target).suffix or Path(target).name
        start = time.monotonic()
        try:
            real(fd)  # type: ignore[operator]
        finally:
            _syncs.append((threading.current_thread().name, what, start, time.monotonic() - start))

    return wrapper


def quantiles(values: list[float]) -> str:
    if not values:
        return "-"
    v = sorted(values)

    def pick(q: float) -> float:
        return v[min(len(v) - 1, int(q * len(v)))] * 1e3

    return f"n={len(v)}: p50 {pick(0.5):.2f}, p99 {pick(0.99):.2f}, max {v[-1] * 1e3:.2f} ms"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rate", type=float, default=125e6, help="bytes per second")
    parser.add_argument("--frame", type=int, default=130_000, help="bytes per frame")
    parser.add_argument(
        "--no-release", action="store_true", help="never release (no term is deleted)"
    )
    args = parser.parse_args()
    os.fdatasync = _timed(os.fdatasync, "fdatasync")  # type: ignore[assignment]
    os.fsync = _timed(os.fsync, "fsync")  # type: ignore[assignment]
    real_unlink, real_drop = os.unlink, TermFile.drop_pages

    def unlink(path: str | os.PathLike[str], *a: object, **k: object) -> None:
        began = time.monotonic()
        try:
            real_unlink(path, *a, **k)  # type: ignore[arg-type]
        finally:
            name = threading.current_thread().name
            _syncs.append((name, "unlink", began, time.monotonic() - began))

    def drop_pages(term: TermFile) -> None:
        began = time.monotonic()
        try:
            real_drop(term)
        finally:
            name = threading.current_thread().name
            _syncs.append((name, "drop_pages (madvise)", began, time.monotonic() - began))

    os.unlink = unlink  # type: ignore[assignment]
    TermFile.drop_pages = drop_pages  # type: ignore[method-assign,assignment]
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    base = Path(tempfile.mkdtemp(prefix="headgate-termsync-"))
    capacity = (int(args.rate * args.seconds * 1.1) // TERM_LENGTH + 2) * TERM_LENGTH
    log = StreamLog.open(base / "log", term_length=TERM_LENGTH, capacity=capacity)
    payload = os.urandom(args.frame)
    commits: list[tuple[float, float, int, int]] = []  # start, seconds, tail before, tail after
    stop = threading.Event()

    def committer() -> None:
        while not stop.is_set():
            time.sleep(INTERVAL_S)
            before = log.durable_position
            start = time.monotonic()
            after = log.sync()
            commits.append((start, time.monotonic() - start, before, after))

    thread = threading.Thread(target=committer, name="commit")
    thread.start()
    start = time.monotonic()
    written = 0
    try:
        while (now := time.monotonic()) < start + args.seconds:
            due = int(args.rate * (now - start)) - written
            while due >= args.frame:
                log.append(
                    payload, producer_id=1, first_sequence=written, record_count=1, timestamp_us=0
                )
                written += args.frame
                due -= args.frame
                if (
                    not args.no_release
                    and log.tail_position - log.release_position > 32 * TERM_LENGTH
                ):
                    log.release(log.durable_position)
            time.sleep(0.0005)
    finally:
        stop.set()
        thread.join()
        log.close()
    entered = {i for i, (_, _, b, a) in enumerate(commits) if a // TERM_LENGTH != b // TERM_LENGTH}
    after = {i + 1 for i in entered} - entered
    groups = {
        "entered a term": [c[1] for i, c in enumerate(commits) if i in entered],
        "the commit after": [c[1] for i, c in enumerate(commits) if i in after],
        "the others": [c[1] for i, c in enumerate(commits) if i not in entered | after],
    }
    print(
        f"# {written / 1e6 / args.seconds:.0f} MB/s in {args.frame:,}-byte frames for "
        f"{args.seconds:g} s, sync every {INTERVAL_S * 1e3:g} ms; load average {load} at start, "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} at end\n"
    )
    print("| commits (StreamLog.sync, whole) | latency |\n|---|---|")
    for name, values in groups.items():
        print(f"| {name} | {quantiles(values)} |")
    by: dict[tuple[str, str], list[float]] = defaultdict(list)
    for thread_name, what, _, seconds in _syncs:
        role = "preparer" if thread_name.startswith("headgate-term") else thread_name
        by[(role, what)].append(seconds)
    print("\n| thread | synced | latency |\n|---|---|---|")
    for (role, what), values in sorted(by.items()):
        print(f"| {role} | {what} | {quantiles(values)} |")
    # How many commits overlapped a preparer's fdatasync, and how slow they were.
    prep = [(s, s + d) for name, _, s, d in _syncs if name.startswith("headgate-term")]
    overlapping = [c[1] for c in commits if any(s < c[0] + c[1] and e > c[0] for s, e in prep)]
    print(f"\ncommits while a preparer synced: {quantiles(overlapping)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
