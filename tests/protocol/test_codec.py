"""The frame codec: exact bytes, the full decoding relation, chunking, hostile input."""

from __future__ import annotations

import array
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from headgate.protocol.c64 import U64_MAX
from headgate.protocol.codec import FrameDecoder, encode_frame, encode_frame_into
from headgate.protocol.errors import ErrorCode, FrameError
from headgate.protocol.frames import (
    CLIENT_FRAMES,
    SERVER_FRAMES,
    Absolve,
    AnnounceDropping,
    Apologise,
    Frame,
    IssueGuarantees,
    LimitReceiving,
    LimitSending,
    Plead,
    SendChannel,
    SendGlobal,
)

MAX_PAYLOAD = 1 << 20

# Values where some tag width switches to a longer encoding, and neighbours.
BOUNDARIES = sorted(
    {
        v
        for b in [0, 3, 4, 11, 12, 251, 252, 255, 256, 65535, 65536, 2**32 - 1, 2**32]
        for v in (b - 1, b, b + 1)
        if v >= 0
    }
    | {U64_MAX - 1, U64_MAX}
)
u64s = st.one_of(st.sampled_from(BOUNDARIES), st.integers(min_value=0, max_value=U64_MAX))
# Payload lengths that land on every length-tag boundary (3 and 4 bits).
payloads = st.one_of(
    st.binary(max_size=40),
    st.sampled_from([3, 4, 11, 12, 255, 256, 65535, 65536]).map(lambda n: bytes([n % 251]) * n),
)

frames: st.SearchStrategy[Frame] = st.one_of(
    st.builds(IssueGuarantees, channel=u64s, amount=u64s),
    st.builds(Plead, channel=u64s, target=u64s),
    st.builds(LimitReceiving, channel=u64s, bound=u64s),
    st.builds(AnnounceDropping, channel=u64s),
    st.builds(SendChannel, channel=u64s, payload=payloads),
    st.builds(Absolve, channel=u64s, amount=u64s),
    st.builds(LimitSending, channel=u64s, bound=u64s),
    st.builds(Apologise, channel=u64s),
    st.builds(SendGlobal, payload=payloads),
)
small_frames: st.SearchStrategy[Frame] = st.one_of(
    st.builds(SendChannel, channel=st.integers(0, 300), payload=st.binary(max_size=300)),
    st.builds(SendGlobal, payload=st.binary(max_size=20)),
    frames.filter(lambda f: not isinstance(f, SendChannel | SendGlobal)),
)


# --- an independent reference encoder that may pick any valid tag ----------

SIZES = (1, 2, 4, 8)


def valid_tags(value: int, width: int) -> list[int]:
    """Every tag of ``width`` bits that can carry ``value``, minimal or not."""
    top = (1 << width) - 1
    tags = [value] if value <= top - 4 else []
    tags += [top - 3 + i for i, size in enumerate(SIZES) if value < 256**size]
    return tags


def tail(value: int, tag: int, width: int) -> bytes:
    top = (1 << width) - 1
    if tag <= top - 4:
        return b""
    return value.to_bytes(SIZES[tag - (top - 3)], "big")


def reference_encode(frame: Frame, pick: st.DataObject | None = None) -> bytes:
    """Encode from the spec's description; with ``pick``, tags are drawn freely."""

    def choose(value: int, width: int) -> int:
        tags = valid_tags(value, width)
        return min(tags) if pick is None else pick.draw(st.sampled_from(tags))

    def standalone(value: int) -> bytes:
        tag = choose(value, 8)
        return bytes([tag]) + tail(value, tag, 8)

    def channel_header(prefix: int, channel: int) -> bytes:
        tag = choose(channel, 4)
        return bytes([prefix << 4 | tag]) + tail(channel, tag, 4)

    match frame:
        case IssueGuarantees(channel=c, amount=v):
            return channel_header(0b1111, c) + standalone(v)
        case Plead(channel=c, target=v):
            return channel_header(0b1110, c) + standalone(v)
        case LimitReceiving(channel=c, bound=v):
            return channel_header(0b1101, c) + standalone(v)
        case AnnounceDropping(channel=c):
            return channel_header(0b1100, c)
        case Absolve(channel=c, amount=v):
            return channel_header(0b1011, c) + standalone(v)
        case LimitSending(channel=c, bound=v):
            return channel_header(0b1010, c) + standalone(v)
        case Apologise(channel=c):
            return channel_header(0b1001, c)
        case SendGlobal(payload=p):
            return channel_header(0b1000, len(p)) + bytes(p)
        case SendChannel(channel=c, payload=p):
            ctag = choose(c, 4)
            ltag = choose(len(p), 3)
            head = bytes([ltag << 4 | ctag])
            return head + tail(c, ctag, 4) + tail(len(p), ltag, 3) + bytes(p)
    raise AssertionError(frame)


