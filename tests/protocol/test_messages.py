"""headgate messages: round trips, limits, hostile payloads, and PROTOCOL.md's examples."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from headgate.protocol import frames as frames_module
from headgate.protocol import layout as layout_module
from headgate.protocol import messages as messages_module
from headgate.protocol.c64 import U64_MAX, decode_standalone, encode_standalone
from headgate.protocol.codec import FrameDecoder, encode_frame
from headgate.protocol.errors import ErrorCode, MessageError
from headgate.protocol.frames import SendChannel, SendGlobal
from headgate.protocol.messages import (
    BATCH_HEADER_SIZE,
    FIRST_DATA_CHANNEL,
    MAX_NAME_BYTES,
    MAX_SCHEMA_TEXT_BYTES,
    MAX_TEXT_BYTES,
    MAX_TIME_US,
    MAX_TOKEN_BYTES,
    SCHEMA_CHANNEL,
    SEQUENCE_LIMIT,
    STREAM_CHANNEL,
    TAIL_HEADER_SIZE,
    Ack,
    BindSchema,
    BindStream,
    ChannelMessage,
    DescribeStreams,
    Error,
    Fetch,
    FetchDone,
    FreeHandle,
    GlobalMessage,
    Goodbye,
    HandleRef,
    HandleType,
    Hello,
    HelloFlags,
    ListStreams,
    MessageType,
    Missed,
    Ping,
    Pong,
    Release,
    StartAt,
    StreamDescription,
    StreamDescriptions,
    StreamInfo,
    StreamList,
    Subscribe,
    TailHeader,
    Welcome,
    data_channel,
    decode_batch,
    decode_bind_schema,
    decode_bind_stream,
    decode_global,
    decode_tail_records,
    encode_batch_header,
    encode_message,
    encode_tail_header,
    handle_of_channel,
    is_valid_name,
)

PROTOCOL_MD = Path(__file__).resolve().parents[2] / "PROTOCOL.md"

u64s = st.one_of(
    st.sampled_from([0, 1, 251, 252, 255, 256, 65535, 65536, 2**32 - 1, 2**32, U64_MAX]),
    st.integers(min_value=0, max_value=U64_MAX),
)
names = st.one_of(
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,30}", fullmatch=True),
    st.just("a" * MAX_NAME_BYTES),
    st.just("0._-" * 63 + "Z.-"),
)


def texts(limit: int) -> st.SearchStrategy[str]:
    """UTF-8 strings up to ``limit`` bytes, including one of exactly ``limit``."""
    exact = "é" * (limit // 2) + "x" * (limit % 2)
    return st.one_of(
        st.text(max_size=40).filter(lambda s: len(s.encode()) <= limit),
        st.just(exact),
    )


handle_types = st.sampled_from(list(HandleType))
error_codes = st.sampled_from(list(ErrorCode))

global_messages: st.SearchStrategy[GlobalMessage] = st.one_of(
    st.builds(
        Hello,
        version=u64s,
        producer_id=u64s,
        client_name=texts(MAX_NAME_BYTES),
        token=st.one_of(st.binary(max_size=40), st.just(b"\xff" * MAX_TOKEN_BYTES)),
        flags=st.sampled_from([HelloFlags.NONE, HelloFlags.OPTIMISTIC]),
    ),
    st.builds(
        Welcome,
        version=u64s,
        server_name=texts(MAX_NAME_BYTES),
        max_message_size=u64s,
        idle_timeout_ms=u64s,
    ),
    st.builds(Goodbye, code=error_codes, text=texts(MAX_TEXT_BYTES)),
    st.builds(
        Error,
        code=error_codes.filter(lambda c: c is not ErrorCode.NONE),
        scope=st.none() | st.builds(HandleRef, handle_type=handle_types, handle=u64s),
        text=texts(MAX_TEXT_BYTES),
    ),
    st.builds(Ping, nonce=u64s),
    st.builds(Pong, nonce=u64s),
    st.builds(FreeHandle, handle_type=handle_types, handle=u64s, mine=st.booleans()),
    st.builds(Ack, handle=u64s, next_sequence=u64s, durable_position=u64s),
    st.builds(Release, stream=names, position=u64s),
    st.builds(
        Subscribe,
        stream=names,
        start=st.sampled_from([StartAt.NOW, StartAt.EARLIEST]) | u64s,
        sample_every=u64s.filter(lambda n: n >= 1),
    ),
    st.builds(Missed, handle=u64s, count=u64s),
    st.builds(
        Fetch,
        request_id=u64s,
        stream=names,
        start_position=u64s,
        end_position=u64s,
        max_bytes=u64s,
    ),
    st.builds(FetchDone, request_id=u64s, next_position=u64s, batches=u64s),
    st.builds(ListStreams, request_id=u64s),
    st.builds(
        StreamList,
        request_id=u64s,
        streams=st.lists(
            st.builds(
                StreamInfo,
                stream=names,
                start_position=u64s,
                durable_position=u64s,
                tail_position=u64s,
                term_length=u64s,
            ),
            max_size=4,
        ).map(tuple),
    ),
    st.builds(DescribeStreams, request_id=u64s),
    st.builds(
        StreamDescriptions,
        request_id=u64s,
        streams=st.lists(
            st.builds(
                StreamDescription,
                info=st.builds(
                    StreamInfo,
                    stream=names,
                    start_position=u64s,
                    durable_position=u64s,
                    tail_position=u64s,
                    term_length=u64s,
                ),
                released_at_us=st.integers(min_value=0, max_value=MAX_TIME_US),
            ),
            max_size=4,
        ).map(tuple),
    ),
)
channel_messages: st.SearchStrategy[ChannelMessage] = st.one_of(
    st.builds(BindStream, stream=names),
    st.builds(BindSchema, name=names, text=texts(MAX_SCHEMA_TEXT_BYTES)),
)


def decode_channel_message(message: ChannelMessage, payload: bytes) -> ChannelMessage:
    if isinstance(message, BindStream):
        return decode_bind_stream(payload)
    return decode_bind_schema(payload)


# --- round trips -------------------------------------------------------------


@given(message=global_messages)
def test_every_global_message_round_trips(message: GlobalMessage) -> None:
    encoded = encode_message(message)
    assert decode_global(encoded) == message
    assert decode_global(memoryview(encoded)) == message
    assert encoded[0] == MessageType[_type_name(message)]


def _type_name(message: GlobalMessage) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(message).__name__).upper()


@given(message=channel_messages)
def test_every_bind_message_round_trips(message: ChannelMessage) -> None:
    encoded = encode_message(message)
    assert decode_channel_message(message, encoded) == message


@given(message=global_messages)
def test_a_message_survives_the_frame_layer(message: GlobalMessage) -> None:
    frame = SendGlobal(payload=encode_message(message))
    (decoded,) = FrameDecoder(max_payload=1 << 16).feed(encode_frame(frame))
    assert isinstance(decoded, SendGlobal)
    assert decode_global(decoded.payload) == message


@given(
    first_sequence=st.integers(min_value=0, max_value=SEQUENCE_LIMIT - 2**32),
    block=st.binary(min_size=4, max_size=64),
)
def test_batches_split_without_copying(first_sequence: int, block: bytes) -> None:
    payload = bytearray(encode_batch_header(first_sequence) + block)
    got_sequence, count, records = decode_batch(payload)
    assert got_sequence == first_sequence
    assert count == int.from_bytes(block[:4], "little")
    assert records == block
    # The view is over the payload itself: the records were not copied.
    assert records.obj is payload
    payload[BATCH_HEADER_SIZE] ^= 0xFF
    assert records[0] == block[0] ^ 0xFF


@given(
    first_sequence=u64s,
    position=st.integers(min_value=0, max_value=U64_MAX - 1),
    length=st.integers(min_value=1, max_value=1 << 20),
    producer_id=u64s,
    timestamp_us=st.integers(min_value=-(2**63), max_value=2**63 - 1),
    block=st.binary(min_size=4, max_size=64),
)
def test_tail_records_split_without_copying(
    first_sequence: int,
    position: int,
    length: int,
    producer_id: int,
    timestamp_us: int,
    block: bytes,
) -> None:
    header = TailHeader(
        first_sequence, position, min(U64_MAX, position + length), producer_id, timestamp_us
    )
    payload = bytearray(encode_tail_header(header) + block)
    got_header, count, records = decode_tail_records(payload)
    assert got_header == header
    assert count == int.from_bytes(block[:4], "little")
    assert records == block
    assert records.obj is payload


def test_tail_records_whose_frame_ends_where_it_starts_are_malformed() -> None:
    good = encode_tail_header(TailHeader(0, 64, 128, 1, 0)) + bytes(8)
    bad = bytearray(good)
    bad[16:24] = (64).to_bytes(8, "little")  # end_position = position
    assert decode_tail_records(good)[0].end_position == 128
    with pytest.raises(MessageError, match="not after"):
        decode_tail_records(bad)
    with pytest.raises(ValueError):
        encode_tail_header(TailHeader(0, 64, 64, 1, 0))


@pytest.mark.parametrize(
    ("first_sequence", "count"),
    [
        (SEQUENCE_LIMIT - 1, 2),
        (SEQUENCE_LIMIT, 1),
        (U64_MAX, 0),
        (U64_MAX, 1),
        (U64_MAX, 2**32 - 1),
        (SEQUENCE_LIMIT - 2**32 + 2, 2**32 - 1),
    ],
)
def test_a_batch_whose_sequences_reach_past_the_limit_is_malformed(
    first_sequence: int, count: int
) -> None:
    # first_sequence + count would not be a sequence Spark can read, nor an
    # Ack's next_sequence: refused where the two wire values are added.
    payload = encode_batch_header(first_sequence) + count.to_bytes(4, "little") + bytes(4)
    with pytest.raises(MessageError, match="past the last sequence"):
        decode_batch(payload)


@pytest.mark.parametrize(
    ("first_sequence", "count"), [(0, 0), (SEQUENCE_LIMIT - 1, 1), (SEQUENCE_LIMIT, 0)]
)
def test_a_batch_ending_at_the_limit_decodes(first_sequence: int, count: int) -> None:
    payload = encode_batch_header(first_sequence) + count.to_bytes(4, "little") + bytes(4)
    assert decode_batch(payload)[:2] == (first_sequence, count)


@pytest.mark.parametrize("size", range(BATCH_HEADER_SIZE + 4))
def test_a_batch_without_room_for_a_record_count_is_malformed(size: int) -> None:
    with pytest.raises(MessageError):
        decode_batch(bytes(size))


@pytest.mark.parametrize("size", range(TAIL_HEADER_SIZE + 4))
def test_tail_records_without_room_for_a_record_count_are_malformed(size: int) -> None:
    with pytest.raises(MessageError):
        decode_tail_records(bytes(size))


def test_data_headers_refuse_integers_outside_u64() -> None:
    for bad in (-1, U64_MAX + 1):
        with pytest.raises(ValueError):
            encode_batch_header(bad)
        with pytest.raises(ValueError):
            encode_tail_header(TailHeader(0, bad, U64_MAX, 0, 0))
        with pytest.raises(ValueError):
            encode_tail_header(TailHeader(bad, 0, 64, 0, 0))
        with pytest.raises(ValueError):
            encode_tail_header(TailHeader(0, 0, 64, bad, 0))
    for bad in (-(2**63) - 1, 2**63):
        with pytest.raises(ValueError):
            encode_tail_header(TailHeader(0, 0, 64, 0, bad))


# --- channels ----------------------------------------------------------------


def test_channel_layout() -> None:
    assert (STREAM_CHANNEL, SCHEMA_CHANNEL, FIRST_DATA_CHANNEL) == (0, 1, 2)
    assert STREAM_CHANNEL == HandleType.STREAM and SCHEMA_CHANNEL == HandleType.SCHEMA
    assert handle_of_channel(0) is None
    assert handle_of_channel(1) is None
    assert handle_of_channel(2) == 0
    assert data_channel(U64_MAX - 2) == U64_MAX
    with pytest.raises(ValueError):
        data_channel(U64_MAX - 1)
    with pytest.raises(ValueError):
        data_channel(-1)


@given(handle=st.integers(min_value=0, max_value=U64_MAX - 2))
def test_data_channels_and_handles_correspond(handle: int) -> None:
    assert handle_of_channel(data_channel(handle)) == handle


@pytest.mark.parametrize(
    ("name", "valid"),
    [
        ("clicks", True),
        ("a", True),
        ("9.b_c-d", True),
        ("a" * 255, True),
        ("a" * 256, False),
        ("", False),
        (".hidden", False),
        ("-x", False),
        ("with space", False),
        ("slash/no", False),
        ("line\n", False),
        ("ünicode", False),
    ],
)
def test_stream_names(name: str, valid: bool) -> None:
    assert is_valid_name(name) is valid
    if valid:
        assert decode_bind_stream(encode_message(BindStream(stream=name))).stream == name
    else:
        with pytest.raises(ValueError):
            encode_message(BindStream(stream=name))
        raw = name.encode()
        with pytest.raises(MessageError):
            decode_bind_stream(encode_standalone(len(raw)) + raw)


# --- limits on encode (local misuse) -----------------------------------------


@pytest.mark.parametrize(
    "message",
    [
        Hello(producer_id=1, client_name="x" * (MAX_NAME_BYTES + 1)),
        Hello(producer_id=1, client_name="p", token=b"t" * (MAX_TOKEN_BYTES + 1)),
        Hello(producer_id=-1, client_name="p"),
        Hello(producer_id=1, client_name="p", flags=HelloFlags(0x80)),
        Welcome(server_name="é" * 128, max_message_size=1, idle_timeout_ms=1),
        Goodbye(code=ErrorCode.NONE, text="x" * (MAX_TEXT_BYTES + 1)),
        Error(code=ErrorCode.NONE),
        Error(code=ErrorCode.INTERNAL, scope=HandleRef(handle_type=HandleType.STREAM, handle=-2)),
        Ping(nonce=U64_MAX + 1),
        Release(stream="bad name", position=0),
        Subscribe(stream="s", start=StartAt.NOW, sample_every=0),
        Subscribe(stream="s", start=-1),
        Fetch(request_id=0, stream="s", start_position=0, end_position=U64_MAX + 1, max_bytes=0),
        BindSchema(name="s", text="x" * (MAX_SCHEMA_TEXT_BYTES + 1)),
        StreamDescriptions(
            request_id=1,
            streams=(
                StreamDescription(
                    info=StreamInfo(
                        stream="s",
                        start_position=0,
                        durable_position=0,
                        tail_position=0,
                        term_length=1,
                    ),
                    released_at_us=MAX_TIME_US + 1,
                ),
            ),
        ),
        StreamDescriptions(
            request_id=1,
            streams=(
                StreamDescription(
                    info=StreamInfo(
                        stream="s",
                        start_position=0,
                        durable_position=0,
                        tail_position=0,
                        term_length=1,
                    ),
                    released_at_us=-1,
                ),
            ),
        ),
    ],
)
def test_messages_the_peer_would_refuse_are_not_encoded(
    message: GlobalMessage | ChannelMessage,
) -> None:
    with pytest.raises(ValueError):
        encode_message(message)


# --- hostile payloads ----------------------------------------------------------


def c64(value: int) -> str:
    return encode_standalone(value).hex()


@pytest.mark.parametrize(
    "payload",
    [
        "",
        "00",  # type 0 is never assigned
        "07",
        "ff",
        "02",  # Welcome with nothing after the type
        "01 01 01 00 00 02",  # Hello with an undefined flag
        "01 01 01 02 c3 28 00 00",  # client name that is not UTF-8
        "01 01 01 ff ff ff ff ff ff ff ff ff",  # client name of 2^64-1 bytes
        "01 01 01 00 fd 04 01" + "00" * 1025 + "00",  # token of 1025 bytes
        "03 7f 00",  # Goodbye with code 127, unknown (19 became STORAGE_FULL)
        "04 00 00 00",  # Error with code NONE
        "04 01 02 00",  # Error with scope kind 2
        "04 01 01 02 00 00",  # Error scoped to handle type 2
        "05 01 00 00",  # Ping with half a nonce
        "05" + "00" * 9,  # Ping with a trailing byte
        "10 00 00 02",  # FreeHandle with mine = 2
        "10 02 00 01",  # FreeHandle of handle type 2
        "11 00 00",  # Ack without durable_position
        "12 00 00",  # Release of the empty stream name
        "12 01 2e 00",  # Release of "."
        "20 01 61 03 01",  # Subscribe with start kind 3
        "20 01 61 00 00",  # Subscribe with sample_every 0
        "23 00 00 00 00",  # FetchDone with a trailing byte
        "24",  # ListStreams without a request id
        "25 00 01",  # StreamList that promises a stream and holds none
        "25 00 ff ff ff ff ff ff ff ff ff",  # StreamList of 2^64-1 streams
        "25 00 01 01 2e 00 00 00 00",  # StreamList entry named "."
        "26",  # DescribeStreams without a request id
        "28 00 00",  # DescribeStreams with a trailing byte
        "29 00 01",  # StreamDescriptions that promises a stream and holds none
        "29 00 ff ff ff ff ff ff ff ff ff",  # StreamDescriptions of 2^64-1 streams
        "29 00 01 01 61 00 00 00 00",  # an entry cut before its release time
        "29 00 01 01 61 00 00 00 00 ff 03 84 44 0c cc 73 5f",  # a release time cut short
        "29 00 01 01 61 00 00 00 00 ff 03 84 44 0c cc 73 60 00",  # after the year 9999
        "29 00 01 01 61 00 00 00 00 ff ff ff ff ff ff ff ff ff",  # a release time of 2^64-1
        "29 00 02 01 61 00 00 00 00 00",  # two streams promised, one given
        "04 01 00 fd 04 01" + "61" * 1025,  # Error text of 1025 bytes
    ],
)
def test_malformed_global_messages(payload: str) -> None:
    with pytest.raises(MessageError) as raised:
        decode_global(bytes.fromhex(payload))
    assert raised.value.code is ErrorCode.MALFORMED_MESSAGE


def test_the_latest_release_time_is_the_last_microsecond_of_the_year_9999() -> None:
    entry = "01 61 00 00 00 00" + " " + c64(MAX_TIME_US)
    decoded = decode_global(bytes.fromhex("29 00 01 " + entry))
    assert isinstance(decoded, StreamDescriptions)
    assert decoded.streams[0].released_at_us == MAX_TIME_US
    with pytest.raises(MessageError, match="after the year 9999"):
        decode_global(bytes.fromhex("29 00 01 01 61 00 00 00 00 " + c64(MAX_TIME_US + 1)))


def test_a_huge_declared_length_is_refused_without_the_bytes() -> None:
    payload = bytes.fromhex("02 01") + encode_standalone(U64_MAX)
    with pytest.raises(MessageError, match="at most 255"):
        decode_global(payload)


@given(message=global_messages | channel_messages)
def test_every_strict_prefix_and_any_trailing_byte_is_malformed(
    message: GlobalMessage | ChannelMessage,
) -> None:
    encoded = encode_message(message)
    decode = _decoder_for(message)
    for cut in range(len(encoded)):
        with pytest.raises(MessageError):
            decode(encoded[:cut])
    with pytest.raises(MessageError):
        decode(encoded + b"\x00")


def _decoder_for(message: GlobalMessage | ChannelMessage) -> Callable[[bytes], object]:
    if isinstance(message, BindStream):
        return decode_bind_stream
    if isinstance(message, BindSchema):
        return decode_bind_schema
    return decode_global


@given(payload=st.binary(max_size=64))
def test_random_payloads_only_ever_raise_message_error(payload: bytes) -> None:
    for decode in (decode_global, decode_bind_stream, decode_bind_schema):
        try:
            decoded: Any = decode(payload)
        except MessageError:
            continue
        # Whatever decodes is a valid message: it encodes again, and that
        # encoding decodes to the same value (the input may be non-minimal).
        assert decode(encode_message(decoded)) == decoded


@given(message=global_messages | channel_messages, data=st.data())
def test_mutated_messages_only_ever_raise_message_error(
    message: GlobalMessage | ChannelMessage, data: st.DataObject
) -> None:
    encoded = bytearray(encode_message(message))
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.integers(0, len(encoded)))
        action = data.draw(st.sampled_from(["set", "insert", "delete"]))
        if action == "set" and where < len(encoded):
            encoded[where] = data.draw(st.integers(0, 255))
        elif action == "insert":
            encoded[where:where] = bytes([data.draw(st.integers(0, 255))])
        elif where < len(encoded):
            del encoded[where]
    decode = _decoder_for(message)
    try:
        decoded: Any = decode(bytes(encoded))
    except MessageError:
        return
    assert decode(encode_message(decoded)) == decoded


def test_the_public_names_are_the_exported_ones() -> None:
    for name in messages_module.__all__:
        assert hasattr(messages_module, name), name
    public = {n for n in vars(messages_module) if not n.startswith("_")}
    imported = {
        "annotations",
        "dataclass",
        "re",
        "struct",
        "Enum",
        "IntEnum",
        "IntFlag",
        "NamedTuple",
        "U64_MAX",
        "Buffer",
        "ErrorCode",
        "MessageError",
        "decode_standalone",
        "encode_standalone_into",
        # The layout machinery the declarations are written in (layout.py).
        "Any",
        "Callable",
        "Mapping",
        *layout_module.__all__,
    }
    assert public - imported == set(messages_module.__all__)


# --- PROTOCOL.md ---------------------------------------------------------------

# A table row of a worked example: | kind | ... | `value` | `hex` |
_ROW = re.compile(r"^\|\s*([a-z0-9 -]+?)\s*\|(?:.*\|)?\s*`([^`]+)`\s*\|\s*`([0-9a-f ]*)`\s*\|\s*$")

_NAMES: dict[str, Any] = {
    **{cls.__name__: cls for cls in (*frames_module.SERVER_FRAMES, *frames_module.CLIENT_FRAMES)},
    **{name: getattr(messages_module, name) for name in messages_module.__all__},
    "ErrorCode": ErrorCode,
    "U64_MAX": U64_MAX,
}


def _evaluate(node: ast.expr) -> Any:
    """Evaluate the small subset of Python the examples use, and nothing else."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Tuple):
        return tuple(_evaluate(e) for e in node.elts)
    if isinstance(node, ast.Name):
        return _NAMES[node.id]
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return getattr(_NAMES[node.value.id], node.attr)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _evaluate(node.left) + _evaluate(node.right)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        args = [_evaluate(a) for a in node.args]
        kwargs = {k.arg: _evaluate(k.value) for k in node.keywords if k.arg is not None}
        return _NAMES[node.func.id](*args, **kwargs)
    raise AssertionError(f"unsupported syntax in PROTOCOL.md: {ast.dump(node)}")


