"""One stream inside the gateway: its log, its writers' credit, dedup and acks.

A stream's log has a fixed capacity: the bytes between the log's release
position and the tail. That capacity is the budget the stream's writers
share. The release position is the lowest position the stream's blocking
consumers have committed (:mod:`headgate.gateway.consumers` is the one home
of that rule; :meth:`Stream.release` stores a consumer's Release and frees
the log up to the new floor), so the slowest blocking consumer alone decides
what the producers may write.
Each writer (one connection's channel for the stream) holds part of it as the
capacity of its LCMUX server channel; a batch sits in that channel's buffer
from the moment it is appended until Spark releases the log space behind it.
So the books are::

    log free capacity  >=  reserve + sum over writers of (capacity - buffered)

where ``reserve`` covers the padding that term rotations can cost. Space that
Spark releases returns to the writers as guarantees, a *run* of batches at a
time (:class:`UnreleasedRuns`: the gateway's memory per unreleased batch
would otherwise grow with the log's capacity) (or, for a writer above
its fair share, shrinks its buffer instead); space that no writer holds is
granted to writers below their share. A writer above its share while another
waits is pleaded down (the seed's Plead/Absolve), and a writer that has gone
quiet keeps only a floor, so its share moves to those still writing. Shares
also follow use: a writer is granted a first grant plus twice what it uses,
up to its share, so that what nobody uses is never promised away; a
newcomer gets it at once instead of waiting on a holder that may ignore
Pleads until its deadline.

What a fair share is, is :func:`fair_shares` (the one home of the rule):
equal among *parties* (the token, or the connection where the
gateway has no tokens file), then among a party's connections, then among a
connection's handles. Binding the same stream a thousand times, or opening
sixty connections with one token, buys no more of the stream than one writer.

A Plead has a deadline (``plead_deadline_ms``, announced in Welcome): a
writer still holding more guarantees than the Plead asked it to keep when
the deadline passes is reported by :meth:`Stream.overdue_pleas`, and the
gateway closes its connection (whose guarantees then return to the stream).

A batch the log cannot store now is *held*: kept in memory, in arrival
order, in the stream's one queue (:class:`HeldBatches`), and stored from
there through the ordinary path (so duplicates among held batches are
recognised exactly as on arrival). Two things hold batches:

* The file system refuses the stream's log (a full disk: a new term cannot
  be reserved, or a group commit fails). The stream is then *held*
  (``storage_error``): every writer gets a scoped ``STORAGE_FULL`` Error,
  and no guarantee and no Ack goes out for it. :meth:`Stream.retry_storage`,
  called periodically, stores the held batches once the log can take them
  again.
* A policy whose guarantees the log's space does not back (``window``,
  ``xonxoff``: they append with ``in_channel=False``) sends a batch the log
  has no room for: it waits until the consumer releases space
  (:meth:`Stream.store_held`).

What bounds the queue is the policy's: :meth:`Stream.append` says whether a
batch was stored, was a duplicate, or is held (:class:`AppendOutcome`), so
that a policy never takes a held batch for a stored one. ``credit`` issues
no guarantee while held; ``window`` keeps a batch's slot until the batch is
stored and durable; ``xonxoff`` counts held bytes towards its watermark.

Nothing here touches a socket or the event loop; the caller passes ``now``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from pathlib import Path
from typing import Any

from headgate.config import ConsumerSettings, Retention
from headgate.gateway.accounts import Account
from headgate.gateway.consumers import (
    Consumer,
    ConsumerBook,
    ConsumerStatistics,
    IdleAction,
    PendingSave,
    consumers_file,
    free_position,
)
from headgate.gateway.dedup import (
    DedupSnapshot,
    SnapshotUnreadable,
    load_snapshot,
    snapshot_due,
    snapshot_due_at_open,
    write_snapshot,
)
from headgate.log import (
    AppendResult,
    LogError,
    LogFullError,
    StorageError,
    StreamLog,
    frame_cost,
)
from headgate.log.record_index import RecordIndex, record_index_file, stride_for
from headgate.protocol import messages as m
from headgate.protocol.channel import ServerChannel
from headgate.protocol.errors import ErrorCode, ProtocolError
from headgate.protocol.opening import ResumeAnswer, WriterOpening
from headgate.protocol.session import Session

log = logging.getLogger("headgate.gateway")

#: A writer that sent nothing for this long keeps only a floor of credit
#: when another writer of the same stream could use it.
IDLE_AFTER_S = 1.0
#: A writer's use of its credit counts half as much after this long.
USE_HALF_LIFE_S = 0.5
#: Writers' use asks for a rebalance of their stream (to earn more) at most this often.
ASK_INTERVAL_S = 0.05
#: A run of unreleased batches (see :class:`UnreleasedRuns`) grows to at most
#: this fraction of its writer's channel capacity ...
RUN_CAPACITY_FRACTION = 16
#: ... or to this many bytes where that is more (the largest batch where it is
#: less): what bounds the gateway's memory per unreleased byte.
RUN_FLOOR = 64 * 1024


@dataclass(slots=True)
class UnreleasedRun:
    """Consecutive stored batches of one writer whose channel space waits for a release."""

    #: Where its last batch ends in the log.
    end: int
    #: How many batches.
    count: int
    #: Their size in guarantees (what the channel charged them).
    size: int


class UnreleasedRuns:
    """A writer's batches in the log that Spark has not released, in runs.

    Under the credit policy a batch's space in its writer's channel is freed
    (and reissued) only when the consumer releases the log past the batch.
    An entry per batch would let a writer of tiny batches to a large stream
    that nobody releases grow the gateway's memory by some 150 bytes per
    batch, without end. So consecutive batches of a writer share one entry,
    a run, and the channel keeps them as one too
    (:meth:`ServerChannel.coalesce`). A run grows until it would pass
    ``limit`` bytes (the caller's: a fraction of the writer's capacity, at
    least :data:`RUN_FLOOR`); its first batch always fits. Since each run
    but the last is closed by a batch that did not fit, two consecutive runs
    hold more than ``limit`` bytes: a run costs one entry per half a limit.

    A run is processed, all its bytes freed at once, when the release
    position reaches its *last* batch. A release that ends inside a run
    frees none of it: those bytes come back at the next release that covers
    the run's end. That delays at most one run per writer (the one the
    release ends in), at most ``limit`` bytes, by one release; and since
    the run's batches are stored and durable, a consumer that keeps reading
    reaches its end.
    """

    __slots__ = ("_runs",)

    def __init__(self) -> None:
        self._runs: deque[UnreleasedRun] = deque()

    def __len__(self) -> int:
        return len(self._runs)

    def add(self, end: int, size: int, limit: int) -> None:
        """A batch of ``size`` guarantees, ending at ``end`` in the log, was stored."""
        runs = self._runs
        if runs:
            last = runs[-1]
            if last.size + size <= limit:
                last.end = end
                last.count += 1
                last.size += size
                return
        runs.append(UnreleasedRun(end, 1, size))

    def take_released(self, position: int) -> UnreleasedRun | None:
        """The oldest run if the release ``position`` covers all of it (taken out), else None."""
        runs = self._runs
        if runs and runs[0].end <= position:
            return runs.popleft()
        return None


@dataclass(eq=False)
class Writer:
    """One connection writing one stream: its channel and its pending acks."""

    #: The connection's protocol session.
    session: Session
    #: The stream's name.
    stream: str
    #: Writes out what the session has queued (the connection's flush).
    flush: Callable[[], None]
    #: The connection's (the producer's) handle for the stream.
    handle: int
    #: The producer id from the connection's Hello.
    producer_id: int
    #: When the writer last sent a batch (seconds, the caller's clock).
    last_active: float
    #: (next_sequence, end_position, arrived) of appended batches not yet
    #: acked; ``arrived`` is the batch's arrival (``batch_arrived``), None for
    #: an Ack that answers no batch (the resume Ack of a new writer).
    pending_acks: deque[tuple[int, int, float | None]] = field(default_factory=deque)
    #: What the writer was told of its opening: the zero guarantee and the
    #: resume Ack, each once (the protocol's rule, :mod:`headgate.protocol.opening`).
    opening: WriterOpening = field(default_factory=WriterOpening)
    #: When the batch being appended now arrived (``time.monotonic()``, set
    #: by the gateway before each append): its Ack's latency starts there.
    batch_arrived: float = 0.0
    #: Whether the connection is still there.
    alive: bool = True
    #: Its stored batches waiting for a release (credit policy only).
    unreleased: UnreleasedRuns = field(default_factory=UnreleasedRuns)
    #: The target of the last Plead sent, to avoid repeating it.
    pleaded: int | None = None
    #: When the unanswered Plead was first sent (caller's clock), or None.
    pleaded_at: float | None = None
    #: The largest target pleaded since ``pleaded_at``: holding no more than
    #: that answers the Plead (later targets only follow batches sent since).
    pleaded_most: int = 0
    #: Pauses (True) or resumes (False) reading the connection, for a reason.
    throttle: Callable[[str, bool], None] | None = None
    #: The connection's account, charged for the fan-out a batch causes.
    account: Account | None = None
    #: Ends the connection with an error, for a held batch the stream refuses
    #: when it stores it later (checked on arrival, so only a bug does that).
    refuse: Callable[[ProtocolError], None] | None = None
    #: Whom the writer's share is counted for (see :func:`fair_shares`): the
    #: token's name where the gateway has a tokens file; None: its connection.
    party: Hashable | None = None
    #: Bytes of batches sent, decayed by half every :data:`USE_HALF_LIFE_S`
    #: (as of ``use_at``): about what the writer sent in the last second.
    use: float = 0.0
    use_at: float = 0.0
    #: The last rebalance held this writer's share below its fair part for
    #: want of use (see :func:`fair_shares`): more use may earn it more.
    wants_more: bool = False

    @property
    def channel(self) -> int:
        return m.data_channel(self.handle)

    @cached_property
    def inbound(self) -> ServerChannel[Any]:
        """The writer's channel as the gateway's session keeps it (from the bind to
        the free, which ends the writer too); looked up once."""
        return self.session.inbound(self.channel)

    def note_sent(self, nbytes: int, now: float) -> None:
        """The writer sent a batch of ``nbytes`` guarantees' worth at ``now``."""
        self.last_active = now
        self.use = self.recent_use(now) + nbytes
        self.use_at = max(now, self.use_at)

    def recent_use(self, now: float | None) -> float:
        """What the writer sent lately, decayed to ``now`` (as last noted when None)."""
        if now is None or now <= self.use_at or not self.use:
            return self.use
        return self.use * float(0.5 ** ((now - self.use_at) / USE_HALF_LIFE_S))


