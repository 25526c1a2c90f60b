"""The record index: exact record counts between positions, across frees and restarts.

Each test appends frames of random record counts to a real stream log and
keeps the truth beside it (the running sum); the index must give that sum
at every frame boundary the log holds, at its marks after the log freed
them, and after a reopen that never called ``close`` (what a SIGKILL leaves).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from headgate.log import StreamLog
from headgate.log import record_index as ri
from headgate.log.record_index import RecordIndex, ScanRecords, read_marks

TERM = 4096
STRIDE = 1024


def scan_of(log: StreamLog) -> ScanRecords:
    def scan(start: int, end: int) -> Iterator[tuple[int, int]]:
        for h in log.scan_headers(start, end, verify=False):
            yield h.end_position, h.record_count

    return scan


def append_random(
    log: StreamLog, index: RecordIndex, rng: random.Random, frames: int, truth: dict[int, int]
) -> None:
    """Append ``frames`` frames; ``truth`` gets C at each frame's start and end."""
    total = max(truth.values(), default=0)
    for _ in range(frames):
        n = rng.randint(1, 40)
        result = log.append(
            bytes(rng.randint(0, 300)),
            producer_id=1,
            first_sequence=total,
            record_count=n,
            timestamp_us=0,
        )
        truth.setdefault(result.position, total)
        total += n
        truth[result.end_position] = total
        index.appended(result.end_position, n)


def open_index(path: Path, log: StreamLog) -> RecordIndex:
    return RecordIndex.open(
        path,
        stride=STRIDE,
        release=log.release_position,
        tail=log.tail_position,
        scan=scan_of(log),
    )


def count(index: RecordIndex, log: StreamLog, position: int) -> int | None:
    return index.count_at(position, log.release_position, log.tail_position, scan_of(log))


def test_the_count_at_every_held_frame_boundary_is_the_sum_of_the_records_before_it(
    tmp_path: Path,
) -> None:
    rng = random.Random(18)
    log = StreamLog.open(tmp_path / "log", term_length=TERM, capacity=64 * TERM)
    index = open_index(tmp_path / "s.records", log)
    truth: dict[int, int] = {0: 0}
    append_random(log, index, rng, 600, truth)
    for position, expected in truth.items():
        assert count(index, log, position) == expected, position
    # One mark per stride of log, no more (the frames are under a stride each).
    assert len(index.marks) <= log.tail_position // STRIDE + 1
    assert len(index.marks) >= log.tail_position // STRIDE // 2
    index.close(log.durable_position)
    log.close()


def test_freed_marks_keep_their_counts_and_a_reopen_without_close_counts_the_same(
    tmp_path: Path,
) -> None:
    rng = random.Random(7)
    path = tmp_path / "s.records"
    log = StreamLog.open(tmp_path / "log", term_length=TERM, capacity=64 * TERM)
    index = open_index(path, log)
    truth: dict[int, int] = {0: 0}
    append_random(log, index, rng, 500, truth)
    log.sync()
    index.durable(log.durable_position)
    ends = sorted(truth)
    free_to = ends[len(ends) * 2 // 3]
    before_free = {p: count(index, log, p) for p in ends}
    freed_count = count(index, log, free_to)
    assert freed_count == truth[free_to]
    index.freeing(free_to, freed_count)
    log.release(free_to)
    log.sync()  # deletes the terms wholly before free_to
    marks = dict(zip(index.marks.positions, index.marks.counts, strict=True))
    freed_marks = [p for p in marks if p < free_to]
    assert freed_marks, "some marks lie in the freed data"
    for p in freed_marks:
        assert count(index, log, p) == truth[p]  # a mark outlives its frames
    freed_other = [p for p in ends if p < free_to and p not in marks]
    assert all(count(index, log, p) is None for p in freed_other)  # unknown, never wrong
    log.close()
    # No index.close(): the file is what a SIGKILL leaves behind.
    log = StreamLog.open(tmp_path / "log", term_length=TERM, capacity=64 * TERM)
    again = open_index(path, log)
    assert again.epoch == index.epoch
    for p in ends:
        if p >= free_to:
            assert count(again, log, p) == before_free[p] == truth[p]
    for p in freed_marks:
        assert count(again, log, p) == truth[p]
    more: dict[int, int] = {log.tail_position: truth[max(truth)]}
    append_random(log, again, rng, 50, more)
    for p, expected in more.items():
        assert count(again, log, p) == expected
    again.close(log.durable_position)
    log.close()


def test_an_index_that_cannot_reach_the_release_position_counts_anew_in_a_new_epoch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rng = random.Random(3)
    path = tmp_path / "s.records"
    log = StreamLog.open(tmp_path / "log", term_length=TERM, capacity=64 * TERM)
    index = open_index(path, log)
    truth: dict[int, int] = {0: 0}
    append_random(log, index, rng, 300, truth)
    log.sync()
    index.close(log.durable_position)  # every mark stored, no release point
    tail = log.tail_position
    log.release(tail)
    log.sync()
    log.close()
    # As a power loss can leave it: marks that all lie in freed data, and
    # a release point that was never written.
    log = StreamLog.open(tmp_path / "log", term_length=TERM, capacity=64 * TERM)
    with caplog.at_level("WARNING", logger="headgate.log"):
        again = open_index(path, log)
    assert again.epoch == index.epoch + 1
    assert "counting anew" in caplog.text
    assert count(again, log, tail) == 0
    assert count(again, log, 0) is None  # the old marks are gone with their epoch
    stored = read_marks(path)
    assert stored is not None and stored.epoch == index.epoch + 1
    again.close()
    log.close()


def test_marks_stay_bounded_however_long_the_stream_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ri, "MAX_FREED_MARKS", 8)
    rng = random.Random(11)
    path = tmp_path / "s.records"
    log = StreamLog.open(tmp_path / "log", term_length=TERM, capacity=16 * TERM)
    index = open_index(path, log)
    truth: dict[int, int] = {0: 0}
    sizes = []
    for _ in range(40):  # about 40 * 30 KiB: many times the log's capacity
        append_random(log, index, rng, 150, truth)
        log.sync()
        index.durable(log.durable_position)
        tail = log.tail_position
        at = count(index, log, tail)
        assert at == truth[tail]
        index.freeing(tail, at)
        log.release(tail)
        log.sync()
        sizes.append(path.stat().st_size)
        # Held marks (none: all freed) plus the freed ones kept.
        assert len(index.marks) <= 8 + 16 * TERM // STRIDE
    held_marks = 16 * TERM // STRIDE
    # The file is rewritten once half of it is forgotten marks: it stays
    # within a few times what memory keeps (the run took about 1,200 marks).
    assert len(truth) > 5000 and max(sizes) < ri.HEADER.size + 3 * (8 + held_marks) * 16
    index.close(log.durable_position)
    log.close()


def test_a_damaged_index_is_rebuilt_in_an_epoch_no_stored_count_can_share(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "s.records"
    log = StreamLog.open(tmp_path / "log", term_length=TERM, capacity=64 * TERM)
    index = open_index(path, log)
    truth: dict[int, int] = {0: 0}
    append_random(log, index, random.Random(5), 100, truth)
    log.sync()
    index.close(log.durable_position)
    path.write_bytes(b"garbage")
    with caplog.at_level("WARNING", logger="headgate.log"):
        again = open_index(path, log)
    assert "rebuilt from the log" in caplog.text
    assert again.epoch != index.epoch
    assert count(again, log, log.tail_position) == truth[log.tail_position]
    again.close()
    log.close()
