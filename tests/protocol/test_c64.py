"""Compact U64: minimal encoding, the full decoding relation, and waiting for bytes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from headgate.protocol.c64 import (
    U64_MAX,
    decode_compact,
    decode_standalone,
    encode_compact,
    encode_standalone,
    encode_standalone_into,
    minimal_tag,
    tail_size,
)

# Every value at which some width changes its encoding, and its neighbours.
BOUNDARIES = sorted(
    {
        v
        for b in [0, 3, 4, 7, 11, 12, 251, 252, 255, 256, 65535, 65536, 2**32 - 1, 2**32]
        for v in (b - 1, b, b + 1)
        if v >= 0
    }
    | {U64_MAX - 1, U64_MAX}
)
u64s = st.one_of(st.sampled_from(BOUNDARIES), st.integers(min_value=0, max_value=U64_MAX))
widths = st.integers(min_value=2, max_value=8)


def capacity(size: int) -> int:
    """The largest value a tail of ``size`` bytes can carry."""
    return (1 << (8 * size)) - 1


def smallest_tail(value: int) -> int:
    for size in (1, 2, 4, 8):
        if value <= capacity(size):
            return size
    raise AssertionError(value)


@pytest.mark.parametrize(
    ("value", "encoded"),
    [
        (0, "00"),
        (251, "fb"),
        (252, "fc fc"),
        (255, "fc ff"),
        (256, "fd 01 00"),
        (65535, "fd ff ff"),
        (65536, "fe 00 01 00 00"),
        (2**32 - 1, "fe ff ff ff ff"),
        (2**32, "ff 00 00 00 01 00 00 00 00"),
        (U64_MAX, "ff ff ff ff ff ff ff ff ff"),
    ],
)
def test_standalone_encodings_match_the_spec_table(value: int, encoded: str) -> None:
    assert encode_standalone(value) == bytes.fromhex(encoded)
    assert decode_standalone(bytes.fromhex(encoded), 0) == (value, len(bytes.fromhex(encoded)))


@pytest.mark.parametrize(
    ("width", "inline_max"),
    [(2, None), (3, 3), (4, 11), (8, 251)],
)
def test_inline_range_ends_four_below_the_top_tag(width: int, inline_max: int | None) -> None:
    top = (1 << width) - 1
    if inline_max is None:
        # With two bits every tag announces a tail: even 0 takes a byte.
        assert minimal_tag(0, width) == 0
        assert tail_size(0, width) == 1
    else:
        assert minimal_tag(inline_max, width) == inline_max
        assert tail_size(inline_max, width) == 0
        assert minimal_tag(inline_max + 1, width) == top - 3
    assert [tail_size(t, width) for t in range(top - 3, top + 1)] == [1, 2, 4, 8]


@given(value=u64s, width=widths)
def test_compact_round_trip_is_minimal(value: int, width: int) -> None:
    """Decoding what was encoded gives the value back, with the shortest tail."""
    tag, tail = encode_compact(value, width)
    assert 0 <= tag < (1 << width)
    inline_max = (1 << width) - 5
    expected = 0 if value <= inline_max else smallest_tail(value)
    assert len(tail) == expected == tail_size(tag, width)
    assert decode_compact(tag, width, b"\xaa" + tail + b"\xbb", 1) == (value, 1 + len(tail))


@given(value=u64s, width=widths, data=st.data())
def test_every_valid_tag_decodes(value: int, width: int, data: st.DataObject) -> None:
    """Non-minimal tags are part of the encoding relation and must be accepted."""
    top = (1 << width) - 1
    sizes = {top - 3: 1, top - 2: 2, top - 1: 4, top: 8}
    usable = [t for t, size in sizes.items() if value <= capacity(size)]
    tag = data.draw(st.sampled_from(usable))
    tail = value.to_bytes(sizes[tag], "big")
    assert decode_compact(tag, width, tail, 0) == (value, len(tail))


def test_seven_written_with_a_four_bit_tag_and_eight_bytes() -> None:
    assert decode_compact(15, 4, bytes(7) + b"\x07", 0) == (7, 8)
    assert decode_standalone(b"\xff" + bytes(7) + b"\x07", 0) == (7, 9)
    assert decode_standalone(b"\xfe\x00\x00\x00\x07", 0) == (7, 5)


@given(value=u64s)
def test_standalone_round_trip_at_an_offset(value: int) -> None:
    encoded = encode_standalone(value)
    out = bytearray(b"xy")
    encode_standalone_into(value, out)
    assert bytes(out[2:]) == encoded
    for buf in (bytes(out), out, memoryview(out)):
        assert decode_standalone(buf, 2) == (value, len(out))


@given(value=u64s)
def test_every_strict_prefix_asks_for_more(value: int) -> None:
    """A decoder that sees part of a number waits; it never raises or guesses."""
    encoded = encode_standalone(value)
    for cut in range(len(encoded)):
        assert decode_standalone(encoded[:cut], 0) is None
    tag, tail = encode_compact(value, 4)
    for cut in range(len(tail)):
        assert decode_compact(tag, 4, tail[:cut], 0) is None


def test_reading_past_the_end_asks_for_more() -> None:
    assert decode_standalone(b"\x01", 5) is None
    assert decode_compact(12, 4, b"", 3) is None
    # An inline tag needs no bytes, wherever the offset is.
    assert decode_compact(3, 4, b"", 3) == (3, 3)


@pytest.mark.parametrize("bad", [-1, U64_MAX + 1, 2**100])
def test_values_outside_u64_are_refused(bad: int) -> None:
    with pytest.raises(ValueError):
        encode_standalone(bad)
    with pytest.raises(ValueError):
        encode_compact(bad, 4)
    out = bytearray()
    with pytest.raises(ValueError):
        encode_standalone_into(bad, out)
    assert out == b""


@pytest.mark.parametrize("width", [0, 1, 9])
def test_widths_outside_two_to_eight_are_refused(width: int) -> None:
    with pytest.raises(ValueError):
        minimal_tag(0, width)
    with pytest.raises(ValueError):
        decode_compact(0, width, b"\x00" * 8, 0)


def test_a_tag_wider_than_its_width_is_local_misuse() -> None:
    with pytest.raises(ValueError):
        tail_size(16, 4)
    with pytest.raises(ValueError):
        decode_compact(8, 3, b"", 0)
    with pytest.raises(ValueError):
        decode_standalone(b"\x00", -1)
