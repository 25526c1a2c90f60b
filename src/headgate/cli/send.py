"""``headgate send STREAM FILE``: the lines of a file (or stdin) as records of a stream.

With a cluster (``--cluster``), STREAM is a partitioned stream and a
:class:`~headgate.client.FleetProducer` sends the lines (keyless: sticky
partitions, round robin among the gateways that are up); a gateway that is
down at the start is named in one line on stderr, and the lines go to the
others.

Lines are read in a thread, so that a pipe that is quiet (``tail -f log |
headgate send``) never stalls the event loop that receives the gateway's
acknowledgements, and so that Ctrl-C is heard while the read waits. Ctrl-C
stops the reading, gives what was sent a few seconds to become durable (a
second Ctrl-C stops that too), and then reports what the gateway
acknowledged: a run that was cut short says where to pick it up.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import sys
import threading
import time
from array import array
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Final

import click
from rich.console import Console
from rich.progress import Progress, ProgressColumn, Task, TextColumn
from rich.text import Text

from headgate.cli.options import client_security, gateway_option, security_options
from headgate.client import (
    FleetProducer,
    GatewayAddress,
    Producer,
    ProducerError,
    ProducerGaveUp,
    SpoolError,
)
from headgate.client.producer import Policy
from headgate.client.security import ClientSecurity
from headgate.cluster import Cluster, ClusterError, load_cluster
from headgate.config import ConfigError
from headgate.protocol.messages import MAX_SECRET_BYTES, is_valid_name

__all__ = ["SendOptions", "SendReport", "run_send", "send"]

#: How long an interrupted send waits for the acknowledgements of what it sent.
INTERRUPT_GRACE_S: Final = 5.0
#: Bytes the reading thread hands over at a time, and chunks it may hold ahead.
#: A stream that gives no credit this long is said to be full (on stderr).
FULL_AFTER_S: Final = 2.0
#: How long saying why a stream is full may wait for the gateway's DescribeStreams.
DESCRIBE_TIMEOUT_S: Final = 5.0
_CHUNK_BYTES: Final = 1 << 16
_CHUNKS_AHEAD: Final = 8
_POLICIES: Final[dict[str, Policy]] = {
    "wait": "wait",
    "optimistic": "optimistic",
    "window": "window",
}
#: Line numbers a report of bad lines names before it says "and N more".
_LINES_NAMED: Final = 10


@dataclass(frozen=True, slots=True)
class SendOptions:
    gateway: str
    stream: str
    #: "raw" (every line is a record) or "jsonl" (lines that are not JSON are skipped).
    fmt: str = "raw"
    #: The producer's policy: "wait", "optimistic" or "window".
    policy: str = "wait"
    producer_id: int | None = None
    producer_secret: bytes | None = None
    #: Seconds to keep trying to reach the gateway.
    timeout: float = 30.0
    security: ClientSecurity = field(default_factory=ClientSecurity)
    #: Show a progress line on stderr (only where stderr is a terminal).
    progress: bool = True
    #: The producer's spool directory (see Producer's spool), or None.
    spool: Path | None = None
    #: A fleet: ``stream`` is one of its partitioned streams (``gateway`` is unused).
    cluster: Cluster | None = None


@dataclass(slots=True)
class SendReport:
    """What a send did; the command turns it into its last lines of output."""

    stream: str
    gateway: str = ""
    #: Records handed to the producer.
    sent: int = 0
    #: Records that went to the gateway at least once.
    transmitted: int = 0
    #: Records written to the spool (with --spool): sent again by the next
    #: send on the same spool, so the input goes on after them.
    spooled: int = 0
    #: Records (and their bytes) the gateway acknowledged durable.
    acked: int = 0
    bytes_acked: int = 0
    #: Line numbers (from 1) that were not valid JSON, in order; nothing was sent for them.
    bad_lines: array[int] = field(default_factory=lambda: array("q"))
    #: Why the first bad line is not JSON.
    first_bad_reason: str = ""
    #: Whether Ctrl-C cut the send short, and whether the gateway had answered by then.
    interrupted: bool = False
    connected: bool = False
    #: The producer's id, and the secret that proves it (None with a token).
    producer_id: int | None = None
    producer_secret: bytes | None = None

    def line_of_record(self, count: int) -> int:
        """The input line that holds the ``count``-th record sent (from 1).

        Records are the lines that are not bad, in order: the k-th record is
        line k, moved on by each bad line at or before it.
        """
        line = count
        for bad in self.bad_lines:
            if bad > line:
                break
            line += 1
        return line

    def bad_lines_message(self) -> str:
        """One line naming the lines that were not JSON, or "" if there were none."""
        bad = len(self.bad_lines)
        if not bad:
            return ""
        named = ", ".join(f"{n:,}" for n in self.bad_lines[:_LINES_NAMED])
        more = f" and {bad - _LINES_NAMED:,} more" if bad > _LINES_NAMED else ""
        were = "line was" if bad == 1 else "lines were"
        which = "line" if bad == 1 else "lines"
        return (
            f"{bad:,} {were} not valid JSON and not sent: {which} {named}{more} "
            f"(line {self.bad_lines[0]:,}: {self.first_bad_reason})"
        )

    def resume_hint(self) -> str:
        """How to go on with this producer's identity, or "" without one."""
        if self.producer_id is None:
            return ""
        hint = f"to resume this producer: --producer-id {self.producer_id}"
        if self.producer_secret is not None:
            hint += f" --producer-secret {self.producer_secret.hex()}"
        return hint

    def interrupted_message(self) -> str:
        """What an interrupted send stored, and where its input should go on from."""
        if not self.connected:
            return f"interrupted before gateway {self.gateway} answered; nothing was sent"
        if self.spooled:
            done = self.line_of_record(self.spooled)
            return (
                f"interrupted: {self.acked:,} of {self.sent:,} records acknowledged durable on "
                f"{self.stream}; input up to line {done:,} is acknowledged or spooled (the "
                f"next send with the same --spool sends it again, each record once); go on "
                f"from line {done + 1:,}"
            )
        done = self.line_of_record(self.acked) if self.acked else 0
        stored = f"go on from line {done + 1:,}"
        if done:
            stored = f"input up to line {done:,} is done; {stored}"
        # Those the gateway received and did not acknowledge yet may be stored
        # or not; the others never left this process.
        unknown = self.transmitted - self.acked
        pending = (
            f"; {unknown:,} more reached the gateway without an acknowledgement "
            "(they may be stored)"
            if unknown > 0
            else ""
        )
        return (
            f"interrupted: {self.acked:,} of {self.sent:,} records acknowledged durable on "
            f"{self.stream} ({stored}){pending}"
        )


