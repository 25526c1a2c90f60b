"""Release and reclaim: free capacity is exact after every step.

The invariant, in words: at every moment, the free capacity equals the
capacity minus the bytes between the release position and the tail, where
those bytes are exactly the frames appended since the release plus the
padding that the rotations among them left; an append succeeds exactly when
its bytes (padding included) fit the free capacity; and the term files on disk
after a group commit are exactly those from the release position's term to
the tail's term (plus at most one term prepared ahead).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from headgate.log import HEADER_LENGTH, LogError, LogFullError, StreamLog, frame_cost

TERM = 4096


@dataclass
class Model:
    """What the log must hold, computed independently of the log's own arithmetic."""

    capacity: int
    tail: int = 0
    release: int = 0
    durable: int = 0
    #: (position, end_position, payload length) of every frame not yet released.
    frames: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def free(self) -> int:
        return self.capacity - (self.tail - self.release)

    def append(self, length: int) -> tuple[bool, int]:
        """Returns (succeeds, new tail) by the rules in LOG.md, written out longhand."""
        cost = frame_cost(length)
        start = self.tail
        left_in_term = TERM - start % TERM
        if cost > left_in_term:
            if left_in_term > self.free:
                return False, self.tail
            start += left_in_term
            # The padding stays even if the frame then does not fit.
            self.tail = start
        end = start + cost
        left_after = TERM - end % TERM
        if end % TERM and left_after < HEADER_LENGTH:
            end += left_after
        if end - self.tail > self.free:
            return False, self.tail
        self.frames.append((start, end, length))
        self.tail = end
        return True, end

    def boundaries(self) -> list[int]:
        """Positions a consumer may release to: frame starts and ends up to durable."""
        points = {self.release}
        for start, end, _ in self.frames:
            if end <= self.durable:
                points.update((start, end))
        return sorted(p for p in points if self.release <= p <= self.durable)


append_op = st.tuples(st.just("append"), st.integers(0, TERM - HEADER_LENGTH))
small_append_op = st.tuples(st.just("append"), st.integers(0, 300))
sync_op = st.tuples(st.just("sync"), st.just(0))
release_op = st.tuples(st.just("release"), st.integers(0, 1000))
reopen_op = st.tuples(st.just("reopen"), st.just(0))
operations = st.lists(
    st.one_of(append_op, small_append_op, small_append_op, sync_op, release_op, reopen_op),
    max_size=50,
)


def term_files(directory: Path) -> set[int]:
    return {int(name[:16], 16) for name in os.listdir(directory) if name.endswith(".term")}