def doc_examples() -> list[tuple[str, str, bytes]]:
    rows = []
    for line in PROTOCOL_MD.read_text(encoding="utf-8").splitlines():
        match = _ROW.match(line)
        if match and match.group(1) not in {"kind", "code", "type"}:
            kind, value, hex_bytes = match.groups()
            rows.append((kind, value, bytes.fromhex(hex_bytes)))
    return rows


EXAMPLES = doc_examples()


def test_the_protocol_document_has_examples_of_everything() -> None:
    kinds = {kind for kind, _, _ in EXAMPLES}
    assert kinds == {
        "c64",
        "c64 accepted",
        "frame",
        "frame accepted",
        "global",
        "global accepted",
        "bind-stream",
        "bind-schema",
        "batch",
        "tail",
    }
    frame_types = {
        type(_evaluate(ast.parse(v, mode="eval").body)).__name__
        for k, v, _ in EXAMPLES
        if k == "frame"
    }
    assert frame_types == {
        cls.__name__ for cls in (*frames_module.SERVER_FRAMES, *frames_module.CLIENT_FRAMES)
    }
    message_types = {encoded[0] for k, _, encoded in EXAMPLES if k == "global"} | {
        FrameDecoder(max_payload=1 << 16).feed(encoded)[0].payload[0]  # type: ignore[union-attr]
        for k, v, encoded in EXAMPLES
        if k == "frame" and v.startswith("SendGlobal(payload=encode")
    }
    assert message_types == {int(t) for t in MessageType}


