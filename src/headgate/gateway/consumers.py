"""A stream's named consumers: their committed positions, and the rules that use them.

A stream has any number of named consumers (an archive, a live aggregation,
a backfill). Each commits a position with Release. The log may free only
what every *blocking* consumer has committed, so the stream's free space,
and with it the producers' credit, follows the slowest blocking consumer
and nothing else (:meth:`ConsumerBook.floor`). A *non-blocking* consumer
holds nothing back: the log may free what it has not read, and its next
read behind the log fails or skips ahead, as it asked
(:meth:`ConsumerBook.read_from`). A blocking consumer that stops releasing
while it has something to release is *idle* after ``idle_release_seconds``;
the stream's policy then holds (one WARNING) or detaches it
(:meth:`ConsumerBook.idle`). Time is always an argument.

The positions are stored in ``<data_dir>/state/<stream>.consumers.json``
with the crash rule of every gateway state file
(:func:`~headgate.gateway.dedup.write_json_durably`): a crash leaves the
old file or the new one. The log frees only up to what the file on disk
allows (:attr:`Consumer.saved`), and the file is written before the log's
release position moves, so after any crash every blocking consumer's
stored position is at or after the log's release position. A Release only
marks the book unsaved; the gateway writes it off the event loop
(:meth:`ConsumerBook.prepare_save` on the loop, :meth:`ConsumerBook.write`
in a thread, :meth:`ConsumerBook.saved_as` back on the loop), one save in
flight per stream: every Release that arrives while one is written goes
into the next, so many Releases cost one write, and the freeing they allow
waits for it. A data
directory without the file (one from before consumers) gets one consumer,
:data:`~headgate.protocol.messages.DEFAULT_CONSUMER`, at the log's release
position: exactly the single consumer it had.
"""

from __future__ import annotations

import bisect
import json
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from headgate.config import DATA_LOSS_OUTCOMES, ConsumerSettings, Retention
from headgate.gateway.dedup import write_json_durably
from headgate.protocol import messages as m
from headgate.protocol.errors import ErrorCode, ProtocolError

__all__ = [
    "MAX_CONSUMERS_PER_STREAM",
    "Consumer",
    "ConsumerBook",
    "ConsumerStatistics",
    "IdleAction",
    "PendingSave",
    "consumers_file",
    "declare_before_the_stream",
    "free_position",
]

log = logging.getLogger("headgate.gateway")

_FILE_VERSION = 1
#: Most consumers a stream has: each Release rewrites the stream's whole
#: consumers file, and a token's ``consume`` pattern may allow many names.
MAX_CONSUMERS_PER_STREAM = 256
#: Most frame headers read, per free of the log, to count the records a
#: non-blocking consumer loses (a few µs each, on the event loop).
MAX_COUNTED_FRAMES = 16384


def free_position(
    consumed: int,
    retention: Retention,
    frames: Iterable[tuple[int, int, int]],
    now_us: int,
) -> int:
    """How far the log may free, behind the *consumed* position, under ``retention``.

    Two positions, one rule (the one place they are split): the *consumed*
    position is what every blocking consumer has committed (the floor); the
    producers' credit follows it, and only it. The *freed* position is what
    the log has actually deleted or may reuse; it trails the consumed one by
    what retention keeps readable after release: at most ``retention.bytes``
    bytes, and none older than ``retention.seconds``. So the log holds at
    most ``capacity`` (unconsumed, the producers' budget) plus
    ``retention.bytes`` (retained): the two budgets add up.

    ``frames``: ``(position, end_position, timestamp_us)`` of the frames from
    the present freed position up to ``consumed``, in log order; read only
    until the first frame that is kept (all after it are kept too).
    """
    if retention.bytes <= 0:
        return consumed
    cutoff = None if retention.seconds is None else now_us - round(retention.seconds * 1e6)
    for start, _end, timestamp_us in frames:
        if consumed - start <= retention.bytes and (cutoff is None or timestamp_us >= cutoff):
            return start  # this frame, and every one after it, is kept
    return consumed


def consumers_file(data_dir: Path, stream: str) -> Path:
    """Where the consumers of ``stream`` are stored in a data directory."""
    return data_dir / "state" / f"{stream}.consumers.json"