def decode_all(data: bytes, chunks: list[int] | None = None) -> list[Frame]:
    decoder = FrameDecoder(max_payload=MAX_PAYLOAD)
    out: list[Frame] = []
    if chunks is None:
        out += decoder.feed(data)
    else:
        pos = 0
        for size in chunks:
            out += decoder.feed(data[pos : pos + size])
            pos += size
        out += decoder.feed(data[pos:])
    assert decoder.buffered == 0
    return out


# --- exact bytes -------------------------------------------------------------


@pytest.mark.parametrize(
    ("frame", "encoded"),
    [
        (IssueGuarantees(channel=0, amount=4096), "f0 fd 10 00"),
        (IssueGuarantees(channel=12, amount=7), "fc 0c 07"),
        (Plead(channel=3, target=0), "e3 00"),
        (LimitReceiving(channel=2, bound=252), "d2 fc fc"),
        (AnnounceDropping(channel=11), "cb"),
        (Absolve(channel=300, amount=1), "bd 01 2c 01"),
        (LimitSending(channel=U64_MAX, bound=0), "af ff ff ff ff ff ff ff ff 00"),
        (Apologise(channel=65536), "9e 00 01 00 00"),
        (SendGlobal(payload=b""), "80"),
        (SendGlobal(payload=b"x" * 12), "8c 0c" + " 78" * 12),
        (SendChannel(channel=2, payload=b"hi"), "22 68 69"),
        (SendChannel(channel=0, payload=b"abcd"), "40 04 61 62 63 64"),
        (SendChannel(channel=12, payload=b""), "0c 0c"),
        (SendChannel(channel=2, payload=b"\x00" * 256), "52 01 00" + " 00" * 256),
    ],
)
def test_frames_encode_to_the_documented_bytes(frame: Frame, encoded: str) -> None:
    assert encode_frame(frame) == bytes.fromhex(encoded)
    assert FrameDecoder(max_payload=MAX_PAYLOAD).feed(bytes.fromhex(encoded)) == [frame]


@given(frame=frames)
def test_encoding_is_the_minimal_member_of_the_relation(frame: Frame) -> None:
    assert encode_frame(frame) == reference_encode(frame)


@given(frame=frames)
def test_every_frame_round_trips(frame: Frame) -> None:
    encoded = encode_frame(frame)
    out = bytearray(b"previous")
    encode_frame_into(frame, out)
    assert bytes(out) == b"previous" + encoded
    decoded = FrameDecoder(max_payload=MAX_PAYLOAD).feed(encoded)
    assert decoded == [frame]
    payload = getattr(decoded[0], "payload", b"")
    assert type(payload) is bytes


@given(frame=frames, pick=st.data())
def test_non_minimal_encodings_decode(frame: Frame, pick: st.DataObject) -> None:
    """Any valid tag for any field is accepted, not only the shortest one."""
    encoded = reference_encode(frame, pick)
    assert FrameDecoder(max_payload=MAX_PAYLOAD).feed(encoded) == [frame]


@given(frame=frames)
def test_server_frames_and_client_frames_differ_in_their_first_byte(frame: Frame) -> None:
    """Both sessions share a byte stream, so the first byte must tell the roles apart."""
    first = encode_frame(frame)[0]
    assert (first >= 0xC0) == isinstance(frame, SERVER_FRAMES)
    assert (first < 0xC0) == isinstance(frame, CLIENT_FRAMES)


def test_payloads_of_any_buffer_type_encode_as_their_bytes() -> None:
    numbers = array.array("I", [1, 2, 3])
    raw = numbers.tobytes()
    expected = encode_frame(SendChannel(channel=5, payload=raw))
    for payload in (bytearray(raw), memoryview(raw), memoryview(numbers)):
        assert encode_frame(SendChannel(channel=5, payload=payload)) == expected
    strided = memoryview(b"a-b-c-")[::2]
    assert encode_frame(SendGlobal(payload=strided)) == encode_frame(SendGlobal(payload=b"abc"))


@pytest.mark.parametrize(
    "frame",
    [
        SendChannel(channel=-1, payload=b""),
        SendChannel(channel=U64_MAX + 1, payload=b"x"),
        IssueGuarantees(channel=0, amount=-5),
        Plead(channel=1, target=U64_MAX + 1),
        Absolve(channel=-1, amount=0),
        Apologise(channel=2**70),
    ],
)
def test_integers_outside_u64_are_refused_and_leave_the_buffer_alone(frame: Frame) -> None:
    out = bytearray(b"batch so far")
    with pytest.raises(ValueError):
        encode_frame_into(frame, out)
    assert out == b"batch so far"
    with pytest.raises(ValueError):
        encode_frame(frame)


