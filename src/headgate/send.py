"""``headgate send STREAM FILE``: the lines of a file (or stdin) as records of a stream.

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
import json
import signal
import threading
from array import array
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import BinaryIO, Final

from rich.console import Console
from rich.progress import Progress, ProgressColumn, Task, TextColumn
from rich.text import Text

from headgate.client import Producer
from headgate.client.producer import Policy
from headgate.client.security import ClientSecurity

__all__ = ["SendOptions", "SendReport", "run_send"]

#: How long an interrupted send waits for the acknowledgements of what it sent.
INTERRUPT_GRACE_S: Final = 5.0
#: Bytes the reading thread hands over at a time, and chunks it may hold ahead.
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


@dataclass(slots=True)
class SendReport:
    """What a send did; the command turns it into its last lines of output."""

    stream: str
    #: Records handed to the producer.
    sent: int = 0
    #: Records that went to the gateway at least once.
    transmitted: int = 0
    #: Records (and their bytes) the gateway acknowledged durable.
    acked: int = 0
    bytes_acked: int = 0
    #: Line numbers (from 1) that were not valid JSON, in order; nothing was sent for them.
    bad_lines: array[int] = field(default_factory=lambda: array("q"))
    #: Why the first bad line is not JSON.
    first_bad_reason: str = ""
    #: Whether Ctrl-C cut the send short.
    interrupted: bool = False
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


async def _chunks(source: BinaryIO) -> AsyncIterator[bytes]:
    """The bytes of ``source`` as they come, read in a daemon thread.

    A daemon, so that a read still waiting on a terminal or a pipe when the
    send ends never keeps the process alive.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[bytes | BaseException] = asyncio.Queue(_CHUNKS_AHEAD)
    read = getattr(source, "read1", source.read)

    def pump() -> None:
        try:
            while True:
                chunk = read(_CHUNK_BYTES)
                asyncio.run_coroutine_threadsafe(queue.put(chunk), loop).result()
                if not chunk:
                    return
        except BaseException as exc:  # handed to the loop, which raises it
            with contextlib.suppress(RuntimeError):  # the loop is gone
                asyncio.run_coroutine_threadsafe(queue.put(exc), loop)

    threading.Thread(target=pump, name="headgate-send-read", daemon=True).start()
    while True:
        item = await queue.get()
        if isinstance(item, BaseException):
            raise item
        if not item:
            return
        yield item


async def _lines(source: BinaryIO) -> AsyncIterator[bytes]:
    """The lines of ``source``, without their line ends; a last line may lack one."""
    rest = b""
    async for chunk in _chunks(source):
        lines = (rest + chunk).split(b"\n")
        rest = lines.pop()
        for line in lines:
            yield line.removesuffix(b"\r")
    if rest:
        yield rest.removesuffix(b"\r")


async def _feed(
    producer: Producer,
    source: BinaryIO,
    options: SendOptions,
    report: SendReport,
    progress: Progress,
) -> None:
    task = progress.add_task(f"sending to {options.stream}", total=None)
    number = 0
    async for value in _lines(source):
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
        if report.sent % 1000 == 0:
            progress.update(task, completed=report.sent)
    progress.update(task, completed=report.sent, description="waiting for durable acks")


async def _until_done_or_interrupted(work: asyncio.Task[None]) -> bool:
    """Wait for ``work``; Ctrl-C cancels it. Whether it was interrupted."""
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, work.cancel)
    try:
        await asyncio.wait({work})
    finally:
        loop.remove_signal_handler(signal.SIGINT)
    if work.cancelled():
        return True
    work.result()  # raises what the work raised
    return False


async def _send_all(
    producer: Producer,
    source: BinaryIO,
    options: SendOptions,
    report: SendReport,
    progress: Progress,
) -> None:
    connect = asyncio.create_task(producer.connect())
    if await _until_done_or_interrupted(connect):
        report.interrupted = True
        return
    with progress:
        feed = asyncio.create_task(_feed(producer, source, options, report, progress))
        report.interrupted = await _until_done_or_interrupted(feed)
        flush = asyncio.create_task(producer.flush())
        if not report.interrupted:
            report.interrupted = await _until_done_or_interrupted(flush)
            return
        # What was sent gets a moment to become durable; a second Ctrl-C, or
        # a stream that stays full, ends the wait.
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, flush.cancel)
        try:
            await asyncio.wait({flush}, timeout=INTERRUPT_GRACE_S)
        finally:
            loop.remove_signal_handler(signal.SIGINT)
        flush.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await flush


async def run_send(options: SendOptions, source: BinaryIO) -> SendReport:
    """Send every line of ``source``; return the report, also when interrupted.

    Raises :class:`~headgate.client.ProducerError` when the gateway cannot
    be reached or refuses the stream.
    """
    report = SendReport(options.stream)
    console = Console(stderr=True)
    progress = Progress(
        TextColumn("{task.description}"),
        TextColumn("{task.completed:,} records"),
        _RateColumn(),
        console=console,
        transient=True,
        disable=not (options.progress and console.is_terminal),
    )
    producer = Producer(
        options.gateway,
        policy=_POLICIES[options.policy],
        producer_id=options.producer_id,
        producer_secret=options.producer_secret,
        client_name="headgate-send",
        reconnect_timeout=options.timeout,
        security=options.security,
    )
    report.producer_id = producer.producer_id
    try:
        await _send_all(producer, source, options, report, progress)
    except BaseException:
        await producer.abort()
        raise
    if report.interrupted:
        await producer.abort()  # what was not acknowledged by now is given up
    else:
        await producer.close()
    stats = producer.statistics().streams.get(options.stream)
    if stats is not None:
        report.acked, report.bytes_acked = stats.records_acked, stats.bytes_acked
        report.transmitted = stats.records_sent
    report.producer_secret = producer.producer_secret
    return report
