"""The ``headgate`` Spark data source: stream logs in, one row per record out.

A Structured Streaming query reads the logs a gateway writes, by position,
the way the Kafka source reads topics by offset::

    spark.readStream.format("headgate")
        .option("path", "/var/lib/headgate")          # the gateway's data directory
        .option("streamPattern", "orders-.*")
        .option("maxRecordsPerTrigger", 1_000_000)
        .load()

``format("headgate")`` needs no register call: the top-level module
``pyspark_headgate`` exposes :class:`HeadgateDataSource` as ``DefaultSource``.
``spark.read.format("headgate")`` reads the same logs as one batch.

Options:

``path``
    A gateway's local data directory; stream ``s`` is the log in ``<path>/streams/s``.
``gateway``
    ``host:port`` of a gateway to read through, for executors that cannot see
    the disk (a cluster). The driver plans from the gateway's stream list and
    every partition carries the address and its position ranges; nothing
    touches the data directory. With admission control the driver fetches the
    frames it admits (their headers decide) over the network too. See
    :mod:`headgate.spark.remote`.
``cluster``
    A cluster file (:mod:`headgate.cluster`): read the partitioned streams
    of a fleet of gateways, every partition through the gateway that holds
    it, in parallel (each Spark partition reads one gateway). ``streams`` /
    ``streamPattern`` then select partitioned streams by their names in the
    file (without either, every one), and a named stream the file lacks is
    refused. Offsets, ``startingOffsets`` and the ``stream`` column use the
    partitions' log names (``orders.p0``, ``orders.p1``, ...), so an offset
    is a position per partition, keys sorted; the rows also carry a
    ``partition`` column, the partition's number (:data:`FLEET_SCHEMA`). A
    partition appears once its first record is written. A gateway that does
    not answer holds back only its partitions: they keep the position the
    query has read them to, the others go on, and they catch up when it
    returns. The token options
    apply to every gateway; TLS comes from the cluster file's settings of
    each gateway (see :func:`headgate.client.fleet.gateway_security`).
``streams`` / ``streamPattern``
    A comma-separated list of stream names, or a regex a whole name must
    match. Without either, every stream. Streams that appear later are read
    from their start (or from ``startingOffsets`` if it names them).
``missingStreams``
    What a query does when a stream that ``streams`` names does not exist
    when it starts: ``fail`` (default) fails it at once, naming the missing
    streams and those that exist (a misspelt name would otherwise read
    nothing, without a word); ``wait`` reads such a stream from its start
    once a producer creates it (a query started before its producers). Only
    with ``streams``: a ``streamPattern`` always takes streams as they appear.
``startingOffsets``
    ``earliest`` (default), ``latest``, or JSON ``{"stream": position}``,
    where a position may be a record address ``"POSITION:INDEX"`` (what a
    row's ``position`` and ``index`` say): the query starts exactly at that
    record. Streams the JSON does not name start at their earliest retained
    position. Checked when the query starts (a released position, one past
    the end or inside a batch, an index past the batch's records: one line).
    Used only when a query starts without a checkpoint.
``startingTimestamp``
    Instead of ``startingOffsets``, as in Kafka's source: milliseconds since
    the epoch, or an ISO-8601 time with its zone (``2026-11-25T06:00:00Z``).
    Each stream starts at the first record stored at or after that time: the
    driver reads the frame headers from the oldest retained position on and
    takes the first frame whose timestamp (when the gateway appended it;
    every record of a frame has it) is at or after it; none: the stream's
    end. A stream that appears later is read the same way. Used only when a
    query starts without a checkpoint.
``consumer``
    The gateway consumer this query reads for (PROTOCOL.md, "Consumers"):
    ``headgate pipeline`` releases each batch it commits as that consumer
    (with ``cluster``: :class:`headgate.spark.fleet.FleetReleases` sends each
    partition's release to its gateway).
    The query's progress names it (see below).
``failOnDataLoss``
    ``true`` (default): a batch whose start the log no longer holds (freed
    before this query read it: a non-blocking consumer that fell behind, or
    a start outside the retention) fails the query with an error that names
    the stream, the position the query had read to and the oldest position
    the log holds. ``false``: the query skips to the oldest held position,
    and its progress counts the bytes it skipped.
``endingOffsets``
    Batch reads only: ``latest`` (default) or JSON ``{"stream": position}``
    (where a batch starts; the batch at it is not read).
``maxRecordsPerTrigger`` / ``maxBytesPerTrigger``
    Admission control: at most this many records / log bytes per
    micro-batch, in whole frames, oldest frames first; a single frame larger
    than the limit is read alone (see :mod:`headgate.spark.planning`).
    ``Trigger.AvailableNow`` honours them and reads everything in several
    batches; ``Trigger.Once`` ignores them, as Spark asks.
``bytesPerPartition``
    Log bytes per Spark partition (default 32 MiB), cut at frame boundaries.
``tokenEnv`` / ``tokenFile`` / ``token``
    With ``gateway`` or ``cluster``: the token for a gateway with a tokens file (it needs
    the ``read`` right on the streams). ``tokenEnv`` names an environment
    variable and ``tokenFile`` a file that hold it; the driver and every
    executor read it there when they connect, so set the variable on both
    (``spark.executorEnv.NAME``) or put the file where both can read it.
    Prefer them to ``token``: Spark shows a query's options in its plans, UI
    and logs, so a token given as an option is visible to whoever sees those.
``tls`` / ``tlsCaFile`` / ``tlsCertFile`` / ``tlsKeyFile`` / ``tlsServerName``
    With ``gateway``: speak TLS (``tls`` ``true`` verifies the gateway with
    the system's trust store, ``tlsCaFile`` with a CA bundle; any of these
    options implies TLS), show a client certificate for mutual TLS, check
    another name than the host of ``gateway``. The files must exist on the
    driver and the executors.

Any other option is refused with an error that lists these (Kafka's
``maxOffsetsPerTrigger`` would otherwise be ignored without a word).

Offsets are JSON objects from stream name to log position, keys sorted; a
query that starts inside a batch holds the address text (``"4096:2"``) for
that stream until it reads the batch.

Progress: PySpark's Python sources have no custom metrics, so the source
reports through ``latestOffset`` in each ``StreamingQueryProgress`` source
(:meth:`HeadgateStreamReader.reportLatestOffset`): each stream's durable end
position, as Kafka's source reports its latest offsets, plus one key no
stream can have (names start with a letter or digit), ``_consumer``::

    {"orders": 81920,
     "_consumer": {"name": "archive",
                   "lag_bytes": {"orders": 4096},
                   "lag_records": {"orders": 37},
                   "skipped_bytes": {"orders": 0},
                   "skipped_records": {"orders": 0}}}

``lag_bytes``: log bytes between the end of the batch just planned and the
stream's durable end, when it was planned (0: the query is caught up).
``lag_records``: the records in those bytes.
``skipped_bytes``: bytes this run of the query skipped with
``failOnDataLoss`` false (what the log freed before the query read it).
``skipped_records``: the records in those bytes.
Records are counted from the gateway's record index
(:mod:`headgate.spark.record_counts`: read from the data directory, or
asked of the gateway with CountRecords); ``null`` where they cannot be: a
skip from a position whose count nobody took while the log held it (a
checkpoint's start that is not the consumer's committed position), or a
gateway that cannot answer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxBytes,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import (
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from headgate.client.security import ClientSecurity, SecurityError
from headgate.cluster import Cluster, ClusterError, load_cluster
from headgate.log.address import AddressError, RecordAddress
from headgate.protocol.messages import is_valid_name
from headgate.spark.decode import SourceError, StreamSlice, arrow_schema, read_slice
from headgate.spark.planning import (
    MISSING_STREAMS,
    Logs,
    Offset,
    OffsetValue,
    StreamLogs,
    StreamSelection,
    admit,
    offset_address,
    offset_position,
    offset_value,
    plan_slices,
    sorted_offset,
)
from headgate.spark.record_counts import (
    LocalRecordCounts,
    PlannedCounts,
    RecordCounter,
    RemoteRecordCounts,
)

if TYPE_CHECKING:
    from headgate.spark.fleet import FleetLogs

__all__ = [
    "FLEET_SCHEMA",
    "PROGRESS_KEY",
    "SCHEMA",
    "HeadgateDataSource",
    "HeadgatePartition",
    "SourceOptions",
]

#: One row per record. ``position`` is the log position of the record's frame
#: and ``index`` the record's index in it: together the record's address
#: (``POSITION:INDEX``, :mod:`headgate.log.address`), which ``startingOffsets``
#: takes; ``sequence`` is the frame's first sequence plus ``index``;
#: ``ingest_time`` is the frame's timestamp (when the gateway appended it).
SCHEMA = StructType(
    [
        StructField("stream", StringType()),
        StructField("position", LongType()),
        StructField("index", LongType()),
        StructField("producer", LongType()),
        StructField("sequence", LongType()),
        StructField("ingest_time", TimestampType()),
        StructField("key", BinaryType()),
        StructField("value", BinaryType()),
    ]
)

#: The rows of a query that reads a fleet (option ``cluster``): :data:`SCHEMA`
#: with ``partition``, the number of the record's partition, after ``stream``
#: (which names the partition's log, ``orders.p3``). Only there: the rows of
#: ``path`` and ``gateway`` keep :data:`SCHEMA`, so their checkpoints still open.
FLEET_SCHEMA = StructType(
    [SCHEMA.fields[0], StructField("partition", IntegerType()), *SCHEMA.fields[1:]]
)


def source_schema(cluster: bool) -> StructType:
    """The source's fixed schema: :data:`FLEET_SCHEMA` for a fleet, else :data:`SCHEMA`."""
    return FLEET_SCHEMA if cluster else SCHEMA


