"""StreamLog.append_many: several frames per call, one publish, same bytes as one by one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from headgate.log import LogError, LogFullError, LogReader, StreamLog, frame_cost
from headgate.log.appender import FrameSpec
from headgate.log.term import list_term_files
from tests.log import _frames

TERM = 4096


def spec(seq: int) -> FrameSpec:
    """Frame ``seq`` of tests.log._frames, as an append_many item."""
    return (
        _frames.payload(seq),
        _frames.PRODUCER_ID,
        seq,
        _frames.record_count(seq),
        seq * 10,
    )


def sequences(count: int, seq: int = 0) -> list[int]:
    out = []
    for _ in range(count):
        out.append(seq)
        seq += _frames.record_count(seq)
    return out


def test_the_same_bytes_as_one_append_per_frame(tmp_path: Path) -> None:
    # 300 frames of 1..700 bytes in 4 KiB terms: dozens of rotations inside
    # groups, with padding frames and implicit padding.
    seqs = sequences(300)
    with StreamLog.open(tmp_path / "one", term_length=TERM, capacity=64 * TERM) as one:
        one_ends = [_frames.append(one, seq).end_position for seq in seqs]
        one_tail = one.tail_position
    with StreamLog.open(tmp_path / "many", term_length=TERM, capacity=64 * TERM) as many:
        ends: list[int] = []
        for start in range(0, len(seqs), 7):
            tail = many.append_many([spec(s) for s in seqs[start : start + 7]], ends)
            assert tail == many.tail_position == ends[-1]
        assert many.tail_position == one_tail
        # Each frame's end, padding and rotations included, as one by one.
        assert ends == one_ends
        frames = many.read(0)
        assert [f.first_sequence for f in frames] == seqs
        for frame in frames:
            _frames.check_frame(frame)
        _frames.check_contiguous(frames, TERM)
    one_files = list_term_files(tmp_path / "one")
    many_files = list_term_files(tmp_path / "many")
    assert one_files.keys() == many_files.keys()
    assert len(one_files) > 20
    for term_id, path in one_files.items():
        assert path.read_bytes() == many_files[term_id].read_bytes(), term_id


def test_readers_see_the_group_at_once(tmp_path: Path) -> None:
    # Within one term, the published position stays where the call began
    # until the last frame of the group is committed.
    with (
        StreamLog.open(tmp_path, term_length=64 * 1024, capacity=64 * 64 * 1024) as log,
        LogReader.open(tmp_path) as reader,
    ):
        _frames.append(log, 0)
        start = log.tail_position
        seen: list[int] = []

        def frames() -> Iterator[FrameSpec]:
            for seq in sequences(20, seq=1):
                seen.append(reader.published_position())
                yield spec(seq)

        end = log.append_many(frames())
        assert seen == [start] * 20
        assert reader.published_position() == end == log.tail_position
        read = reader.read(start, end)
        assert [f.first_sequence for f in read] == sequences(20, seq=1)


def test_an_empty_group_changes_nothing(tmp_path: Path) -> None:
    with StreamLog.open(tmp_path, term_length=TERM, capacity=4 * TERM) as log:
        _frames.append(log, 0)
        tail = log.tail_position
        assert log.append_many([]) == tail
        assert log.tail_position == tail


def test_a_full_log_keeps_and_publishes_the_frames_before(tmp_path: Path) -> None:
    capacity = 5 * frame_cost(100)
    with (
        StreamLog.open(tmp_path, term_length=TERM, capacity=capacity) as log,
        LogReader.open(tmp_path) as reader,
    ):
        items = [(bytes([i]) * 100, 1, i, 1, i) for i in range(8)]
        ends: list[int] = []
        with pytest.raises(LogFullError):
            log.append_many(items, ends)
        assert ends == [frame_cost(100) * (i + 1) for i in range(5)]
        assert log.tail_position == 5 * frame_cost(100)
        assert log.free_capacity == 0
        assert reader.published_position() == log.tail_position
        assert [f.first_sequence for f in log.read(0)] == [0, 1, 2, 3, 4]
        log.sync()
        log.release(log.tail_position)
        # The rest goes in once space is released.
        assert log.append_many(items[5:]) == log.tail_position
        assert [f.first_sequence for f in log.read(log.release_position)] == [5, 6, 7]


def test_a_bad_header_field_stops_the_group_there(tmp_path: Path) -> None:
    with StreamLog.open(tmp_path, term_length=TERM, capacity=16 * TERM) as log:
        items: list[FrameSpec] = [(b"a", 1, 0, 1, 0), (b"b", 1, 1, 1, 0), (b"c", -1, 2, 1, 0)]
        with pytest.raises(LogError, match="out of range"):
            log.append_many(items)
        assert [f.first_sequence for f in log.read(0)] == [0, 1]
        assert log.tail_position == 2 * frame_cost(1)
        # And the log goes on from there.
        log.append_many([(b"c", 1, 2, 1, 0)])
        assert [bytes(f.payload) for f in log.read(0)] == [b"a", b"b", b"c"]


def test_padding_before_a_frame_that_then_does_not_fit_stays_in_the_tail(tmp_path: Path) -> None:
    # A frame that needs the next term, where the padding fits the free
    # capacity and the frame then does not: the padding stays written (the
    # frame fits once the consumer releases up to the new term), and the
    # tail is after it, also when earlier frames of the same call were
    # written. It was once put back before the padding, inside the old term
    # while the writer had moved to the new one.
    capacity = TERM + 512
    with StreamLog.open(tmp_path, term_length=TERM, capacity=capacity) as log:
        filler = [(b"f" * 960, 1, seq, 1, 0) for seq in range(4)]
        assert log.append_many(filler) == 4000
        small: FrameSpec = (b"s" * 16, 1, 4, 1, 0)
        large: FrameSpec = (b"L" * 500, 1, 5, 1, 0)
        assert frame_cost(500) > capacity - TERM  # does not fit after the padding
        ends: list[int] = []
        with pytest.raises(LogFullError):
            log.append_many([small, large], ends)
        assert ends == [4056]
        assert log.tail_position == TERM  # after the padding, in the new term
        with LogReader.open(tmp_path) as reader:
            assert reader.published_position() == TERM
        log.sync()
        log.release(TERM)
        assert log.append_many([large]) == TERM + frame_cost(500)
        frames = log.read(TERM)
        assert [(f.first_sequence, len(f.payload)) for f in frames] == [(5, 500)]
    with StreamLog.open(tmp_path) as reopened:
        assert reopened.tail_position == TERM + frame_cost(500)
        assert reopened.recovery is not None and reopened.recovery.cut is None