@dataclass(eq=False)
class Consumer:
    """One named consumer of one stream."""

    #: The consumer's name.
    name: str
    #: The position it committed last (everything before it is done).
    position: int
    #: The position stored on disk: what the log may free by this consumer.
    saved: int
    #: Whether it holds the log back (False: declared non-blocking, or detached).
    blocking: bool
    #: ``fail`` or ``skip``: what its read behind the log does.
    on_data_loss: str
    #: Whether the idle rule made it non-blocking (it was declared blocking).
    detached: bool = False
    #: Who made it: ``config`` (the gateway's TOML: it goes when the TOML no
    #: longer declares it), ``runtime`` (DeclareConsumer) or ``default``.
    origin: str = "runtime"
    #: When it last made progress or was caught up (caller's clock); None
    #: until the first idle check.
    progress_at: float | None = None
    #: Whether the idle WARNING was logged for the present idle spell.
    idle: bool = False
    #: Bytes its reads skipped because the log freed them first (``skip``).
    skipped_bytes: int = 0
    #: Records among them, where they were counted (see :meth:`ConsumerBook.freeing`).
    skipped_records: int = 0
    #: Where the gateway's last Fetch for it ended (in memory only), or None.
    read_to: int | None = None
    #: Records the log freed after each of its *anchors* (its committed
    #: position, and ``read_to``), for a non-blocking consumer behind the
    #: log; None where they could not be counted.
    lost_records: dict[int, int | None] = field(default_factory=dict)
    #: How often the idle rule detached it.
    detached_total: int = 0
    #: ``(position, epoch, count)``: the record index's count at a position
    #: of it, taken while the log held it (see
    #: :mod:`headgate.log.record_index`); stored with a non-blocking
    #: consumer's position, so that the records the log frees after it stay
    #: countable across a restart.
    counted: tuple[int, int, int] | None = None

    def anchors(self) -> set[int]:
        """Where its next read likely starts: where it committed, or where its last read ended."""
        return {self.position} if self.read_to is None else {self.position, self.read_to}

    def record(self) -> dict[str, Any]:
        """What the consumers file stores of it (its committed position)."""
        entry: dict[str, Any] = {
            "name": self.name,
            "position": self.position,
            "blocking": self.blocking,
            "on_data_loss": self.on_data_loss,
            "detached": self.detached,
            "origin": self.origin,
        }
        counted = self.counted
        if counted is not None and counted[0] == self.position and not self.blocking:
            entry["records"] = [counted[1], counted[2]]  # [epoch, count]
        return entry


@dataclass(frozen=True, slots=True)
class ConsumerStatistics:
    """A snapshot of one consumer, for metrics."""

    name: str
    #: Its committed position.
    position: int
    #: Bytes of the stream's durable log after its position.
    lag_bytes: int
    #: Age of the oldest durable record it has not committed (0 when it has
    #: committed everything; None when not asked for).
    lag_seconds: float | None
    blocking: bool
    detached: bool
    #: Idle under the ``hold`` policy: the producers wait on it.
    idle: bool
    skipped_bytes: int
    #: Records among the skipped bytes, where they could be counted.
    skipped_records: int
    detached_total: int
    #: Records in the durable log after its position; None where they
    #: cannot be counted (or were not asked for).
    lag_records: int | None = None


@dataclass(frozen=True, slots=True)
class IdleAction:
    """What :meth:`ConsumerBook.idle` did to a consumer (the caller logs and counts)."""

    consumer: Consumer
    #: ``hold`` (it stays blocking; warned once) or ``detach``.
    policy: str
    #: Seconds since its last progress.
    idle_for: float


@dataclass(frozen=True, slots=True)
class PendingSave:
    """One save of a consumers file, taken on the loop and written elsewhere."""

    #: Its place in the book's saves: a later one supersedes it.
    number: int
    #: The file's content.
    body: dict[str, Any]
    #: Each consumer's committed position as it was taken.
    positions: dict[str, int]