def check(log: StreamLog, model: Model, directory: Path, after_sync: bool) -> None:
    assert log.tail_position == model.tail
    assert log.release_position == model.release
    assert log.free_capacity == model.free == log.capacity - (model.tail - model.release)
    assert 0 <= log.free_capacity <= log.capacity
    if after_sync:
        wanted = set(range(model.release // TERM, model.tail // TERM + 1))
        present = term_files(directory)
        assert wanted <= present
        assert present - wanted <= {model.tail // TERM + 1}


@given(
    capacity_terms=st.integers(1, 6),
    capacity_slack=st.sampled_from([0, 8, 40, 1000]),
    ops=operations,
)
def test_free_capacity_is_exact_after_every_step(
    capacity_terms: int, capacity_slack: int, ops: list[tuple[str, int]]
) -> None:
    capacity = capacity_terms * TERM + capacity_slack
    model = Model(capacity)
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        log = StreamLog.open(directory, term_length=TERM, capacity=capacity)
        try:
            for op, argument in ops:
                after_sync = False
                if op == "append":
                    expected, _ = model.append(argument)
                    try:
                        result = log.append(
                            bytes(argument),
                            producer_id=1,
                            first_sequence=0,
                            record_count=1,
                            timestamp_us=0,
                        )
                    except LogFullError:
                        assert not expected
                    else:
                        assert expected
                        assert result.end_position == model.tail
                elif op == "sync":
                    model.durable = model.tail
                    assert log.sync() == model.tail
                    after_sync = True
                elif op == "release":
                    choices = model.boundaries()
                    target = choices[argument % len(choices)]
                    log.release(target)
                    model.release = target
                    model.frames = [f for f in model.frames if f[0] >= target]
                else:
                    log.close()
                    log = StreamLog.open(directory)
                    model.durable = model.tail
                check(log, model, directory, after_sync)
            frames = log.read(model.release)
            assert [(f.position, f.end_position, len(f.payload)) for f in frames] == model.frames
        finally:
            log.close()


def test_release_rejects_positions_that_are_not_boundaries(tmp_path: Path) -> None:
    with StreamLog.open(tmp_path, term_length=TERM, capacity=8 * TERM) as log:
        first = log.append(
            b"a" * 100, producer_id=1, first_sequence=0, record_count=1, timestamp_us=0
        )
        second = log.append(
            b"b" * 100, producer_id=1, first_sequence=1, record_count=1, timestamp_us=0
        )
        with pytest.raises(LogError, match="durable position 0"):
            log.release(first.end_position)
        log.sync()
        with pytest.raises(LogError, match="not a frame boundary"):
            log.release(first.position + 48)
        with pytest.raises(LogError, match="between"):
            log.release(second.end_position + 8)
        log.release(first.end_position)
        with pytest.raises(LogError, match="between"):
            log.release(first.position)
        log.release(second.end_position)
        assert log.free_capacity == log.capacity


def test_released_space_is_reused(tmp_path: Path) -> None:
    """A log of two terms carries many terms' worth of frames when the consumer keeps up."""
    with StreamLog.open(tmp_path, term_length=TERM, capacity=2 * TERM) as log:
        total = 0
        for seq in range(400):
            try:
                result = log.append(
                    b"p" * 300, producer_id=1, first_sequence=seq, record_count=1, timestamp_us=0
                )
            except LogFullError:
                log.release(log.sync())
                result = log.append(
                    b"p" * 300, producer_id=1, first_sequence=seq, record_count=1, timestamp_us=0
                )
            total = result.end_position
        assert total > 20 * TERM
        log.release(log.sync())
        log.sync()
        assert term_files(tmp_path) <= {total // TERM, total // TERM + 1}
        assert log.free_capacity == log.capacity


def test_a_frame_that_needs_padding_fits_once_the_padding_is_released(tmp_path: Path) -> None:
    # Capacity of one term: a big frame after a small one can only fit in a
    # fresh term, and the padding before it must be releasable first.
    with StreamLog.open(tmp_path, term_length=TERM, capacity=TERM) as log:
        log.append(b"s" * 100, producer_id=1, first_sequence=0, record_count=1, timestamp_us=0)
        log.release(log.sync())
        big = TERM - HEADER_LENGTH
        with pytest.raises(LogFullError):
            log.append(b"b" * big, producer_id=1, first_sequence=1, record_count=1, timestamp_us=0)
        assert log.tail_position == TERM  # the padding went in
        log.release(log.sync())
        result = log.append(
            b"b" * big, producer_id=1, first_sequence=1, record_count=1, timestamp_us=0
        )
        assert (result.position, result.end_position) == (TERM, 2 * TERM)
        assert log.free_capacity == 0


def test_a_capacity_lowered_below_the_unreleased_bytes_refuses_appends_until_released(
    tmp_path: Path,
) -> None:
    with StreamLog.open(tmp_path, term_length=TERM, capacity=4 * TERM) as log:

        def append(seq: int) -> None:
            log.append(
                b"c" * 900, producer_id=1, first_sequence=seq, record_count=1, timestamp_us=0
            )

        for seq in range(8):
            append(seq)
        unreleased = log.tail_position - log.release_position
        assert unreleased > TERM
        log.set_capacity(TERM)
        assert log.capacity == TERM
        assert log.free_capacity == 0  # never negative
        with pytest.raises(LogFullError):
            append(8)
        log.release(log.sync())
        assert log.free_capacity == TERM
        append(8)
        log.set_capacity(3 * TERM)
        assert log.free_capacity == 3 * TERM - (log.tail_position - log.release_position)
        for seq in range(9, 16):
            append(seq)
        assert log.tail_position - log.release_position > TERM
        with pytest.raises(LogError, match="capacity"):
            log.set_capacity(TERM + 1)
