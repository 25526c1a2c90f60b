"""Decoding in place: frames read straight out of the caller's buffer.

The gateway reads into a ring of its own and decodes there, so payloads must
be views of that ring, an incomplete frame must stay where it is, and every
guarantee of the copying decoder (the same frames however the bytes arrive,
hostile lengths refused as soon as the header is complete) must still hold.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from headgate.protocol import messages as m
from headgate.protocol.codec import FrameDecoder, encode_frame
from headgate.protocol.errors import ErrorCode, FrameError, ProtocolError
from headgate.protocol.frames import Frame, SendChannel, SendGlobal
from headgate.protocol.records import encode_records
from headgate.protocol.session import BatchReceived, Event, Role, Session
from tests.protocol.test_codec import MAX_PAYLOAD, small_frames


class Reader:
    """A caller that keeps undecoded bytes in its buffer, as the ring does."""

    def __init__(self, max_payload: int = MAX_PAYLOAD) -> None:
        self.decoder = FrameDecoder(max_payload=max_payload)
        self.buffer = bytearray()
        self.start = 0  # first undecoded byte
        self.need = 0

    def receive(self, data: bytes) -> list[Frame]:
        self.buffer += data
        if len(self.buffer) - self.start < self.need:
            return []
        view = memoryview(self.buffer)[self.start :]
        frames, ends, consumed, need = self.decoder.decode_in_place(view)
        assert len(ends) == len(frames)
        assert ends == sorted(ends) and (not ends or ends[-1] == consumed)
        # Copy out: the test buffer grows, which the views would forbid.
        out = [_owned(f) for f in frames]
        del view, frames
        self.start += consumed
        self.need = need
        assert need == 0 or need > len(self.buffer) - self.start
        return out


def _owned(frame: Frame) -> Frame:
    if isinstance(frame, SendChannel):
        return SendChannel(channel=frame.channel, payload=bytes(frame.payload))
    if isinstance(frame, SendGlobal):
        return SendGlobal(payload=bytes(frame.payload))
    return frame


def chunks_of(data: bytes, cuts: list[int]) -> list[bytes]:
    out, pos = [], 0
    for size in cuts:
        out.append(data[pos : pos + size])
        pos += size
    out.append(data[pos:])
    return out


@given(batch=st.lists(small_frames, max_size=30), cuts=st.lists(st.integers(0, 64), max_size=40))
def test_in_place_decoding_gives_the_frames_that_feed_gives(
    batch: list[Frame], cuts: list[int]
) -> None:
    data = b"".join(encode_frame(f) for f in batch)
    reader = Reader()
    got: list[Frame] = []
    for chunk in chunks_of(data, cuts):
        got += reader.receive(chunk)
    assert got == batch
    assert reader.start == len(data) and reader.need == 0


def test_payloads_are_views_of_the_callers_buffer_and_ends_point_past_each_frame() -> None:
    one = encode_frame(SendChannel(channel=3, payload=b"abc"))
    two = encode_frame(SendGlobal(payload=b"hello"))
    ring = bytearray(one + two + one[:2])  # and the start of a third frame
    decoder = FrameDecoder(max_payload=100)
    frames, ends, consumed, need = decoder.decode_in_place(memoryview(ring))
    assert frames == [SendChannel(channel=3, payload=b"abc"), SendGlobal(payload=b"hello")]
    assert ends == [len(one), len(one) + len(two)]
    assert consumed == len(one) + len(two)
    assert need == len(one), "the incomplete frame says how long it is"
    first = frames[0]
    assert isinstance(first, SendChannel) and isinstance(first.payload, memoryview)
    ring[ends[0] - 1] = ord("X")  # the payload is the buffer's own memory
    assert bytes(first.payload) == b"abX"


@pytest.mark.parametrize(
    "header",
    [
        "70 ff ff ff ff ff ff ff ff",  # SendChannel, channel 0, length 2^64-1
        "8f ff ff ff ff ff ff ff ff",  # SendGlobal, length 2^64-1
        "8e 00 10 00 01",  # SendGlobal, length 2^20 + 1
        "63 00 10 00 01",  # SendChannel, channel 3, length 2^20 + 1 in 4 bytes
    ],
)
def test_hostile_lengths_fail_in_place_as_soon_as_the_header_is_complete(header: str) -> None:
    data = bytes.fromhex(header)
    decoder = FrameDecoder(max_payload=MAX_PAYLOAD)
    frames, _, consumed, need = decoder.decode_in_place(memoryview(data[:-1]))
    assert (frames, consumed) == ([], 0) and need == len(data)
    with pytest.raises(FrameError) as raised:
        decoder.decode_in_place(memoryview(data))
    assert raised.value.code is ErrorCode.FRAME_TOO_LARGE
    with pytest.raises(FrameError) as again:
        decoder.decode_in_place(memoryview(b""))
    assert again.value is raised.value


@given(
    data=st.binary(max_size=400),
    cuts=st.lists(st.integers(0, 50), max_size=20),
    max_payload=st.sampled_from([0, 16, 300]),
)
def test_random_bytes_in_place_give_what_feed_gives(
    data: bytes, cuts: list[int], max_payload: int
) -> None:
    """Frames, a wait or FrameError, exactly as the copying decoder answers."""
    fed = FrameDecoder(max_payload=max_payload)
    try:
        expected: list[Frame] | ErrorCode = fed.feed(data)
    except FrameError as error:
        expected = error.code
    reader = Reader(max_payload)
    got: list[Frame] = []
    try:
        for chunk in chunks_of(data, cuts):
            got += reader.receive(chunk)
    except FrameError as error:
        assert expected == error.code
        return
    assert got == expected


def test_in_place_refuses_to_mix_with_feed_and_odd_views() -> None:
    decoder = FrameDecoder(max_payload=100)
    decoder.feed(encode_frame(SendGlobal(payload=b"hello"))[:3])
    with pytest.raises(ValueError, match="holds part of a frame"):
        decoder.decode_in_place(memoryview(b"\x00"))
    other = FrameDecoder(max_payload=100)
    with pytest.raises(ValueError, match="contiguous"):
        other.decode_in_place(memoryview(b"a-b-c-")[::2])
    with pytest.raises(ValueError, match="contiguous"):
        other.decode_in_place(memoryview(bytearray(8)).cast("I"))


# --- the session ---------------------------------------------------------------

HELLO = m.Hello(producer_id=7, client_name="test")


def opening() -> bytes:
    return encode_frame(SendGlobal(payload=m.encode_message(HELLO)))


def bind(name: str) -> bytes:
    return encode_frame(SendChannel(channel=0, payload=m.encode_message(m.BindStream(stream=name))))


def batch(handle: int, seq: int, block: bytes) -> bytes:
    payload = m.encode_batch_header(seq) + block
    return encode_frame(SendChannel(channel=m.data_channel(handle), payload=payload))


def gateway_with_credit() -> Session:
    """A gateway session with stream "s" bound as handle 0 and credit on it."""
    session = Session(Role.GATEWAY)
    session.receive_data(opening())
    session.grant(m.STREAM_CHANNEL, 4096)
    events: list[Event] = session.receive_data(bind("s"))
    assert len(events) == 1
    session.grant(m.data_channel(0), 1 << 20)
    session.issue(m.data_channel(0))
    return session


def test_the_session_in_place_reports_batches_as_views_with_their_frame_end() -> None:
    blocks = [encode_records([b"a", b"bb"]), encode_records([b"ccc"])]
    frames = [batch(0, 0, blocks[0]), batch(0, 2, blocks[1])]
    ring = bytearray(b"".join(frames) + frames[0][:5])
    copying = gateway_with_credit()
    in_place = gateway_with_credit()
    expected = copying.receive_data(b"".join(frames))
    events, consumed, need = in_place.receive_in_place(memoryview(ring))
    assert consumed == len(frames[0]) + len(frames[1]) and need == len(frames[0])
    got = [e for e in events if isinstance(e, BatchReceived)]
    assert [(e.first_sequence, e.record_count, bytes(e.records)) for e in got] == [
        (e.first_sequence, e.record_count, bytes(e.records))
        for e in expected
        if isinstance(e, BatchReceived)
    ]
    assert [e.end for e in got] == [len(frames[0]), consumed]
    ring[consumed - 1] ^= 0xFF  # the records are the ring's bytes, not a copy
    assert bytes(got[1].records) != blocks[1]


def test_the_session_in_place_raises_what_receive_data_raises() -> None:
    bad = batch(0, 0, b"\x01\x00\x00\x00garbage")
    session = gateway_with_credit()
    with pytest.raises(ProtocolError) as info:
        session.receive_in_place(memoryview(bytearray(bad)))
    assert info.value.code is ErrorCode.MALFORMED_MESSAGE
