"""StreamLog: append and read back by position, across term rotations, in one process."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from headgate.log import (
    FRAME_ALIGNMENT,
    HEADER_LENGTH,
    LogError,
    LogFullError,
    StreamLog,
    frame_cost,
)
from tests.log import _frames

TERM = 4096


def open_log(path: Path, **kwargs: int) -> StreamLog:
    kwargs.setdefault("term_length", TERM)
    kwargs.setdefault("capacity", 64 * TERM)
    return StreamLog.open(path, **kwargs)  # type: ignore[arg-type]


def test_frames_come_back_by_position_across_rotations(tmp_path: Path) -> None:
    # Sizes from 1 to 700 bytes in 4 KiB terms: dozens of rotations, each
    # leaving a padding frame (or, under a header's worth, implicit padding).
    with open_log(tmp_path) as log:
        results, _ = _frames.append_many(log, 300)
        assert log.tail_position == results[-1].end_position
        frames = log.read(0)
        assert [f.position for f in frames] == [r.position for r in results]
        assert [f.end_position for f in frames] == [r.end_position for r in results]
        for frame in frames:
            _frames.check_frame(frame)
        _frames.check_contiguous(frames, TERM)
        rotations = {r.position // TERM for r in results}
        assert len(rotations) > 20
        # Reading from the middle, by any frame boundary.
        middle = results[150]
        again = log.read(middle.position, results[160].position)
        assert [f.first_sequence for f in again] == [f.first_sequence for f in frames[150:160]]


def test_each_frame_costs_frame_cost_unless_it_rotates(tmp_path: Path) -> None:
    with open_log(tmp_path) as log:
        for seq in range(200):
            predicted = log.append_cost(_frames.payload_length(seq))
            before = log.tail_position
            result = _frames.append(log, seq)
            assert log.tail_position - before == predicted
            cost = frame_cost(_frames.payload_length(seq))
            if result.position == before:
                # No rotation: the frame itself, plus the term's last few bytes
                # if it leaves less than a header there.
                assert predicted - cost in range(0, HEADER_LENGTH)
            else:
                assert result.position % TERM == 0
                assert predicted == result.position - before + (
                    result.end_position - result.position
                )


def test_frame_cost_is_aligned_header_plus_payload() -> None:
    assert FRAME_ALIGNMENT == 8
    assert HEADER_LENGTH == 40
    assert frame_cost(0) == 40
    assert frame_cost(1) == 48
    assert frame_cost(100) == 144
    assert all(frame_cost(n) % FRAME_ALIGNMENT == 0 for n in range(200))
    assert all(0 <= frame_cost(n) - HEADER_LENGTH - n < FRAME_ALIGNMENT for n in range(200))


def test_a_frame_can_fill_a_term_exactly(tmp_path: Path) -> None:
    with open_log(tmp_path) as log:
        assert log.max_payload == TERM - HEADER_LENGTH
        whole = log.append(
            b"w" * log.max_payload, producer_id=1, first_sequence=0, record_count=1, timestamp_us=0
        )
        assert (whole.position, whole.end_position) == (0, TERM)
        nearly = log.append(
            b"n" * (TERM - 2 * HEADER_LENGTH),
            producer_id=1,
            first_sequence=1,
            record_count=1,
            timestamp_us=0,
        )
        assert nearly.position == TERM
        # 40 bytes are left: room for a padding frame that is only a header.
        small = log.append(b"s", producer_id=1, first_sequence=2, record_count=1, timestamp_us=0)
        assert small.position == 2 * TERM
        frames = log.read(0)
        assert [bytes(f.payload[:1]) for f in frames] == [b"w", b"n", b"s"]
        assert [f.end_position for f in frames] == [TERM, 2 * TERM - HEADER_LENGTH, 2 * TERM + 48]
        with pytest.raises(LogFullError, match="can never fit"):
            log.append(
                b"x" * (log.max_payload + 1),
                producer_id=1,
                first_sequence=4,
                record_count=1,
                timestamp_us=0,
            )


def test_implicit_padding_when_less_than_a_header_is_left(tmp_path: Path) -> None:
    with open_log(tmp_path) as log:
        # Leave 16 bytes at the end of term 0: the frame's end moves to term 1.
        result = log.append(
            b"a" * (TERM - HEADER_LENGTH - 16),
            producer_id=1,
            first_sequence=0,
            record_count=1,
            timestamp_us=0,
        )
        assert result.end_position == TERM
        nxt = log.append(b"b", producer_id=1, first_sequence=1, record_count=1, timestamp_us=0)
        assert nxt.position == TERM
        frames = log.read(0)
        assert [f.end_position for f in frames] == [TERM, TERM + 48]


def test_read_limits_bytes_but_returns_at_least_one_frame(tmp_path: Path) -> None:
    with open_log(tmp_path) as log:
        results, _ = _frames.append_many(log, 50)
        one = log.read(0, max_bytes=1)
        assert len(one) == 1
        some = log.read(0, max_bytes=2000)
        assert some[-1].end_position <= 2000
        following = log.read(some[-1].end_position, max_bytes=2000)
        assert following[0].position == some[-1].end_position
        assert log.read(results[-1].end_position) == []


def test_payloads_are_read_only_views(tmp_path: Path) -> None:
    with open_log(tmp_path) as log:
        log.append(b"abc", producer_id=1, first_sequence=0, record_count=1, timestamp_us=5)
        (frame,) = log.read(0)
        assert frame.payload.readonly
        assert bytes(frame.payload) == b"abc"
        with pytest.raises(TypeError):
            frame.payload[0] = 0


def test_bad_read_positions_are_log_errors(tmp_path: Path) -> None:
    with open_log(tmp_path) as log:
        results, _ = _frames.append_many(log, 30)
        assert log.tail_position > TERM
        with pytest.raises(LogError, match="not a frame boundary"):
            log.read(results[1].position + 8)
        with pytest.raises(LogError, match="tail"):
            log.read(0, log.tail_position + 8)
        with pytest.raises(LogError, match="not a frame boundary"):
            log.read(0, results[1].position + 8)
        with pytest.raises(LogError, match="not a frame boundary"):
            log.read(TERM - 8)


def test_header_fields_out_of_range_are_log_errors(tmp_path: Path) -> None:
    with open_log(tmp_path) as log:
        with pytest.raises(LogError, match="out of range"):
            log.append(b"x", producer_id=-1, first_sequence=0, record_count=1, timestamp_us=0)
        with pytest.raises(LogError, match="out of range"):
            log.append(b"x", producer_id=0, first_sequence=0, record_count=2**32, timestamp_us=0)
        # Nothing was committed: the tail did not move and the next append is fine.
        assert log.tail_position == 0
        log.append(b"x", producer_id=0, first_sequence=0, record_count=1, timestamp_us=0)
        assert len(log.read(0)) == 1


def test_scan_headers_walks_without_payloads(tmp_path: Path) -> None:
    with open_log(tmp_path) as log:
        results, _ = _frames.append_many(log, 100)
        for verify in (True, False):
            headers = list(log.scan_headers(0, verify=verify))
            assert [h.position for h in headers] == [r.position for r in results]
            assert all(h.producer_id == _frames.PRODUCER_ID for h in headers)
            assert [h.record_count for h in headers] == [
                _frames.record_count(h.first_sequence) for h in headers
            ]


def test_reopen_continues_at_the_tail(tmp_path: Path) -> None:
    with open_log(tmp_path) as log:
        _, seq = _frames.append_many(log, 40)
        tail = log.tail_position
    with StreamLog.open(tmp_path) as log:
        assert log.term_length == TERM
        assert log.tail_position == log.durable_position == log.published_position == tail
        assert _frames.append(log, seq).position == tail
        frames = log.read(0)
        _frames.check_contiguous(frames, TERM)


def test_stored_settings_win_and_term_length_cannot_change(tmp_path: Path) -> None:
    open_log(tmp_path, capacity=8 * TERM).close()
    with StreamLog.open(tmp_path, capacity=99 * TERM) as log:
        assert log.capacity == 8 * TERM
    with pytest.raises(LogError, match="cannot change"):
        StreamLog.open(tmp_path, term_length=2 * TERM)


def test_invalid_settings_are_log_errors(tmp_path: Path) -> None:
    for bad in (3000, 4096 + 8, 1024, 2**31):
        with pytest.raises(LogError, match="power of two"):
            StreamLog.open(tmp_path / "a", term_length=bad)
    with pytest.raises(LogError, match="capacity"):
        StreamLog.open(tmp_path / "b", term_length=TERM, capacity=1001)
    with pytest.raises(LogError, match="no stream log"):
        StreamLog.open(tmp_path / "c", create=False)


def test_one_writer_per_directory(tmp_path: Path) -> None:
    with open_log(tmp_path), pytest.raises(LogError, match="another writer"):
        open_log(tmp_path)
    # The lock goes with the writer.
    open_log(tmp_path).close()


def test_a_closed_log_refuses_everything(tmp_path: Path) -> None:
    log = open_log(tmp_path)
    log.append(b"x", producer_id=1, first_sequence=0, record_count=1, timestamp_us=0)
    log.close()
    log.close()
    for call in (
        lambda: log.append(b"x", producer_id=1, first_sequence=1, record_count=1, timestamp_us=0),
        lambda: log.read(0),
        log.sync,
        lambda: log.release(0),
    ):
        with pytest.raises(LogError, match="closed"):
            call()


def test_sync_from_another_thread_while_appending(tmp_path: Path) -> None:
    """The gateway's arrangement: the owner appends, a worker thread group-commits."""
    with open_log(tmp_path, capacity=1024 * TERM) as log:
        stop = threading.Event()
        synced: list[int] = []

        def committer() -> None:
            while not stop.is_set():
                synced.append(log.sync())
                time.sleep(0.001)

        thread = threading.Thread(target=committer)
        thread.start()
        try:
            results, _ = _frames.append_many(log, 2000)
            ends = [r.end_position for r in results]
            assert log.wait_durable(ends[-1], timeout=10)
        finally:
            stop.set()
            thread.join(10)
        assert synced == sorted(synced)
        assert log.durable_position >= ends[-1]
        assert all(s == 0 or s in ends or s % TERM == 0 for s in synced)
        frames = log.read(0)
        assert len(frames) == 2000
        _frames.check_contiguous(frames, TERM)


