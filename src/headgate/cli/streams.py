"""``headgate streams``: list and describe a gateway's streams, delete one offline.

Listing asks a running gateway (DescribeStreams, the ``read`` right with a
tokens file): positions, and when each stream's consumer last released it.
Deleting works on the data directory of a stopped gateway: it takes the
directory's lock, so it cannot run beside the gateway that owns it.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from headgate.gateway.consumers import consumers_file
from headgate.gateway.server import DATA_LOCK_FILE_NAME
from headgate.gateway.streams import stream_files
from headgate.log.lock import DirectoryLock
from headgate.log.record_index import record_index_file
from headgate.protocol import messages as m


@dataclass(frozen=True, slots=True)
class StreamRow:
    """One stream as ``headgate streams list`` shows it."""

    stream: str
    start_position: int
    durable_position: int
    tail_position: int
    term_length: int
    #: When a Release last moved the start position, in microseconds since the
    #: Unix epoch (UTC, the gateway's clock); 0: none since the gateway started;
    #: None: the gateway does not say (it predates DescribeStreams).
    released_at_us: int | None = None

    @property
    def retained_bytes(self) -> int:
        """Log bytes between the oldest retained position and the tail."""
        return self.tail_position - self.start_position

    @classmethod
    def of(cls, info: m.StreamInfo, released_at_us: int | None = None) -> StreamRow:
        return cls(
            info.stream,
            info.start_position,
            info.durable_position,
            info.tail_position,
            info.term_length,
            released_at_us,
        )

    def as_dict(self) -> dict[str, int | str | None]:
        released = self.released_at_us
        return {
            "stream": self.stream,
            "start_position": self.start_position,
            "durable_position": self.durable_position,
            "tail_position": self.tail_position,
            "term_length": self.term_length,
            "retained_bytes": self.retained_bytes,
            "released_at_us": released,
            "released_at": _utc(released).isoformat().replace("+00:00", "Z") if released else None,
        }


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _utc(time_us: int) -> datetime:
    # Exact to the microsecond up to MAX_TIME_US (a float of seconds rounds the
    # last microsecond of 9999 into the year 10000).
    return _EPOCH + timedelta(microseconds=time_us)


def release_phrase(released_at_us: int | None, now: float) -> str:
    """When a stream's consumer last released it, for people: ``03:12:40 UTC (95 s
    ago)`` (with the date when it is not today's, UTC), ``never since the gateway
    started``, or ``not reported`` by a gateway that predates DescribeStreams.

    ``now`` is this machine's clock (seconds since the epoch); the time is the
    gateway's, so a skewed clock shows in the "ago".
    """
    if released_at_us is None:
        return "not reported by this gateway"
    if released_at_us == 0:
        return "never since the gateway started"
    at = _utc(released_at_us)
    shown = (
        "%H:%M:%S UTC"
        if at.date() == datetime.fromtimestamp(now, tz=UTC).date()
        else ("%Y-%m-%d %H:%M:%S UTC")
    )
    return f"{at.strftime(shown)} ({_ago(now - released_at_us / 1_000_000)})"


def _ago(seconds: float) -> str:
    if seconds < 0:
        return f"{-seconds:.0f} s ahead of this machine's clock"
    for unit, size, up_to in (("s", 1, 120), ("min", 60, 7200), ("h", 3600, 172_800)):
        if seconds < up_to:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{seconds / 86400:.0f} days ago"


def consumer_silence(released_at_us: int | None, now: float) -> str | None:
    """Since when nobody released a stream, as ``headgate send`` says it of a full
    stream; None when the gateway does not say."""
    if released_at_us is None:
        return None
    if released_at_us == 0:
        return "no consumer has released it since the gateway started"
    return f"its consumer has not released it since {release_phrase(released_at_us, now)}"


async def list_streams(
    gateway: str, security: object | None = None, names: Sequence[str] = ()
) -> list[StreamRow]:
    """The gateway's streams (only ``names`` if given), sorted by name.

    Raises:
        ReaderError: the gateway cannot be reached or refused the request.
        LookupError: a stream of ``names`` does not exist.
    """
    from headgate.client.reader import Reader, ReaderRefused
    from headgate.client.security import ClientSecurity
    from headgate.protocol.errors import ErrorCode

    assert security is None or isinstance(security, ClientSecurity)
    try:
        async with Reader(gateway, client_name="headgate-streams", security=security) as reader:
            rows = [StreamRow.of(d.info, d.released_at_us) for d in await reader.describe_streams()]
    except ReaderRefused as exc:
        if exc.code is not ErrorCode.MALFORMED_MESSAGE:
            raise
        # A gateway older than DescribeStreams: positions only.
        async with Reader(gateway, client_name="headgate-streams", security=security) as reader:
            rows = [StreamRow.of(info) for info in await reader.list_streams()]
    if names:
        known = {row.stream for row in rows}
        missing = [name for name in names if name not in known]
        if missing:
            raise LookupError(
                f"the gateway at {gateway} has no stream {', '.join(map(repr, missing))}"
            )
        rows = [row for row in rows if row.stream in names]
    return sorted(rows, key=lambda row: row.stream)


@dataclass(frozen=True, slots=True)
class ConsumerRow:
    """One consumer as ``headgate consumers`` shows it."""

    stream: str
    consumer: str
    position: int
    lag_bytes: int
    lag_seconds: float
    blocking: bool
    on_data_loss: str
    #: ``ok``, ``idle`` (blocking, holding the producers) or ``detached``.
    state: str
    #: Records in the durable log after its position; None where the gateway
    #: cannot count them (or is older than the field).
    lag_records: int | None = None

    @classmethod
    def of(cls, stream: str, info: m.ConsumerInfo) -> ConsumerRow:
        state = "detached" if info.detached else "idle" if info.idle else "ok"
        return cls(
            stream,
            info.consumer,
            info.position,
            info.lag_bytes,
            info.lag_ms / 1000,
            info.blocking,
            "skip" if info.skip_data_loss else "fail",
            state,
            info.lag_records,
        )

    def as_dict(self) -> dict[str, int | str | float | bool | None]:
        return {
            "stream": self.stream,
            "consumer": self.consumer,
            "position": self.position,
            "lag_bytes": self.lag_bytes,
            "lag_records": self.lag_records,
            "lag_seconds": self.lag_seconds,
            "blocking": self.blocking,
            "on_data_loss": self.on_data_loss,
            "state": self.state,
        }


async def list_consumers(
    gateway: str, security: object | None = None, names: Sequence[str] = ()
) -> list[ConsumerRow]:
    """The consumers of the gateway's streams (only ``names`` if given), by stream and name.

    Raises:
        ReaderError: the gateway cannot be reached or refused the request.
        LookupError: a stream of ``names`` does not exist.
    """
    from headgate.client.reader import Reader
    from headgate.client.security import ClientSecurity

    assert security is None or isinstance(security, ClientSecurity)
    async with Reader(gateway, client_name="headgate-consumers", security=security) as reader:
        known = [info.stream for info in await reader.list_streams()]
        missing = [name for name in names if name not in known]
        if missing:
            raise LookupError(
                f"the gateway at {gateway} has no stream {', '.join(map(repr, missing))}"
            )
        rows: list[ConsumerRow] = []
        for stream in sorted(names or known):
            rows += [ConsumerRow.of(stream, c) for c in await reader.list_consumers(stream)]
    return rows


@dataclass(frozen=True, slots=True)
class Deleted:
    """What ``delete_stream`` removed."""

    stream: str
    #: Bytes of the log's files, its producer state and its consumers.
    bytes_removed: int
    paths: tuple[Path, ...]


def delete_stream(data_dir: Path, name: str) -> Deleted:
    """Remove stream ``name``'s log and producer state from a stopped gateway's directory.

    Raises:
        DirectoryInUse: a gateway (or another delete) holds the directory.
        LookupError: the directory holds no such stream.
    """
    if not m.is_valid_name(name):
        raise LookupError(f"{name!r} is not a stream name")
    log_dir, state = stream_files(data_dir, name)
    if not data_dir.is_dir():
        raise LookupError(f"{data_dir} is not a directory")
    lock = DirectoryLock.acquire(data_dir, DATA_LOCK_FILE_NAME)
    try:
        if not log_dir.is_dir():
            raise LookupError(f"{data_dir} holds no stream {name!r}")
        size = sum(f.stat().st_size for f in log_dir.rglob("*") if f.is_file())
        paths = [log_dir]
        extras = (state, consumers_file(data_dir, name), record_index_file(data_dir, name))
        for extra in extras:
            if extra.exists():
                size += extra.stat().st_size
                paths.append(extra)
        # A crash in the middle leaves a log without its directory entry or
        # without its state: both are what a stream that never existed has.
        shutil.rmtree(log_dir)
        state.unlink(missing_ok=True)
        # Its consumers and record counts go with it: a new stream of that
        # name starts afresh.
        consumers_file(data_dir, name).unlink(missing_ok=True)
        record_index_file(data_dir, name).unlink(missing_ok=True)
        return Deleted(name, size, tuple(paths))
    finally:
        lock.release()
