"""CountRecords / RecordCounts and ConsumerList's lag_records: bounds and round trips."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from headgate.protocol import messages as m
from headgate.protocol.errors import MessageError

U62 = st.integers(min_value=0, max_value=(1 << 62) - 1)


@given(
    st.lists(U62, max_size=m.MAX_COUNTED_POSITIONS),
    st.lists(st.none() | U62, max_size=m.MAX_COUNTED_POSITIONS),
)
def test_count_records_and_its_answer_round_trip(
    positions: list[int], counts: list[int | None]
) -> None:
    """Whatever the positions and counts (unknown ones too), decoding gives them back."""
    ask = m.CountRecords(request_id=9, stream="s", positions=tuple(positions))
    assert m.decode_global(m.encode_message(ask)) == ask
    answer = m.RecordCounts(request_id=9, epoch=3, counts=tuple(counts))
    assert m.decode_global(m.encode_message(answer)) == answer


def test_more_positions_than_the_limit_are_refused_both_ways() -> None:
    too_many = tuple(range(m.MAX_COUNTED_POSITIONS + 1))
    with pytest.raises(ValueError, match="at most 64 positions"):
        m.encode_message(m.CountRecords(request_id=1, stream="s", positions=too_many))
    fits = m.encode_message(m.CountRecords(request_id=1, stream="s", positions=too_many[:-1]))
    # The same message claiming one position more (and carrying it).
    count_at = 1 + 1 + 2  # type, request_id, the stream name "s"
    hostile = (
        fits[:count_at] + bytes([m.MAX_COUNTED_POSITIONS + 1]) + fits[count_at + 1 :] + b"\x00"
    )
    with pytest.raises(MessageError, match="COUNT_RECORDS: 65 positions, at most 64"):
        m.decode_global(hostile)


def test_a_consumer_list_entry_without_lag_records_is_what_an_older_gateway_sends() -> None:
    """Bit 4 clear, nothing after the flags: read as an unknown lag in records."""
    old = bytes.fromhex("33 04 01 07 61 72 63 68 69 76 65 fd 20 00 fd 10 00 fd 05 dc 01")
    (entry,) = m.decode_global(old).consumers  # type: ignore[union-attr]
    assert entry.lag_records is None and entry.blocking
    new = m.encode_message(
        m.ConsumerList(request_id=4, consumers=(m.ConsumerInfo(
            consumer="archive", position=8192, lag_bytes=4096, lag_ms=1500, blocking=True,
            lag_records=0,
        ),))
    )  # fmt: skip
    assert new[-2:] == bytes([0x11, 0x00])  # bit 4, then the count: known to be 0