class _RateColumn(ProgressColumn):
    def render(self, task: Task) -> Text:
        return Text(f"{task.speed or 0:,.0f} records/s")


def _unlocked_read(source: BinaryIO) -> Any:
    """A ``read(n)`` of ``source`` that takes no lock of Python's (see :func:`_chunks`)."""
    try:
        fd = source.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return getattr(source, "read1", source.read)  # in memory: nothing to abort on
    return lambda size: os.read(fd, size)


async def _chunks(source: BinaryIO) -> AsyncIterator[bytes]:
    """The bytes of ``source`` as they come, read in a daemon thread.

    The thread reads at most :data:`_CHUNKS_AHEAD` chunks ahead of the loop.
    It hands them over with ``call_soon_threadsafe``, which leaves nothing
    pending in the loop when the send ends early; and it is a daemon, so
    that a read still waiting on a terminal or a pipe then never keeps the
    process alive. A source with a file descriptor (stdin, a file) is read
    with ``os.read`` on it, not through its buffered reader: a daemon thread
    blocked inside a buffered read holds that reader's lock, and the
    interpreter, flushing the standard streams as it exits (after Ctrl-C, say),
    then aborts with "could not acquire lock ... at interpreter shutdown".
    Nothing else reads the source, so its buffer is empty when this starts.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[bytes | BaseException] = asyncio.Queue()
    room = threading.Semaphore(_CHUNKS_AHEAD)
    read = _unlocked_read(source)

    def pump() -> None:
        item: bytes | BaseException = b"x"
        while item:
            room.acquire()
            try:
                item = read(_CHUNK_BYTES)
            except BaseException as exc:  # handed to the loop, which raises it
                item = exc
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody wants the rest
                return
            if isinstance(item, BaseException):
                return

    threading.Thread(target=pump, name="headgate-send-read", daemon=True).start()
    while True:
        item = await queue.get()
        room.release()
        if isinstance(item, BaseException):
            raise item
        if not item:
            return
        yield item


async def _lines(source: BinaryIO) -> AsyncIterator[list[bytes]]:
    """The lines of ``source`` without their line ends, a chunk's worth at a time.

    A last line may lack its newline. Lists, not single lines: an await per
    line would cost a third of the command's speed.
    """
    rest = b""
    async for chunk in _chunks(source):
        lines = (rest + chunk).split(b"\n")
        rest = lines.pop()
        yield [line.removesuffix(b"\r") for line in lines]
    if rest:
        yield [rest.removesuffix(b"\r")]


async def _feed(
    producer: Producer | FleetProducer,
    source: BinaryIO,
    options: SendOptions,
    report: SendReport,
    progress: Progress,
) -> None:
    task = progress.add_task(f"sending to {options.stream}", total=None)
    number = 0
    async for lines in _lines(source):
        for value in lines:
            number += 1
            if options.fmt == "jsonl":
                try:
                    json.loads(value)
                except ValueError as exc:
                    if not report.bad_lines:
                        report.first_bad_reason = (
                            f"column {exc.colno}: {exc.msg}"
                            if isinstance(exc, json.JSONDecodeError)
                            else str(exc)
                        )
                    report.bad_lines.append(number)
                    continue
            await producer.send(options.stream, value)
            report.sent += 1
        progress.update(task, completed=report.sent)
    progress.update(task, completed=report.sent, description="waiting for durable acks")


class _CtrlC:
    """Ctrl-C for the whole send: it cancels the step under way, and is remembered.

    One handler from start to end, so that no Ctrl-C, even one between two
    steps, becomes a KeyboardInterrupt with a traceback.
    """

    def __init__(self) -> None:
        #: How many times Ctrl-C was pressed.
        self.pressed = 0
        self._step: asyncio.Task[None] | None = None

    def __call__(self) -> None:
        self.pressed += 1
        if self._step is not None:
            self._step.cancel()

    async def run(self, work: Coroutine[Any, Any, None], timeout: float | None = None) -> bool:
        """Run one step; whether it finished (not cut short by Ctrl-C or ``timeout``).

        Raises what the step raised.
        """
        step = asyncio.create_task(work)
        self._step = step
        try:
            done, _ = await asyncio.wait({step}, timeout=timeout)
        finally:
            self._step = None
        if not done:
            step.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await step
            return False
        if step.cancelled():
            return False
        step.result()
        return True


def _waiting(producer: Producer, stream: str) -> tuple[int, str | None] | None:
    """Records acknowledged so far, while batches of ``stream`` wait, and the
    gateway's reason when it cannot store (None: the stream's log is full).

    None while nothing waits for the gateway (or the producer is not connected:
    reconnecting is another story).
    """
    snapshot = producer.statistics()
    stats = snapshot.streams.get(stream)
    if stats is None or not snapshot.connected or not stats.batches_queued:
        return None
    return stats.records_acked, stats.storage_full


def _why_full(storage_full: str | None, silence: str | None) -> str:
    """Why a stream stays full: the gateway's disk, or its log, which only its
    consumer frees (``silence``: since when nobody released it, if the gateway says)."""
    if storage_full is not None:
        return f"the gateway cannot store it now: {storage_full}"
    full = "its log is full" if silence is None else f"its log is full and {silence}"
    return (
        f"{full}: the gateway gives no credit until the stream's consumer "
        "(the Spark pipeline) writes what is there and releases it"
    )


async def _consumer_silence(options: SendOptions) -> str | None:
    """Since when no consumer released ``options.stream``, from the gateway's
    DescribeStreams; None when it cannot say (an older gateway, a token that may
    not read the stream, no answer in DESCRIBE_TIMEOUT_S)."""
    from headgate.cli.streams import consumer_silence, list_streams
    from headgate.client.reader import ReaderError

    try:
        async with asyncio.timeout(DESCRIBE_TIMEOUT_S):
            (row,) = await list_streams(options.gateway, options.security, [options.stream])
    except (ReaderError, LookupError, OSError, TimeoutError):
        return None
    return consumer_silence(row.released_at_us, time.time())


async def _watch_full(producer: Producer, options: SendOptions, console: Console) -> None:
    """Say on stderr when the stream stays full (batches wait, nothing is
    acknowledged), why, and since when its consumer has not released it."""
    stream = options.stream
    loop = asyncio.get_running_loop()
    since: float | None = None
    acked = -1
    said = False
    while True:
        await asyncio.sleep(0.25)
        now = loop.time()
        waiting = _waiting(producer, stream)
        if waiting is None or waiting[0] != acked:
            if said and since is not None:
                console.print(
                    f"headgate send: {stream} flows again after {now - since:.0f} s",
                    markup=False,
                    highlight=False,
                    soft_wrap=True,
                )
            since, said = None, False
            acked = -1 if waiting is None else waiting[0]
            if waiting is not None:
                since = now
            continue
        if since is None:
            since = now
        if not said and now - since >= FULL_AFTER_S:
            silence = None if waiting[1] is not None else await _consumer_silence(options)
            console.print(
                f"headgate send: {stream} is full for {now - since:.0f} s: "
                f"{_why_full(waiting[1], silence)}",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
            said = True


async def _reach_fleet(producer: FleetProducer, options: SendOptions, console: Console) -> None:
    """Connect to the stream's gateways; one line on stderr per gateway that is down.

    Raises:
        ProducerError: none of them answered within ``options.timeout``.
    """
    stats = await producer.reach(options.stream, options.timeout)
    holders = dict.fromkeys(producer.cluster.stream(options.stream).holders)
    down = [stats.gateways[g] for g in holders if not stats.gateways[g].up]
    why = [f"{g.name} ({g.address}): {g.last_error or 'no answer'}" for g in down]
    if len(down) == len(holders):
        raise ProducerError(
            f"no gateway of {options.stream} answered within {options.timeout:g} s: "
            + "; ".join(why)
        )
    for line in why:
        console.print(
            f"headgate send: gateway {line}; its partitions of {options.stream} get no "
            "records, the other gateways take them",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )


async def _send_all(
    producer: Producer | FleetProducer,
    source: BinaryIO,
    options: SendOptions,
    report: SendReport,
    progress: Progress,
    ctrl_c: _CtrlC,
) -> None:
    if isinstance(producer, FleetProducer):
        reached = await ctrl_c.run(_reach_fleet(producer, options, progress.console))
    else:
        reached = await ctrl_c.run(producer.connect())
    if not reached or ctrl_c.pressed:
        report.interrupted = True
        return
    report.connected = True
    watcher = None
    if isinstance(producer, Producer):
        # A fleet's partitions are not watched: keyless lines move to those with credit.
        watcher = asyncio.create_task(_watch_full(producer, options, progress.console))
    try:
        with progress:
            fed = await ctrl_c.run(_feed(producer, source, options, report, progress))
            if fed and not ctrl_c.pressed:
                report.interrupted = not await ctrl_c.run(producer.flush())
                return
            report.interrupted = True
            if ctrl_c.pressed < 2:
                # What was sent gets a moment to become durable; a second
                # Ctrl-C, or a stream that stays full, ends the wait.
                with contextlib.suppress(Exception):
                    await ctrl_c.run(producer.flush(), timeout=INTERRUPT_GRACE_S)
    finally:
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher


async def run_send(options: SendOptions, source: BinaryIO) -> SendReport:
    """Send every line of ``source``; return the report, also when interrupted.

    Raises :class:`~headgate.client.ProducerError` when the gateway cannot
    be reached or refuses the stream.
    """
    gateway = options.gateway
    if options.cluster is not None:
        gateway = ", ".join(dict.fromkeys(options.cluster.stream(options.stream).holders))
    report = SendReport(options.stream, gateway)
    console = Console(stderr=True)
    progress = Progress(
        TextColumn("{task.description}"),
        TextColumn("{task.completed:,} records"),
        _RateColumn(),
        console=console,
        transient=True,
        disable=not (options.progress and console.is_terminal),
    )
    producer: Producer | FleetProducer
    if options.cluster is not None:
        producer = FleetProducer(
            cluster=options.cluster,
            policy=_POLICIES[options.policy],
            producer_id=options.producer_id,
            client_name="headgate-send",
            partition_timeout=options.timeout,
            security=options.security,
            spool=options.spool,
        )
    else:
        producer = Producer(
            options.gateway,
            policy=_POLICIES[options.policy],
            producer_id=options.producer_id,
            producer_secret=options.producer_secret,
            client_name="headgate-send",
            reconnect_timeout=options.timeout,
            security=options.security,
            spool=options.spool,
        )
    report.producer_id = producer.producer_id
    ctrl_c = _CtrlC()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, ctrl_c)
    try:
        await _send_all(producer, source, options, report, progress, ctrl_c)
        if report.interrupted:
            await producer.abort()  # what was not acknowledged by now is given up
        else:
            await producer.close()
    except ProducerGaveUp as exc:
        await producer.abort()
        if options.spool is None:
            raise
        # Everything the producer took is in the spool now (see Producer).
        line = report.line_of_record(report.sent) + 1 if report.sent else 1
        raise ProducerError(
            f"{exc}. The spool {options.spool} keeps every record not acknowledged: send "
            f"again with the same --spool and the input from line {line:,}"
        ) from exc
    except BaseException:
        await producer.abort()
        raise
    finally:
        loop.remove_signal_handler(signal.SIGINT)
    if isinstance(producer, FleetProducer):
        for partition in producer.statistics().partitions.values():
            if partition.stream == options.stream:
                report.acked += partition.records_acked
                report.bytes_acked += partition.bytes_acked
                report.transmitted += partition.records_sent
                report.spooled += partition.records_spooled
        return report
    stats = producer.statistics().streams.get(options.stream)
    if stats is not None:
        report.acked, report.bytes_acked = stats.records_acked, stats.bytes_acked
        report.transmitted = stats.records_sent
        report.spooled = stats.records_spooled
    report.producer_secret = producer.producer_secret
    return report


@click.command()
@click.argument("stream")
@click.argument("source", type=click.File("rb"), default="-")
@gateway_option
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["jsonl", "raw"]),
    default="raw",
    show_default=True,
    help="jsonl: each line must be a JSON value (bad lines are reported, not sent).",
)
@click.option(
    "--policy",
    type=click.Choice(["wait", "optimistic", "window"]),
    default="wait",
    show_default=True,
    help="window: for streams with the gateway's window policy (one batch per slot).",
)
@click.option("--producer-id", type=int, help="Reuse an id to resume after a crash.")
@click.option(
    "--producer-secret",
    help="With --producer-id, the hex secret that proves the id is ours (without tokens); "
    "printed when a send without tokens ends.",
)
@click.option(
    "--timeout",
    type=float,
    default=30.0,
    show_default=True,
    help="Seconds to keep trying to reach the gateway before giving up.",
)
@click.option(
    "--spool",
    type=click.Path(file_okay=False, path_type=Path),
    help="Keep unacknowledged records in this directory, so that a send cut short "
    "(Ctrl-C, a crash, a gateway away past --timeout) is resumed by the next send "
    "with the same --spool, each record stored once; the input goes on from the line "
    "it reports.",
)
@click.option(
    "--cluster",
    type=click.Path(path_type=Path),
    help="STREAM is partitioned over this cluster file's gateways (--gateway is not "
    "used): lines go to sticky partitions, round robin among the gateways that are up; "
    "--timeout bounds how long they wait for a gateway that is down.",
)
@security_options
def send(
    stream: str,
    source: Any,
    gateway: str,
    fmt: str,
    policy: str,
    producer_id: int | None,
    producer_secret: str | None,
    timeout: float,
    spool: Path | None,
    cluster: Path | None,
    **options: Any,
) -> None:
    """Send the lines of SOURCE (a file, or - for stdin) as records of STREAM.

    Each line (without its newline) is one record. Shows progress while it
    sends and reports the records and bytes the gateway acknowledged durable.
    On Ctrl-C it reports what was acknowledged, the input line to go on
    from, and the producer id to go on with (exit status 130).
    """
    try:
        GatewayAddress.parse(gateway, what="--gateway")
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    loaded = None
    if cluster is not None:
        if producer_secret is not None:
            raise click.UsageError(
                "--producer-secret does not go with --cluster: each gateway of a fleet keeps "
                "its own secret (resume a fleet send with --spool)"
            )
        try:
            loaded = load_cluster(cluster)
            loaded.stream(stream)
        except ClusterError as exc:
            click.echo(f"headgate send: {exc}", err=True)
            sys.exit(2)
    if not is_valid_name(stream):
        raise click.UsageError(
            f"{stream!r} is not a stream name: letters, digits, '.', '_' and '-', "
            "up to 255, starting with a letter or digit"
        )
    secret = None
    if producer_secret is not None:
        if producer_id is None:
            raise click.UsageError("--producer-secret goes with the --producer-id it proves")
        try:
            secret = bytes.fromhex(producer_secret)
        except ValueError:
            raise click.UsageError("--producer-secret must be hex digits") from None
        if not 1 <= len(secret) <= MAX_SECRET_BYTES:
            raise click.UsageError(f"--producer-secret must be 1 to {MAX_SECRET_BYTES} bytes")
    security = client_security(options)
    send_options = SendOptions(
        gateway,
        stream,
        fmt,
        policy,
        producer_id,
        secret,
        timeout,
        security=security,
        spool=spool,
        cluster=loaded,
    )
    try:
        report = asyncio.run(run_send(send_options, source))
    except ProducerError as exc:
        click.echo(f"headgate send: {exc}", err=True)
        sys.exit(1)
    except (SpoolError, ValueError) as exc:
        click.echo(f"headgate send: {exc}", err=True)
        sys.exit(1)
    if report.interrupted:
        click.echo(f"headgate send: {report.interrupted_message()}", err=True)
    else:
        where = f"{stream} ({report.gateway})" if loaded is not None else stream
        click.echo(
            f"{report.acked:,} records ({report.bytes_acked:,} bytes) "
            f"acknowledged durable on {where}"
        )
    if bad_lines := report.bad_lines_message():
        click.echo(f"headgate send: {bad_lines}", err=True)
    if report.producer_secret is not None or (report.interrupted and report.transmitted):
        # Without tokens the id is its secret's: what resuming it takes.
        click.echo(report.resume_hint(), err=True)
    if report.interrupted:
        sys.exit(130)
    if report.acked != report.sent:
        click.echo(
            f"headgate send: only {report.acked:,} of {report.sent:,} records were acknowledged",
            err=True,
        )
        sys.exit(1)
    if report.bad_lines:
        sys.exit(2)