@pytest.mark.parametrize(("kind", "value", "encoded"), EXAMPLES, ids=lambda x: str(x)[:40])
def test_protocol_document_example(kind: str, value: str, encoded: bytes) -> None:
    """Each example in PROTOCOL.md encodes to its bytes, and its bytes decode to it."""
    expected = _evaluate(ast.parse(value, mode="eval").body)
    minimal = not kind.endswith("accepted")
    if kind.startswith("c64"):
        assert decode_standalone(encoded, 0) == (expected, len(encoded))
        if minimal:
            assert encode_standalone(expected) == encoded
    elif kind.startswith("frame"):
        assert FrameDecoder(max_payload=1 << 16).feed(encoded) == [expected]
        if minimal:
            assert encode_frame(expected) == encoded
    elif kind.startswith("global"):
        assert decode_global(encoded) == expected
        if minimal:
            assert encode_message(expected) == encoded
    elif kind == "bind-stream":
        assert decode_bind_stream(encoded) == expected
        assert encode_message(expected) == encoded
        assert isinstance(expected, BindStream)
    elif kind == "bind-schema":
        assert decode_bind_schema(encoded) == expected
        assert encode_message(expected) == encoded
    elif kind == "batch":
        first_sequence, count, records = expected
        assert decode_batch(encoded) == (first_sequence, count, memoryview(records))
        assert encode_batch_header(first_sequence) + records == encoded
    elif kind == "tail":
        header, count, records = expected
        got = decode_tail_records(encoded)
        assert got == (header, count, memoryview(records))
        assert encode_tail_header(header) + records == encoded
    else:
        raise AssertionError(f"unknown example kind {kind!r}")


def test_the_lifecycle_transcript_decodes_as_one_stream() -> None:
    """The lifecycle rows, concatenated, are a valid stream of frames."""
    text = PROTOCOL_MD.read_text(encoding="utf-8")
    section = text.split("## Connection lifecycle", 1)[1].split("## Worked examples", 1)[0]
    stream = b""
    expected = []
    for line in section.splitlines():
        match = _ROW.match(line)
        if match:
            stream += bytes.fromhex(match.group(3))
            expected.append(_evaluate(ast.parse(match.group(2), mode="eval").body))
    assert len(expected) >= 8
    assert FrameDecoder(max_payload=1 << 16).feed(stream) == expected
    binds = [f for f in expected if isinstance(f, SendChannel) and f.channel == STREAM_CHANNEL]
    assert [decode_bind_stream(f.payload).stream for f in binds] == ["clicks"]
