"""Deterministic test frames: everything about frame ``seq`` follows from ``seq``.

Tests and child processes share this, so a frame read back anywhere can be
checked against what must have been appended, with no side channel.
"""

from __future__ import annotations

import itertools

from headgate.log import AppendResult, LogFrame, StreamLog

PRODUCER_ID = 7
MAX_LENGTH = 700


def payload_length(seq: int) -> int:
    """Varied sizes, from 1 byte to about a sixth of a 4 KiB term."""
    return 1 + (seq * 7919) % MAX_LENGTH


def payload(seq: int) -> bytes:
    n = payload_length(seq)
    word = (seq * 0x9E3779B97F4A7C15 & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "little")
    return (word * (n // 8 + 1))[:n]


def record_count(seq: int) -> int:
    return 1 + seq % 5


def append(log: StreamLog, seq: int) -> AppendResult:
    """Append frame ``seq``; the next frame's sequence is ``seq + record_count(seq)``."""
    return log.append(
        payload(seq),
        producer_id=PRODUCER_ID,
        first_sequence=seq,
        record_count=record_count(seq),
        timestamp_us=seq * 10,
    )


def check_frame(frame: LogFrame) -> None:
    """Assert that ``frame`` is exactly what :func:`append` wrote for its sequence."""
    seq = frame.first_sequence
    assert frame.producer_id == PRODUCER_ID
    assert frame.record_count == record_count(seq)
    assert frame.timestamp_us == seq * 10
    assert bytes(frame.payload) == payload(seq), f"payload of frame {seq} differs"


def check_contiguous(frames: list[LogFrame], term_length: int) -> None:
    """Frames follow each other with no gap (padding aside) and sequences continue."""
    header = 40
    for before, after in itertools.pairwise(frames):
        gap = after.position - before.end_position
        if gap:
            # Only padding may sit between frames: the rest of a term.
            assert after.position % term_length == 0, (before, after)
            assert before.end_position // term_length + 1 == after.position // term_length
            assert term_length - before.end_position % term_length >= header
        assert after.first_sequence == before.first_sequence + before.record_count


def append_many(log: StreamLog, count: int, seq: int = 0) -> tuple[list[AppendResult], int]:
    """Append ``count`` consecutive frames from ``seq``; return them and the next sequence."""
    results = []
    for _ in range(count):
        results.append(append(log, seq))
        seq += record_count(seq)
    return results, seq
