"""Receive deadlines, with time as an argument: frames are activity, bytes are not."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from headgate.protocol.deadlines import (
    FRAME_ALLOWANCE_RATE,
    KEEPALIVE_FLOOR,
    WHOLE_FRAME_GRACE,
    ReceiveDeadlines,
    keepalive_interval,
)


def deadlines(idle: float = 2.0, frame: float = 5.0) -> ReceiveDeadlines:
    return ReceiveDeadlines(idle_timeout=idle, frame_timeout=frame, now=0.0)


def test_a_complete_frame_is_activity() -> None:
    d = deadlines()
    d.decoded(1.5, frames=1, partial=False)
    assert d.expired(3.4) is None
    reason = d.expired(3.5)
    assert reason is not None and "no complete frame" in reason


def test_a_trickle_that_completes_no_frame_is_not_activity() -> None:
    # Half of a 32 KiB frame, then a byte a second: bytes keep arriving, yet
    # no frame completes, so the idle clock runs from the last whole frame.
    d = deadlines(idle=2.0, frame=60.0)
    d.decoded(0.1, frames=1, partial=False)  # Hello
    for second in range(1, 6):
        d.decoded(0.1 + second, frames=1, partial=True, need=32 * 1024)
    assert d.expired(2.0) is None
    assert d.expired(2.1) is not None


def test_a_started_frame_must_finish_within_its_deadline_plus_its_size_allowance() -> None:
    d = deadlines(idle=0, frame=1.0)
    d.decoded(0.0, frames=1, partial=False)
    d.decoded(10.0, frames=1, partial=True, need=FRAME_ALLOWANCE_RATE)  # a 64 KiB frame starts
    d.decoded(11.5, frames=1, partial=True, need=FRAME_ALLOWANCE_RATE)  # more of it
    assert d.frame_deadline() == pytest.approx(12.0)  # 1 s, plus 1 s for 64 KiB
    assert d.expired(11.99) is None
    reason = d.expired(12.0)
    assert reason is not None and "65536 bytes" in reason and "not finished" in reason
    d.decoded(11.9, frames=2, partial=False)  # it completed in time after all
    assert d.frame_deadline() is None and d.expired(100.0) is None  # idle is off


def test_each_frame_of_a_drip_gets_its_own_clock() -> None:
    d = deadlines(idle=0, frame=1.0)
    d.decoded(0.0, frames=1, partial=True, need=11)
    d.decoded(0.9, frames=2, partial=True, need=11)  # one done, the next begun
    assert d.frame_deadline() == pytest.approx(0.9 + 1.0 + 11 / FRAME_ALLOWANCE_RATE)
    assert d.expired(1.5) is None
    assert d.expired(2.0) is not None


def test_the_frame_clock_stops_while_the_receiver_does_not_read() -> None:
    d = deadlines(idle=0, frame=1.0)
    d.decoded(0.0, frames=0, partial=True, need=100)
    d.paused(0.5, True)  # our own backpressure: the peer cannot progress
    assert d.frame_deadline() is None and d.expired(30.0) is None
    d.paused(30.0, False)
    assert d.expired(30.9) is None
    assert d.expired(31.1) is not None


def test_idle_applies_only_when_asked_and_zero_disables() -> None:
    d = deadlines(idle=1.0)
    assert d.expired(5.0, idle=False) is None
    assert d.expired(5.0) is not None
    assert deadlines(idle=0, frame=0).expired(1e9) is None


def test_negative_timeouts_are_refused() -> None:
    with pytest.raises(ValueError):
        ReceiveDeadlines(idle_timeout=-1, frame_timeout=1, now=0)


@given(
    gaps=st.lists(st.floats(0.0, 3.0), min_size=1, max_size=40),
    complete=st.lists(st.booleans(), min_size=40, max_size=40),
)
def test_idle_fires_exactly_when_the_last_prompt_frame_is_a_timeout_old(
    gaps: list[float], complete: list[bool]
) -> None:
    """Whatever bytes arrive, the connection is idle exactly when the last
    complete frame that arrived promptly (within the grace of its first
    byte) is at least the idle timeout old."""
    d = deadlines(idle=2.0, frame=0)
    now, frames, last_frame = 0.0, 0, 0.0
    started: float | None = None  # first byte of the frame in progress
    for gap, done in zip(gaps, complete, strict=False):
        now += gap
        if done:
            frames += 1
            if started is None or now - started <= WHOLE_FRAME_GRACE:
                last_frame = now
            started = None
        elif started is None:
            started = now
        d.decoded(now, frames=frames, partial=not done, need=10)
        later = now + 0.5
        assert (d.expired(later) is not None) == (later - last_frame >= 2.0)


def test_two_byte_frames_dripped_a_byte_at_a_time_are_no_activity() -> None:
    d = deadlines(idle=2.0, frame=0)
    now, frames = 0.0, 0
    while now < 1.9:
        now += 0.6
        d.decoded(now, frames=frames, partial=True, need=2)  # the first byte
        now += 0.6
        frames += 1
        d.decoded(now, frames=frames, partial=False)  # the second
    assert d.expired(2.0) is not None
    # The same frames sent whole keep the connection.
    d = deadlines(idle=2.0, frame=0)
    for frames in range(1, 5):
        d.decoded(1.2 * frames, frames=frames, partial=False)
    assert d.expired(1.2 * 4 + 1.9) is None


def test_a_large_frame_that_arrives_fast_enough_is_activity() -> None:
    d = deadlines(idle=2.0, frame=0)
    d.decoded(0.0, frames=0, partial=True, need=1 << 20)
    d.decoded(1.5, frames=1, partial=False)  # 1 MiB in 1.5 s: 680 KiB/s
    assert d.expired(3.4) is None


def test_reading_for_counts_from_the_last_resume_and_is_zero_while_paused() -> None:
    d = deadlines()
    assert d.reading_for(3.0) == 3.0
    d.paused(3.0, True)
    assert d.reading_for(10.0) == 0.0
    d.paused(10.0, False)
    d.paused(11.0, False)  # no change: still reading since 10
    assert d.reading_for(12.5) == 2.5


def test_time_the_receiver_excuses_is_not_silence_and_the_rest_is() -> None:
    """A producer whose bytes wait for the gateway's turn or disk is not idle."""
    d = ReceiveDeadlines(idle_timeout=1.0, frame_timeout=0.0, now=0.0)
    d.decoded(0.0, frames=1, partial=False)
    # The receiver did not read it from 0.5 s to 3.5 s, for reasons of its own.
    d.excuse(0.5, excused=False)
    for tick in (1.5, 2.5, 3.5):
        d.excuse(tick, excused=True)
        assert d.expired(tick) is None
    # Reading again: 0.5 s of silence before, and now 0.6 s more: 1.1 s.
    d.excuse(4.1, excused=False)
    reason = d.expired(4.1)
    assert reason is not None and "no complete frame" in reason


