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

Each message's layout is declared once, at the end of this module, in the
terms of :mod:`headgate.protocol.layout` (``GLOBAL_LAYOUTS`` and the bind
layouts): :func:`encode_message` and the decoders walk those declarations,
and ``tests/protocol/test_layouts.py`` reads PROTOCOL.md's diagrams against
them. The data headers (Batch, TailRecords) are the exception: they are read
once per batch, so they keep their one-``struct``-call codecs, and their
declarations (``BATCH_LAYOUT``, ``TAIL_LAYOUT``) are what tests hold those
codecs to.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum, IntEnum, IntFlag
from typing import Any, NamedTuple

from headgate.protocol.c64 import U64_MAX, Buffer
from headgate.protocol.errors import ErrorCode, MessageError
from headgate.protocol.layout import (
    C64,
    I64LE,
    NAME_LIMIT,
    NAME_PATTERN,
    U32LE,
    U64LE,
    BitFlags,
    Bool8,
    Bytes,
    Choice,
    Counted,
    Element,
    Enum8,
    Field,
    FlagSet,
    Layout,
    Name,
    Present,
    Repeated,
    Struct,
    Text,
    Variant,
    check_u64,
)

__all__ = [
    "BATCH_HEADER_SIZE",
    "BATCH_LAYOUT",
    "BIND_SCHEMA_LAYOUT",
    "BIND_STREAM_LAYOUT",
    "DEFAULT_CONSUMER",
    "FIRST_DATA_CHANNEL",
    "GLOBAL_LAYOUTS",
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
    "TAIL_LAYOUT",
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
MAX_NAME_BYTES = NAME_LIMIT
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

_U64LE = struct.Struct("<Q")  # the hand-tuned hot-path codecs below
_BATCH_HEAD = struct.Struct("<QI")
_TAIL_HEAD = struct.Struct("<QQQQqI")
_TAIL_PREFIX = struct.Struct("<QQQQq")

#: The consumer a Release or Fetch names when it names none (every old
#: client): an old data directory's one release position is this consumer's.
DEFAULT_CONSUMER = "default"


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
    return name.isascii() and NAME_PATTERN.fullmatch(name.encode("ascii")) is not None


# --- data messages ---------------------------------------------------------


def encode_batch_header(first_sequence: int) -> bytes:
    """Return the 8 bytes that precede a records block in a Batch."""
    check_u64(first_sequence, "first_sequence")
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
    check_u64(header.first_sequence, "first_sequence")
    check_u64(header.position, "position")
    check_u64(header.end_position, "end_position")
    check_u64(header.producer_id, "producer_id")
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


# --- layouts: each message declared once -------------------------------------
#
# The encoder, the decoder and PROTOCOL.md's check (tests/protocol) all read
# these declarations; layout.py holds the machinery. The words of each
# refusal are part of the declaration, so a peer reads the same text as ever.


def _request_id() -> Field:
    return Field("request_id", C64("request_id"))


_STREAM = Field("stream", Name("stream name"))
_CONSUMER = Field("consumer", Name("consumer name"))
_CODE = Enum8(ErrorCode, "code")
_HANDLE_TYPE = Field("handle_type", Enum8(HandleType, "handle type"))

_STREAM_INFO = Struct(
    StreamInfo,
    (
        _STREAM,
        Field("start_position", C64("start_position")),
        Field("durable_position", C64("durable_position")),
        Field("tail_position", C64("tail_position")),
        Field("term_length", C64("term_length")),
    ),
)

_CONSUMER_INFO = Struct(
    ConsumerInfo,
    (
        _CONSUMER,
        Field("position", C64("position")),
        Field("lag_bytes", C64("lag_bytes")),
        Field("lag_ms", C64("lag_ms")),
        BitFlags(
            "flags",
            bits=(("blocking", 1), ("skip_data_loss", 2), ("detached", 4), ("idle", 8)),
            present=((16, Field("lag_records", C64("lag_records"))),),
        ),
    ),
)

_METADATA_GATEWAY = Struct(
    MetadataGateway,
    (
        Field("name", Name("gateway name")),
        Field(
            "address",
            Text(
                MAX_NAME_BYTES,
                "gateway address",
                empty_text="a gateway's address is empty",
                empty_problem="gateway {name!r} has an empty address",
            ),
        ),
    ),
)

_METADATA_STREAM = Struct(
    MetadataStream,
    (
        _STREAM,
        Field(
            "holders",
            Repeated(
                C64("holder"),
                "partition count",
                count_problem="stream {stream!r} has {count} partitions",
                count_text=f"a stream has 1 to {MAX_METADATA_PARTITIONS} partitions",
                minimum=1,
                maximum=MAX_METADATA_PARTITIONS,
                fits=True,
                indexes="gateways",
                index_text="partition holder {value} is not a gateway's index",
                index_problem="stream {stream!r}: holder {value} is not a gateway",
            ),
            wire="holder",
        ),
    ),
)


def _global(
    message_type: MessageType,
    cls: type,
    *elements: Element,
    when: Callable[[Any], bool] | None = None,
    fixed: Mapping[str, object] | None = None,
    refusal: str = "",
) -> Layout:
    return Layout(
        cls=cls,
        what=message_type.name,
        type_byte=int(message_type),
        elements=elements,
        when=when,
        fixed=fixed or {},
        refusal=refusal,
    )


#: Every global message's layout, in type order; PROTOCOL.md draws each one.
GLOBAL_LAYOUTS: tuple[Layout, ...] = (
    _global(
        MessageType.HELLO,
        Hello,
        Field("version", C64("version")),
        Field("producer_id", C64("producer_id")),
        Field("client_name", Text(MAX_NAME_BYTES, "client name")),
        Field("token", Bytes(MAX_TOKEN_BYTES, "token")),
        Field(
            "flags",
            FlagSet(
                HelloFlags,
                _KNOWN_HELLO_FLAGS,
                "flags",
                undefined_text="undefined Hello flags {bits:#x}",
            ),
        ),
        Field("secret", Bytes(MAX_SECRET_BYTES, "secret")),
    ),
    _global(
        MessageType.WELCOME,
        Welcome,
        Field("version", C64("version")),
        Field("server_name", Text(MAX_NAME_BYTES, "server name")),
        Field("max_message_size", C64("max_message_size")),
        Field("idle_timeout_ms", C64("idle_timeout_ms")),
        Field("plead_deadline_ms", C64("plead_deadline_ms")),
        Field("producer_secret", Bytes(MAX_SECRET_BYTES, "producer_secret")),
    ),
    _global(
        MessageType.GOODBYE,
        Goodbye,
        Field("code", _CODE),
        Field("text", Text(MAX_TEXT_BYTES, "text", put_label="goodbye text")),
    ),
    _global(
        MessageType.ERROR,
        Error,
        Field(
            "code",
            Enum8(
                ErrorCode,
                "code",
                forbidden=ErrorCode.NONE,
                forbidden_text="an Error message needs a code other than NONE",
                forbidden_problem="code NONE is not an error",
            ),
        ),
        Field(
            "scope",
            Choice(
                "scope",
                (
                    Variant(0, constant=None),
                    Variant(
                        1,
                        payload=Struct(HandleRef, (_HANDLE_TYPE, Field("handle", C64("handle")))),
                        accepts=HandleRef,
                    ),
                ),
                unknown_problem="unknown scope kind {tag}",
            ),
        ),
        Field("text", Text(MAX_TEXT_BYTES, "text", put_label="error text")),
    ),
    _global(MessageType.PING, Ping, Field("nonce", U64LE("nonce"))),
    _global(MessageType.PONG, Pong, Field("nonce", U64LE("nonce"))),
    _global(
        MessageType.FREE_HANDLE,
        FreeHandle,
        _HANDLE_TYPE,
        Field("handle", C64("handle")),
        Field("mine", Bool8("mine")),
    ),
    _global(
        MessageType.ACK,
        Ack,
        Field("handle", C64("handle")),
        Field("next_sequence", C64("next_sequence")),
        Field("durable_position", C64("durable_position")),
    ),
    _global(
        MessageType.RELEASE,
        Release,
        _STREAM,
        Field("position", C64("position")),
        when=lambda release: release.consumer == DEFAULT_CONSUMER,
        fixed={"consumer": DEFAULT_CONSUMER},
    ),
    _global(
        MessageType.CONSUMER_RELEASE,
        Release,
        _STREAM,
        Field("position", C64("position")),
        _CONSUMER,
    ),
    _global(
        MessageType.SUBSCRIBE,
        Subscribe,
        _STREAM,
        Field(
            "start",
            Choice(
                "start",
                (
                    Variant(0, constant=StartAt.NOW),
                    Variant(1, constant=StartAt.EARLIEST),
                    Variant(2, payload=C64("start position"), accepts=int, wire="position"),
                ),
                unknown_problem="unknown start kind {tag}",
            ),
        ),
        Field(
            "sample_every",
            C64(
                "sample_every",
                minimum=1,
                bounds_text="sample_every must be at least 1",
                bounds_problem="sample_every must be at least 1",
            ),
        ),
    ),
    _global(
        MessageType.MISSED,
        Missed,
        Field("handle", C64("handle")),
        Field("count", C64("count")),
    ),
    _global(
        MessageType.FETCH,
        Fetch,
        _request_id(),
        _STREAM,
        Field("start_position", C64("start_position")),
        Field("end_position", C64("end_position")),
        Field("max_bytes", C64("max_bytes")),
        when=lambda fetch: fetch.consumer is None,
        fixed={"consumer": None},
    ),
    _global(
        MessageType.FETCH_DONE,
        FetchDone,
        _request_id(),
        Field("next_position", C64("next_position")),
        Field("batches", C64("batches")),
        when=lambda done: done.skipped_bytes is None,
        fixed={"skipped_bytes": None, "skipped_records": None},
        refusal="skipped_records goes only with skipped_bytes",
    ),
    _global(MessageType.LIST_STREAMS, ListStreams, _request_id()),
    _global(
        MessageType.STREAM_LIST,
        StreamList,
        _request_id(),
        Field(
            "streams",
            Repeated(
                _STREAM_INFO,
                "stream count",
                count_problem="{count} streams cannot fit in the message",
                fits=True,
            ),
            wire="stream entry",
        ),
    ),
    _global(
        MessageType.CONSUMER_FETCH,
        Fetch,
        _request_id(),
        _STREAM,
        Field("start_position", C64("start_position")),
        Field("end_position", C64("end_position")),
        Field("max_bytes", C64("max_bytes")),
        Field("consumer", Name("consumer name")),
    ),
    _global(
        MessageType.CONSUMER_FETCH_DONE,
        FetchDone,
        _request_id(),
        Field("next_position", C64("next_position")),
        Field("batches", C64("batches")),
        Field("skipped_bytes", C64("skipped_bytes")),
        Field(
            "skipped_records",
            Present(C64("skipped_records"), "skipped_records", wire_presence="known"),
        ),
    ),
    _global(MessageType.DESCRIBE_STREAMS, DescribeStreams, _request_id()),
    _global(
        MessageType.STREAM_DESCRIPTIONS,
        StreamDescriptions,
        _request_id(),
        Field(
            "streams",
            Repeated(
                Struct(
                    StreamDescription,
                    (
                        Field("info", _STREAM_INFO),
                        Field(
                            "released_at_us",
                            C64(
                                "released_at_us",
                                maximum=MAX_TIME_US,
                                bounds_text="released_at_us {value} is not a time "
                                "between 1970 and 9999",
                                bounds_problem="released_at_us {value} is after the year 9999",
                            ),
                        ),
                    ),
                ),
                "stream count",
                count_problem="{count} streams cannot fit in the message",
                fits=True,
            ),
            wire="described entry",
        ),
    ),
    _global(
        MessageType.DECLARE_CONSUMER,
        DeclareConsumer,
        _request_id(),
        _STREAM,
        _CONSUMER,
        BitFlags("flags", bits=(("blocking", 1), ("skip_data_loss", 2))),
    ),
    _global(
        MessageType.CONSUMER_POSITION,
        ConsumerPosition,
        _request_id(),
        Field("position", C64("position")),
    ),
    _global(MessageType.LIST_CONSUMERS, ListConsumers, _request_id(), _STREAM),
    _global(
        MessageType.CONSUMER_LIST,
        ConsumerList,
        _request_id(),
        Field(
            "consumers",
            Repeated(
                _CONSUMER_INFO,
                "consumer count",
                count_problem="{count} consumers cannot fit in the message",
                fits=True,
            ),
        ),
    ),
    _global(
        MessageType.RESET_CONSUMER,
        ResetConsumer,
        _request_id(),
        _STREAM,
        _CONSUMER,
        Field(
            "to",
            Choice(
                "to",
                (
                    Variant(0, constant=ResetTo.EARLIEST),
                    Variant(1, constant=ResetTo.LATEST),
                    Variant(2, payload=C64("position"), accepts=int, wire="value"),
                    Variant(
                        3,
                        payload=Struct(ResetTime, (Field("timestamp_us", C64("timestamp_us")),)),
                        accepts=ResetTime,
                        wire="value",
                    ),
                ),
                unknown_problem="unknown kind {tag}",
            ),
            wire="kind",
        ),
    ),
    _global(MessageType.DELETE_CONSUMER, DeleteConsumer, _request_id(), _STREAM, _CONSUMER),
    _global(
        MessageType.COUNT_RECORDS,
        CountRecords,
        _request_id(),
        _STREAM,
        Field(
            "positions",
            Repeated(
                C64("position"),
                "position count",
                count_problem=f"{{count}} positions, at most {MAX_COUNTED_POSITIONS}",
                count_text=f"at most {MAX_COUNTED_POSITIONS} positions",
                maximum=MAX_COUNTED_POSITIONS,
            ),
            wire="position",
        ),
    ),
    _global(
        MessageType.RECORD_COUNTS,
        RecordCounts,
        _request_id(),
        Field("epoch", C64("epoch")),
        Field(
            "counts",
            Repeated(
                Counted("count"),
                "count count",
                count_problem=f"{{count}} counts, at most {MAX_COUNTED_POSITIONS}",
                count_text=f"at most {MAX_COUNTED_POSITIONS} counts",
                maximum=MAX_COUNTED_POSITIONS,
            ),
            wire="records",
        ),
    ),
    _global(MessageType.METADATA, Metadata, _request_id()),
    _global(
        MessageType.CLUSTER_METADATA,
        ClusterMetadata,
        _request_id(),
        Field("gateway", Text(MAX_NAME_BYTES, "gateway name")),
        Field(
            "gateways",
            Repeated(
                _METADATA_GATEWAY,
                "gateway count",
                count_problem="{count} gateways cannot be (or fit) in it",
                count_text=f"at most {MAX_METADATA_GATEWAYS} gateways",
                maximum=MAX_METADATA_GATEWAYS,
                fits=True,
                wire_count="n_gw",
            ),
        ),
        Field(
            "streams",
            Repeated(
                _METADATA_STREAM,
                "stream count",
                count_problem="{count} streams cannot fit in the message",
                fits=True,
                wire_count="n_str",
            ),
        ),
    ),
)

#: BindStream (channel 0) and BindSchema (channel 1): no type byte.
BIND_STREAM_LAYOUT = Layout(BindStream, "BindStream", None, (_STREAM,))
BIND_SCHEMA_LAYOUT = Layout(
    BindSchema,
    "BindSchema",
    None,
    (Field("name", Name("schema name")), Field("text", Text(MAX_SCHEMA_TEXT_BYTES, "schema text"))),
)

#: The hot-path headers, declared for PROTOCOL.md and for the tests that hold
#: their hand-tuned codecs (one ``struct`` call each) to the declaration; the
#: codecs themselves are ``encode_batch_header`` and ``decode_batch``,
#: ``encode_tail_header`` and ``decode_tail_records``. Both end with the
#: records block's count, the first field that records.py owns.
BATCH_LAYOUT = Layout(
    dict,
    "Batch",
    None,
    (Field("first_sequence", U64LE("first_sequence")), Field("count", U32LE("count"))),
)
TAIL_LAYOUT = Layout(
    dict,
    "TailRecords",
    None,
    (
        Field("first_sequence", U64LE("first_sequence")),
        Field("position", U64LE("position")),
        Field("end_position", U64LE("end_position")),
        Field("producer_id", U64LE("producer_id")),
        Field("timestamp_us", I64LE("timestamp_us")),
        Field("count", U32LE("count")),
    ),
)

_DECODERS: dict[int, Layout] = {}
_ENCODERS: dict[type, list[Layout]] = {}
for _layout in (*GLOBAL_LAYOUTS, BIND_STREAM_LAYOUT, BIND_SCHEMA_LAYOUT):
    if _layout.type_byte is not None:
        _DECODERS[_layout.type_byte] = _layout
    _ENCODERS.setdefault(_layout.cls, []).append(_layout)
del _layout


def encode_message(message: GlobalMessage | ChannelMessage) -> bytes:
    """Return the payload bytes of a global message or a bind message.

    Raises ``ValueError`` for a field the peer would reject (an integer out of
    range, a string too long, an invalid name, an Error with code NONE).
    """
    layouts = _ENCODERS.get(type(message))
    if layouts is None:
        raise TypeError(f"not a headgate message: {message!r}")
    for layout in layouts:
        if layout.when is None or layout.when(message):
            return layout.encode(message)
    raise AssertionError(f"no layout for {message!r}")  # the last layout has no `when`


def decode_bind_stream(payload: Buffer) -> BindStream:
    """Decode the payload of a SendChannel on channel 0."""
    message: BindStream = BIND_STREAM_LAYOUT.decode(payload)
    return message


def decode_bind_schema(payload: Buffer) -> BindSchema:
    """Decode the payload of a SendChannel on channel 1."""
    message: BindSchema = BIND_SCHEMA_LAYOUT.decode(payload)
    return message


def decode_global(payload: Buffer) -> GlobalMessage:
    """Decode the payload of a SendGlobal frame into the message it carries."""
    if len(payload) == 0:
        raise MessageError("empty global message")
    kind = payload[0]
    layout = _DECODERS.get(kind)
    if layout is None:
        raise MessageError(f"unknown global message type {kind:#04x}")
    message: GlobalMessage = layout.decode(payload)
    return message