class ConsumerBook:
    """The consumers of one stream, their rules, and their file. Create with :meth:`load`."""

    def __init__(self, stream: str, path: Path, consumers: dict[str, Consumer]) -> None:
        self.stream = stream
        self.path = path
        self.consumers = consumers
        #: Whether a position or setting in memory is not on disk yet.
        self.unsaved = False
        #: Whether a save is being written off the loop (the gateway starts
        #: the next one only after it, so Releases meanwhile coalesce).
        self.saving = False
        #: Files written so far (every save, wherever it ran).
        self.writes = 0
        self._taken = 0  # saves taken (numbers handed out)
        self._written = 0  # the newest save on disk
        self._applied = 0  # the newest save whose positions ``saved`` holds
        #: Serialises writes of the file: a save on the loop (an admin
        #: change) and one in the writer thread never write it at once.
        self._write_lock = threading.Lock()

    @classmethod
    def load(
        cls,
        stream: str,
        path: Path,
        *,
        release_position: int,
        tail_position: int,
        declared: Mapping[str, ConsumerSettings],
    ) -> ConsumerBook:
        """The stream's stored consumers, plus those the configuration declares.

        Without a file: the declared consumers, or (none declared) the one
        :data:`~headgate.protocol.messages.DEFAULT_CONSUMER`, all at the
        log's release position. A stored position beyond the tail (the log
        lost frames it had not made durable) comes back to the tail; a
        blocking one below the release position (a file from elsewhere) up to
        it. A declared consumer's settings win over the stored ones, except
        that a detached consumer stays detached; a consumer the configuration
        made and no longer declares is deleted (WARNING).

        Raises:
            ValueError: the file is damaged (the gateway refuses to guess
                which consumers there were).
        """
        consumers: dict[str, Consumer] = {}
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raw = None
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: consumers file unreadable: {exc}") from None
        if raw is not None:
            for consumer in _parse(path, raw):
                position = min(consumer.position, tail_position)
                if consumer.blocking and position < release_position:
                    log.warning(
                        "stream %s: consumer %s stored at %d, behind the log's release "
                        "position %d; it continues there",
                        stream,
                        consumer.name,
                        position,
                        release_position,
                    )
                    position = release_position
                consumer.position = consumer.saved = position
                consumers[consumer.name] = consumer
        elif not declared:
            consumers[m.DEFAULT_CONSUMER] = Consumer(
                m.DEFAULT_CONSUMER,
                release_position,
                release_position,
                True,
                "fail",
                origin="default",
            )
        book = cls(stream, path, consumers)
        book.unsaved = raw is None
        for name, consumer in list(consumers.items()):
            if consumer.origin == "config" and name not in declared:
                # The operator took it out of the TOML: it must not hold the log.
                log.warning(
                    "stream %s: consumer %s is no longer in the configuration; deleted "
                    "(it was at %d)",
                    stream,
                    name,
                    consumer.position,
                )
                del consumers[name]
                book.unsaved = True
            elif consumer.origin == "default" and consumer.blocking and declared:
                log.warning(
                    "stream %s: consumer %s (from before consumers were configured) still "
                    "blocks at %d; releases of it (Release naming no consumer) free the log",
                    stream,
                    name,
                    consumer.position,
                )
        for name, settings in declared.items():
            existing = consumers.get(name)
            if existing is None:
                consumers[name] = Consumer(
                    name,
                    release_position,
                    release_position,
                    settings.blocking,
                    settings.on_data_loss,
                    origin="config",
                )
                book.unsaved = True
            elif (existing.blocking, existing.on_data_loss) != (
                settings.blocking and not existing.detached,
                settings.on_data_loss,
            ):
                if existing.detached and settings.blocking:
                    log.warning(
                        "stream %s: consumer %s was detached for idling; it stays "
                        "non-blocking (delete and declare it again to make it block)",
                        stream,
                        name,
                    )
                if not existing.blocking and settings.blocking and not existing.detached:
                    # Made blocking by the configuration: it must not hold
                    # what the log has freed already.
                    existing.position = existing.saved = max(existing.position, release_position)
                existing.blocking = settings.blocking and not existing.detached
                existing.on_data_loss = settings.on_data_loss
                book.unsaved = True
            if existing is not None and existing.origin != "config":
                existing.origin = "config"
                book.unsaved = True
        return book

    # -- the rules ----------------------------------------------------------------

    def floor(self) -> int | None:
        """The lowest stored position of a blocking consumer: the log may free up to it.

        None when no consumer blocks: nothing holds the log back then.
        """
        blocking = [c.saved for c in self.consumers.values() if c.blocking]
        return min(blocking) if blocking else None

    def get(self, name: str) -> Consumer:
        """The consumer called ``name``; a scoped UNKNOWN_CONSUMER error if there is none."""
        consumer = self.consumers.get(name)
        if consumer is None:
            known = ", ".join(sorted(self.consumers)) or "none"
            raise ProtocolError(
                f"stream {self.stream}: no consumer called {name!r} (it has: {known}); "
                "declare it in the gateway's configuration or with DeclareConsumer",
                code=ErrorCode.UNKNOWN_CONSUMER,
            )
        return consumer

    def commit(self, consumer: Consumer, position: int, now: float | None) -> bool:
        """``consumer`` committed up to ``position`` (checked by the caller); True if it moved.

        ``now`` (the idle rule's clock) None: its idle clock restarts at the next check.
        """
        if position <= consumer.position:
            return False
        consumer.position = position
        consumer.progress_at = now
        consumer.idle = False
        self.unsaved = True
        return True

    def declare(
        self,
        name: str,
        settings: ConsumerSettings,
        start: int,
        *,
        origin: str = "runtime",
        stream_created: bool = True,
    ) -> Consumer:
        """Create consumer ``name`` at ``start``, or return the one there is.

        The first blocking consumer declared at run time (``origin``
        ``runtime``) on a stream whose consumer is still the implicit
        :data:`~headgate.protocol.messages.DEFAULT_CONSUMER` (one nobody
        declared) replaces it, at its position: a WARNING, as a client that
        released as ``default`` is refused from then on; only INFO before
        the stream is created (``stream_created`` False), when none can have.

        Raises:
            ProtocolError: it exists with other settings; RESOURCE_EXHAUSTED
                beyond :data:`MAX_CONSUMERS_PER_STREAM`.
        """
        existing = self.consumers.get(name)
        if existing is not None:
            wanted = (settings.blocking, settings.on_data_loss)
            if (existing.blocking, existing.on_data_loss) != wanted:
                raise ProtocolError(
                    f"stream {self.stream}: consumer {name!r} exists with blocking="
                    f"{str(existing.blocking).lower()}, on_data_loss={existing.on_data_loss}"
                    + (" (detached for idling)" if existing.detached else ""),
                    code=ErrorCode.UNEXPECTED_FRAME,
                )
            return existing
        implicit = self.consumers.get(m.DEFAULT_CONSUMER)
        if (
            settings.blocking
            and origin == "runtime"
            and implicit is not None
            and implicit.origin == "default"
            and implicit.blocking
        ):
            # The implicit consumer only stands in for a consumer nobody named
            # (it holds a new stream's log until one is declared): the first
            # blocking consumer declared at run time takes its place and its
            # position. Otherwise a pipeline that names its consumer would
            # leave ``default`` holding the producers forever.
            del self.consumers[m.DEFAULT_CONSUMER]
            consumer = Consumer(
                name,
                implicit.position,
                implicit.saved,
                True,
                settings.on_data_loss,
                origin=origin,
            )
            self.consumers[name] = consumer
            self.unsaved = True
            log.log(
                logging.WARNING if stream_created else logging.INFO,
                "stream %s: consumer %s takes over the implicit consumer %s at %d (a Release "
                "naming no consumer is refused from now on)",
                self.stream,
                name,
                m.DEFAULT_CONSUMER,
                implicit.position,
            )
            return consumer
        if len(self.consumers) >= MAX_CONSUMERS_PER_STREAM:
            raise ProtocolError(
                f"stream {self.stream}: already has {len(self.consumers)} consumers, "
                f"the most a stream may have",
                code=ErrorCode.RESOURCE_EXHAUSTED,
            )
        consumer = Consumer(
            name, start, start, settings.blocking, settings.on_data_loss, origin=origin
        )
        self.consumers[name] = consumer
        self.unsaved = True
        return consumer

    def reset(self, name: str, position: int, now: float) -> Consumer:
        """Move consumer ``name`` to ``position`` (checked by the caller), back or forth."""
        consumer = self.get(name)
        consumer.position = position
        consumer.progress_at = now
        consumer.idle = False
        self.unsaved = True
        return consumer

    def delete(self, name: str) -> Consumer:
        """Delete consumer ``name``; it no longer holds anything."""
        consumer = self.get(name)
        del self.consumers[name]
        self.unsaved = True
        return consumer

    def behind(self, position: int) -> list[Consumer]:
        """Non-blocking consumers with an anchor before ``position`` (the log frees up to it)."""
        return [
            c
            for c in self.consumers.values()
            if not c.blocking and any(a < position for a in c.anchors())
        ]

    def freeing(self, old: int, new: int, frames: Iterable[tuple[int, int]]) -> None:
        """The log frees ``[old, new)``, whose frames are ``(position, record_count)``.

        Counts, for each non-blocking consumer's anchors before ``new``,
        the records freed after the anchor, so that a ``skip`` read from an
        anchor reports exactly the records it skipped. The caller scans the
        frame headers only when :meth:`behind` names a consumer, and one
        pass serves every anchor. At most :data:`MAX_COUNTED_FRAMES` frames
        are counted per free (a header read each, on the event loop); past
        that the anchors' counts become unknown (None).
        """
        behind = self.behind(new)
        anchors: set[int] = set()
        for consumer in behind:
            lost = consumer.lost_records
            for anchor in consumer.anchors():
                if anchor < new and anchor not in lost:
                    # An anchor the log had freed already when it was set: unknown.
                    lost[anchor] = 0 if anchor >= old else None
                if anchor < new and lost[anchor] is not None:
                    anchors.add(anchor)
            for anchor in [a for a in lost if a not in consumer.anchors()]:
                del lost[anchor]
        if not anchors:
            return
        ordered = sorted(anchors)
        # in_span[i]: records of frames at or after ordered[i] and before ordered[i + 1].
        in_span = [0] * len(ordered)
        complete = True
        for counted, (position, records) in enumerate(frames):
            if counted >= MAX_COUNTED_FRAMES:
                complete = False
                break
            i = bisect.bisect_right(ordered, position) - 1
            if i >= 0:
                in_span[i] += records
        totals = {a: sum(in_span[i:]) for i, a in enumerate(ordered)}
        for consumer in behind:
            lost = consumer.lost_records
            for anchor in consumer.anchors():
                value = lost.get(anchor)
                if anchor in totals and value is not None:
                    lost[anchor] = value + totals[anchor] if complete else None

    def read(self, name: str, end: int) -> None:
        """The gateway served consumer ``name`` up to ``end`` (a Fetch naming it ended there)."""
        consumer = self.consumers.get(name)
        if consumer is not None:
            consumer.read_to = end

    def read_from(
        self, name: str, start: int, oldest: int, counted: tuple[int, int | None] = (0, None)
    ) -> tuple[int, int, int | None]:
        """Where consumer ``name`` reads, asking for ``start`` while the log holds from ``oldest``.

        Returns ``(position, skipped_bytes, skipped_records)``: ``start``, 0
        and 0 when the log still holds it; for a ``skip`` consumer behind the
        log, ``oldest``, the bytes freed before it read them, and the records
        among them when ``start`` is one of its anchors (where it committed,
        or where its last read ended), else None (counted on it).
        ``counted``: ``(epoch, count)``, the record index's count at
        ``oldest``: with the count stored at the consumer's committed
        position (:attr:`Consumer.counted`, same epoch) it gives the skipped
        records where the frees did not count them (after a restart).

        Raises:
            ProtocolError: an unknown consumer; DATA_LOST for a ``fail`` one
                behind the log, naming the positions.
        """
        consumer = self.get(name)
        if start >= oldest:
            return start, 0, 0
        if consumer.on_data_loss != "skip":
            raise ProtocolError(
                f"stream {self.stream}: consumer {name!r} asked to read from {start}, but the "
                f"log holds from {oldest}: {oldest - start} bytes were freed before it read "
                "them (on_data_loss = fail)",
                code=ErrorCode.DATA_LOST,
            )
        records = consumer.lost_records.get(start)
        epoch, oldest_count = counted
        stored = consumer.counted
        if (
            records is None
            and oldest_count is not None
            and stored is not None
            and stored[:2] == (start, epoch)
        ):
            records = max(0, oldest_count - stored[2])
        consumer.skipped_bytes += oldest - start
        consumer.skipped_records += records or 0
        # It reads on from the oldest held position: nothing is lost after it yet.
        consumer.read_to = oldest
        consumer.lost_records = {a: n for a, n in consumer.lost_records.items() if a != start}
        return oldest, oldest - start, records

    def idle(self, now: float, idle_after: float, policy: str, durable: int) -> list[IdleAction]:
        """Apply the idle rule at ``now``; the consumers it newly warned about or detached.

        A blocking consumer with nothing to release (at or past ``durable``)
        is making progress as far as it can; one that has something to
        release and has not for ``idle_after`` seconds is idle. ``hold``
        keeps it blocking and reports it once per idle spell; ``detach``
        makes it non-blocking (stored, so it stays so after a restart).
        """
        actions: list[IdleAction] = []
        for consumer in self.consumers.values():
            if not consumer.blocking:
                continue
            if consumer.progress_at is None or consumer.position >= durable:
                consumer.progress_at = now
                consumer.idle = False
                continue
            idle_for = now - consumer.progress_at
            if idle_for < idle_after or consumer.idle:
                continue
            if policy == "detach":
                consumer.blocking = False
                consumer.detached = True
                consumer.detached_total += 1
                self.unsaved = True
            else:
                consumer.idle = True
            actions.append(IdleAction(consumer, policy, idle_for))
        return actions

    # -- the file -----------------------------------------------------------------

    def save(self) -> None:
        """Store every consumer's committed position and settings now (raises OSError).

        On the calling thread (the loop, for the rare changes an answer
        waits on: declare, reset, delete, detach). Only once this returned
        may the log free up to the new positions.
        """
        pending = self.prepare_save()
        try:
            self.write(pending)
        except OSError:
            self.unsaved = True
            raise
        self.saved_as(pending)

    def prepare_save(self) -> PendingSave:
        """Take a save of what is in memory now (on the loop); write it with :meth:`write`.

        The book counts as saved from here; a failed write makes it unsaved
        again (:meth:`save_failed`), a Release meanwhile too.
        """
        self._taken += 1
        records = [c.record() for c in self.consumers.values()]
        self.unsaved = False
        return PendingSave(
            self._taken,
            {"version": _FILE_VERSION, "stream": self.stream, "consumers": records},
            {c.name: c.position for c in self.consumers.values()},
        )

    def write(self, pending: PendingSave) -> None:
        """Write ``pending`` durably; from any thread (raises OSError).

        A save older than the one on disk is not written: the file only moves forward.
        """
        with self._write_lock:
            if pending.number <= self._written:
                return
            write_json_durably(self.path, pending.body)
            self._written = pending.number
            self.writes += 1

    def saved_as(self, pending: PendingSave) -> None:
        """``pending`` is on disk (on the loop): the log may free up to its positions.

        A save that completes after a newer one was applied changes nothing.
        """
        if pending.number <= self._applied:
            return
        self._applied = pending.number
        for name, position in pending.positions.items():
            consumer = self.consumers.get(name)
            if consumer is not None:
                consumer.saved = position

    def save_failed(self) -> None:
        """A write failed: what it held is unsaved again (the next save retries it)."""
        self.unsaved = True

    def statistics(
        self,
        durable: int,
        ages: tuple[int, Callable[[int], int | None]] | None = None,
        lag_records: Callable[[Iterable[Consumer]], Mapping[str, int]] | None = None,
    ) -> tuple[ConsumerStatistics, ...]:
        """Each consumer's snapshot, by name.

        ``ages``: ``(now_us, timestamp_at)``, where ``timestamp_at(position)``
        is the timestamp of the first durable record at or after it; then
        each consumer's lag in seconds is ``now_us`` minus that.
        ``lag_records``: each consumer's lag in records, by name, where known.
        """
        records = {} if lag_records is None else lag_records(self.consumers.values())

        def lag_seconds(position: int) -> float | None:
            if ages is None:
                return None
            now_us, timestamp_at = ages
            oldest = timestamp_at(position)
            return 0.0 if oldest is None else max(0.0, (now_us - oldest) / 1e6)

        return tuple(
            ConsumerStatistics(
                name=c.name,
                position=c.position,
                lag_bytes=max(0, durable - c.position),
                lag_seconds=lag_seconds(c.position),
                blocking=c.blocking,
                detached=c.detached,
                idle=c.idle,
                skipped_bytes=c.skipped_bytes,
                skipped_records=c.skipped_records,
                detached_total=c.detached_total,
                lag_records=records.get(c.name),
            )
            for c in sorted(self.consumers.values(), key=lambda c: c.name)
        )


