"""Metadata and ClusterMetadata: round trips, and hostile bytes for the decoder."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from headgate.protocol import messages as m
from headgate.protocol.c64 import encode_standalone
from headgate.protocol.errors import MessageError

GW = m.MetadataGateway


def answer(*holders: tuple[int, ...], gateways: int = 2) -> m.ClusterMetadata:
    return m.ClusterMetadata(
        request_id=3,
        gateway="gw1",
        gateways=tuple(GW(name=f"gw{i + 1}", address=f"h:{7000 + i}") for i in range(gateways)),
        streams=tuple(m.MetadataStream(stream=f"s{i}", holders=h) for i, h in enumerate(holders)),
    )


def test_round_trips() -> None:
    for message in (
        m.Metadata(request_id=0),
        m.Metadata(request_id=(1 << 64) - 1),
        answer((0, 1, 0), (1,)),
        answer(gateways=0),
        answer(tuple(k % 3 for k in range(m.MAX_METADATA_PARTITIONS)), gateways=3),
    ):
        assert m.decode_global(m.encode_message(message)) == message


def test_the_encoder_refuses_what_the_decoder_would() -> None:
    with pytest.raises(ValueError, match="not a gateway's index"):
        m.encode_message(answer((0, 2)))
    with pytest.raises(ValueError, match="1 to 1024 partitions"):
        m.encode_message(answer(()))
    with pytest.raises(ValueError, match="address is empty"):
        m.encode_message(
            m.ClusterMetadata(
                request_id=1, gateway="g", gateways=(GW(name="g", address=""),), streams=()
            )
        )


def c64(value: int) -> bytes:
    return encode_standalone(value)


HEAD = bytes([0x41, 3, 3]) + b"gw1"
ONE_GATEWAY = c64(1) + b"\x03gw1" + b"\x03h:1"

MALFORMED = [
    (HEAD + ONE_GATEWAY + c64(1) + b"\x01s" + c64(2) + b"\x00\x01", "holder 1 is not a gateway"),
    (HEAD + ONE_GATEWAY + c64(1) + b"\x01s" + c64(0), "has 0 partitions"),
    (HEAD + ONE_GATEWAY + c64(1) + b"\x01s" + c64(1025) + b"\x00" * 1025, "has 1025 partitions"),
    (HEAD + ONE_GATEWAY + c64(1) + b"\x01s" + c64(3) + b"\x00", "truncated in holder"),
    (HEAD + c64(1 << 40), "gateways cannot be"),
    (HEAD + c64(256) + (b"\x01g\x01h" * 256), "gateways cannot be"),
    (HEAD + ONE_GATEWAY + c64(1 << 40), "streams cannot fit"),
    (HEAD + c64(1) + b"\x03gw1" + b"\x00", "empty address"),
    (HEAD + c64(1) + b"\x03g w" + b"\x03h:1", "not a valid name"),
    (HEAD + ONE_GATEWAY + c64(0) + b"\x00", "1 trailing bytes"),
    (HEAD + ONE_GATEWAY, "truncated in stream count"),
    (bytes([0x40]), "truncated in request_id"),
    (bytes([0x40, 1, 0]), "1 trailing bytes"),
]


@pytest.mark.parametrize(("payload", "expected"), MALFORMED, ids=[e for _, e in MALFORMED])
def test_malformed_metadata_is_a_message_error(payload: bytes, expected: str) -> None:
    with pytest.raises(MessageError, match=expected):
        m.decode_global(payload)


@given(st.binary(max_size=200))
def test_any_bytes_decode_to_a_consistent_answer_or_a_message_error(tail: bytes) -> None:
    """Whatever follows the type byte, the decoder returns an answer whose every
    holder names one of its gateways, or raises MessageError: nothing else."""
    for kind in (0x40, 0x41):
        try:
            message = m.decode_global(bytes([kind]) + tail)
        except MessageError:
            continue
        if isinstance(message, m.ClusterMetadata):
            for stream in message.streams:
                assert 1 <= len(stream.holders) <= m.MAX_METADATA_PARTITIONS
                assert all(h < len(message.gateways) for h in stream.holders)
            assert all(g.address for g in message.gateways)


@given(
    st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=8), max_size=4),
    st.data(),
)
def test_prefixes_and_flipped_bytes_never_escape(
    holders: list[list[int]], data: st.DataObject
) -> None:
    encoded = m.encode_message(answer(*map(tuple, holders), gateways=3))
    cut = data.draw(st.integers(0, len(encoded) - 1))
    with pytest.raises(MessageError):
        m.decode_global(encoded[:cut] if cut else b"")
    where = data.draw(st.integers(1, len(encoded) - 1))
    flipped = bytearray(encoded)
    flipped[where] ^= data.draw(st.integers(1, 255))
    with contextlib.suppress(MessageError):
        m.decode_global(bytes(flipped))