DEFAULT_BYTES_PER_PARTITION = 32 * 1024 * 1024

#: The key of the consumer's figures in the progress's ``latestOffset`` (no
#: stream name starts with an underscore).
PROGRESS_KEY = "_consumer"

# --- options ------------------------------------------------------------------


def _positive(options: Mapping[str, str], name: str) -> int | None:
    text = options.get(name.lower())
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"headgate: option {name!r} must be an integer, got {text!r}") from None
    if value <= 0:
        raise ValueError(f"headgate: option {name!r} must be positive, got {value}")
    return value


def _positions(name: str, text: str, words: Sequence[str], *, addresses: bool) -> str | Offset:
    """A word of ``words``, or JSON from stream to position (or to record address)."""
    if text.strip().lower() in words:
        return text.strip().lower()
    try:
        parsed = json.loads(text)
    except ValueError:  # not JSON, or a number of more digits than Python converts
        parsed = None
    if not isinstance(parsed, dict):
        example = ' or {"orders": "4096:2"} (a record address)' if addresses else ""
        raise ValueError(
            f"headgate: option {name!r} must be {' or '.join(map(repr, words))} or a JSON "
            f'object from stream name to position, like {{"orders": 0}}{example}; got {text!r}'
        )
    offset: Offset = {}
    for stream, value in parsed.items():
        try:
            address = offset_address(value)
        except AddressError as error:
            raise ValueError(f"headgate: option {name!r}: stream {stream!r}: {error}") from None
        if address.index and not addresses:
            raise ValueError(
                f"headgate: option {name!r}: stream {stream!r}: {value!r} is inside a batch; "
                "it takes positions (where a batch starts)"
            )
        offset[str(stream)] = offset_value(address)
    return sorted_offset(offset)