def declare_before_the_stream(
    stream: str,
    path: Path,
    name: str,
    settings: ConsumerSettings,
    *,
    declared: Mapping[str, ConsumerSettings],
) -> tuple[int, bool]:
    """Declare consumer ``name`` of a stream not created yet: ``(position, file written)``.

    A pipeline often starts before the producers that create its streams
    (each partition of a fleet, a stream it waits for). Its consumer must
    still hold every record from the stream's first on, so the declaration
    is kept where the stream will find it: in the stream's consumers file
    (``path``), which :meth:`ConsumerBook.load` reads when the stream is
    created. It is made by the same rules as a declaration the moment the
    stream is created: at position 0, beside the consumers the
    configuration ``declared`` (or in place of the implicit ``default``),
    refused with other settings or beyond :data:`MAX_CONSUMERS_PER_STREAM`.

    Raises:
        ProtocolError: as :meth:`ConsumerBook.declare`; STORAGE_UNAVAILABLE
            when the file cannot be read or written.
    """
    try:
        book = ConsumerBook.load(
            stream, path, release_position=0, tail_position=0, declared=declared
        )
        new = name not in book.consumers
        consumer = book.declare(name, settings, 0, stream_created=False)
        written = book.unsaved
        if written:
            book.save()
    except (OSError, ValueError) as exc:
        raise ProtocolError(
            f"stream {stream}: consumer {name!r} not stored: {exc}",
            code=ErrorCode.STORAGE_UNAVAILABLE,
        ) from None
    if new:
        log.info(
            "stream %s (not created yet): consumer %s declared at %d (blocking=%s, "
            "on_data_loss=%s); the stream starts with it",
            stream,
            name,
            consumer.position,
            consumer.blocking,
            consumer.on_data_loss,
        )
    return consumer.position, written


