"""headgate's own messages, carried inside LCMUX SendGlobal and SendChannel frames.

LCMUX moves opaque payloads; this module gives them meaning. There are two
families:

* **Global messages** travel in ``SendGlobal`` frames. They are never buffered
  and need no guarantees, so they are the control plane: the handshake, acks,
  errors, freeing handles, keep-alives. Each begins with one byte naming its
  type (:class:`MessageType`).
* **Channel messages** travel in ``SendChannel`` frames, and the channel names
  their type, so they carry no type byte: channel 0 binds stream names,
  channel 1 binds schemas, and channel ``2 + h`` carries the data of stream
  handle ``h``. Data messages are the bulk of the traffic and each of their
  bytes costs guarantees, which is why their header is a fixed 8 (or 16)
  bytes that a receiver reads with one ``struct`` call.

Integers are standalone compact U64s (big-endian tails, as in LCMUX) except
where the value is usually large or random, where a fixed 8-byte little-endian
field is shorter on average and cheaper to read: a ping nonce, and the sequence
and position in data headers (little-endian like the records block after them).
Strings are a standalone compact U64 byte length followed by UTF-8; every
string and byte field has a maximum length, checked before anything is copied.

Encoding a value that the peer would reject raises ``ValueError`` (the bug is
local); decoding anything malformed raises :class:`MessageError` (the peer is
at fault). Every byte is drawn in ``PROTOCOL.md``.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from enum import Enum, IntEnum, IntFlag
from typing import NamedTuple

from headgate.protocol.c64 import (
    U64_MAX,
    Buffer,
    decode_standalone,
    encode_standalone_into,
)
from headgate.protocol.errors import ErrorCode, MessageError

__all__ = [
    "BATCH_HEADER_SIZE",
    "DEFAULT_CONSUMER",
    "FIRST_DATA_CHANNEL",
    "MAX_COUNTED_POSITIONS",
    "MAX_METADATA_GATEWAYS",
    "MAX_METADATA_PARTITIONS",
    "MAX_NAME_BYTES",
    "MAX_SCHEMA_TEXT_BYTES",
    "MAX_SECRET_BYTES",
    "MAX_TEXT_BYTES",
    "MAX_TIME_US",
    "MAX_TOKEN_BYTES",
    "PRODUCER_ID_LIMIT",
    "PROTOCOL_VERSION",
    "SCHEMA_CHANNEL",
    "SEQUENCE_LIMIT",
    "STREAM_CHANNEL",
    "TAIL_HEADER_SIZE",
    "Ack",
    "BindSchema",
    "BindStream",
    "ChannelMessage",
    "ClusterMetadata",
    "ConsumerInfo",
    "ConsumerList",
    "ConsumerPosition",
    "CountRecords",
    "DeclareConsumer",
    "DeleteConsumer",
    "DescribeStreams",
    "Error",
    "Fetch",
    "FetchDone",
    "FreeHandle",
    "GlobalMessage",
    "Goodbye",
    "HandleRef",
    "HandleType",
    "Hello",
    "HelloFlags",
    "ListConsumers",
    "ListStreams",
    "MessageType",
    "Metadata",
    "MetadataGateway",
    "MetadataStream",
    "Missed",
    "Ping",
    "Pong",
    "RecordCounts",
    "Release",
    "ResetConsumer",
    "ResetTime",
    "ResetTo",
    "StartAt",
    "StreamDescription",
    "StreamDescriptions",
    "StreamInfo",
    "StreamList",
    "Subscribe",
    "TailHeader",
    "Welcome",
    "data_channel",
    "decode_batch",
    "decode_bind_schema",
    "decode_bind_stream",
    "decode_global",
    "decode_tail_records",
    "encode_batch_header",
    "encode_message",
    "encode_tail_header",
    "handle_of_channel",
    "is_valid_name",
]

#: The protocol version that Hello and Welcome carry.
PROTOCOL_VERSION = 1

#: Channel on which stream names are bound (handle type STREAM).
STREAM_CHANNEL = 0
#: Channel on which schemas are bound (handle type SCHEMA).
SCHEMA_CHANNEL = 1
#: Channel of stream handle 0; stream handle ``h`` uses ``FIRST_DATA_CHANNEL + h``.
FIRST_DATA_CHANNEL = 2

#: Longest stream name, schema name, client name or server name, in bytes.
MAX_NAME_BYTES = 255
#: Longest error or goodbye text, in bytes of UTF-8.
MAX_TEXT_BYTES = 1024
#: Longest authentication token, in bytes.
MAX_TOKEN_BYTES = 1024
#: The largest producer secret (Hello, Welcome), in bytes.
MAX_SECRET_BYTES = 64
#: Longest schema text (DDL), in bytes of UTF-8.
MAX_SCHEMA_TEXT_BYTES = 65536

#: The latest wall-clock time a message may name, in microseconds since the
#: Unix epoch (UTC): the last microsecond of the year 9999, the end of what a
#: calendar date (and Python's datetime) can show. A time beyond it is malformed.
MAX_TIME_US = 253_402_300_799_999_999

#: Every record's sequence number is below this: Spark reads sequences as a
#: signed 64-bit long, and ``first_sequence + count`` (the next sequence, which
#: an Ack carries) must stay a u64. A Batch reaching past it is malformed.
SEQUENCE_LIMIT = 1 << 63

#: Every producer id is below this, for the same reason (Spark's signed long);
#: a Hello with a larger one is refused with BAD_HELLO.
PRODUCER_ID_LIMIT = 1 << 63

#: Bytes before the records block in a Batch: first_sequence (u64 LE).
BATCH_HEADER_SIZE = 8
#: Bytes before the records block in TailRecords: the five fields of a
#: :class:`TailHeader` (four u64 LE, then the timestamp as an i64 LE).
TAIL_HEADER_SIZE = 40

# The records block begins with its record count, a u32 LE (records.py owns
# the rest of the block).
_RECORD_COUNT_SIZE = 4

_U64LE = struct.Struct("<Q")
_BATCH_HEAD = struct.Struct("<QI")
_TAIL_HEAD = struct.Struct("<QQQQqI")
_TAIL_PREFIX = struct.Struct("<QQQQq")

#: The consumer a Release or Fetch names when it names none (every old
#: client): an old data directory's one release position is this consumer's.
DEFAULT_CONSUMER = "default"

# Stream and schema names: ASCII, so their UTF-8 length is their length.
_NAME = re.compile(rb"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")


class MessageType(IntEnum):
    """The first byte of every global message."""

    # 0 is left unassigned so that a zeroed buffer never parses as a message.
    HELLO = 0x01
    WELCOME = 0x02
    GOODBYE = 0x03
    ERROR = 0x04
    PING = 0x05
    PONG = 0x06
    FREE_HANDLE = 0x10
    ACK = 0x11
    RELEASE = 0x12
    #: Release naming its consumer (Release is the default consumer's).
    CONSUMER_RELEASE = 0x13
    SUBSCRIBE = 0x20
    MISSED = 0x21
    FETCH = 0x22
    FETCH_DONE = 0x23
    LIST_STREAMS = 0x24
    STREAM_LIST = 0x25
    DESCRIBE_STREAMS = 0x28
    STREAM_DESCRIPTIONS = 0x29
    #: Fetch naming the consumer that reads.
    CONSUMER_FETCH = 0x26
    #: FetchDone answering a CONSUMER_FETCH: it adds the bytes skipped.
    CONSUMER_FETCH_DONE = 0x27
    DECLARE_CONSUMER = 0x30
    CONSUMER_POSITION = 0x31
    LIST_CONSUMERS = 0x32
    CONSUMER_LIST = 0x33
    RESET_CONSUMER = 0x34
    DELETE_CONSUMER = 0x35
    #: Record counts at positions of a stream (for a reader's lag in records).
    COUNT_RECORDS = 0x36
    RECORD_COUNTS = 0x37
    # --- a fleet of gateways (0x40 to 0x47) ---
    #: What cluster does the gateway run under? (any peer)
    METADATA = 0x40
    #: The answer: the cluster's gateways and partition assignment.
    CLUSTER_METADATA = 0x41


class HandleType(IntEnum):
    """The kinds of data handle; each is bound on the channel of the same number."""

    #: A stream name, bound by BindStream on channel 0.
    STREAM = 0
    #: A schema, bound by BindSchema on channel 1.
    SCHEMA = 1


class HelloFlags(IntFlag):
    """Options a producer asks for in Hello; undefined bits must be zero."""

    NONE = 0
    #: The producer may send beyond its guarantees (the seed's optimistic mode),
    #: so the gateway must be ready to drop and announce.
    OPTIMISTIC = 0x01


# A plain int: IntFlag's own complement keeps only defined bits, which would
# hide exactly the undefined ones this mask is for.
_KNOWN_HELLO_FLAGS = int(HelloFlags.OPTIMISTIC)


class StartAt(Enum):
    """Where a subscription starts when no explicit position is given."""

    #: At the end of the log: only batches appended from now on.
    NOW = "now"
    #: At the oldest position the log still holds.
    EARLIEST = "earliest"


# --- global messages -------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello:
    """The producer's opening message: who it is and what it wants."""

    #: Protocol version the producer speaks.
    version: int = PROTOCOL_VERSION
    #: Identity of the producer; one that resumes after a crash reuses its id,
    #: so the gateway can recognise sequences it already stored.
    producer_id: int
    #: A human-readable name for logs and dashboards (UTF-8, at most 255 bytes).
    client_name: str
    #: Authentication token, opaque to the protocol; empty when none is used.
    token: bytes = b""
    #: Options the producer asks for.
    flags: HelloFlags = HelloFlags.NONE
    #: The secret that proves this peer owns ``producer_id`` (from an earlier
    #: Welcome's ``producer_secret``); empty on first use, or with a token.
    secret: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True)