def test_wait_durable_times_out_without_a_sync(tmp_path: Path) -> None:
    with open_log(tmp_path) as log:
        end = _frames.append(log, 0).end_position
        assert not log.wait_durable(end, timeout=0.01)
        assert log.sync() == end
        assert log.wait_durable(end, timeout=0)


def test_the_next_term_is_written_ahead(tmp_path: Path) -> None:
    term = 64 * 1024
    with StreamLog.open(tmp_path, term_length=term, capacity=16 * term) as log:
        _frames.append(log, 0)
        deadline = time.monotonic() + 10
        while not (tmp_path / "0000000000000001.term").exists():
            assert time.monotonic() < deadline
            time.sleep(0.005)
        # The writer rotates into it, and the term after it is written ahead in turn.
        _frames.append_many(log, 400)
        assert log.tail_position > term
        while not (tmp_path / "0000000000000002.term").exists():
            assert time.monotonic() < deadline
            time.sleep(0.005)
    names = sorted(os.listdir(tmp_path))
    assert not [n for n in names if "creating" in n or "preparing" in n]


def _resident_kib(path: Path) -> int:
    """Resident kB of this process's mappings of ``path`` (from /proc/self/smaps)."""
    total = 0
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            inside = fields[-1] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


def test_durable_full_terms_leave_the_process_and_read_back_intact(tmp_path: Path) -> None:
    with open_log(tmp_path, term_length=64 * 1024, capacity=16 * 64 * 1024) as log:
        results = [
            log.append(
                bytes([i % 251]) * 4000,
                producer_id=1,
                first_sequence=i,
                record_count=1,
                timestamp_us=0,
            )
            for i in range(60)
        ]
        assert log.tail_position > 3 * 64 * 1024  # the writer is in the fourth term
        terms = sorted(p for p in tmp_path.iterdir() if p.name.endswith(".term"))
        # Frames are written through the descriptor: appending maps no page.
        assert [_resident_kib(term) for term in terms] == [0] * len(terms)
        # Reading does: the first term's pages come into the process ...
        assert len(log.read(0, max_bytes=60_000)) > 10
        assert _resident_kib(terms[0]) > 0
        # ... and leave it once the term is full and durable.
        log.sync()
        assert _resident_kib(terms[0]) == 0
        frames = log.read(0)
        assert [f.position for f in frames] == [r.position for r in results]
        for i, frame in enumerate(frames):
            assert bytes(frame.payload) == bytes([i % 251]) * 4000