@dataclass(frozen=True, slots=True)
class SourceOptions:
    """The source's options, checked; see the module docstring for each."""

    data_dir: str | None
    gateway: str | None
    selection: StreamSelection = field(default_factory=StreamSelection)
    starting: str | Offset = "earliest"
    ending: str | Offset = "latest"
    max_records: int | None = None
    max_bytes: int | None = None
    bytes_per_partition: int = DEFAULT_BYTES_PER_PARTITION
    security: ClientSecurity = field(default_factory=ClientSecurity)
    #: ``fail`` or ``wait``: see ``missingStreams``.
    missing_streams: str = "fail"
    #: ``startingTimestamp`` in µs since the epoch, or None.
    starting_timestamp_us: int | None = None
    #: The gateway consumer the query reads for (``consumer``), or None.
    consumer: str | None = None
    #: ``failOnDataLoss``.
    fail_on_data_loss: bool = True
    #: The fleet (``cluster``), or None; then ``selection`` names partition logs.
    cluster: Cluster | None = None
    #: With ``cluster``: the partitioned streams the query reads.
    fleet_streams: tuple[str, ...] = ()

    @classmethod
    def parse(cls, raw: Mapping[str, str]) -> SourceOptions:
        """Check Spark's (case-insensitive) options; ``ValueError`` names the bad one."""
        options = {str(k).lower(): str(v) for k, v in raw.items()}
        unknown = sorted(str(k) for k in raw if str(k).lower() not in _KNOWN_OPTIONS)
        if unknown:
            raise ValueError(
                f"headgate: unknown option{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(map(repr, unknown))}; the source takes "
                f"{', '.join(sorted(_KNOWN_OPTIONS.values(), key=str.lower))}"
            )
        data_dir, gateway = options.get("path"), options.get("gateway")
        cluster_path = options.get("cluster")
        if sum(o is not None for o in (data_dir, gateway, cluster_path)) != 1:
            raise ValueError(
                "headgate: set exactly one of option 'path' (a gateway's data directory), "
                "option 'gateway' (host:port) and option 'cluster' (a cluster file)"
            )
        if gateway is not None:
            host, _, port = gateway.strip().rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(
                    f"headgate: option 'gateway' must be host:port, like 127.0.0.1:7878; "
                    f"got {gateway!r}"
                )
            gateway = gateway.strip()
        security = _security(options, gateway is not None or cluster_path is not None)
        names, pattern = options.get("streams"), options.get("streampattern")
        if names is not None and pattern is not None:
            raise ValueError("headgate: set option 'streams' or 'streamPattern', not both")
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(
                    f"headgate: option 'streamPattern' is not a regex: {error}"
                ) from None
        missing = options.get("missingstreams", "fail").strip().lower()
        if missing not in MISSING_STREAMS:
            raise ValueError(
                f"headgate: option 'missingStreams' must be fail or wait, "
                f"got {options['missingstreams']!r}"
            )
        if "missingstreams" in options and names is None:
            raise ValueError(
                "headgate: option 'missingStreams' applies to the streams that option "
                "'streams' names (a streamPattern takes streams as they appear)"
            )
        if "startingtimestamp" in options and "startingoffsets" in options:
            raise ValueError(
                "headgate: set option 'startingOffsets' or 'startingTimestamp', not both"
            )
        consumer = options.get("consumer")
        if consumer is not None:
            consumer = consumer.strip()
            if not is_valid_name(consumer):
                raise ValueError(
                    f"headgate: option 'consumer' must be a consumer name (letters, digits, "
                    f"'.', '_' and '-', starting with a letter or digit), got {consumer!r}"
                )
        fail_text = options.get("failondataloss", "true").strip().lower()
        if fail_text not in ("true", "false"):
            raise ValueError(
                f"headgate: option 'failOnDataLoss' must be true or false, "
                f"got {options['failondataloss']!r}"
            )
        selection = StreamSelection(
            names=None
            if names is None
            else tuple(n.strip() for n in names.split(",") if n.strip()),
            pattern=pattern,
        )
        cluster: Cluster | None = None
        fleet_streams: tuple[str, ...] = ()
        if cluster_path is not None:
            cluster, fleet_streams = _fleet(cluster_path, selection)
            # The partitions' logs: a partition appears with its first record.
            selection = StreamSelection(
                names=tuple(
                    sorted(p.name for s in fleet_streams for p in cluster.stream(s).partitions)
                )
            )
            missing = "wait"
        return cls(
            data_dir=data_dir,
            gateway=gateway,
            selection=selection,
            starting=_positions(
                "startingOffsets",
                options.get("startingoffsets", "earliest"),
                ("earliest", "latest"),
                addresses=True,
            ),
            ending=_positions(
                "endingOffsets",
                options.get("endingoffsets", "latest"),
                ("latest",),
                addresses=False,
            ),
            max_records=_positive(options, "maxRecordsPerTrigger"),
            max_bytes=_positive(options, "maxBytesPerTrigger"),
            bytes_per_partition=_positive(options, "bytesPerPartition")
            or DEFAULT_BYTES_PER_PARTITION,
            security=security,
            missing_streams=missing,
            starting_timestamp_us=_timestamp_us(options.get("startingtimestamp")),
            consumer=consumer,
            fail_on_data_loss=fail_text == "true",
            cluster=cluster,
            fleet_streams=fleet_streams,
        )


