"""The record index's cost on the append path, in nanoseconds per batch.

Times the two lines ``Stream._store`` runs per batch (``total +=``, one
comparison, a mark every stride) against a log append of the same batch,
the work they ride on. Run: ``python bench/record_index.py [--batches N]``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from headgate.log import StreamLog
from headgate.log.record_index import MIN_STRIDE, RecordIndex


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, default=200_000)
    parser.add_argument("--payload", type=int, default=100)
    args = parser.parse_args()
    n, payload = args.batches, bytes(args.payload)
    with tempfile.TemporaryDirectory() as tmp:
        log = StreamLog.open(Path(tmp) / "log", term_length=64 << 20, capacity=1 << 30)
        ends = []
        start = time.perf_counter_ns()
        for i in range(n):
            result = log.append(
                payload, producer_id=1, first_sequence=i, record_count=1, timestamp_us=0
            )
            ends.append(result.end_position)
        appended = time.perf_counter_ns() - start
        log.close()
    index = RecordIndex.in_memory(MIN_STRIDE)
    best = None
    for _ in range(5):
        index = RecordIndex.in_memory(MIN_STRIDE)
        start = time.perf_counter_ns()
        for end in ends:
            # Exactly what Stream._store runs per batch.
            index.total += 1
            if end >= index.next_mark:
                index.mark(end)
        spent = time.perf_counter_ns() - start
        best = spent if best is None else min(best, spent)
    empty = None
    for _ in range(5):
        start = time.perf_counter_ns()
        for _end in ends:
            pass
        spent = time.perf_counter_ns() - start
        empty = spent if empty is None else min(empty, spent)
    assert best is not None and empty is not None
    per_batch = (best - empty) / n
    print(f"log append: {appended / n:,.0f} ns per batch ({args.payload}-byte payload)")
    print(f"record index: {per_batch:,.1f} ns per batch ({len(index.marks)} marks)")
    print(f"share of the append: {per_batch / (appended / n):.1%}")


if __name__ == "__main__":
    main()