class Welcome:
    """The gateway's answer to Hello: the session is open, with these terms."""

    #: Protocol version the gateway speaks on this connection.
    version: int = PROTOCOL_VERSION
    #: A human-readable name of the gateway (UTF-8, at most 255 bytes).
    server_name: str
    #: The largest frame payload the gateway accepts, in bytes.
    max_message_size: int
    #: After this many milliseconds without receiving a complete frame, either
    #: side may close the connection; a peer with nothing to say sends Ping
    #: well before.
    idle_timeout_ms: int
    #: A writer that holds guarantees the gateway pleaded for must absolve
    #: within this many milliseconds, or the connection is closed (0: never).
    plead_deadline_ms: int = 0
    #: The secret that binds the Hello's producer id to this peer, to present
    #: in Hello when it resumes; empty where a token binds it instead.
    producer_secret: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True)
class Goodbye:
    """A graceful close: the sender sends nothing after it."""

    #: Why: ``ErrorCode.NONE`` for a normal close, else the reason.
    code: ErrorCode
    #: Details for humans (UTF-8, at most 1024 bytes).
    text: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class HandleRef:
    """A data handle named by its type and number, as the scope of an Error."""

    #: Which kind of handle.
    handle_type: HandleType
    #: The handle's number, as bound by the peer that bound it.
    handle: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Error:
    """A violation or refusal; with no scope the connection closes after it."""

    #: What went wrong (never ``ErrorCode.NONE``).
    code: ErrorCode
    #: The handle the error is confined to (a refused stream), or ``None`` when
    #: it concerns the whole connection.
    scope: HandleRef | None = None
    #: Details for humans (UTF-8, at most 1024 bytes).
    text: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Ping:
    """A keep-alive that asks for a Pong carrying the same nonce."""

    #: Any u64; echoed back unchanged.
    nonce: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Pong:
    """The answer to a Ping."""

    #: The nonce of the Ping being answered.
    nonce: int


@dataclass(frozen=True, slots=True, kw_only=True)
class FreeHandle:
    """A proposal (or confirmation) to free a data handle, as in the seed."""

    #: Which kind of handle.
    handle_type: HandleType
    #: The handle's number.
    handle: int
    #: True if the sender is the peer that bound the handle.
    mine: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Ack:
    """Cumulative durability of one producer's batches on one stream."""

    #: The stream handle, as bound by the producer.
    handle: int
    #: Every batch of this producer on this stream whose first_sequence is
    #: below this is durable.
    next_sequence: int
    #: The stream log's durable end position when the ack was made.
    durable_position: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Release:
    """A consumer has committed everything of a stream before ``position``.

    The gateway frees the log up to the lowest position among the stream's
    blocking consumers. A Release of :data:`DEFAULT_CONSUMER` is type
    ``RELEASE``, the bytes every old client sends (and an old gateway
    reads); one naming another consumer is type ``CONSUMER_RELEASE``, with
    the name after the position.
    """

    #: The stream name.
    stream: str
    #: Everything before this position is committed by the consumer.
    position: int
    #: The consumer's name (same rules as a stream name).
    consumer: str = DEFAULT_CONSUMER