def _fleet(path: str, selection: StreamSelection) -> tuple[Cluster, tuple[str, ...]]:
    """The cluster file, and the partitioned streams of it that ``selection`` picks."""
    try:
        cluster = load_cluster(path.strip())
    except ClusterError as error:
        raise ValueError(f"headgate: option 'cluster': {error}") from None
    if selection.names is not None:
        unknown = [n for n in selection.names if n not in cluster.streams]
        if unknown:
            raise ValueError(
                f"headgate: option 'streams': the cluster file {path} has no partitioned "
                f"stream {', '.join(map(repr, unknown))} (it has: "
                f"{', '.join(cluster.streams) or 'none'})"
            )
        return cluster, tuple(selection.names)
    return cluster, tuple(s for s in cluster.streams if selection.matches(s))


def _timestamp_us(text: str | None) -> int | None:
    """``startingTimestamp``: milliseconds since the epoch or an ISO-8601 time with a zone."""
    if text is None:
        return None
    text = text.strip()
    if text.isdigit():
        return int(text) * 1000
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        moment = None
    if moment is None or moment.tzinfo is None:
        raise ValueError(
            "headgate: option 'startingTimestamp' must be milliseconds since the epoch "
            f"or an ISO-8601 time with its zone (2026-11-25T06:00:00Z); got {text!r}"
        )
    return int(moment.timestamp() * 1_000_000)


#: How many stream names a message lists before it says how many more there are.
_NAMES_SHOWN = 20


def missing_streams_error(missing: Sequence[str], existing: Sequence[str], where: str) -> str:
    """The one line that refuses named streams that do not exist, and says what does."""
    quoted = ", ".join(map(repr, missing))
    subject = f"stream {quoted} does" if len(missing) == 1 else f"streams {quoted} do"
    if existing:
        shown = ", ".join(existing[:_NAMES_SHOWN])
        more = len(existing) - _NAMES_SHOWN
        has = f"{where} has {shown}{f' and {more} more' if more > 0 else ''}"
    else:
        has = f"{where} has no streams yet"
    return (
        f"headgate: {subject} not exist ({has}). A producer's first send creates a stream: "
        "check the name, or start the producers first, or set option missingStreams to "
        "'wait' (pipeline file: missing_streams = \"wait\") to read it once it appears"
    )


#: Option (lower case, as Spark hands them over) -> its spelling in messages.
_SECURITY_OPTIONS = {
    "token": "token",
    "tokenenv": "tokenEnv",
    "tokenfile": "tokenFile",
    "tls": "tls",
    "tlscafile": "tlsCaFile",
    "tlscertfile": "tlsCertFile",
    "tlskeyfile": "tlsKeyFile",
    "tlsservername": "tlsServerName",
}

#: Every option the source takes (lower case -> its spelling); any other is
#: refused, so that a misspelt or a Kafka-only option is not silently ignored.
_KNOWN_OPTIONS = {
    name.lower(): name
    for name in (
        "path",
        "gateway",
        "cluster",
        "streams",
        "streamPattern",
        "startingOffsets",
        "endingOffsets",
        "maxRecordsPerTrigger",
        "maxBytesPerTrigger",
        "bytesPerPartition",
        "missingStreams",
        "startingTimestamp",
        "consumer",
        "failOnDataLoss",
    )
} | _SECURITY_OPTIONS


def security_options(security: ClientSecurity) -> dict[str, str]:
    """The source options that give a reader ``security`` (for ``headgate pipeline``).

    Raises ValueError for a token given as such: it would show in Spark's plans.
    """
    if security.token is not None:
        raise ValueError("pass the token to Spark by tokenEnv or tokenFile, not as an option")
    options = {
        "tokenEnv": security.token_env,
        "tokenFile": security.token_file,
        "tls": "true" if security.tls else None,
        "tlsCaFile": security.ca_file,
        "tlsCertFile": security.cert_file,
        "tlsKeyFile": security.key_file,
        "tlsServerName": security.server_name,
    }
    return {key: value for key, value in options.items() if value is not None}


