"""The open batch, without I/O: what a record adds to it, when it is cut, and
that its size estimate never falls below what it encodes to."""

from __future__ import annotations

import pytest

from headgate.client.open_batch import APPENDED, CUT, OPENED, OpenBatchStream
from headgate.protocol.records import BLOCK_BASE, decode_records, encode_records

LIMIT = 1024


class Timer:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def take(s: OpenBatchStream, value: bytes, key: bytes | None = None) -> bool:
    """Append without a bound on the stream's bytes; True if the batch was cut first."""
    return s.append(value, key, LIMIT, float("inf")) == CUT


def test_the_estimate_covers_what_the_open_batch_encodes_to() -> None:
    s = OpenBatchStream("s")
    assert s.open_bytes == BLOCK_BASE and s.open_held == 0
    for i in range(20):
        assert not take(s, b"v" * i)
        assert len(encode_records(s.values, s.keys)) <= s.open_bytes == s.open_held
    take(s, b"keyed", b"k")  # the batch takes keys: every earlier record grows
    assert s.keys == [None] * 20 + [b"k"]
    assert len(encode_records(s.values, s.keys)) <= s.open_bytes


def test_a_record_that_would_pass_the_limit_cuts_the_batch_first() -> None:
    s = OpenBatchStream("s")
    timer = s.linger = Timer()
    s.opened_at = 7.0
    cut = next(i for i in range(40) if take(s, b"%03d" % i + b"x" * 60))
    assert 10 <= cut < 16, "cut only once the next record would pass 1 KiB"
    assert timer.cancelled and s.linger is None
    (batch,) = s.queue
    assert len(batch.block) <= LIMIT and batch.count == cut and batch.opened_at == 7.0
    values, _ = decode_records(batch.block).to_lists()
    assert [v[:3] for v in values] == [b"%03d" % i for i in range(cut)]
    # The record that did not fit opened the next batch.
    assert s.values[0][:3] == b"%03d" % cut
    assert s.buffered == len(batch.block) and s.sealed_batches == 1


def test_sealing_and_discarding() -> None:
    s = OpenBatchStream("s")
    assert s.seal() is None and s.open_block() is None
    take(s, b"a")
    take(s, b"b", b"key")
    block, count = s.open_block() or (b"", 0)
    assert count == 2 and s.values, "open_block leaves the batch open"
    batch = s.seal()
    assert batch is not None and batch.block == block
    assert decode_records(batch.block).to_lists() == ([b"a", b"b"], [None, b"key"])
    assert s.values == [] and s.keys is None and s.open_bytes == BLOCK_BASE
    take(s, b"c")
    timer = s.linger = Timer()
    s.discard_open()
    assert s.values == [] and timer.cancelled and len(s.queue) == 1


def test_a_record_no_batch_can_hold_is_refused_before_anything_changes() -> None:
    s = OpenBatchStream("s")
    take(s, b"small")
    with pytest.raises(ValueError, match="does not fit in a batch of at most 1024 bytes"):
        s.append(b"x" * LIMIT, None, LIMIT, float("inf"))
    assert s.values == [b"small"]


def test_a_record_beyond_the_room_is_not_taken_and_says_what_it_needs() -> None:
    s = OpenBatchStream("s")
    assert s.append(b"first", None, LIMIT, 1 << 20) == OPENED
    assert s.append(b"second", None, LIMIT, 1 << 20) == APPENDED
    held = s.open_bytes
    needed = -s.append(b"x" * 100, None, LIMIT, held + 50)
    assert needed > 100 and s.values == [b"first", b"second"] and s.open_bytes == held
    assert s.append(b"x" * 100, None, LIMIT, held + needed) == APPENDED, "exactly enough room"