def _split(
    total: int, floor: int, active: Sequence[bool], demand: Sequence[int] | None = None
) -> tuple[list[int], list[bool]]:
    """Share ``total`` among members: idle ones get a floor, active ones the rest equally.

    An idle member keeps ``min(floor, total // n)`` so that it can still send
    a batch without waiting; when all members are idle (or all active) they
    share equally. With ``demand``, no member gets more than its demand, and
    what one does not want goes equally to the others that want more (max-min
    fairness); what nobody wants is left over. The sum never exceeds ``total``.

    Returns the parts, and for each whether its demand, not fairness, bounded it.
    """
    n = len(active)
    busy = sum(active)
    if busy == 0 or busy == n:
        eligible = list(range(n))
        parts = [0] * n
        room = total
    else:
        kept = min(floor, total // n)
        eligible = [i for i, a in enumerate(active) if a]
        parts = [0 if a else kept for a in active]
        room = total - kept * (n - busy)
    each = room // len(eligible)
    if demand is None or all(demand[i] >= each for i in eligible):
        # Nobody wants less than an equal part: equal parts (the common case).
        for i in eligible:
            parts[i] = each
        return parts, [False] * n
    capped = [False] * n
    # Water-fill: the smallest demands first, each at most an equal part of what is left.
    order = sorted(eligible, key=lambda i: demand[i])
    left = len(order)
    for i in order:
        fair = room // left
        if demand[i] < fair:
            parts[i] = demand[i]
            capped[i] = True
        else:
            parts[i] = fair
        room -= parts[i]
        left -= 1
    return parts, capped


def party_of(writer: Writer) -> Hashable:
    """Who a writer's credit is shared and capped by: its token, or its connection without one."""
    return writer.party if writer.party is not None else ("connection", id(writer.session))


def fair_shares(
    total: int,
    floor: int,
    writers: Sequence[Writer],
    now: float | None,
    *,
    start: int | None = None,
    limited: set[int] | None = None,
) -> dict[int, int]:
    """The fair share of ``total`` guarantees of each writer of one stream, by ``id``.

    The one rule for sharing a stream's log space: the credit policy's
    grants, pleads and reclaims all go by it (and the window policy groups
    alike: one window per connection, not per handle). It is equal
    per *party* first, then per connection within a party, then per handle
    within a connection: so what a peer gets does not grow with the handles
    it binds (a thousand binds of one stream on one connection share one
    connection's part), nor, where the gateway has tokens, with the
    connections it opens (sixty connections of one token share that token's
    part). Per token rather than per connection because a token is what a
    budget is granted to; without a tokens file every peer is anonymous and
    the connection is the finest owner there is (an address is shared by
    everything behind one NAT, or one loopback).

    At each level a member is idle when none of its writers sent a batch for
    :data:`IDLE_AFTER_S` (with ``now`` None, nobody is idle); an idle member
    keeps only a floor of ``floor`` (at most an equal part) while others are
    active. The shares sum to at most ``total``.

    With ``start``, shares follow use as well: a member (a party, a
    connection, a handle) is given at most ``start`` plus twice the bytes
    its writers hold in the log and sent lately (counted at half every
    :data:`USE_HALF_LIFE_S`, :meth:`Writer.recent_use`). Credit that a
    writer holds and does not use would otherwise stay out of reach of a
    newcomer for as long as the holder ignores Pleads (up to
    ``plead_deadline_ms``); so what nobody uses is left unassigned, and a
    new writer is granted it at once. A writer that uses what it has earns
    more at once (twice its use, up to its fair part). The ids of writers
    bounded by use rather than fairness, at any level, go into ``limited``.
    """
    if not writers:
        return {}
    parties: dict[Hashable, dict[int, list[Writer]]] = {}
    for w in writers:
        parties.setdefault(party_of(w), {}).setdefault(id(w.session), []).append(w)

    def active(group: Sequence[Writer]) -> bool:
        return now is None or any(now - w.last_active <= IDLE_AFTER_S for w in group)

    # What each writer holds in the log and sent lately: once, for all three levels.
    used = (
        {}
        if start is None
        else {id(w): w.inbound.buffered_bytes + w.recent_use(now) for w in writers}
    )

    def demands(groups: Sequence[Sequence[Writer]]) -> list[int] | None:
        if start is None:
            return None
        return [start + 2 * int(sum(used[id(w)] for w in group)) for group in groups]

    out: dict[int, int] = {}
    party_groups = list(parties.values())
    party_writers = [[w for c in p.values() for w in c] for p in party_groups]
    party_parts, party_capped = _split(
        total, floor, [active(p) for p in party_writers], demands(party_writers)
    )
    for connections, party_part, p_capped in zip(
        party_groups, party_parts, party_capped, strict=True
    ):
        groups = list(connections.values())
        parts, c_capped = _split(party_part, floor, [active(c) for c in groups], demands(groups))
        for handles, part, capped in zip(groups, parts, c_capped, strict=True):
            shares, h_capped = _split(
                part, floor, [active([w]) for w in handles], demands([[w] for w in handles])
            )
            out.update((id(w), share) for w, share in zip(handles, shares, strict=True))
            if limited is not None:
                limited.update(
                    id(w) for w, h in zip(handles, h_capped, strict=True) if h or capped or p_capped
                )
    return out


class AppendOutcome(Enum):
    """What :meth:`Stream.append` did with a batch."""

    #: Appended to the log now (durable at the next group commit).
    STORED = "stored"
    #: Stored before: acknowledged again once the log is durable, not stored twice.
    DUPLICATE = "duplicate"
    #: Kept in memory (:class:`HeldBatches`): the log cannot store it now.
    HELD = "held"


class HeldBatch:
    """A batch the log could not store when it arrived, kept to store later."""

    __slots__ = (
        "arrived",
        "first_sequence",
        "in_channel",
        "record_count",
        "records",
        "timestamp_us",
        "writer",
    )

    def __init__(
        self,
        writer: Writer,
        first_sequence: int,
        record_count: int,
        records: bytes,
        timestamp_us: int,
        in_channel: bool,
        arrived: float,
    ) -> None:
        self.writer = writer
        self.first_sequence = first_sequence
        self.record_count = record_count
        self.records = records
        self.timestamp_us = timestamp_us
        self.in_channel = in_channel
        self.arrived = arrived


class HeldBatches:
    """The one queue of a stream's held batches, oldest first, and what it holds.

    Every batch the stream keeps in memory is here, whatever held it (a
    failing disk, or a full log under a policy that does not back its
    guarantees with log space), so every policy counts the same bytes. Each
    batch gets a ticket, 1, 2, 3, ... in arrival order; :meth:`left` tells
    whether that batch has left the queue (stored, or found a duplicate), so
    that a policy can keep what a held batch costs it until then without a
    reference to the batch.
    """

    __slots__ = ("_batches", "_taken", "_tickets", "bytes", "peak_bytes")

    def __init__(self) -> None:
        self._batches: deque[HeldBatch] = deque()
        #: Bytes of records held now, and the most ever held at once.
        self.bytes = 0
        self.peak_bytes = 0
        self._tickets = 0
        self._taken = 0

    def __len__(self) -> int:
        return len(self._batches)

    def add(self, batch: HeldBatch) -> int:
        """Hold ``batch`` after every batch held before it; returns its ticket."""
        self._batches.append(batch)
        self.bytes += len(batch.records)
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        self._tickets += 1
        return self._tickets

    @property
    def last_ticket(self) -> int:
        """The ticket of the batch held last (0 before any)."""
        return self._tickets

    def first(self) -> HeldBatch:
        """The oldest held batch (the next to store)."""
        return self._batches[0]

    def take(self) -> HeldBatch:
        """The oldest held batch leaves the queue (it was stored)."""
        batch = self._batches.popleft()
        self.bytes -= len(batch.records)
        self._taken += 1
        return batch

    def left(self, ticket: int) -> bool:
        """Whether the batch with ``ticket`` has left the queue."""
        return ticket <= self._taken


def stream_files(data_dir: Path, name: str) -> tuple[Path, Path]:
    """Where a stream lives in a data directory: its log directory and its producer state."""
    return data_dir / "streams" / name, data_dir / "state" / f"{name}.producers.json"


@dataclass(frozen=True, slots=True)
class GatewayStreamStatistics:
    """A snapshot of one stream, for metrics and ``headgate top``."""

    name: str
    capacity: int
    free_capacity: int
    tail_position: int
    durable_position: int
    release_position: int
    writers: int
    guarantees_outstanding: int
    appended_batches: int
    appended_records: int
    duplicate_batches: int
    #: Why the stream's storage is failing (held), or None.
    storage_problem: str | None = None
    #: Batches held in memory (see :class:`HeldBatches`), waiting to be stored.
    held_batches: int = 0
    #: Free capacity kept back for term rotations: the log is full for
    #: writers once ``free_capacity`` is down to about this.
    reserve: int = 0
    #: The stream's named consumers, by name.
    consumers: tuple[ConsumerStatistics, ...] = ()
    #: Released bytes the log still holds (retention), readable for replays.
    retained_bytes: int = 0
    #: The oldest position the log holds (``release_position`` less the retained bytes).
    freed_position: int = 0


class Stream:
    """The gateway's state for one stream. Create with :meth:`open`."""

    def __init__(self, name: str, stream_log: StreamLog, state_file: Path, *, max_frame: int):
        self.name = name
        self.log = stream_log
        self._state_file = state_file
        # Each term rotation may waste up to one frame in padding.
        self.reserve = (stream_log.capacity // stream_log.term_length + 2) * max_frame
        self._floor = max_frame
        self._max_frame = max_frame
        #: Released data kept readable; its bytes are part of the log's
        #: capacity, not of the producers' (see :attr:`capacity`).
        self.retention = Retention()
        #: What every blocking consumer has committed: producers' credit
        #: follows it. The log's release position (what it frees) trails it
        #: by the retained bytes (:func:`~headgate.gateway.consumers.free_position`).
        self.consumed_position = stream_log.release_position
        self._start = self._first_grant(stream_log.capacity)
        #: When the gateway last rebalanced this stream's credit (``Gateway.rebalance``; its clock).
        self.rebalanced_at = float("-inf")
        #: The most credit the writers of one party (token) may hold here at
        #: once, under the credit policy: guarantees not yet used plus what
        #: was sent under them and not yet received (0: no cap). The gateway
        #: sets it (``max_stream_credit``).
        self.max_party_credit = 0
        # When a writer's use last asked for a rebalance (wants_credit).
        self._asked_at = float("-inf")
        self.writers: list[Writer] = []
        #: producer id -> next sequence, over everything appended.
        self.dedup: dict[int, int] = {}
        #: producer id -> next sequence, over everything durable.
        self._durable_dedup: dict[int, int] = {}
        # Every frame ending at or before this position is in _durable_dedup.
        self._durable_dedup_position = 0
        # The position the snapshot on disk covers (None: no snapshot written).
        self._snapshot_position: int | None = None
        # Frames settled into _durable_dedup since the snapshot on disk.
        self._frames_since_snapshot = 0
        #: Set by the gateway: asks for a group commit soon.
        self.commit_soon: Callable[[], None] | None = None
        #: Set by the gateway: has the snapshot written off the event loop
        #: (take_snapshot, write_taken_snapshot, snapshot_written); without it
        #: (a stream driven by hand) a snapshot is written at once.
        self.snapshot_soon: Callable[[], None] | None = None
        # A snapshot is wanted / one is being written off the loop.
        self._snapshot_wanted = False
        self._snapshot_in_flight = False
        # The position the snapshot file holds, and the lock of its writers
        # (the loop's own writes at open, reload and close, and the thread's).
        self._snapshot_file_position = -1
        self._snapshot_file_lock = threading.Lock()
        #: Frame headers read at open to rebuild the dedup state (the start-up
        #: work that grows with the log, bounded by the snapshot).
        self.recovered_frames = 0
        self._appends: deque[tuple[int, int, int]] = deque()  # (end, producer, next_seq)
        #: The stream's named consumers (set by :meth:`open`).
        self.consumers = ConsumerBook(name, state_file.with_name(f"{name}.consumers.json"), {})
        #: Cumulative record counts by position (set by :meth:`open`): lag in records.
        self.records = RecordIndex.in_memory()
        # Whether a failed write of the record marks was logged (once).
        self._records_unsaved_logged = False
        #: Frame headers read to count records (what a peer that asked is charged).
        self.records_scanned = 0
        # Whether a failed save of the consumers was logged (once per spell).
        self._consumers_unsaved_logged = False
        #: When a Release last moved one of this stream's consumers forward, in
        #: microseconds since the Unix epoch (the gateway's wall clock, set by
        #: the gateway); 0: none did since the gateway started. DescribeStreams
        #: carries it, so a producer waiting on a full stream can say since when
        #: its consumers have been silent.
        self.released_at_us = 0
        self.appended_batches = 0
        self.appended_records = 0
        self.duplicate_batches = 0
        #: Why the log cannot store now (see the module docstring), or None.
        self.storage_error: StorageError | None = None
        # The last group commit of this stream failed (cleared by on_durable).
        self._sync_failed = False
        #: Batches the log could not store yet, in arrival order.
        self.held = HeldBatches()
        # producer id -> next sequence over stored and held batches, while held.
        self._held_next: dict[int, int] = {}
        #: Where the latest append put its frame (for live tail subscribers).
        self.last_append = AppendResult(0, 0)
        #: Called after each batch is appended (the gateway offers it to tails).
        self.on_append: Callable[[Stream, Writer, int, memoryview, int], None] | None = None
        # Arrival times of the batches whose Acks on_durable queued, until
        # flush_writers has written them out.
        self._acked_arrivals: list[float] = []
        #: Called with those arrival times once their Acks are written (the
        #: gateway's ack latency histogram); the list is reused afterwards.
        self.on_acks_written: Callable[[Stream, list[float]], None] | None = None

    @classmethod
    def open(
        cls,
        name: str,
        data_dir: Path,
        *,
        capacity: int,
        term_length: int,
        max_message_size: int,
        consumers: Mapping[str, ConsumerSettings] | None = None,
        retention: Retention | None = None,
    ) -> Stream:
        """Open (or create) the stream's log, its consumers, and rebuild its dedup state.

        Dedup state comes from two places: a snapshot (see
        :mod:`headgate.gateway.dedup`) that covers the log up to a position,
        and the headers of the frames after that position. ``consumers``
        are those the configuration declares (see
        :meth:`~headgate.gateway.consumers.ConsumerBook.load`). ``capacity``
        is the producers' budget; the log holds ``retention.bytes`` more.

        Raises:
            LogError: the log, or the stream's consumers file, is damaged.
        """
        directory, state_file = stream_files(data_dir, name)
        retention = retention or Retention()
        stream_log = StreamLog.open(
            directory, term_length=term_length, capacity=capacity + retention.bytes
        )
        # A release's freed terms are not the acks' business (headgate.log.deleter).
        stream_log.delete_in_background()
        stream = cls(name, stream_log, state_file, max_frame=frame_cost(max_message_size))
        stream.retention = retention
        stream.reserve = stream._reserve_for(stream.capacity)
        stream._start = stream._first_grant(stream.capacity)
        try:
            stream.consumers = ConsumerBook.load(
                name,
                consumers_file(data_dir, name),
                release_position=stream_log.release_position,
                tail_position=stream_log.tail_position,
                declared=consumers or {},
            )
        except ValueError as exc:
            stream_log.close()
            raise LogError(str(exc)) from None
        if stream.consumers.unsaved:
            stream._save_consumers()
        stream._recover_dedup()
        try:
            stream.records = RecordIndex.open(
                record_index_file(data_dir, name),
                stride=stride_for(stream_log.capacity),
                release=stream_log.release_position,
                tail=stream_log.tail_position,
                scan=stream.scan_records,
            )
        except OSError as exc:
            stream_log.close()
            raise LogError(f"stream {name}: record index not opened: {exc}") from None
        # A consumer deleted or detached since the last life: free what it held.
        stream._free_to_floor()
        return stream

    def _recover_dedup(self) -> None:
        release = self.log.release_position
        tail = self.log.tail_position
        try:
            snapshot = load_snapshot(self._state_file)
        except SnapshotUnreadable as exc:
            log.warning(
                "stream %s: producer state unreadable, rebuilt from the log alone; "
                "a producer resending batches already released may store them again: %s",
                self.name,
                exc,
            )
            snapshot = None
        producers = {} if snapshot is None else snapshot.producers
        start = release
        if snapshot is not None and snapshot.position is not None:
            if release <= snapshot.position <= tail:
                start = snapshot.position
            else:
                # Written for another life of this log (or the log was damaged
                # and cut below it): it cannot say which headers to skip.
                log.warning(
                    "stream %s: producer state covers position %d, outside the log "
                    "[%d, %d]; reading every frame header",
                    self.name,
                    snapshot.position,
                    release,
                    tail,
                )
        try:
            scanned = self._scan_dedup(producers, start)
        except LogError as exc:
            if start == release:
                raise
            # Not a frame boundary of this log: trust only the log itself.
            log.warning(
                "stream %s: producer state position %d is not a frame of the log (%s); "
                "reading every frame header",
                self.name,
                start,
                exc,
            )
            start = release
            scanned = self._scan_dedup(producers, start)
        self.recovered_frames = scanned
        for producer, end in producers.items():
            if end > m.SEQUENCE_LIMIT:
                # Stored before batches past the limit were refused: an Ack
                # could not carry it. That id can add nothing more here.
                log.warning(
                    "stream %s: producer %d reached sequence %d, past the limit; "
                    "it can store nothing more on this stream",
                    self.name,
                    producer,
                    end,
                )
                producers[producer] = m.SEQUENCE_LIMIT
        self.dedup = dict(producers)
        self._durable_dedup = dict(producers)
        # Recovery made everything up to the tail durable.
        self._durable_dedup_position = tail
        if snapshot is not None and snapshot.position is not None and start == snapshot.position:
            self._snapshot_position = start
        self._frames_since_snapshot = scanned
        if snapshot_due_at_open(scanned, tail - start):
            # So that the next start does not read these headers again.
            self._try_snapshot()

    def _scan_dedup(self, producers: dict[int, int], start: int) -> int:
        """Fold the headers from ``start`` to the tail into ``producers``; return how many."""
        scanned = 0
        found: dict[int, int] = {}
        for header in self.log.scan_headers(start, verify=False):
            scanned += 1
            end = header.first_sequence + header.record_count
            if end > found.get(header.producer_id, 0):
                found[header.producer_id] = end
        # Only once the whole scan succeeded: a failed one changes nothing.
        for producer, end in found.items():
            if end > producers.get(producer, 0):
                producers[producer] = end
        return scanned

    def _settle_durable(self) -> None:
        """Move every append the log made durable into the durable dedup state."""
        durable = self.log.durable_position
        while self._appends and self._appends[0][0] <= durable:
            _, producer, next_sequence = self._appends.popleft()
            self._durable_dedup[producer] = next_sequence
            self._frames_since_snapshot += 1
        self._durable_dedup_position = max(self._durable_dedup_position, durable)

    def _write_snapshot(self) -> None:
        """Write the durable dedup state and the position it covers (raises OSError)."""
        # Only durable state: a batch that a crash loses must be accepted again.
        self._settle_durable()
        position = self._durable_dedup_position
        self.write_taken_snapshot(DedupSnapshot(position, dict(self._durable_dedup)))
        self._snapshot_position = position
        self._frames_since_snapshot = 0

    def _try_snapshot(self) -> None:
        """Write a snapshot where it only saves work later: a failure is a warning."""
        try:
            self._write_snapshot()
        except OSError as exc:
            log.warning("stream %s: producer state not saved: %s", self.name, exc)

    def _want_snapshot(self) -> bool:
        """Have a snapshot written soon; True if it was written at once (no gateway).

        Under a gateway a thread writes it (ConsumerService.snapshot_soon): written
        on the event loop, its fsyncs held every connection for their length,
        once per release that freed the log (about 90 ms of loop time in 10 s
        of 1 KiB records released every 250 ms, sampled with py-spy).
        """
        if self.snapshot_soon is None:
            self._try_snapshot()
            return True
        if not self._snapshot_in_flight:
            self._snapshot_wanted = True
            self.snapshot_soon()
        else:
            self._snapshot_wanted = True  # another after the one in flight
        return False

    def take_snapshot(self) -> DedupSnapshot | None:
        """The snapshot to write now, if one is wanted and none is in flight (on the loop).

        Only durable state (what the group commits so far made durable),
        copied, so that a thread can write it while appends go on.
        """
        if not self._snapshot_wanted or self._snapshot_in_flight:
            return None
        self._snapshot_wanted = False
        self._snapshot_in_flight = True
        self._settle_durable()
        return DedupSnapshot(self._durable_dedup_position, dict(self._durable_dedup))

    def write_taken_snapshot(self, snapshot: DedupSnapshot) -> None:
        """Write what :meth:`take_snapshot` returned (a thread; raises OSError).

        Never replaces a newer snapshot file by an older one.
        """
        with self._snapshot_file_lock:
            if (snapshot.position or 0) < self._snapshot_file_position:
                return
            write_snapshot(self._state_file, snapshot)
            self._snapshot_file_position = snapshot.position or 0

    @property
    def snapshot_pending(self) -> bool:
        """A producer-state snapshot is wanted, or being written off the loop."""
        return self._snapshot_wanted or self._snapshot_in_flight

    def snapshot_written(self, snapshot: DedupSnapshot, error: OSError | None) -> None:
        """The thread wrote ``snapshot`` (``error`` None) or failed (on the loop)."""
        self._snapshot_in_flight = False
        if error is not None:
            log.warning("stream %s: producer state not saved: %s", self.name, error)
            return
        position = snapshot.position
        if position is not None and (
            self._snapshot_position is None or position > self._snapshot_position
        ):
            self._snapshot_position = position
        self._frames_since_snapshot = 0
        # The freeing (and credit) that waited for it (the gateway then asks
        # for a commit, which deletes the terms freed, and rebalances).
        self._free_to_floor()
        if self._snapshot_wanted and not self._snapshot_in_flight and self.snapshot_soon:
            self.snapshot_soon()  # asked for again while this one was written

    # -- writers --------------------------------------------------------------

    def add_writer(self, writer: Writer) -> None:
        self.writers.append(writer)
        if self.storage_error is not None:
            self._tell_held(writer)

    def remove_writer(self, writer: Writer) -> None:
        """The connection is gone; its buffered batches stay in the log."""
        writer.alive = False
        writer.opening.leave()
        with contextlib.suppress(ValueError):
            self.writers.remove(writer)

    def open_channel(self, writer: Writer) -> bool:
        """Send the writer's zero guarantee if it is due (once: the protocol's rule).

        True when it went out now: the policy grants what it grants next.
        """
        if not writer.opening.open_channel():
            return False
        writer.session.issue(writer.channel, 0)
        return True

    def announce_resume(self, writer: Writer) -> None:
        """Tell a new writer where its producer's sequence numbers continue.

        When, and with what, is :mod:`headgate.protocol.opening`'s rule: the
        next sequence after everything stored for the producer id on this
        stream, once all of it is durable (until then a crash could still
        lose those batches, and the producer must keep and resend them), and
        not while batches are held (they count for the producer but are not
        stored yet). A resume Ack that waits for the held batches is asked
        for again once they are stored (:meth:`_resume_after_held`).
        """
        producer = writer.producer_id
        held = self.storage_error is not None or bool(len(self.held))
        undurable_end = None
        if not held:
            for end, p, _ in reversed(self._appends):
                if p == producer:
                    undurable_end = end
                    break
        step = writer.opening.resume(
            handle=writer.handle,
            held=held,
            next_sequence=self.dedup.get(producer, 0),
            undurable_end=undurable_end,
            durable_position=self.log.durable_position,
        )
        if step.answer is ResumeAnswer.SEND:
            assert step.ack is not None
            writer.session.send_global(step.ack)
        elif step.answer is ResumeAnswer.AFTER_COMMIT:
            # Acks are cumulative and in order: it goes out with the commit
            # that makes the producer's last stored batch durable.
            writer.pending_acks.append((step.next_sequence, step.after, None))

    # -- the books --------------------------------------------------------------

    def outstanding(self) -> int:
        """Space promised or issuable to writers, not yet filled."""
        total = 0
        for w in self.writers:
            state = w.inbound
            total += state.capacity - state.buffered_bytes
        return total

    @property
    def capacity(self) -> int:
        """The producers' budget: the log's capacity less what retention may hold."""
        return self.log.capacity - self.retention.bytes

    @property
    def free_capacity(self) -> int:
        """What producers may still fill: ``capacity`` less the unconsumed bytes.

        Retained bytes (released, kept readable) never count against it; the
        log's own free space is the bound only if retention was lowered
        while it held more.
        """
        unconsumed = self.log.tail_position - self.consumed_position
        return max(0, min(self.capacity - unconsumed, self.log.free_capacity))

    def unassigned(self) -> int:
        """Log space that no writer holds; never negative."""
        return max(0, self.free_capacity - self.reserve - self.outstanding())

    def guarantees_outstanding(self) -> int:
        """Guarantees the writers hold (as the gateway knows them)."""
        return sum(max(0, w.inbound.client_guarantees) for w in self.writers)

    # -- sequences --------------------------------------------------------------

    def next_sequence(self, producer_id: int) -> int:
        """Where the producer's next new batch on this stream must start.

        After every batch stored for it and, while the stream is held, every
        batch held for it: a producer numbers on from what it sent.
        """
        stored = self.dedup.get(producer_id, 0)
        return self._held_next.get(producer_id, stored)

    def _is_duplicate(self, next_sequence: int, first_sequence: int, record_count: int) -> bool:
        """The sequence rule, for a batch at ``first_sequence`` against ``next_sequence``.

        True for a batch wholly before ``next_sequence`` (a resend: stored
        once, acknowledged again); False for one that starts exactly there.
        Sequences per producer and stream are contiguous, so that no batch
        can make the gateway take records it never stored for duplicates
        (Kafka refuses an out-of-order sequence for the same reason).

        Raises:
            ProtocolError: OUT_OF_SEQUENCE for a batch that skips ahead (an
                empty one included); MALFORMED_MESSAGE for one that overlaps
                stored records without matching them.
        """
        end_sequence = first_sequence + record_count
        if first_sequence > next_sequence:
            raise ProtocolError(
                f"stream {self.name}: batch at sequence {first_sequence} skips ahead of "
                f"the producer's next sequence {next_sequence}",
                code=ErrorCode.OUT_OF_SEQUENCE,
            )
        if first_sequence < next_sequence < end_sequence:
            raise ProtocolError(
                f"stream {self.name}: batch {first_sequence}..{end_sequence} overlaps "
                f"stored records up to {next_sequence}",
                code=ErrorCode.MALFORMED_MESSAGE,
            )
        return first_sequence < next_sequence

    # -- batches --------------------------------------------------------------

    def append(
        self,
        writer: Writer,
        first_sequence: int,
        record_count: int,
        records: memoryview,
        *,
        now: float,
        timestamp_us: int,
        in_channel: bool = True,
    ) -> AppendOutcome:
        """Store one batch that the writer's channel buffered, or hold it.

        The batch is held (kept in memory, see :class:`HeldBatches`) while
        the stream's storage is failing, while older batches are held (order
        per stream: once one batch waits, every later one waits too), and,
        without ``in_channel``, when the log has no room for it now. Held
        batches are stored by :meth:`retry_storage` and :meth:`store_held`.
        With ``in_channel`` the batch stays in the writer's channel buffer
        until Spark releases the log space behind it (credit), and that
        space was promised to it, so a full log is an error (``LogFullError``);
        a policy that processes the channel itself passes False.

        Raises:
            ProtocolError: the batch skips ahead of the producer's next
                sequence, or overlaps stored records without matching them (a
                resend must repeat the original batches exactly); nothing is
                stored or held then.
        """
        writer.note_sent(frame_cost(len(records)), now)
        if self.storage_error is None and not len(self.held):
            try:
                return self._store(
                    writer,
                    first_sequence,
                    record_count,
                    records,
                    timestamp_us,
                    in_channel,
                    writer.batch_arrived,
                )
            except StorageError as exc:
                # Nothing was written: the log refused before the frame.
                self._storage_failed(exc)
            except LogFullError:
                if in_channel:
                    raise
        self._hold(writer, first_sequence, record_count, records, timestamp_us, in_channel)
        return AppendOutcome.HELD

    def _store(
        self,
        writer: Writer,
        first_sequence: int,
        record_count: int,
        records: memoryview,
        timestamp_us: int,
        in_channel: bool,
        arrived: float,
    ) -> AppendOutcome:
        # Against what is stored (held batches being stored count as new).
        next_sequence = self.dedup.get(writer.producer_id, 0)
        end_sequence = first_sequence + record_count
        if self._is_duplicate(next_sequence, first_sequence, record_count):
            # Already stored: acknowledge it once the log is durable up to now.
            self.duplicate_batches += 1
            end = self.log.tail_position
            writer.pending_acks.append((next_sequence, end, arrived))
            if in_channel:
                self._await_release(writer, end, records)
                self._process_released((writer,))
            return AppendOutcome.DUPLICATE
        result = self.log.append(
            records,
            producer_id=writer.producer_id,
            first_sequence=first_sequence,
            record_count=record_count,
            timestamp_us=timestamp_us,
        )
        self.last_append = result
        self.dedup[writer.producer_id] = end_sequence
        self._appends.append((result.end_position, writer.producer_id, end_sequence))
        writer.pending_acks.append((end_sequence, result.end_position, arrived))
        if in_channel:
            self._await_release(writer, result.end_position, records)
        self.appended_batches += 1
        self.appended_records += record_count
        # RecordIndex.appended, inlined: the append path's whole cost of lag in records.
        index = self.records
        index.total += record_count
        if result.end_position >= index.next_mark:
            index.mark(result.end_position)
        if self.on_append is not None:
            self.on_append(self, writer, first_sequence, records, timestamp_us)
        return AppendOutcome.STORED

    def _await_release(self, writer: Writer, end: int, records: memoryview) -> None:
        """A batch of ``writer``'s channel is in the log up to ``end``: free it at release."""
        state = writer.inbound
        if not state.coalescing:
            # Its buffer then holds runs too, processed as ours are.
            state.coalesce()
        limit = max(state.capacity // RUN_CAPACITY_FRACTION, min(RUN_FLOOR, self._max_frame))
        writer.unreleased.add(end, writer.session.batch_cost(len(records)), limit)

    def on_durable(self) -> None:
        """After a group commit: send the acks that durability now allows."""
        self._sync_failed = False
        self._settle_durable()
        durable = self.log.durable_position
        if snapshot_due(
            self._frames_since_snapshot,
            self._durable_dedup_position - (self._snapshot_position or 0),
        ):
            # Bounds what the next start reads (see headgate.gateway.dedup).
            self._want_snapshot()
        # While held, no Ack goes out (they wait in pending_acks): the first
        # Ack or guarantee after STORAGE_FULL tells a producer it is over.
        arrivals = self._acked_arrivals
        for w in self.writers if self.storage_error is None else ():
            acked = None
            while w.pending_acks and w.pending_acks[0][1] <= durable:
                acked, _, arrived = w.pending_acks.popleft()
                if arrived is not None:
                    arrivals.append(arrived)
            if acked is not None:
                w.session.send_global(
                    m.Ack(handle=w.handle, next_sequence=acked, durable_position=durable)
                )
        self._store_marks(durable)
        # Consumers may have committed past what was durable: free on as it
        # is (a save of their positions goes on off the loop, see
        # begin_consumer_save; a failed one is retried after each commit).
        self._free_to_floor()

    def _store_marks(self, durable: int) -> None:
        """Store the record marks the log is now durable up to (a pwrite when one is due)."""
        try:
            self.records.durable(durable)
        except OSError as exc:
            if not self._records_unsaved_logged:
                log.warning("stream %s: record marks not stored: %s", self.name, exc)
                self._records_unsaved_logged = True

    def scan_records(self, start: int, end: int) -> Iterator[tuple[int, int]]:
        """``(end_position, record_count)`` of the frames in ``[start, end)`` (headers only)."""
        for header in self.log.scan_headers(start, end, verify=False):
            self.records_scanned += 1
            yield header.end_position, header.record_count

    def count_at(self, position: int) -> int | None:
        """Records in the frames before ``position`` (the index's count), if it can be known.

        Exact for what the log holds (a bounded header scan from the
        nearest mark); for a freed position only where a mark is.
        """
        log_ = self.log
        try:
            return self.records.count_at(
                position, log_.release_position, log_.tail_position, self.scan_records
            )
        except LogError:
            return None  # not a frame boundary of the log: no count

    def count_known(self, position: int) -> int | None:
        """:meth:`count_at`, or the count stored with a consumer committed at ``position``.

        For a position a peer names (CountRecords): one the log holds must
        be a frame boundary (a header scan from inside a frame would read
        payload as headers), checked first.
        """
        log_ = self.log
        if log_.release_position <= position <= log_.tail_position:
            if position > log_.durable_position:
                if position != log_.tail_position:
                    return None
            elif log_.boundary_problem(position) is not None:
                return None
        count = self.count_at(position)
        if count is not None:
            return count
        epoch = self.records.epoch
        for consumer in self.consumers.consumers.values():
            counted = consumer.counted
            if counted is not None and counted[:2] == (position, epoch):
                return counted[2]
        return None

    def _count_consumers(self, consumers: Iterable[Consumer]) -> None:
        """Take each consumer's count at its position while the log still holds it."""
        epoch = self.records.epoch
        for consumer in consumers:
            counted = consumer.counted
            if counted is not None and counted[:2] == (consumer.position, epoch):
                continue
            count = self.count_at(consumer.position)
            if count is not None:
                consumer.counted = (consumer.position, epoch, count)
                if not consumer.blocking:
                    self.consumers.unsaved = True  # stored with its position

    # -- release and credit --------------------------------------------------------

    def release(
        self,
        position: int,
        consumer: str = m.DEFAULT_CONSUMER,
        *,
        now: float | None = None,
        store: bool = True,
    ) -> bool:
        """Consumer ``consumer`` committed everything before ``position``: store it, free the log.

        The log is freed up to the lowest committed position of the
        stream's blocking consumers (and no further than what is durable:
        Spark may read what is published before it is fsynced; the rest is
        freed as the log becomes durable), and the freed space is shared
        out. A position at or below the consumer's is a no-op (a Release
        sent twice). Nothing moves unless every check passes. Returns
        whether the consumer moved. The log frees only once the position is
        on disk (the crash rule of :mod:`headgate.gateway.consumers`):
        ``store`` stores it here and now; the gateway passes False and
        stores it off the loop, coalesced with other Releases
        (:meth:`begin_consumer_save`).

        Raises:
            ProtocolError: an unknown consumer (UNKNOWN_CONSUMER); a position
                beyond the tail, or not where a frame ends (its reader cannot
                have reached it).
        """
        target = self.consumers.get(consumer)
        if position <= target.position:
            return False
        self._check_release(consumer, position)
        self.consumers.commit(target, position, now)
        if not target.blocking:
            # The log may free its position before it reads on: count it now.
            self._count_consumers((target,))
        if store:
            self._save_consumers()
            self._free_to_floor()
        return True

    def begin_consumer_save(self) -> PendingSave | None:
        """The consumers' save to write off the loop now, or None (saved, or one in flight).

        One save in flight per stream: Releases that arrive while it is
        written go into the next one, so their writes coalesce. The caller
        writes it with :meth:`ConsumerBook.write` (any thread) and then calls
        :meth:`end_consumer_save` on the loop.
        """
        book = self.consumers
        if book.saving or not book.unsaved:
            return None
        book.saving = True
        return book.prepare_save()

    def end_consumer_save(self, pending: PendingSave, error: OSError | None) -> None:
        """A save from :meth:`begin_consumer_save` ended: free the log up to what it stored."""
        book = self.consumers
        book.saving = False
        if error is not None:
            book.save_failed()
            self._report_consumer_save(error)
            return
        self._report_consumer_save(None)
        book.saved_as(pending)
        self._free_to_floor()

    def _check_release(self, consumer: str, position: int) -> None:
        """Raise unless ``position`` is a frame boundary a consumer can have read to."""
        log_ = self.log
        where = f"stream {self.name}: consumer {consumer!r} cannot release to {position}"
        if position > log_.tail_position:
            raise ProtocolError(
                f"{where}, beyond the tail {log_.tail_position}", code=ErrorCode.UNEXPECTED_FRAME
            )
        if position < log_.release_position:
            # A non-blocking consumer behind the log, committing what it read
            # before the log freed it: nothing is left there to check, and it
            # frees nothing.
            return
        if position > log_.durable_position:
            problem = (
                None
                if position == log_.tail_position
                or any(end == position for end, _, _ in self._appends)
                else "not the end of a frame"
            )
        else:
            problem = log_.boundary_problem(position)
        if problem is not None:
            raise ProtocolError(f"{where}: {problem}", code=ErrorCode.UNEXPECTED_FRAME)

    def _save_consumers(self) -> None:
        """Store the consumers' positions; on failure the log frees nothing more until stored.

        A failure is logged once until a save succeeds again (each group
        commit tries again).
        """
        try:
            self.consumers.save()
        except OSError as exc:
            self._report_consumer_save(exc)
        else:
            self._report_consumer_save(None)

    def _report_consumer_save(self, error: OSError | None) -> None:
        """Log a failed save of the consumers once, until one succeeds again."""
        if error is not None:
            if not self._consumers_unsaved_logged:
                log.warning(
                    "stream %s: consumer positions not stored (the log frees nothing past "
                    "the stored ones until they are; tried again at each commit): %s",
                    self.name,
                    error,
                )
                self._consumers_unsaved_logged = True
        elif self._consumers_unsaved_logged:
            log.warning("stream %s: consumer positions stored again", self.name)
            self._consumers_unsaved_logged = False

    def _free_to_floor(self) -> None:
        """Free the log up to what every blocking consumer has stored, as far as it is durable.

        With no blocking consumer nothing holds the log back, but it is
        freed only once half of it is in use, so that non-blocking readers
        find what was written lately and a release (with its producer-state
        snapshot) is not paid at every group commit.

        The consumed position (credit) moves to that point; the log frees
        only what retention lets go (:func:`free_position`), here and
        nowhere else.
        """
        log_ = self.log
        durable = log_.durable_position
        floor = self.consumers.floor()
        consumed = self.consumed_position
        if floor is None:
            if log_.tail_position - consumed >= self.capacity // 2:
                consumed = durable
        else:
            consumed = min(floor, durable)
        previous = self.consumed_position
        if self.snapshot_soon is not None:
            # Credit and space go no further than a snapshot on disk covers
            # (_free_retained's rule); the rest follows the next snapshot,
            # written off the loop.
            covered = self._snapshot_position if self._snapshot_position is not None else -1
            if consumed > covered:
                self._want_snapshot()
                consumed = max(previous, min(consumed, covered))
        moved = consumed > previous
        if moved:
            self.consumed_position = consumed
        if not self._free_retained(snapshot_off_loop=True):
            # A full disk, or the snapshot being written: the credit waits
            # with the log's space.
            self.consumed_position = previous
            return
        if moved:
            self._process_released()

    def _free_retained(self, *, snapshot_off_loop: bool = False) -> bool:
        """Free the log up to what retention no longer keeps behind the consumed position.

        Returns False only when freeing had to be deferred (the dedup
        snapshot could not be written, or, with ``snapshot_off_loop`` under a
        gateway, is wanted from the next group commit).
        """
        log_ = self.log
        consumed = self.consumed_position
        if consumed <= log_.release_position:
            return True
        position = consumed
        if self.retention.bytes:
            try:
                position = free_position(
                    consumed,
                    self.retention,
                    (
                        (h.position, h.end_position, h.timestamp_us)
                        for h in log_.scan_headers(log_.release_position, consumed, verify=False)
                    ),
                    time.time_ns() // 1000,
                )
            except LogError as exc:
                log.warning("stream %s: retained data not freed: %s", self.name, exc)
                return True
        if position <= log_.release_position:
            return True
        # Frames being reclaimed must stay recognisable as duplicates: a
        # snapshot on disk at or past ``position`` must hold them first.
        if self._snapshot_position is None or self._snapshot_position < position:
            if snapshot_off_loop and self.snapshot_soon is not None:
                # The next group commit writes one off the loop; the space
                # (and the credit) waits for it, as for a full disk.
                self._want_snapshot()
                return False
            try:
                self._write_snapshot()
            except OSError as exc:
                # A full disk: keep the space until the snapshot can be written
                # (the next commit of this stream tries again).
                log.warning("stream %s: release to %d deferred: %s", self.name, position, exc)
                return False
        behind = self.consumers.behind(position)
        if behind:
            self._count_consumers(behind)
        count = self.count_at(position)
        if count is not None:
            try:
                self.records.freeing(position, count)
            except OSError as exc:
                log.warning("stream %s: record release point not stored: %s", self.name, exc)
        if behind:
            # A non-blocking consumer loses these frames: count their records.
            try:
                self.consumers.freeing(
                    log_.release_position,
                    position,
                    (
                        (h.position, h.record_count)
                        for h in log_.scan_headers(log_.release_position, position, verify=False)
                    ),
                )
            except LogError as exc:
                log.warning("stream %s: freed records not counted: %s", self.name, exc)
        try:
            log_.release(position)
        except LogError as exc:  # positions are checked on arrival: only a bug lands here
            log.error("stream %s: cannot free the log to %d: %s", self.name, position, exc)
        return True

    def expire_retained(self) -> bool:
        """Free retained data older than ``retain_seconds`` (housekeeping); True if it did."""
        if self.retention.seconds is None:
            return False
        before = self.log.release_position
        self._free_retained()
        return self.log.release_position != before

    def set_retention(self, retention: Retention) -> None:
        """Change the retention (a reload): the log's capacity follows, credit keeps its own."""
        capacity = self.capacity
        self.retention = retention
        self.set_capacity(capacity)
        self._free_retained()

    def declare_consumer(
        self, name: str, settings: ConsumerSettings, *, origin: str = "runtime"
    ) -> tuple[int, bool]:
        """Create consumer ``name`` at the oldest held position (or find it).

        Returns its position, and whether it is new (its file was written).

        Raises:
            ProtocolError: it exists with other settings.
        """
        known = set(self.consumers.consumers)
        consumer = self.consumers.declare(name, settings, self.log.release_position, origin=origin)
        created = name not in known
        if created:
            self._save_consumers()
            log.info(
                "stream %s: consumer %s declared at %d (blocking=%s, on_data_loss=%s)",
                self.name,
                name,
                consumer.position,
                consumer.blocking,
                consumer.on_data_loss,
            )
        return consumer.position, created

    def reset_consumer(self, name: str, to: m.ResetTo | int | m.ResetTime, now: float) -> int:
        """Move consumer ``name`` within what the log holds; its new position.

        ``EARLIEST`` is the oldest held position, ``LATEST`` the durable end,
        a :class:`~headgate.protocol.messages.ResetTime` the first durable
        frame stored at or after it (the durable end if none). An explicit
        position must be a frame boundary the log holds. Moving back replays
        what the log still holds; a blocking consumer cannot go before it.

        Raises:
            ProtocolError: an unknown consumer, or a position the log does not hold.
        """
        self.consumers.get(name)  # unknown: refused before anything is read
        log_ = self.log
        if to is m.ResetTo.EARLIEST:
            position = log_.release_position
        elif to is m.ResetTo.LATEST:
            position = log_.durable_position
        elif isinstance(to, m.ResetTime):
            position = log_.durable_position
            for header in log_.scan_headers(
                log_.release_position, log_.durable_position, verify=False
            ):
                if header.timestamp_us >= to.timestamp_us:
                    position = header.position
                    break
        else:
            assert isinstance(to, int)
            position = to
            if not log_.release_position <= position <= log_.tail_position:
                raise ProtocolError(
                    f"stream {self.name}: cannot reset consumer {name!r} to {position}: the "
                    f"log holds [{log_.release_position}, {log_.tail_position}]",
                    code=ErrorCode.UNEXPECTED_FRAME,
                )
            self._check_release(name, position)
        consumer = self.consumers.reset(name, position, now)
        self._save_consumers()
        self._free_to_floor()
        log.warning("stream %s: consumer %s reset to %d", self.name, name, consumer.position)
        return consumer.position

    def delete_consumer(self, name: str) -> int:
        """Delete consumer ``name``; the log is freed of what it held. Its last position.

        Raises:
            ProtocolError: an unknown consumer.
        """
        consumer = self.consumers.delete(name)
        self._save_consumers()
        self._free_to_floor()
        log.warning("stream %s: consumer %s deleted at %d", self.name, name, consumer.position)
        return consumer.position

    def read_start(self, consumer: str, start: int) -> tuple[int, int, int | None]:
        """Where ``consumer`` reads from when it asks for ``start``; the bytes and records skipped.

        Raises:
            ProtocolError: an unknown consumer, or DATA_LOST (see
                :meth:`~headgate.gateway.consumers.ConsumerBook.read_from`).
        """
        oldest = self.log.release_position
        return self.consumers.read_from(
            consumer, start, oldest, (self.records.epoch, self.count_at(oldest))
        )

    def consumer_read(self, consumer: str, end: int) -> None:
        """A Fetch naming ``consumer`` ended at ``end`` (where its next read likely starts)."""
        self.consumers.read(consumer, end)

    def check_idle(self, now: float, idle_after: float, policy: str) -> list[IdleAction]:
        """The idle rule for this stream's blocking consumers at ``now``; what it did.

        ``hold``: one WARNING per idle spell, the consumer still blocks.
        ``detach``: the consumer stops blocking (stored), a WARNING says so,
        and the log is freed to the new floor, so the stream flows again.
        """
        actions = self.consumers.idle(now, idle_after, policy, self.log.durable_position)
        for action in actions:
            consumer = action.consumer
            if action.policy == "detach":
                log.warning(
                    "stream %s: consumer %s has not released for %.1f s (at %d, durable %d); "
                    "detached: it no longer holds the producers back",
                    self.name,
                    consumer.name,
                    action.idle_for,
                    consumer.position,
                    self.log.durable_position,
                )
            else:
                log.warning(
                    "stream %s: consumer %s has not released for %.1f s (at %d, durable %d); "
                    "producers wait for it (idle_policy = hold)",
                    self.name,
                    consumer.name,
                    action.idle_for,
                    consumer.position,
                    self.log.durable_position,
                )
        if any(action.policy == "detach" for action in actions):
            # Stored before it frees anything (Releases pending beside it go
            # along; they alone are left to the gateway's save off the loop).
            self._save_consumers()
            self._free_to_floor()
        return actions

    def _process_released(self, writers: Sequence[Writer] | None = None) -> None:
        """Free the channel space of every run the consumed position now covers."""
        released = self.consumed_position
        shares: dict[int, int] | None = None
        for writer in self.writers if writers is None else writers:
            if not writer.alive:
                continue
            while (run := writer.unreleased.take_released(released)) is not None:
                if shares is None:
                    shares = self.shares(now=None)
                state = writer.inbound
                # Asked by a Plead to hold less, a writer's buffer shrinks
                # instead of re-issuing (re-issuing to a pleaded writer would
                # hand back what the Plead asked for, and count against it at
                # the deadline); so it does while the stream is held.
                reissue = self.storage_error is None and writer.pleaded_at is None
                writer.session.process(
                    writer.handle, reissue=reissue, count=run.count, size=run.size
                )
                excess = state.capacity - shares.get(id(writer), 0)
                if reissue and excess > 0:
                    # Above its share, what the run frees beyond the share
                    # is taken back before it is issued.
                    state.shrink(min(excess, run.size, state.issuable, state.free))

    def _first_grant(self, capacity: int) -> int:
        """What a writer that has used nothing yet may hold: a few frames, or 1/16 of the log."""
        return max(4 * self._max_frame, capacity // 16)

    def shares(self, now: float | None, limited: set[int] | None = None) -> dict[int, int]:
        """Each writer's fair share of the stream, by ``id`` (see :func:`fair_shares`).

        Shares follow use (``start``): credit nobody uses stays unassigned,
        for a newcomer to be granted at once.
        """
        total = max(0, self.capacity - self.reserve)
        return fair_shares(
            total, self._floor, self.writers, now, start=self._start, limited=limited
        )

    def wants_credit(self, writer: Writer, now: float) -> bool:
        """Whether a rebalance could give ``writer`` more now (checked after each batch).

        True when the last rebalance held its share down for want of use,
        left space unassigned, and the writer has since used half of what it
        holds: its use now earns it more. At most once per rebalance, and
        once per :data:`ASK_INTERVAL_S` for the whole stream, whoever asks (a
        rebalance visits every writer, and serves them all: a thousand
        handles writing small batches cannot make it run more often).
        """
        if not writer.wants_more or now - self._asked_at < ASK_INTERVAL_S:
            return False
        state = writer.inbound
        if state.client_guarantees >= state.capacity // 2:
            return False
        writer.wants_more = False
        self._asked_at = now
        return True

    def set_capacity(self, capacity: int) -> None:
        """Resize the producers' budget (the log holds the retention on top of it).

        The next rebalance (``Gateway.rebalance``) grants or pleads to match.
        """
        self.log.set_capacity(capacity + self.retention.bytes)
        self.reserve = self._reserve_for(capacity)
        self._start = self._first_grant(capacity)

    def _reserve_for(self, capacity: int) -> int:
        """Room kept back for padding at term rotations while ``capacity`` bytes are written.

        Retained bytes are positions already written, their padding included:
        only the producers' budget needs the reserve.
        """
        return (capacity // self.log.term_length + 2) * self._max_frame

    def rebalance_credit(self, now: float) -> None:
        """Grant free space to writers below their share; plead those above it."""
        if self.storage_error is not None:
            return  # no guarantees while the storage fails
        limited: set[int] = set()
        shares = self.shares(now, limited)
        if not shares:
            return
        unassigned = self.unassigned()
        starving = False
        # What each party holds beyond what the log holds for it (its credit
        # and the batches in flight under it), against max_party_credit: a
        # share of a big stream is otherwise megabytes a party can send
        # ahead, which keep arriving for seconds after it stops.
        cap = self.max_party_credit
        held: dict[Hashable, int] = {}
        if cap:
            for w in self.writers:
                party = party_of(w)
                held[party] = held.get(party, 0) + w.inbound.capacity - w.inbound.buffered_bytes
        for w in self.writers:
            state = w.inbound
            want = shares[id(w)] - state.capacity
            if want > 0:
                if cap:
                    party = party_of(w)
                    room = max(0, cap - held[party])
                    if want > room:
                        # Capped, not starved: it asks again as it uses it.
                        want = room
                        limited.add(id(w))
                grant = min(want, unassigned)
                if grant:
                    state.grow(grant)
                    unassigned -= grant
                    if cap:
                        held[party] += grant
                if grant < want:
                    starving = True
        for w in self.writers:
            # Who was held down for want of use may earn more by using it, as
            # long as there is space left to grant (Stream.wants_credit).
            w.wants_more = unassigned > 0 and id(w) in limited
            state = w.inbound
            excess = state.capacity - shares[id(w)]
            if starving and excess > 0 and state.client_guarantees > 0:
                self.plead(w, max(0, state.client_guarantees - excess), now)
            elif excess <= 0:
                w.pleaded = None
                w.pleaded_at = None
            w.session.issue(w.channel)

    # -- pleas and their deadline ------------------------------------------------

    @staticmethod
    def plead(writer: Writer, target: int, now: float) -> None:
        """Ask ``writer`` to keep only ``target`` guarantees, and start its deadline.

        The one place a Plead is sent. A repeated target is not sent again;
        the deadline runs from the first Plead that is still unanswered.
        """
        if writer.pleaded == target:
            return
        writer.session.plead(writer.channel, target)
        writer.pleaded = target
        if writer.pleaded_at is None:
            writer.pleaded_at = now
            writer.pleaded_most = target
        else:
            writer.pleaded_most = max(writer.pleaded_most, target)

    def overdue_pleas(self, now: float, deadline: float) -> list[tuple[Writer, int]]:
        """Writers that still hold more than they were pleaded down to after ``deadline`` s.

        Returns each with the bytes it did not absolve. A writer that holds no
        more than its Plead's target has answered it (its deadline stops);
        one that Pleads since asked for less, only because it sent batches
        meanwhile, is measured against the largest target of the episode.
        """
        overdue: list[tuple[Writer, int]] = []
        for w in self.writers:
            if w.pleaded_at is None:
                continue
            held = w.inbound.client_guarantees
            if held <= w.pleaded_most:
                w.pleaded_at = None
            elif now - w.pleaded_at >= deadline:
                overdue.append((w, held - w.pleaded_most))
        return overdue

    def flush_writers(self) -> None:
        """Write out what this stream's credit decisions queued, once per connection."""
        flushes = {id(w.session): w.flush for w in self.writers}
        for flush in flushes.values():
            flush()
        if self._acked_arrivals:
            if self.on_acks_written is not None:
                self.on_acks_written(self, self._acked_arrivals)
            self._acked_arrivals.clear()

    # -- failing storage ---------------------------------------------------------------

    def sync_failed(self, error: LogError) -> None:
        """The group commit of this stream failed: hold it until one succeeds."""
        self._sync_failed = True
        if isinstance(error, StorageError):
            self._storage_failed(error)
        else:
            self._storage_failed(StorageError(str(error), self.log.directory, errno.EIO))

    def _storage_failed(self, error: StorageError) -> None:
        first = self.storage_error is None
        self.storage_error = error
        if first:
            log.warning(
                "stream %s: storage failing, holding its batches and issuing no "
                "guarantees until it recovers: %s",
                self.name,
                error,
            )
            for writer in self.writers:
                self._tell_held(writer)

    def _tell_held(self, writer: Writer) -> None:
        error = self.storage_error
        assert error is not None
        writer.session.send_global(
            m.Error(
                code=ErrorCode.STORAGE_FULL,
                scope=m.HandleRef(handle_type=m.HandleType.STREAM, handle=writer.handle),
                text=f"stream {self.name}: cannot store now ({error.message}: "
                f"{os.strerror(error.errno)}); batches are kept and stored when space returns",
            )
        )

    def _hold(
        self,
        writer: Writer,
        first_sequence: int,
        record_count: int,
        records: memoryview,
        timestamp_us: int,
        in_channel: bool,
    ) -> None:
        producer = writer.producer_id
        next_sequence = self.next_sequence(producer)
        if not self._is_duplicate(next_sequence, first_sequence, record_count):
            self._held_next[producer] = first_sequence + record_count
        # A copy: ``records`` is a view into the connection's receive buffer.
        self.held.add(
            HeldBatch(
                writer,
                first_sequence,
                record_count,
                bytes(records),
                timestamp_us,
                in_channel,
                writer.batch_arrived,
            )
        )

    def _store_held(self) -> bool:
        """Store held batches, oldest first, until one does not fit the log; True if any.

        Raises:
            StorageError: the log's storage failed; the batch stays held.
        """
        stored = False
        held = self.held
        while len(held):
            batch = held.first()
            try:
                self._store(
                    batch.writer,
                    batch.first_sequence,
                    batch.record_count,
                    memoryview(batch.records),
                    batch.timestamp_us,
                    batch.in_channel,
                    batch.arrived,
                )
            except LogFullError:
                break  # it waits for the consumer to release space
            except ProtocolError as exc:
                # Checked on arrival (_hold), so only a bug lands here: the
                # batch is let go, and its writer's connection with it.
                log.error("stream %s: dropping a held batch: %s", self.name, exc)
                if batch.writer.alive and batch.writer.refuse is not None:
                    batch.writer.refuse(exc)
            held.take()
            stored = True
        self._resume_after_held()
        return stored

    def _resume_after_held(self) -> None:
        """Once nothing is held and the storage works: the resume Acks that waited."""
        if self.storage_error is not None or len(self.held):
            return
        self._held_next.clear()
        for writer in self.writers:
            if writer.opening.waiting:
                self.announce_resume(writer)

    def store_held(self) -> bool:
        """Store what the log has room for now of the held batches; True if any was stored.

        For batches held by a full log (the ``window`` and ``xonxoff``
        policies call it after releases and commits). While the storage is
        failing it does nothing: that is :meth:`retry_storage`'s to try.
        """
        if self.storage_error is not None or not len(self.held):
            return False
        try:
            return self._store_held()
        except StorageError as exc:
            self._storage_failed(exc)
            return False

    def retry_storage(self) -> bool:
        """If the stream is held, try its storage again; True once it is not held.

        The log must be able to reserve its next term (what failed when the
        disk filled up) and the last group commit must have succeeded. Then
        the held batches are stored in arrival order through the ordinary
        path, so a batch held twice (a resend after a reconnect) is stored
        once and acknowledged twice, like any duplicate. Those that the log
        has no room for yet (a policy without log-backed guarantees) stay
        held for :meth:`store_held`.
        """
        if self.storage_error is None:
            return True
        if self._sync_failed:
            return False
        try:
            self.log.ensure_next_term()
            self._store_held()
        except StorageError as exc:
            self.storage_error = exc
            return False
        log.warning("stream %s: storage recovered; stored its held batches", self.name)
        self.storage_error = None
        self._resume_after_held()
        return True

    def statistics(self, now_us: int | None = None) -> GatewayStreamStatistics:
        """A snapshot; with ``now_us`` (wall clock, µs) each consumer's lag in seconds too."""
        return GatewayStreamStatistics(
            name=self.name,
            capacity=self.capacity,
            free_capacity=self.free_capacity,
            tail_position=self.log.tail_position,
            durable_position=self.log.durable_position,
            release_position=self.consumed_position,
            writers=len(self.writers),
            guarantees_outstanding=self.guarantees_outstanding(),
            appended_batches=self.appended_batches,
            appended_records=self.appended_records,
            duplicate_batches=self.duplicate_batches,
            storage_problem=None if self.storage_error is None else str(self.storage_error),
            held_batches=len(self.held),
            reserve=self.reserve,
            consumers=self.consumers.statistics(
                self.log.durable_position,
                None if now_us is None else (now_us, self._oldest_unreleased_timestamp),
                self._lag_records,
            ),
            retained_bytes=self.consumed_position - self.log.release_position,
            freed_position=self.log.release_position,
        )

    def _lag_records(self, consumers: Iterable[Consumer]) -> dict[str, int]:
        """Records between each consumer's position and the durable end, where countable.

        A consumer's count is taken once per position it commits (cached on
        it, see :meth:`_count_consumers`); a freed position is countable
        only from the count stored with it (the same epoch) or a mark.
        """
        end = self.count_at(self.log.durable_position)
        if end is None:
            return {}
        consumers = list(consumers)
        epoch = self.records.epoch
        held = [c for c in consumers if c.position >= self.log.release_position]
        self._count_consumers(held)
        lags: dict[str, int] = {}
        for consumer in consumers:
            counted = consumer.counted
            if counted is not None and counted[:2] == (consumer.position, epoch):
                lags[consumer.name] = max(0, end - counted[2])
            elif consumer.position < self.log.release_position:
                count = self.count_at(consumer.position)  # a mark, if there is one
                if count is not None:
                    lags[consumer.name] = max(0, end - count)
        return lags

    def _oldest_unreleased_timestamp(self, position: int) -> int | None:
        """The timestamp (µs) of the first durable frame at or after ``position``, if any.

        One header read: the age of the oldest record a consumer at
        ``position`` has not committed (from what the log still holds).
        """
        log_ = self.log
        start = max(position, log_.release_position)
        if start >= log_.durable_position:
            return None
        try:
            for header in log_.scan_headers(start, log_.durable_position, verify=False):
                return header.timestamp_us
        except LogError:
            return None  # a position the log cannot scan from: no age known
        return None

    def close(self) -> None:
        """Make the log durable, save the dedup state at its tail, close the log.

        After a clean stop the next start reads no frame header at all.
        """
        try:
            self.log.sync()
        except LogError as exc:
            log.warning("stream %s: last group commit failed at close: %s", self.name, exc)
        else:
            self._settle_durable()
            if self._durable_dedup_position != self._snapshot_position:
                self._try_snapshot()
            # A freeing that waited for a snapshot from the group commit: now.
            self.commit_soon = self.snapshot_soon = None
            self._snapshot_wanted = self._snapshot_in_flight = False
            self._free_to_floor()
        if self.consumers.unsaved:
            # Releases since the last save (the gateway waited for any in flight).
            self._save_consumers()
        try:
            self.records.close(self.log.durable_position)
        except OSError as exc:
            log.warning("stream %s: record marks not stored at close: %s", self.name, exc)
        self.log.close()