def _security(options: Mapping[str, str], remote: bool) -> ClientSecurity:
    """The token and TLS options, checked (they make sense only with ``gateway`` or ``cluster``)."""
    given = {key: options[key] for key in _SECURITY_OPTIONS if key in options}
    if not given:
        return ClientSecurity()
    if not remote:
        names = ", ".join(repr(_SECURITY_OPTIONS[k]) for k in given)
        raise ValueError(f"headgate: option {names} needs option 'gateway' (or 'cluster')")
    for key, value in given.items():
        if not value.strip():
            raise ValueError(f"headgate: option {_SECURITY_OPTIONS[key]!r} is empty")
    tls = given.get("tls", "false").strip().lower()
    if tls not in ("true", "false"):
        raise ValueError(f"headgate: option 'tls' must be true or false, got {given['tls']!r}")
    token = given.get("token")
    try:
        return ClientSecurity(
            token=None if token is None else token.encode(),
            token_env=given.get("tokenenv"),
            token_file=given.get("tokenfile"),
            tls=tls == "true",
            ca_file=given.get("tlscafile"),
            cert_file=given.get("tlscertfile"),
            key_file=given.get("tlskeyfile"),
            server_name=given.get("tlsservername"),
        )
    except SecurityError as error:
        text = str(error)
        for field_name, option in (
            ("token_env", "tokenEnv"),
            ("token_file", "tokenFile"),
            ("cert_file", "tlsCertFile"),
        ):
            text = text.replace(field_name, option)
        raise ValueError(f"headgate: {text}") from None


# --- partitions and reading -----------------------------------------------------


@dataclass(frozen=True)
class HeadgatePartition(InputPartition):
    """One Spark task's share of a batch: everything an executor needs to read it.

    A local read opens ``<data_dir>/streams/<stream>``; a remote read asks
    ``gateway`` for the same frames by stream and position.
    """

    #: Stream ranges to read, in order.
    slices: tuple[StreamSlice, ...]
    #: The gateway's data directory, for a local read.
    data_dir: str | None
    #: ``host:port`` of the gateway, for a remote read.
    gateway: str | None = None
    #: How to authenticate to it (a token's source, never logged; TLS files).
    security: ClientSecurity | None = None
    #: A fleet's read: each slice's partition number, for the ``partition`` column.
    partition_numbers: tuple[int, ...] | None = None


def _read(partition: InputPartition) -> Iterator[Any]:
    if not isinstance(partition, HeadgatePartition):
        return  # Spark's placeholder partition for an empty batch read
    schema = arrow_schema()
    if partition.gateway is not None:
        from headgate.spark.remote import read_remote_slice

        numbers = partition.partition_numbers
        for i, piece in enumerate(partition.slices):
            batches = read_remote_slice(
                partition.gateway, piece, schema, security=partition.security
            )
            if numbers is None:
                yield from batches
            else:
                yield from _with_partition(batches, numbers[i])
        return
    if partition.data_dir is None:
        raise SourceError("headgate: a partition with neither a gateway nor a data directory")
    for piece in partition.slices:
        yield from read_slice(partition.data_dir, piece, schema)


def _with_partition(batches: Iterator[Any], number: int) -> Iterator[Any]:
    """``batches`` with the ``partition`` column of :data:`FLEET_SCHEMA`, ``number`` in each row."""
    import pyarrow as pa

    field = pa.field("partition", pa.int32())
    for batch in batches:
        column = pa.array([number] * batch.num_rows, pa.int32())
        yield batch.add_column(1, field, column)