@dataclass(frozen=True, slots=True, kw_only=True)
class Subscribe:
    """A request for a lossy live tail of a stream."""

    #: The stream name.
    stream: str
    #: ``StartAt.NOW``, ``StartAt.EARLIEST`` or an explicit log position.
    start: StartAt | int
    #: Deliver one batch in every ``sample_every`` (1 delivers all).
    sample_every: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Missed:
    """The gateway skipped batches of a tail because the subscriber was slow."""

    #: The stream handle, as bound by the gateway for this subscriber.
    handle: int
    #: How many batches were skipped since the previous TailRecords.
    count: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Fetch:
    """A request to read a stretch of a stream's log through the gateway."""

    #: Chosen by the reader; FetchDone echoes it.
    request_id: int
    #: The stream name.
    stream: str
    #: The first log position to read.
    start_position: int
    #: Stop before this position (``U64_MAX``: the end as of the request).
    end_position: int
    #: Stop after the batch that reaches this many bytes of records.
    max_bytes: int
    #: The consumer reading, or None (an old client: no consumer's rules).
    #: Named (message type ``CONSUMER_FETCH``), a start behind what the log
    #: holds follows the consumer's ``on_data_loss`` (an error, or skipping
    #: ahead, told in FetchDone).
    consumer: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchDone:
    """The gateway has sent every batch it will send for a Fetch."""

    #: The request_id of the Fetch.
    request_id: int
    #: Where a follow-up Fetch should start.
    next_position: int
    #: How many TailRecords this Fetch produced; because FetchDone is global it
    #: can overtake them, and the reader waits until it has seen this many.
    batches: int
    #: Bytes of log the consumer skipped because they were freed before it
    #: read them (``on_data_loss = "skip"``); present (0 or more, message
    #: type ``CONSUMER_FETCH_DONE``) exactly when the Fetch named a consumer,
    #: absent (None) otherwise.
    skipped_bytes: int | None = None
    #: Records among the skipped bytes, where the gateway could count them
    #: (None: not counted; in CONSUMER_FETCH_DONE only).
    skipped_records: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ListStreams:
    """A request for the gateway's streams and their positions (a Spark driver plans with it)."""

    #: Chosen by the reader; StreamList echoes it.
    request_id: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamInfo:
    """One stream's positions, as the gateway saw them when it answered."""

    #: The stream name.
    stream: str
    #: The oldest position the log retains (its release position).
    start_position: int
    #: Every frame before this position is on disk: what a Spark query reads up to.
    durable_position: int
    #: Where the next frame goes; frames between durable and tail are not fsynced yet.
    tail_position: int
    #: Bytes per term of the log; every multiple of it is a frame boundary.
    term_length: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamList:
    """The gateway's answer to ListStreams: every stream it holds, sorted by name."""

    #: The request_id of the ListStreams.
    request_id: int
    #: One entry per stream.
    streams: tuple[StreamInfo, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class DescribeStreams:
    """ListStreams, asking also when each stream's consumer last released it.

    A request of its own rather than a field added to ListStreams: a message
    ends where its last field ends, so an added field would be malformed to
    every peer that predates it. A gateway that predates DescribeStreams
    refuses it as an unknown type; its readers use ListStreams.
    """

    #: Chosen by the reader; StreamDescriptions echoes it.
    request_id: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamDescription:
    """One stream's positions, and when its release position last moved."""

    #: The positions, as ListStreams gives them.
    info: StreamInfo
    #: When the gateway last took a Release that moved this stream's release
    #: position forward, in microseconds since the Unix epoch (UTC, the
    #: gateway's clock); 0 when none did since the gateway started.
    released_at_us: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamDescriptions:
    """The gateway's answer to DescribeStreams: every stream it holds, sorted by name."""

    #: The request_id of the DescribeStreams.
    request_id: int
    #: One entry per stream.
    streams: tuple[StreamDescription, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class DeclareConsumer:
    """Create a named consumer of a stream at run time (or find the one that exists).

    Needs the ``admin`` right or a ``consume`` pattern of the token that
    matches ``stream/consumer``. A new consumer starts at the oldest position
    the log holds; declaring an existing one with the same settings changes
    nothing (so a pipeline can declare on every start), with other settings
    it is refused.
    """

    #: Chosen by the client; ConsumerPosition echoes it.
    request_id: int
    #: The stream name.
    stream: str
    #: The consumer's name (same rules as a stream name).
    consumer: str
    #: Whether the consumer holds the log (and so the producers) back.
    blocking: bool = True
    #: Non-blocking only: a read behind the log fails (False) or skips ahead (True).
    skip_data_loss: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class ConsumerPosition:
    """The gateway's answer to DeclareConsumer, ResetConsumer and DeleteConsumer."""

    #: The request_id of the request.
    request_id: int
    #: The consumer's committed position now (where it reads on from); for
    #: DeleteConsumer, the position it had.
    position: int


class ResetTo(Enum):
    """Where ResetConsumer moves a consumer, besides an explicit position or time."""

    #: The oldest position the log holds.
    EARLIEST = "earliest"
    #: The durable end of the log: nothing left to read.
    LATEST = "latest"


@dataclass(frozen=True, slots=True, kw_only=True)
class ResetConsumer:
    """Move a consumer's committed position, back or forth (the ``admin`` right).

    ``to`` is :class:`ResetTo`, a log position (a frame boundary the log
    holds), or a :class:`ResetTime` (the first record stored at or after it).
    """

    #: Chosen by the client; ConsumerPosition echoes it.
    request_id: int
    #: The stream name.
    stream: str
    #: The consumer's name.
    consumer: str
    #: Where to.
    to: ResetTo | int | ResetTime


@dataclass(frozen=True, slots=True)
class ResetTime:
    """A time to reset a consumer to, in microseconds since the epoch (UTC)."""

    timestamp_us: int


@dataclass(frozen=True, slots=True, kw_only=True)
class DeleteConsumer:
    """Delete a consumer of a stream (the ``admin`` right); what it held is freed."""

    #: Chosen by the client; ConsumerPosition echoes it.
    request_id: int
    #: The stream name.
    stream: str
    #: The consumer's name.
    consumer: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ListConsumers:
    """A request for the consumers of one stream (the ``read`` right on it)."""

    #: Chosen by the client; ConsumerList echoes it.
    request_id: int
    #: The stream name.
    stream: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ConsumerInfo:
    """One consumer of a stream, as the gateway saw it when it answered."""

    #: The consumer's name.
    consumer: str
    #: Its committed position.
    position: int
    #: Durable log bytes after its position.
    lag_bytes: int
    #: Age of the oldest durable record it has not committed, in milliseconds.
    lag_ms: int
    #: Whether it holds the log (and so the producers) back.
    blocking: bool
    #: Whether its reads behind the log skip ahead (else they fail).
    skip_data_loss: bool = False
    #: Whether the idle rule made it non-blocking.
    detached: bool = False
    #: Whether it is idle and holding the producers (``idle_policy = "hold"``).
    idle: bool = False
    #: Records in the durable log after its position; None where the gateway
    #: cannot count them (a position in data freed before it was counted, or
    #: a gateway from before this field). On the wire: flag bit 4, then a c64.
    lag_records: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ConsumerList:
    """The gateway's answer to ListConsumers: the stream's consumers, sorted by name."""

    #: The request_id of the ListConsumers.
    request_id: int
    #: One entry per consumer.
    consumers: tuple[ConsumerInfo, ...]


#: Most positions one CountRecords may ask about.
MAX_COUNTED_POSITIONS = 64


@dataclass(frozen=True, slots=True, kw_only=True)
class CountRecords:
    """Asks for the record index's counts at positions of one stream (the ``read`` right).

    A reader that plans by position (the Spark source through a gateway)
    subtracts two counts of one epoch to get the records between them.
    """

    #: Chosen by the client; RecordCounts echoes it.
    request_id: int
    #: The stream name.
    stream: str
    #: Log positions (frame boundaries), at most :data:`MAX_COUNTED_POSITIONS`.
    positions: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordCounts:
    """The answer to CountRecords: per position, the records in the frames before it."""

    #: The request_id of the CountRecords.
    request_id: int
    #: The index's epoch: counts of different epochs are not comparable.
    epoch: int
    #: One per position asked, in order; None where the gateway cannot count
    #: (freed data with no count kept, or not a frame boundary).
    counts: tuple[int | None, ...]


# --- a fleet of gateways ---------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Metadata:
    """Asks a gateway for the cluster it runs under, so a client can start from one address."""

    #: Chosen by the client; ClusterMetadata echoes it.
    request_id: int


@dataclass(frozen=True, slots=True, kw_only=True)
class MetadataGateway:
    """One gateway of the cluster, as clients reach it."""

    #: Its name in the cluster file.
    name: str
    #: ``host:port`` (UTF-8, at most 255 bytes).
    address: str


@dataclass(frozen=True, slots=True, kw_only=True)
class MetadataStream:
    """One partitioned stream: which gateway holds each partition."""

    #: The stream's name.
    stream: str
    #: Per partition (by number), the index of its gateway in ``gateways``.
    holders: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterMetadata:
    """A gateway's answer to Metadata: the assignment it runs under.

    No TLS settings: they name files on each client's machine. A gateway
    without a cluster file answers with no gateways and no streams.
    """

    #: The request_id of the Metadata.
    request_id: int
    #: The answering gateway's name in the cluster (its server name without one).
    gateway: str
    #: The cluster's gateways, sorted by name.
    gateways: tuple[MetadataGateway, ...]
    #: The partitioned streams, sorted by name.
    streams: tuple[MetadataStream, ...]


#: Most gateways, and partitions per stream, a ClusterMetadata may carry
#: (what a cluster file may hold: headgate.cluster's limits).
MAX_METADATA_GATEWAYS = 255
MAX_METADATA_PARTITIONS = 1024


# --- channel messages ------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class BindStream:
    """Binds the least unassigned stream handle to a stream name (channel 0)."""

    #: The stream name: ``[A-Za-z0-9][A-Za-z0-9._-]{0,254}``.
    stream: str


@dataclass(frozen=True, slots=True, kw_only=True)
class BindSchema:
    """Binds the least unassigned schema handle to a schema (channel 1)."""

    #: The schema name, with the same rules as a stream name.
    name: str
    #: The schema as DDL text (UTF-8, at most 64 KiB).
    text: str


GlobalMessage = (
    Hello
    | Welcome
    | Goodbye
    | Error
    | Ping
    | Pong
    | FreeHandle
    | Ack
    | Release
    | Subscribe
    | Missed
    | Fetch
    | FetchDone
    | ListStreams
    | StreamList
    | DescribeStreams
    | StreamDescriptions
    | DeclareConsumer
    | ConsumerPosition
    | ListConsumers
    | ConsumerList
    | ResetConsumer
    | DeleteConsumer
    | CountRecords
    | RecordCounts
    | Metadata
    | ClusterMetadata
)
ChannelMessage = BindStream | BindSchema


# --- channels --------------------------------------------------------------


def data_channel(handle: int) -> int:
    """Return the channel that carries the data of stream handle ``handle``."""
    if not 0 <= handle <= U64_MAX - FIRST_DATA_CHANNEL:
        raise ValueError(f"stream handle {handle} has no data channel")
    return FIRST_DATA_CHANNEL + handle


def handle_of_channel(channel: int) -> int | None:
    """Return the stream handle whose data ``channel`` carries, or None for 0 and 1."""
    if channel < FIRST_DATA_CHANNEL:
        return None
    return channel - FIRST_DATA_CHANNEL


def is_valid_name(name: str) -> bool:
    """Tell whether ``name`` may name a stream or a schema."""
    return name.isascii() and _NAME.fullmatch(name.encode("ascii")) is not None


# --- data messages ---------------------------------------------------------


def _check_u64(value: int, what: str) -> None:
    if not 0 <= value <= U64_MAX:
        raise ValueError(f"{what} {value} is not an unsigned 64-bit integer")


def encode_batch_header(first_sequence: int) -> bytes:
    """Return the 8 bytes that precede a records block in a Batch."""
    _check_u64(first_sequence, "first_sequence")
    return _U64LE.pack(first_sequence)


def decode_batch(payload: Buffer) -> tuple[int, int, memoryview]:
    """Split a Batch into ``(first_sequence, record_count, records)``, copying nothing.

    ``records`` is a view of the whole records block, record count included,
    over ``payload``'s own memory, ready for the records module to parse.
    Raises ``MessageError`` when there is no room for a record count, or when
    the batch's records do not all have sequences below :data:`SEQUENCE_LIMIT`
    (checked here, where the two wire values are added, so that no sum beyond
    it reaches the log, an Ack or Spark).
    """
    if len(payload) < BATCH_HEADER_SIZE + _RECORD_COUNT_SIZE:
        raise MessageError(f"a batch needs at least 12 bytes, got {len(payload)}")
    first_sequence, count = _BATCH_HEAD.unpack_from(payload)
    if first_sequence + count > SEQUENCE_LIMIT:
        raise MessageError(
            f"a batch of {count} records at sequence {first_sequence} reaches past "
            f"the last sequence number, 2**63 - 1"
        )
    return first_sequence, count, memoryview(payload)[BATCH_HEADER_SIZE:]


class TailHeader(NamedTuple):
    """What TailRecords says about its batch besides the records: the log frame's header."""

    #: The sequence number of the batch's first record.
    first_sequence: int
    #: The log position of the frame holding the batch.
    position: int
    #: The position right after that frame: where the next frame (or padding) starts.
    end_position: int
    #: The producer that sent the batch.
    producer_id: int
    #: When the gateway appended the batch, in microseconds since the epoch (signed).
    timestamp_us: int


_I64_MIN = -(1 << 63)
_I64_MAX = (1 << 63) - 1


def encode_tail_header(header: TailHeader) -> bytes:
    """Return the 40 bytes that precede a records block in TailRecords."""
    _check_u64(header.first_sequence, "first_sequence")
    _check_u64(header.position, "position")
    _check_u64(header.end_position, "end_position")
    _check_u64(header.producer_id, "producer_id")
    if not _I64_MIN <= header.timestamp_us <= _I64_MAX:
        raise ValueError(f"timestamp_us {header.timestamp_us} is not a signed 64-bit integer")
    if header.end_position <= header.position:
        raise ValueError(f"end_position {header.end_position} is not after {header.position}")
    return _TAIL_PREFIX.pack(*header)


def decode_tail_records(payload: Buffer) -> tuple[TailHeader, int, memoryview]:
    """Split TailRecords into ``(header, record_count, records)``, copying nothing.

    As :func:`decode_batch`, with the whole log frame header in place of the
    sequence. Raises ``MessageError`` when there is no room for a record
    count, or when the frame would end where it starts.
    """
    if len(payload) < TAIL_HEADER_SIZE + _RECORD_COUNT_SIZE:
        raise MessageError(
            f"tail records need at least {TAIL_HEADER_SIZE + 4} bytes, got {len(payload)}"
        )
    first, position, end, producer, timestamp, count = _TAIL_HEAD.unpack_from(payload)
    if end <= position:
        raise MessageError(f"tail records: end position {end} is not after position {position}")
    header = TailHeader(first, position, end, producer, timestamp)
    return header, count, memoryview(payload)[TAIL_HEADER_SIZE:]


# --- encoding --------------------------------------------------------------


def _put_u64(out: bytearray, value: int, what: str) -> None:
    _check_u64(value, what)
    encode_standalone_into(value, out)


def _put_bytes(out: bytearray, data: bytes, limit: int, what: str) -> None:
    if len(data) > limit:
        raise ValueError(f"{what} is {len(data)} bytes; at most {limit} allowed")
    encode_standalone_into(len(data), out)
    out += data


def _put_text(out: bytearray, text: str, limit: int, what: str) -> None:
    _put_bytes(out, text.encode("utf-8"), limit, what)


def _put_name(out: bytearray, name: str, what: str) -> None:
    if not is_valid_name(name):
        raise ValueError(f"{what} {name!r} is not a valid name")
    _put_bytes(out, name.encode("ascii"), MAX_NAME_BYTES, what)


def _put_code(out: bytearray, code: ErrorCode) -> None:
    out.append(ErrorCode(code))


def encode_message(message: GlobalMessage | ChannelMessage) -> bytes:
    """Return the payload bytes of a global message or a bind message.

    Raises ``ValueError`` for a field the peer would reject (an integer out of
    range, a string too long, an invalid name, an Error with code NONE).
    """
    out = bytearray()
    match message:
        case BindStream():
            _put_name(out, message.stream, "stream name")
        case BindSchema():
            _put_name(out, message.name, "schema name")
            _put_text(out, message.text, MAX_SCHEMA_TEXT_BYTES, "schema text")
        case Hello():
            flags = int(message.flags)
            if flags & ~_KNOWN_HELLO_FLAGS:
                raise ValueError(f"undefined Hello flags {flags:#x}")
            out.append(MessageType.HELLO)
            _put_u64(out, message.version, "version")
            _put_u64(out, message.producer_id, "producer_id")
            _put_text(out, message.client_name, MAX_NAME_BYTES, "client name")
            _put_bytes(out, bytes(message.token), MAX_TOKEN_BYTES, "token")
            out.append(flags)
            _put_bytes(out, bytes(message.secret), MAX_SECRET_BYTES, "secret")
        case Welcome():
            out.append(MessageType.WELCOME)
            _put_u64(out, message.version, "version")
            _put_text(out, message.server_name, MAX_NAME_BYTES, "server name")
            _put_u64(out, message.max_message_size, "max_message_size")
            _put_u64(out, message.idle_timeout_ms, "idle_timeout_ms")
            _put_u64(out, message.plead_deadline_ms, "plead_deadline_ms")
            _put_bytes(out, bytes(message.producer_secret), MAX_SECRET_BYTES, "producer_secret")
        case Goodbye():
            out.append(MessageType.GOODBYE)
            _put_code(out, message.code)
            _put_text(out, message.text, MAX_TEXT_BYTES, "goodbye text")
        case Error():
            if message.code == ErrorCode.NONE:
                raise ValueError("an Error message needs a code other than NONE")
            out.append(MessageType.ERROR)
            _put_code(out, message.code)
            if message.scope is None:
                out.append(0)
            else:
                out.append(1)
                out.append(HandleType(message.scope.handle_type))
                _put_u64(out, message.scope.handle, "handle")
            _put_text(out, message.text, MAX_TEXT_BYTES, "error text")
        case Ping():
            _check_u64(message.nonce, "nonce")
            out.append(MessageType.PING)
            out += _U64LE.pack(message.nonce)
        case Pong():
            _check_u64(message.nonce, "nonce")
            out.append(MessageType.PONG)
            out += _U64LE.pack(message.nonce)
        case FreeHandle():
            out.append(MessageType.FREE_HANDLE)
            out.append(HandleType(message.handle_type))
            _put_u64(out, message.handle, "handle")
            out.append(1 if message.mine else 0)
        case Ack():
            out.append(MessageType.ACK)
            _put_u64(out, message.handle, "handle")
            _put_u64(out, message.next_sequence, "next_sequence")
            _put_u64(out, message.durable_position, "durable_position")
        case Release():
            named = message.consumer != DEFAULT_CONSUMER
            out.append(MessageType.CONSUMER_RELEASE if named else MessageType.RELEASE)
            _put_name(out, message.stream, "stream name")
            _put_u64(out, message.position, "position")
            if named:
                _put_name(out, message.consumer, "consumer name")
        case Subscribe():
            if message.sample_every < 1:
                raise ValueError("sample_every must be at least 1")
            out.append(MessageType.SUBSCRIBE)
            _put_name(out, message.stream, "stream name")
            if message.start is StartAt.NOW:
                out.append(0)
            elif message.start is StartAt.EARLIEST:
                out.append(1)
            else:
                out.append(2)
                _put_u64(out, message.start, "start position")
            _put_u64(out, message.sample_every, "sample_every")
        case Missed():
            out.append(MessageType.MISSED)
            _put_u64(out, message.handle, "handle")
            _put_u64(out, message.count, "count")
        case Fetch():
            named = message.consumer is not None
            out.append(MessageType.CONSUMER_FETCH if named else MessageType.FETCH)
            _put_u64(out, message.request_id, "request_id")
            _put_name(out, message.stream, "stream name")
            _put_u64(out, message.start_position, "start_position")
            _put_u64(out, message.end_position, "end_position")
            _put_u64(out, message.max_bytes, "max_bytes")
            if message.consumer is not None:
                _put_name(out, message.consumer, "consumer name")
        case FetchDone():
            skipped = message.skipped_bytes is not None
            if not skipped and message.skipped_records is not None:
                raise ValueError("skipped_records goes only with skipped_bytes")
            out.append(MessageType.CONSUMER_FETCH_DONE if skipped else MessageType.FETCH_DONE)
            _put_u64(out, message.request_id, "request_id")
            _put_u64(out, message.next_position, "next_position")
            _put_u64(out, message.batches, "batches")
            if message.skipped_bytes is not None:
                _put_u64(out, message.skipped_bytes, "skipped_bytes")
                if message.skipped_records is None:
                    out.append(0)
                else:
                    out.append(1)
                    _put_u64(out, message.skipped_records, "skipped_records")
        case DeclareConsumer():
            out.append(MessageType.DECLARE_CONSUMER)
            _put_u64(out, message.request_id, "request_id")
            _put_name(out, message.stream, "stream name")
            _put_name(out, message.consumer, "consumer name")
            out.append((1 if message.blocking else 0) | (2 if message.skip_data_loss else 0))
        case ConsumerPosition():
            out.append(MessageType.CONSUMER_POSITION)
            _put_u64(out, message.request_id, "request_id")
            _put_u64(out, message.position, "position")
        case ResetConsumer():
            out.append(MessageType.RESET_CONSUMER)
            _put_u64(out, message.request_id, "request_id")
            _put_name(out, message.stream, "stream name")
            _put_name(out, message.consumer, "consumer name")
            if message.to is ResetTo.EARLIEST:
                out.append(0)
            elif message.to is ResetTo.LATEST:
                out.append(1)
            elif isinstance(message.to, ResetTime):
                out.append(3)
                _put_u64(out, message.to.timestamp_us, "timestamp_us")
            else:
                out.append(2)
                _put_u64(out, message.to, "position")
        case DeleteConsumer():
            out.append(MessageType.DELETE_CONSUMER)
            _put_u64(out, message.request_id, "request_id")
            _put_name(out, message.stream, "stream name")
            _put_name(out, message.consumer, "consumer name")
        case ListConsumers():
            out.append(MessageType.LIST_CONSUMERS)
            _put_u64(out, message.request_id, "request_id")
            _put_name(out, message.stream, "stream name")
        case ConsumerList():
            out.append(MessageType.CONSUMER_LIST)
            _put_u64(out, message.request_id, "request_id")
            _put_u64(out, len(message.consumers), "consumer count")
            for entry in message.consumers:
                _put_name(out, entry.consumer, "consumer name")
                _put_u64(out, entry.position, "position")
                _put_u64(out, entry.lag_bytes, "lag_bytes")
                _put_u64(out, entry.lag_ms, "lag_ms")
                out.append(
                    (1 if entry.blocking else 0)
                    | (2 if entry.skip_data_loss else 0)
                    | (4 if entry.detached else 0)
                    | (8 if entry.idle else 0)
                    | (16 if entry.lag_records is not None else 0)
                )
                if entry.lag_records is not None:
                    _put_u64(out, entry.lag_records, "lag_records")
        case CountRecords():
            if len(message.positions) > MAX_COUNTED_POSITIONS:
                raise ValueError(f"at most {MAX_COUNTED_POSITIONS} positions")
            out.append(MessageType.COUNT_RECORDS)
            _put_u64(out, message.request_id, "request_id")
            _put_name(out, message.stream, "stream name")
            _put_u64(out, len(message.positions), "position count")
            for position in message.positions:
                _put_u64(out, position, "position")
        case RecordCounts():
            if len(message.counts) > MAX_COUNTED_POSITIONS:
                raise ValueError(f"at most {MAX_COUNTED_POSITIONS} counts")
            out.append(MessageType.RECORD_COUNTS)
            _put_u64(out, message.request_id, "request_id")
            _put_u64(out, message.epoch, "epoch")
            _put_u64(out, len(message.counts), "count count")
            for count in message.counts:
                # c64 count + 1; 0: not countable.
                _put_u64(out, 0 if count is None else count + 1, "count")
        case ListStreams():
            out.append(MessageType.LIST_STREAMS)
            _put_u64(out, message.request_id, "request_id")
        case StreamList():
            out.append(MessageType.STREAM_LIST)
            _put_u64(out, message.request_id, "request_id")
            _put_u64(out, len(message.streams), "stream count")
            for info in message.streams:
                _put_stream_info(out, info)
        case DescribeStreams():
            out.append(MessageType.DESCRIBE_STREAMS)
            _put_u64(out, message.request_id, "request_id")
        case StreamDescriptions():
            out.append(MessageType.STREAM_DESCRIPTIONS)
            _put_u64(out, message.request_id, "request_id")
            _put_u64(out, len(message.streams), "stream count")
            for described in message.streams:
                _put_stream_info(out, described.info)
                if not 0 <= described.released_at_us <= MAX_TIME_US:
                    raise ValueError(
                        f"released_at_us {described.released_at_us} is not a time "
                        f"between 1970 and 9999"
                    )
                _put_u64(out, described.released_at_us, "released_at_us")
        case Metadata():
            out.append(MessageType.METADATA)
            _put_u64(out, message.request_id, "request_id")
        case ClusterMetadata():
            _put_cluster_metadata(out, message)
        case _:
            raise TypeError(f"not a headgate message: {message!r}")
    return bytes(out)


def _put_cluster_metadata(out: bytearray, message: ClusterMetadata) -> None:
    if len(message.gateways) > MAX_METADATA_GATEWAYS:
        raise ValueError(f"at most {MAX_METADATA_GATEWAYS} gateways")
    out.append(MessageType.CLUSTER_METADATA)
    _put_u64(out, message.request_id, "request_id")
    _put_text(out, message.gateway, MAX_NAME_BYTES, "gateway name")
    _put_u64(out, len(message.gateways), "gateway count")
    for gateway in message.gateways:
        _put_name(out, gateway.name, "gateway name")
        if not gateway.address:
            raise ValueError("a gateway's address is empty")
        _put_text(out, gateway.address, MAX_NAME_BYTES, "gateway address")
    _put_u64(out, len(message.streams), "stream count")
    for stream in message.streams:
        _put_name(out, stream.stream, "stream name")
        if not 1 <= len(stream.holders) <= MAX_METADATA_PARTITIONS:
            raise ValueError(f"a stream has 1 to {MAX_METADATA_PARTITIONS} partitions")
        _put_u64(out, len(stream.holders), "partition count")
        for holder in stream.holders:
            if not 0 <= holder < len(message.gateways):
                raise ValueError(f"partition holder {holder} is not a gateway's index")
            _put_u64(out, holder, "holder")


def _read_cluster_metadata(reader: _Reader, size: int) -> ClusterMetadata:
    """ClusterMetadata's fields; every count is checked against what the bytes can hold."""
    request_id = reader.u64("request_id")
    gateway = reader.text(MAX_NAME_BYTES, "gateway name")
    count = reader.u64("gateway count")
    # A gateway entry takes at least 4 bytes (a name, an address).
    if count > min(MAX_METADATA_GATEWAYS, size // 4):
        raise MessageError(f"CLUSTER_METADATA: {count} gateways cannot be (or fit) in it")
    gateways = []
    for _ in range(count):
        name = reader.name("gateway name")
        address = reader.text(MAX_NAME_BYTES, "gateway address")
        if not address:
            raise MessageError(f"CLUSTER_METADATA: gateway {name!r} has an empty address")
        gateways.append(MetadataGateway(name=name, address=address))
    count = reader.u64("stream count")
    # A stream entry takes at least 4 bytes (a name, a count, one holder).
    if count > size // 4:
        raise MessageError(f"CLUSTER_METADATA: {count} streams cannot fit in the message")
    streams = []
    for _ in range(count):
        name = reader.name("stream name")
        partitions = reader.u64("partition count")
        if not 1 <= partitions <= min(MAX_METADATA_PARTITIONS, size):
            raise MessageError(f"CLUSTER_METADATA: stream {name!r} has {partitions} partitions")
        holders = tuple(reader.u64("holder") for _ in range(partitions))
        for holder in holders:
            if holder >= len(gateways):
                raise MessageError(
                    f"CLUSTER_METADATA: stream {name!r}: holder {holder} is not a gateway"
                )
        streams.append(MetadataStream(stream=name, holders=holders))
    return ClusterMetadata(
        request_id=request_id, gateway=gateway, gateways=tuple(gateways), streams=tuple(streams)
    )


def _put_stream_info(out: bytearray, info: StreamInfo) -> None:
    """A stream's entry in StreamList, and the start of its entry in StreamDescriptions."""
    _put_name(out, info.stream, "stream name")
    _put_u64(out, info.start_position, "start_position")
    _put_u64(out, info.durable_position, "durable_position")
    _put_u64(out, info.tail_position, "tail_position")
    _put_u64(out, info.term_length, "term_length")


# --- decoding --------------------------------------------------------------


class _Reader:
    """A cursor over one message's bytes; every shortfall is a MessageError."""

    __slots__ = ("_buf", "_pos", "_what")

    def __init__(self, payload: Buffer, what: str) -> None:
        self._buf = bytes(payload)
        self._pos = 0
        self._what = what

    def _fail(self, problem: str) -> MessageError:
        return MessageError(f"{self._what}: {problem}")

    def u8(self, field: str) -> int:
        if self._pos >= len(self._buf):
            raise self._fail(f"truncated before {field}")
        value = self._buf[self._pos]
        self._pos += 1
        return value

    def u64(self, field: str) -> int:
        got = decode_standalone(self._buf, self._pos)
        if got is None:
            raise self._fail(f"truncated in {field}")
        value, self._pos = got
        return value

    def u64le(self, field: str) -> int:
        if self._pos + 8 > len(self._buf):
            raise self._fail(f"truncated in {field}")
        (value,) = _U64LE.unpack_from(self._buf, self._pos)
        self._pos += 8
        return int(value)

    def raw(self, limit: int, field: str) -> bytes:
        length = self.u64(f"the length of {field}")
        if length > limit:
            raise self._fail(f"{field} is {length} bytes; at most {limit} allowed")
        end = self._pos + length
        if end > len(self._buf):
            raise self._fail(f"truncated in {field}")
        data = self._buf[self._pos : end]
        self._pos = end
        return data

    def text(self, limit: int, field: str) -> str:
        data = self.raw(limit, field)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise self._fail(f"{field} is not UTF-8") from error

    def name(self, field: str) -> str:
        data = self.raw(MAX_NAME_BYTES, field)
        if _NAME.fullmatch(data) is None:
            raise self._fail(f"{field} {data!r} is not a valid name")
        return data.decode("ascii")

    def code(self, field: str) -> ErrorCode:
        value = self.u8(field)
        try:
            return ErrorCode(value)
        except ValueError:
            raise self._fail(f"unknown {field} {value}") from None

    def handle_type(self) -> HandleType:
        value = self.u8("handle type")
        try:
            return HandleType(value)
        except ValueError:
            raise self._fail(f"unknown handle type {value}") from None

    def finish(self) -> None:
        if self._pos != len(self._buf):
            raise self._fail(f"{len(self._buf) - self._pos} trailing bytes")


def decode_bind_stream(payload: Buffer) -> BindStream:
    """Decode the payload of a SendChannel on channel 0."""
    reader = _Reader(payload, "BindStream")
    message = BindStream(stream=reader.name("stream name"))
    reader.finish()
    return message


def _read_stream_info(reader: _Reader) -> StreamInfo:
    return StreamInfo(
        stream=reader.name("stream name"),
        start_position=reader.u64("start_position"),
        durable_position=reader.u64("durable_position"),
        tail_position=reader.u64("tail_position"),
        term_length=reader.u64("term_length"),
    )


def decode_bind_schema(payload: Buffer) -> BindSchema:
    """Decode the payload of a SendChannel on channel 1."""
    reader = _Reader(payload, "BindSchema")
    name = reader.name("schema name")
    text = reader.text(MAX_SCHEMA_TEXT_BYTES, "schema text")
    reader.finish()
    return BindSchema(name=name, text=text)


def _counted(reader: _Reader, field: str) -> int | None:
    """A count that may be unknown: a presence byte (0 or 1), then the count if 1."""
    known = reader.u8(f"{field} presence")
    if known > 1:
        raise MessageError(f"{field} presence must be 0 or 1, not {known}")
    return reader.u64(field) if known else None


def decode_global(payload: Buffer) -> GlobalMessage:
    """Decode the payload of a SendGlobal frame into the message it carries."""
    if len(payload) == 0:
        raise MessageError("empty global message")
    kind = payload[0]
    try:
        message_type = MessageType(kind)
    except ValueError:
        raise MessageError(f"unknown global message type {kind:#04x}") from None
    reader = _Reader(payload, message_type.name)
    reader.u8("type")
    message: GlobalMessage
    match message_type:
        case MessageType.HELLO:
            version = reader.u64("version")
            producer_id = reader.u64("producer_id")
            client_name = reader.text(MAX_NAME_BYTES, "client name")
            token = reader.raw(MAX_TOKEN_BYTES, "token")
            flags = reader.u8("flags")
            if flags & ~_KNOWN_HELLO_FLAGS:
                raise MessageError(f"HELLO: undefined flags {flags:#04x}")
            message = Hello(
                version=version,
                producer_id=producer_id,
                client_name=client_name,
                token=token,
                flags=HelloFlags(flags),
                secret=reader.raw(MAX_SECRET_BYTES, "secret"),
            )
        case MessageType.WELCOME:
            message = Welcome(
                version=reader.u64("version"),
                server_name=reader.text(MAX_NAME_BYTES, "server name"),
                max_message_size=reader.u64("max_message_size"),
                idle_timeout_ms=reader.u64("idle_timeout_ms"),
                plead_deadline_ms=reader.u64("plead_deadline_ms"),
                producer_secret=reader.raw(MAX_SECRET_BYTES, "producer_secret"),
            )
        case MessageType.GOODBYE:
            code = reader.code("code")
            message = Goodbye(code=code, text=reader.text(MAX_TEXT_BYTES, "text"))
        case MessageType.ERROR:
            code = reader.code("code")
            if code == ErrorCode.NONE:
                raise MessageError("ERROR: code NONE is not an error")
            scope_kind = reader.u8("scope")
            scope: HandleRef | None
            if scope_kind == 0:
                scope = None
            elif scope_kind == 1:
                handle_type = reader.handle_type()
                scope = HandleRef(handle_type=handle_type, handle=reader.u64("handle"))
            else:
                raise MessageError(f"ERROR: unknown scope kind {scope_kind}")
            message = Error(code=code, scope=scope, text=reader.text(MAX_TEXT_BYTES, "text"))
        case MessageType.PING:
            message = Ping(nonce=reader.u64le("nonce"))
        case MessageType.PONG:
            message = Pong(nonce=reader.u64le("nonce"))
        case MessageType.FREE_HANDLE:
            handle_type = reader.handle_type()
            handle = reader.u64("handle")
            mine = reader.u8("mine")
            if mine > 1:
                raise MessageError(f"FREE_HANDLE: mine must be 0 or 1, not {mine}")
            message = FreeHandle(handle_type=handle_type, handle=handle, mine=mine == 1)
        case MessageType.ACK:
            message = Ack(
                handle=reader.u64("handle"),
                next_sequence=reader.u64("next_sequence"),
                durable_position=reader.u64("durable_position"),
            )
        case MessageType.RELEASE | MessageType.CONSUMER_RELEASE:
            stream = reader.name("stream name")
            position = reader.u64("position")
            consumer = (
                reader.name("consumer name")
                if message_type == MessageType.CONSUMER_RELEASE
                else DEFAULT_CONSUMER
            )
            message = Release(stream=stream, position=position, consumer=consumer)
        case MessageType.SUBSCRIBE:
            stream = reader.name("stream name")
            start_kind = reader.u8("start")
            start: StartAt | int
            if start_kind == 0:
                start = StartAt.NOW
            elif start_kind == 1:
                start = StartAt.EARLIEST
            elif start_kind == 2:
                start = reader.u64("start position")
            else:
                raise MessageError(f"SUBSCRIBE: unknown start kind {start_kind}")
            sample_every = reader.u64("sample_every")
            if sample_every == 0:
                raise MessageError("SUBSCRIBE: sample_every must be at least 1")
            message = Subscribe(stream=stream, start=start, sample_every=sample_every)
        case MessageType.MISSED:
            message = Missed(handle=reader.u64("handle"), count=reader.u64("count"))
        case MessageType.FETCH | MessageType.CONSUMER_FETCH:
            message = Fetch(
                request_id=reader.u64("request_id"),
                stream=reader.name("stream name"),
                start_position=reader.u64("start_position"),
                end_position=reader.u64("end_position"),
                max_bytes=reader.u64("max_bytes"),
                consumer=(
                    reader.name("consumer name")
                    if message_type == MessageType.CONSUMER_FETCH
                    else None
                ),
            )
        case MessageType.FETCH_DONE | MessageType.CONSUMER_FETCH_DONE:
            message = FetchDone(
                request_id=reader.u64("request_id"),
                next_position=reader.u64("next_position"),
                batches=reader.u64("batches"),
                skipped_bytes=(
                    reader.u64("skipped_bytes")
                    if message_type == MessageType.CONSUMER_FETCH_DONE
                    else None
                ),
                skipped_records=(
                    _counted(reader, "skipped_records")
                    if message_type == MessageType.CONSUMER_FETCH_DONE
                    else None
                ),
            )
        case MessageType.DECLARE_CONSUMER:
            request_id = reader.u64("request_id")
            stream = reader.name("stream name")
            consumer = reader.name("consumer name")
            flags = reader.u8("flags")
            if flags & ~3:
                raise MessageError(f"DECLARE_CONSUMER: undefined flags {flags:#04x}")
            message = DeclareConsumer(
                request_id=request_id,
                stream=stream,
                consumer=consumer,
                blocking=bool(flags & 1),
                skip_data_loss=bool(flags & 2),
            )
        case MessageType.RESET_CONSUMER:
            request_id = reader.u64("request_id")
            stream = reader.name("stream name")
            consumer = reader.name("consumer name")
            kind = reader.u8("to")
            to: ResetTo | int | ResetTime
            if kind == 0:
                to = ResetTo.EARLIEST
            elif kind == 1:
                to = ResetTo.LATEST
            elif kind == 2:
                to = reader.u64("position")
            elif kind == 3:
                to = ResetTime(reader.u64("timestamp_us"))
            else:
                raise MessageError(f"RESET_CONSUMER: unknown kind {kind}")
            message = ResetConsumer(request_id=request_id, stream=stream, consumer=consumer, to=to)
        case MessageType.DELETE_CONSUMER:
            message = DeleteConsumer(
                request_id=reader.u64("request_id"),
                stream=reader.name("stream name"),
                consumer=reader.name("consumer name"),
            )
        case MessageType.LIST_CONSUMERS:
            message = ListConsumers(
                request_id=reader.u64("request_id"), stream=reader.name("stream name")
            )
        case MessageType.CONSUMER_LIST:
            request_id = reader.u64("request_id")
            count = reader.u64("consumer count")
            # Each entry takes at least 6 bytes (as in STREAM_LIST).
            if count > len(payload) // 6:
                raise MessageError(f"CONSUMER_LIST: {count} consumers cannot fit in the message")
            entries = []
            for _ in range(count):
                name = reader.name("consumer name")
                position = reader.u64("position")
                lag_bytes = reader.u64("lag_bytes")
                lag_ms = reader.u64("lag_ms")
                flags = reader.u8("flags")
                if flags & ~31:
                    raise MessageError(f"CONSUMER_LIST: undefined flags {flags:#04x}")
                lag_records = reader.u64("lag_records") if flags & 16 else None
                entries.append(
                    ConsumerInfo(
                        consumer=name,
                        position=position,
                        lag_bytes=lag_bytes,
                        lag_ms=lag_ms,
                        blocking=bool(flags & 1),
                        skip_data_loss=bool(flags & 2),
                        detached=bool(flags & 4),
                        idle=bool(flags & 8),
                        lag_records=lag_records,
                    )
                )
            message = ConsumerList(request_id=request_id, consumers=tuple(entries))
        case MessageType.CONSUMER_POSITION:
            message = ConsumerPosition(
                request_id=reader.u64("request_id"), position=reader.u64("position")
            )
        case MessageType.LIST_STREAMS:
            message = ListStreams(request_id=reader.u64("request_id"))
        case MessageType.STREAM_LIST:
            request_id = reader.u64("request_id")
            count = reader.u64("stream count")
            # Each entry takes at least 6 bytes, so a count beyond what is left
            # is malformed before anything is built for it.
            if count > len(payload) // 6:
                raise MessageError(f"STREAM_LIST: {count} streams cannot fit in the message")
            infos = tuple(_read_stream_info(reader) for _ in range(count))
            message = StreamList(request_id=request_id, streams=infos)
        case MessageType.DESCRIBE_STREAMS:
            message = DescribeStreams(request_id=reader.u64("request_id"))
        case MessageType.STREAM_DESCRIPTIONS:
            request_id = reader.u64("request_id")
            count = reader.u64("stream count")
            # Each entry takes at least 7 bytes (a StreamList entry and a time).
            if count > len(payload) // 7:
                raise MessageError(
                    f"STREAM_DESCRIPTIONS: {count} streams cannot fit in the message"
                )
            described = []
            for _ in range(count):
                info = _read_stream_info(reader)
                released_at_us = reader.u64("released_at_us")
                if released_at_us > MAX_TIME_US:
                    raise MessageError(
                        f"STREAM_DESCRIPTIONS: released_at_us {released_at_us} is after the "
                        "year 9999"
                    )
                described.append(StreamDescription(info=info, released_at_us=released_at_us))
            message = StreamDescriptions(request_id=request_id, streams=tuple(described))
        case MessageType.COUNT_RECORDS:
            request_id = reader.u64("request_id")
            stream = reader.name("stream name")
            count = reader.u64("position count")
            if count > MAX_COUNTED_POSITIONS:
                raise MessageError(
                    f"COUNT_RECORDS: {count} positions, at most {MAX_COUNTED_POSITIONS}"
                )
            message = CountRecords(
                request_id=request_id,
                stream=stream,
                positions=tuple(reader.u64("position") for _ in range(count)),
            )
        case MessageType.RECORD_COUNTS:
            request_id = reader.u64("request_id")
            epoch = reader.u64("epoch")
            count = reader.u64("count count")
            if count > MAX_COUNTED_POSITIONS:
                raise MessageError(
                    f"RECORD_COUNTS: {count} counts, at most {MAX_COUNTED_POSITIONS}"
                )
            counts = tuple(reader.u64("count") for _ in range(count))
            message = RecordCounts(
                request_id=request_id,
                epoch=epoch,
                counts=tuple(None if c == 0 else c - 1 for c in counts),
            )
        case MessageType.METADATA:
            message = Metadata(request_id=reader.u64("request_id"))
        case MessageType.CLUSTER_METADATA:
            message = _read_cluster_metadata(reader, len(payload))
    reader.finish()
    return message