# --- streams and chunking ----------------------------------------------------


@given(batch=st.lists(small_frames, max_size=30), cuts=st.lists(st.integers(0, 64), max_size=40))
def test_chunking_never_changes_the_frames(batch: list[Frame], cuts: list[int]) -> None:
    """However the byte stream is split, the same frames come out, in order."""
    out = bytearray()
    for frame in batch:
        encode_frame_into(frame, out)
    assert decode_all(bytes(out), cuts) == batch


@given(batch=st.lists(small_frames, min_size=1, max_size=8))
def test_one_byte_at_a_time(batch: list[Frame]) -> None:
    data = b"".join(encode_frame(f) for f in batch)
    assert decode_all(data, [1] * len(data)) == batch


@given(frame=frames.filter(lambda f: len(encode_frame(f)) < 2000))
def test_every_prefix_of_a_frame_waits(frame: Frame) -> None:
    """Part of a frame is never an error: the decoder keeps it and waits."""
    encoded = encode_frame(frame)
    for cut in range(len(encoded)):
        decoder = FrameDecoder(max_payload=MAX_PAYLOAD)
        assert decoder.feed(encoded[:cut]) == []
        assert decoder.buffered == cut
        assert decoder.feed(encoded[cut:]) == [frame]
        assert decoder.buffered == 0


@pytest.mark.parametrize("channel", [0, 11, 12, 255, 256, 65536])
@pytest.mark.parametrize("length", [0, 3, 4, 255, 256, 65535, 65536])
def test_every_header_shape_waits_then_decodes(channel: int, length: int) -> None:
    """Every SendChannel header layout, cut anywhere inside the header or just
    after it, is held until the frame is whole."""
    frame = SendChannel(channel=channel, payload=bytes([7]) * length)
    encoded = encode_frame(frame)
    header = len(encoded) - length
    for cut in range(min(header + 2, len(encoded))):
        decoder = FrameDecoder(max_payload=MAX_PAYLOAD)
        assert decoder.feed(encoded[:cut]) == []
        assert decoder.buffered == cut
        assert decoder.feed(encoded[cut:]) == [frame]
    if length:
        # The length alone, with no payload byte yet, is enough to refuse.
        decoder = FrameDecoder(max_payload=length - 1)
        with pytest.raises(FrameError):
            decoder.feed(encoded[:header])


def test_fed_buffers_may_be_reused_by_the_caller() -> None:
    decoder = FrameDecoder(max_payload=MAX_PAYLOAD)
    chunk = bytearray(encode_frame(SendChannel(channel=3, payload=b"hello")))
    got = decoder.feed(memoryview(chunk)[:4])
    got += decoder.feed(memoryview(chunk)[4:])
    chunk[:] = bytes(len(chunk))
    assert got == [SendChannel(channel=3, payload=b"hello")]


def test_a_large_payload_in_tiny_chunks_is_linear() -> None:
    """Buffering grows with the bytes received, and they are not copied again
    on every chunk (a quadratic decoder would take minutes here)."""
    payload = bytes(range(256)) * 800
    encoded = encode_frame(SendChannel(channel=7, payload=payload))
    decoder = FrameDecoder(max_payload=MAX_PAYLOAD)
    for i in range(len(encoded) - 1):
        assert decoder.feed(encoded[i : i + 1]) == []
    assert decoder.buffered == len(encoded) - 1
    assert decoder.feed(encoded[-1:]) == [SendChannel(channel=7, payload=payload)]
    assert decoder.buffered == 0


# --- limits and hostile input ------------------------------------------------


@pytest.mark.parametrize(
    "header",
    [
        "7f ff ff ff ff ff ff ff ff",  # SendChannel, channel 2^64-1 .. cut short
        "70 ff ff ff ff ff ff ff ff",  # SendChannel, channel 0, length 2^64-1
        "8f ff ff ff ff ff ff ff ff",  # SendGlobal, length 2^64-1
        "8e 00 10 00 01",  # SendGlobal, length 2^20 + 1
        "63 00 10 00 01",  # SendChannel, channel 3, length 2^20 + 1 in 4 bytes
    ],
)
def test_huge_declared_lengths_fail_before_the_payload_arrives(header: str) -> None:
    data = bytes.fromhex(header)
    if data[0] == 0x7F:
        data += bytes.fromhex("ff ff ff ff ff ff ff ff")
    decoder = FrameDecoder(max_payload=MAX_PAYLOAD)
    # All but the last header byte: nothing is known yet, so it waits.
    assert decoder.feed(data[:-1]) == []
    assert decoder.buffered == len(data) - 1
    with pytest.raises(FrameError) as raised:
        decoder.feed(data[-1:])
    assert raised.value.code is ErrorCode.FRAME_TOO_LARGE
    assert decoder.buffered == 0