class _Planner:
    """Offsets and partitions over one data directory or gateway; shared by both readers."""

    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self.logs: Logs
        self.fleet: FleetLogs | None = None
        if options.cluster is not None:
            from headgate.spark.fleet import FleetLogs

            self.logs = self.fleet = FleetLogs(
                options.cluster, options.fleet_streams, options.security
            )
        elif options.gateway is not None:
            from headgate.spark.remote import GatewayLogs

            self.logs = GatewayLogs(options.gateway, options.selection, options.security)
        else:
            assert options.data_dir is not None
            self.logs = StreamLogs(options.data_dir, options.selection)
        # Where each stream absent from a start offset begins; remembered so
        # that latestOffset and partitions agree for a stream first seen now.
        self._first: dict[str, OffsetValue] = {}
        #: Per stream, what ``failOnDataLoss`` false skipped: from -> to.
        self.skips: dict[str, dict[int, int]] = {}
        #: Per stream, the records of each skip: from -> (to, records or None).
        self.skipped_counts: dict[str, dict[int, tuple[int, int | None]]] = {}
        #: Record counts: from the data directory, or asked of the gateways.
        self.counts: RecordCounter
        if isinstance(self.logs, StreamLogs):
            self.counts = LocalRecordCounts(self.logs.data_dir, self.logs.reader)
        else:
            self.counts = RemoteRecordCounts(self.logs)
        #: The counts at the ends this query planned (a skip from one is countable).
        self.planned_counts = PlannedCounts()

    def refuse_missing_streams(self, known: Iterable[str] = ()) -> None:
        """Fail if a stream that option ``streams`` names does not exist (``missingStreams``).

        ``known``: streams a checkpoint's offset already holds; one of those
        that is gone gets its own message (the position the query read it to).

        Raises:
            SourceError: one line naming the missing streams and those there are.
        """
        names = self.options.selection.names
        if names is None or self.options.missing_streams == "wait":
            return
        found = set(self.logs.discover()) | set(known)
        missing = [name for name in names if name not in found]
        if missing:
            raise SourceError(missing_streams_error(missing, self.logs.names(), self.logs.where()))

    def starting_offset(self) -> Offset:
        starting = self.options.starting
        streams = self.logs.discover()
        if starting == "latest":
            return sorted_offset({s: self.logs.latest(s) for s in streams})
        return sorted_offset({s: self.first_value(s) for s in streams})

    def first_value(self, stream: str) -> OffsetValue:
        """Where a stream that no offset mentions yet starts being read."""
        if stream not in self._first:
            starting = self.options.starting
            if isinstance(starting, dict) and stream in starting:
                self._first[stream] = self._checked_start(stream, offset_address(starting[stream]))
            elif self.options.starting_timestamp_us is not None:
                self._first[stream] = self.position_at(stream, self.options.starting_timestamp_us)
            else:
                self._first[stream] = self.logs.earliest(stream)
        return self._first[stream]

    def position_at(self, stream: str, timestamp_us: int) -> int:
        """The first frame of ``stream`` stored at or after ``timestamp_us``; the end if none.

        Reads the frame headers from the oldest retained position on, a page
        at a time (``startingTimestamp``: once per stream, when a query starts).
        """
        latest = self.logs.latest(stream)
        for frame in self.logs.frames(stream, self.logs.earliest(stream), latest):
            if frame.timestamp_us >= timestamp_us:
                return int(frame.position)
        return latest

    def begin_value(self, start: Offset, stream: str) -> OffsetValue:
        """Where ``stream`` is read from after ``start``: past what the log freed, if allowed.

        Raises:
            SourceError: the log freed the start before the query read it,
                and ``failOnDataLoss`` is true.
        """
        value = start[stream] if stream in start else self.first_value(stream)
        position = offset_position(value)
        try:
            earliest = self.logs.earliest(stream)
        except SourceError:
            if stream in start:  # gone: say how far the query had read it
                held = self.logs.latest(stream, read_up_to=position)
                if self.fleet is not None and held == position:
                    return value  # its gateway is down: the partition waits where it is
            raise
        if position >= earliest:
            return value
        if self.options.fail_on_data_loss:
            consumer = self.options.consumer
            raise SourceError(
                f"stream {stream!r}: position {position} was already released; the oldest "
                f"position the log retains is {earliest}: {earliest - position} bytes were "
                "freed before this query"
                + (f" (consumer {consumer!r})" if consumer else "")
                + " read them. Set option failOnDataLoss to false (pipeline file: "
                "fail_on_data_loss = false) to skip them, or make the consumer blocking"
            )
        skipped = self.skips.setdefault(stream, {})
        skipped[position] = max(earliest, skipped.get(position, earliest))
        counted = self.skipped_counts.setdefault(stream, {})
        if counted.get(position, (-1, None))[0] != skipped[position]:
            counted[position] = (
                skipped[position],
                self.records_between(stream, position, earliest),
            )
        return earliest

    def skipped_bytes(self, stream: str) -> int:
        """Bytes of ``stream`` skipped so far because the log freed them unread."""
        return sum(to - begin for begin, to in self.skips.get(stream, {}).items())

    def skipped_records(self, stream: str) -> int | None:
        """Records of ``stream`` skipped so far; None if one skip could not be counted."""
        total = 0
        for _, records in self.skipped_counts.get(stream, {}).values():
            if records is None:
                return None
            total += records
        return total

    def count_at(self, stream: str, position: int) -> tuple[int, int] | None:
        """``(epoch, C(position))`` of the record index, wherever it can be had.

        A position this query planned (counted then), one the log holds (the
        index and the frame headers), or the consumer's committed position
        (the gateway stores its count while the log holds it).
        """
        remembered = self.planned_counts.get(stream, position)
        if remembered is not None:
            return remembered
        return self.counts.count_at(stream, position) or self.counts.consumer_count(
            stream, self.options.consumer, position
        )

    def records_between(self, stream: str, start: int, end: int) -> int | None:
        """Records of ``stream`` in ``[start, end)``; None where they cannot be counted."""
        if start >= end:
            return 0
        first, last = self.count_at(stream, start), self.count_at(stream, end)
        if first is None or last is None or first[0] != last[0]:
            return None
        return max(0, last[1] - first[1])

    def remember_planned(self, stream: str, position: int) -> tuple[int, int] | None:
        """Count ``position`` (an end just planned) now, while the log holds it."""
        count = self.count_at(stream, position)
        if count is not None:
            self.planned_counts.remember(stream, position, count)
        return count

    def _checked_start(self, stream: str, address: RecordAddress) -> OffsetValue:
        """``startingOffsets``' address for ``stream``, once the log shows a record is there.

        Raises:
            SourceError: the position was released, is past the end or inside
                a batch, or the batch has no record at the index.
        """
        where = f"headgate: option 'startingOffsets': stream {stream!r}"
        earliest, latest = self.logs.earliest(stream), self.logs.latest(stream)
        if address.position < earliest:
            raise SourceError(
                f"{where}: position {address.position} was already released; the oldest "
                f"position the log retains is {earliest}"
            )
        if address.position > latest or (address.position == latest and address.index):
            raise SourceError(
                f"{where}: record address {address} is past the end of the log ({latest})"
            )
        if address.position < latest:
            try:
                frame = next(iter(self.logs.frames(stream, address.position, latest)), None)
            except SourceError as error:
                raise SourceError(
                    f"{where}: no batch starts at position {address.position} ({error})"
                ) from None
            try:
                address.check_in_frame(
                    stream,
                    latest if frame is None else frame.position,
                    0 if frame is None else frame.record_count,
                )
            except AddressError as error:
                raise SourceError(f"{where}: {error}") from None
        return offset_value(address)

    def ranges(
        self, start: Offset, cap: Offset | None
    ) -> tuple[dict[str, tuple[int, int]], Offset]:
        """Readable ``(from, latest)`` per selected stream, and the offsets carried as they are."""
        selection = self.options.selection
        carried = {s: p for s, p in start.items() if not selection.matches(s)}
        names = {s for s in start if selection.matches(s)}
        names.update(self.logs.discover() if cap is None else cap)
        ranges: dict[str, tuple[int, int]] = {}
        for stream in sorted(names):
            begin = offset_position(self.begin_value(start, stream))
            latest = self.logs.latest(stream, read_up_to=begin if stream in start else None)
            if latest < begin:
                raise SourceError(
                    f"stream {stream!r}: the log ends at position {latest}, before position "
                    f"{begin} the query has already read; was the log recreated?"
                )
            if cap is not None:
                latest = max(begin, min(latest, offset_position(cap.get(stream, begin))))
            ranges[stream] = (begin, latest)
        return ranges, carried

    def partitions(self, start: Offset, end: Offset) -> list[HeadgatePartition]:
        ranges: dict[str, tuple[int, int]] = {}
        inside: dict[str, RecordAddress] = {}  # streams that start inside a batch
        for stream, stop in end.items():
            begin = offset_address(self.begin_value(start, stream))
            ranges[stream] = (begin.position, offset_position(stop))
            if begin.index:
                inside[stream] = begin
        planned = plan_slices(self.logs, ranges, self.options.bytes_per_partition)
        if self.fleet is not None:
            return self._fleet_partitions(self.fleet, planned, inside)
        return [
            HeadgatePartition(
                tuple(_skipping(piece, inside) for piece in p),
                self.options.data_dir,
                self.options.gateway,
                self.options.security if self.options.gateway is not None else None,
            )
            for p in planned
        ]

    def _fleet_partitions(
        self,
        fleet: FleetLogs,
        planned: Sequence[Sequence[StreamSlice]],
        inside: Mapping[str, RecordAddress],
    ) -> list[HeadgatePartition]:
        """One Spark partition per planned share and gateway, with that gateway's security."""
        from headgate.spark.fleet import by_gateway, security_for

        security = {
            fleet.address(piece.stream): security_for(
                fleet.cluster, fleet.partition(piece.stream).gateway, self.options.security
            )
            for pieces in planned
            for piece in pieces
        }
        return [
            HeadgatePartition(
                tuple(_skipping(piece, inside) for piece in pieces),
                None,
                address,
                security[address],
                tuple(fleet.partition(piece.stream).index for piece in pieces),
            )
            for address, pieces in by_gateway(fleet, planned)
        ]

    def close(self) -> None:
        self.logs.close()