def _parse(path: Path, raw: object) -> list[Consumer]:
    """The consumers of a stored file; a ValueError naming the file for any damage."""
    try:
        if not isinstance(raw, dict) or raw.get("version") != _FILE_VERSION:
            raise ValueError(f"expected a version {_FILE_VERSION} consumers file")
        out: list[Consumer] = []
        for entry in raw["consumers"]:
            name = entry["name"]
            position = entry["position"]
            blocking = entry["blocking"]
            on_data_loss = entry["on_data_loss"]
            detached = entry.get("detached", False)
            origin = entry.get("origin", "runtime")
            records = entry.get("records")
            if not (isinstance(name, str) and m.is_valid_name(name)):
                raise ValueError(f"invalid consumer name {name!r}")
            if isinstance(position, bool) or not isinstance(position, int) or position < 0:
                raise ValueError(f"consumer {name}: invalid position {position!r}")
            if not isinstance(blocking, bool) or not isinstance(detached, bool):
                raise ValueError(f"consumer {name}: blocking and detached must be booleans")
            if on_data_loss not in DATA_LOSS_OUTCOMES:
                raise ValueError(f"consumer {name}: invalid on_data_loss {on_data_loss!r}")
            if origin not in ("config", "runtime", "default"):
                raise ValueError(f"consumer {name}: invalid origin {origin!r}")
            consumer = Consumer(
                name, position, position, blocking, on_data_loss, detached, origin=origin
            )
            if records is not None:
                if not (
                    isinstance(records, list)
                    and len(records) == 2
                    and all(type(n) is int and n >= 0 for n in records)
                ):
                    raise ValueError(f"consumer {name}: invalid records {records!r}")
                consumer.counted = (position, records[0], records[1])
            out.append(consumer)
        return out
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: consumers file damaged: {exc}") from None