def test_a_backlog_decoded_late_does_not_take_back_the_time_the_receiver_excused() -> None:
    """A writer put off behind the turns of its token's other connections: its
    frames, read before the pause, are decoded after it; the pause was not
    silence all the same (the gateway closed such writers with TIMEOUT)."""
    d = ReceiveDeadlines(idle_timeout=1.0, frame_timeout=0.0, now=0.0)
    d.decoded(0.0, frames=1, partial=False)
    d.excuse(0.0, excused=False)
    for tick in (0.3, 0.6, 0.9):
        d.excuse(tick, excused=True)
    # Its turn, at 0.95 s, decodes the frames read at 0.0 s.
    d.decoded(0.0, frames=40, partial=False)
    d.excuse(1.2, excused=False)
    assert d.expired(1.2) is None, "silent only since 0.9 s"
    reason = d.expired(2.0)
    assert reason is not None and "no complete frame" in reason


def test_a_pause_the_peer_causes_is_silence() -> None:
    d = ReceiveDeadlines(idle_timeout=1.0, frame_timeout=0.0, now=0.0)
    d.decoded(0.0, frames=1, partial=False)
    d.excuse(0.6, excused=False)
    d.excuse(1.2, excused=False)
    assert d.expired(1.2) is not None


@pytest.mark.parametrize(
    ("idle_timeout_ms", "interval"),
    [
        (0, None),
        (-1, None),
        (30_000, 10.0),
        (3_000, 1.0),
        (90, KEEPALIVE_FLOOR),
        (1, KEEPALIVE_FLOOR),
    ],
)
def test_clients_ping_at_a_third_of_the_idle_timeout_but_not_too_often(
    idle_timeout_ms: int, interval: float | None
) -> None:
    assert keepalive_interval(idle_timeout_ms) == interval