def _skipping(piece: StreamSlice, inside: Mapping[str, RecordAddress]) -> StreamSlice:
    """``piece``, told to skip the records before the address its stream starts at."""
    address = inside.get(piece.stream)
    if address is None or piece.start != address.position:
        return piece
    return replace(piece, skip=address.index)


class HeadgateStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batches over the stream logs; see the module docstring for the options."""

    def __init__(self, options: SourceOptions) -> None:
        self._options = options
        self._planner: _Planner | None = None
        #: The AvailableNow target: latest positions when the query started.
        self._target: Offset | None = None
        #: Whether the streams that option ``streams`` names were found (once a query).
        self._streams_checked = False
        #: The end offset :meth:`latestOffset` returned last (for the lag).
        self._planned: Offset | None = None

    # Spark pickles the reader to run read() in executors; the planner's open
    # logs stay behind (read() opens its own).
    def __getstate__(self) -> dict[str, Any]:
        return {"options": self._options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["options"])  # type: ignore[misc]

    @property
    def planner(self) -> _Planner:
        if self._planner is None:
            self._planner = _Planner(self._options)
        return self._planner

    def _check_streams(self, known: Iterable[str] = ()) -> None:
        # At the query's start: initialOffset for a new query, the first
        # latestOffset for one that resumes a checkpoint.
        if not self._streams_checked:
            self.planner.refuse_missing_streams(known)
            self._streams_checked = True

    def initialOffset(self) -> Offset:
        self._check_streams()
        return self.planner.starting_offset()

    def prepareForTriggerAvailableNow(self) -> None:
        logs = self.planner.logs
        self._target = sorted_offset({s: logs.latest(s) for s in logs.discover()})

    def getDefaultReadLimit(self) -> ReadLimit:
        if self._options.max_records is not None:
            return ReadMaxRows(self._options.max_records)
        if self._options.max_bytes is not None:
            return ReadMaxBytes(self._options.max_bytes)
        return ReadAllAvailable()

    def latestOffset(self, start: Offset, limit: ReadLimit) -> Offset:
        self._check_streams(start)
        ranges, carried = self.planner.ranges(start, self._target)
        max_records, max_bytes = self._limits(limit)
        ends: Offset
        if max_records is None and max_bytes is None:
            ends = {stream: latest for stream, (_, latest) in ranges.items()}
        else:
            ends = admit(self.planner.logs, ranges, max_records=max_records, max_bytes=max_bytes)
        # A stream that does not move keeps its start: an address inside a
        # batch must not turn into that batch's first record.
        kept: Offset = {
            stream: self.planner.begin_value(start, stream) if end == ranges[stream][0] else end
            for stream, end in ends.items()
        }
        self._planned = sorted_offset({**carried, **kept})
        return self._planned

    def _limits(self, limit: ReadLimit) -> tuple[int | None, int | None]:
        # Spark passes our default limit, or ReadAllAvailable to override it
        # (Trigger.Once). Only one limit travels; the other option still applies.
        if isinstance(limit, ReadAllAvailable):
            return None, None
        max_records = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        max_bytes = limit.max_bytes if isinstance(limit, ReadMaxBytes) else None
        return max_records or self._options.max_records, max_bytes or self._options.max_bytes

    def reportLatestOffset(self) -> dict[str, Any]:
        """Each stream's durable end, and the consumer's lag (``latestOffset`` in the progress).

        Spark calls it right after :meth:`latestOffset` and shows it in the
        batch's progress only; see the module docstring for the layout.
        """
        logs = self.planner.logs
        latest = sorted_offset({s: logs.latest(s) for s in logs.discover()})
        planner = self.planner
        planned = self._planned or {}
        lag = {
            stream: max(0, offset_position(end) - offset_position(planned[stream]))
            for stream, end in latest.items()
            if stream in planned
        }
        lag_records: dict[str, int | None] = {}
        for stream in sorted(lag):
            end = offset_position(planned[stream])
            planner.remember_planned(stream, end)
            lag_records[stream] = planner.records_between(
                stream, end, offset_position(latest[stream])
            )
        report: dict[str, Any] = dict(latest)
        report[PROGRESS_KEY] = {
            "name": self._options.consumer,
            "lag_bytes": lag,
            "lag_records": lag_records,
            "skipped_bytes": {s: planner.skipped_bytes(s) for s in sorted(lag)},
            "skipped_records": {s: planner.skipped_records(s) for s in sorted(lag)},
        }
        return report

    def partitions(self, start: Offset, end: Offset) -> Sequence[InputPartition]:
        return self.planner.partitions(start, end)

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return _read(partition)

    def commit(self, end: Offset) -> None:
        """Nothing to do here: the log is released by the gateway, not by Spark.

        Spark calls ``commit`` for batch N only when it plans batch N+1, so the
        last batch of a run is never committed in that run (DESIGN.md). The
        pipeline therefore reports Spark's progress to the gateway from its
        ``StreamingQueryListener.onQueryProgress``, which fires after every
        batch is committed, and the gateway releases log space behind it.
        """

    def stop(self) -> None:
        if self._planner is not None:
            self._planner.close()
            self._planner = None


class HeadgateBatchReader(DataSourceReader):
    """One batch over the logs, from ``startingOffsets`` to ``endingOffsets``."""

    def __init__(self, options: SourceOptions) -> None:
        self._options = options

    def partitions(self) -> Sequence[InputPartition]:
        planner = _Planner(self._options)
        try:
            planner.refuse_missing_streams()
            start = planner.starting_offset()
            ending = self._options.ending
            end: Offset = {
                stream: max(
                    offset_position(begin),
                    offset_position(ending[stream])
                    if isinstance(ending, dict) and stream in ending
                    else planner.logs.latest(stream),
                )
                for stream, begin in start.items()
            }
            return planner.partitions(start, end)
        finally:
            planner.close()

    def read(self, partition: InputPartition) -> Iterator[Any]:
        return _read(partition)


class HeadgateDataSource(DataSource):
    """``format("headgate")``: Spark's entry point to the stream logs."""

    def __init__(self, options: dict[str, str]) -> None:
        super().__init__(options)
        # Checked here so that a bad option fails at load(), not at the first batch.
        self._parsed = SourceOptions.parse(options)

    @classmethod
    def name(cls) -> str:
        return "headgate"

    def schema(self) -> StructType:
        return source_schema(self._parsed.cluster is not None)

    def _check_schema(self, schema: StructType) -> None:
        fixed = self.schema()
        if schema != fixed:
            raise ValueError(
                f"headgate: the schema is fixed ({fixed.simpleString()}); "
                f"do not pass another ({schema.simpleString()})"
            )

    def reader(self, schema: StructType) -> DataSourceReader:
        self._check_schema(schema)
        return HeadgateBatchReader(self._parsed)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        self._check_schema(schema)
        return HeadgateStreamReader(self._parsed)
