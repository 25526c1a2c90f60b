"""``headgate streams``: list and describe a gateway's streams, delete one offline.

Listing asks a running gateway (DescribeStreams, the ``read`` right with a
tokens file): positions, and when each stream's consumer last released it.
Deleting works on the data directory of a stopped gateway: it takes the
directory's lock, so it cannot run beside the gateway that owns it.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import click

from headgate.cli.options import client_security, gateway_option, security_options, table_or_json
from headgate.cli.text import bytes_text, in_use
from headgate.client.reader import ReaderError
from headgate.gateway.consumers import consumers_file
from headgate.gateway.server import DATA_LOCK_FILE_NAME
from headgate.gateway.streams import stream_files
from headgate.log.lock import DirectoryInUse, DirectoryLock
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


@click.group()
def streams() -> None:
    """List and describe a gateway's streams; delete one from a stopped gateway's directory."""


def _print_streams(rows: list[Any], fmt: str) -> None:
    if fmt == "json":
        for row in rows:
            click.echo(json.dumps(row.as_dict()))
        return

    now = time.time()
    header = ("stream", "start", "durable", "tail", "retained", "released")
    table = [header] + [
        (
            r.stream,
            f"{r.start_position:,}",
            f"{r.durable_position:,}",
            f"{r.tail_position:,}",
            bytes_text(r.retained_bytes),
            release_phrase(r.released_at_us, now),
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        # Names and the release time read from the left, numbers from the right.
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:-1], widths[1:-1], strict=True)
        ]
        click.echo("  ".join([*cells, row[-1]]).rstrip())


def _streams_from(gateway: str, names: tuple[str, ...], options: dict[str, Any]) -> list[StreamRow]:
    security = client_security(options)
    try:
        return asyncio.run(list_streams(gateway, security, names))
    except (ReaderError, LookupError) as exc:
        click.echo(f"headgate streams: {exc}", err=True)
        sys.exit(1)


_streams_format = table_or_json("table, or one JSON object per stream (for scripts).")


@streams.command(name="list")
@gateway_option
@_streams_format
@security_options
def streams_list(gateway: str, fmt: str, **options: Any) -> None:
    """Every stream of the gateway, with its positions and the bytes it retains.

    start: the oldest position kept (what Spark released is gone); durable:
    what is on disk and readable; tail: where the next batch goes; released:
    when a consumer last moved start (the gateway's clock, UTC).
    """
    rows = _streams_from(gateway, (), options)
    if not rows and fmt == "table":
        click.echo("no streams", err=True)
        return
    _print_streams(rows, fmt)


@streams.command(name="describe")
@click.argument("names", nargs=-1, required=True)
@gateway_option
@_streams_format
@security_options
def streams_describe(names: tuple[str, ...], gateway: str, fmt: str, **options: Any) -> None:
    """The positions of the streams NAMES, and when their consumers last released
    them; an unknown name is an error."""
    rows = _streams_from(gateway, names, options)
    if fmt == "json":
        _print_streams(rows, fmt)
        return

    now = time.time()
    for row in rows:
        click.echo(f"{row.stream}:")
        for key, value in row.as_dict().items():
            if isinstance(value, int) and key != "released_at_us":
                click.echo(f"  {key}: {value:,}")
        click.echo(f"  released: {release_phrase(row.released_at_us, now)}")


@streams.command(name="delete")
@click.argument("name")
@click.option(
    "--data-dir",
    type=click.Path(path_type=Path),
    default=Path("headgate-data"),
    show_default=True,
    help="The stopped gateway's data directory.",
)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def streams_delete(name: str, data_dir: Path, yes: bool) -> None:
    """Delete stream NAME's log and producer state, with the gateway stopped.

    Its records are gone for good, and producers that resume on it start a
    new sequence. A Spark checkpoint that read the stream refers to
    positions of the old log: delete it (and its output, if it should go
    too) before a pipeline reads a new stream of that name.
    """
    if not yes:
        click.confirm(f"Delete stream {name!r} and every record in it from {data_dir}?", abort=True)
    try:
        deleted = delete_stream(data_dir, name)
    except DirectoryInUse as exc:
        click.echo(
            f"headgate streams: {in_use(exc).replace('choose another --data-dir', 'try again')}",
            err=True,
        )
        sys.exit(1)
    except LookupError as exc:
        click.echo(f"headgate streams: {exc}", err=True)
        sys.exit(1)
    click.echo(f"deleted stream {name!r} ({bytes_text(deleted.bytes_removed)}) from {data_dir}")