def test_the_limit_is_inclusive() -> None:
    decoder = FrameDecoder(max_payload=5)
    assert decoder.feed(encode_frame(SendGlobal(payload=b"12345"))) == [
        SendGlobal(payload=b"12345")
    ]
    with pytest.raises(FrameError):
        decoder.feed(encode_frame(SendChannel(channel=0, payload=b"123456")))


def test_a_dead_decoder_refuses_everything_with_the_same_error() -> None:
    decoder = FrameDecoder(max_payload=0)
    with pytest.raises(FrameError) as first:
        decoder.feed(b"\x01\x00" + encode_frame(SendChannel(channel=1, payload=b"x")))
    for later in (b"", encode_frame(Apologise(channel=0))):
        with pytest.raises(FrameError) as again:
            decoder.feed(later)
        assert again.value is first.value


def test_max_payload_must_be_a_u64() -> None:
    with pytest.raises(ValueError):
        FrameDecoder(max_payload=-1)


def outcome(data: bytes, cuts: list[int], max_payload: int) -> tuple[list[Frame], ErrorCode | None]:
    decoder = FrameDecoder(max_payload=max_payload)
    got: list[Frame] = []
    pos = 0
    try:
        for size in [*cuts, len(data)]:
            got += decoder.feed(data[pos : pos + size])
            pos += size
    except FrameError as error:
        assert decoder.buffered == 0
        return got, error.code
    assert decoder.buffered < 18 + max_payload
    return got, None


@given(
    data=st.binary(max_size=400),
    cuts=st.lists(st.integers(0, 50), max_size=20),
    max_payload=st.sampled_from([0, 16, 300]),
)
def test_random_bytes_only_ever_raise_frame_error(
    data: bytes, cuts: list[int], max_payload: int
) -> None:
    """Arbitrary bytes give frames, a wait, or FrameError, and the same answer
    however they are chunked.

    A feed that raises discards the frames it completed in that same call (the
    connection is over), so with an error the one-chunk frames are a prefix.
    """
    whole = outcome(data, [], max_payload)
    chunked = outcome(data, cuts, max_payload)
    assert chunked[1] == whole[1]
    if whole[1] is None:
        assert chunked[0] == whole[0]
    else:
        assert chunked[0][: len(whole[0])] == whole[0]
    frames_out, error = chunked
    for frame in frames_out:
        # What was decoded is a real frame: it encodes, and decodes back.
        assert FrameDecoder(max_payload=max_payload).feed(encode_frame(frame)) == [frame]
    if error is not None:
        assert error is ErrorCode.FRAME_TOO_LARGE


@given(batch=st.lists(small_frames, min_size=1, max_size=10), data=st.data())
def test_mutated_streams_only_ever_raise_frame_error(
    batch: list[Frame], data: st.DataObject
) -> None:
    stream = bytearray(b"".join(encode_frame(f) for f in batch))
    for _ in range(data.draw(st.integers(1, 4))):
        action = data.draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        where = data.draw(st.integers(0, max(0, len(stream) - 1)))
        if action == "flip" and stream:
            stream[where] ^= 1 << data.draw(st.integers(0, 7))
        elif action == "insert":
            stream[where:where] = bytes([data.draw(st.integers(0, 255))])
        elif action == "delete" and stream:
            del stream[where]
        elif action == "truncate":
            del stream[where:]
    outcome(bytes(stream), [], 300)


def test_random_streams_against_a_seeded_generator() -> None:
    """A larger, reproducible soak: many random chunkings of one long stream."""
    rng = random.Random(20240611)
    batch: list[Frame] = [
        SendChannel(channel=rng.randrange(40), payload=rng.randbytes(rng.randrange(300)))
        for _ in range(500)
    ]
    batch += [IssueGuarantees(channel=rng.randrange(2**40), amount=rng.randrange(2**64))] * 3
    rng.shuffle(batch)
    data = b"".join(encode_frame(f) for f in batch)
    for _ in range(20):
        cuts = [rng.randrange(1, 200) for _ in range(len(data) // 50)]
        assert decode_all(data, cuts) == batch
