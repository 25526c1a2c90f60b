"""Flow-control policies of a stream: credit, sliding window, XON/XOFF.

Each stream on the gateway uses one policy, chosen in the configuration. The
policy decides what a writer's LCMUX channel (its guarantees) stands for and
when the gateway stops a producer:

``credit`` (the default)
    A guarantee is log space. The stream's free capacity is shared among its
    writers in advance; a batch stays in its writer's channel buffer until the
    consumer releases the log behind it. A stalled consumer stops exactly its
    own stream's writers, nothing else. When the operator lowers the capacity,
    the gateway takes back unissued space and pleads writers down to their new
    share (the seed's Plead and Absolve).

``window``
    A sliding window of ``window`` batches per writer: LCMUX's guarantees as
    acknowledgements. A *slot* is the cost of the largest batch the gateway
    accepts; a writer's channel holds ``window`` slots. The guarantee for a
    batch comes back only once the batch is *processed*, which here means
    appended to the log and durable (the same moment its Ack can go out). The
    log's free space does not back the guarantees: a batch that does not fit
    the log (or arrives while the disk is full) waits in gateway memory, and
    keeps its slot while it waits, so the window (at most ``window`` slots
    per writer) is what bounds that memory. Following LCMUX's convention, the
    gateway's first act on the channel is IssueGuarantees(0), which says it
    issues guarantees preemptively, and it then opens the whole window at
    once, so that a producer that never sends optimistically cannot deadlock.
    A producer with ``policy="window"`` spends one whole slot per batch (it
    absolves the rest), so the window counts batches exactly; a plain
    ``wait`` producer is bounded by the same bytes, ``window`` slots. As with
    credit, the window belongs to the connection, not to the handle: handles
    of one connection on one stream share its ``window`` slots (the first
    takes them; another gets those a freed one gave back), so binding a
    stream many times does not multiply what the gateway may hold.

``xonxoff``
    No credit at all: each writer gets guarantees it will never exhaust, and
    the gateway pauses reading every connection that writes the stream once
    the stream's unreleased bytes reach ``xoff``, and resumes them at ``xon``
    (the seed's Off and On ports, carried by TCP). A pause stops the whole
    connection, every stream on it; what was already read when the watermark
    was crossed is still stored (the overshoot), in the log if it fits and in
    memory if not. Bytes held in memory count towards the watermark, so a
    full disk pauses the writers too.

Whatever holds a batch in memory, it is held in the stream's one queue
(:class:`~headgate.gateway.streams.HeldBatches`), which every policy reads.

Every policy's channels open the same way, which no policy can change: a
new writer's zero guarantee goes out once, at the first rebalance after its
bind and before anything the policy grants there (the rule is
:mod:`headgate.protocol.opening`'s; :meth:`Flow.rebalance` applies it, then
the policy's :meth:`Flow._opening` and :meth:`Flow._rebalance`).

Nothing here touches a socket: pausing goes through each writer's
``throttle`` callback, and the caller passes ``now``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import final

from headgate.config import FlowSettings
from headgate.costs import batch_cost
from headgate.gateway.streams import AppendOutcome, Stream, Writer

__all__ = [
    "CreditFlow",
    "Flow",
    "FlowStatistics",
    "WindowFlow",
    "XonXoffFlow",
    "make_flow",
]

#: Guarantees an ``xonxoff`` writer gets: more than it can ever spend.
XONXOFF_CREDIT = 1 << 40


@dataclass(frozen=True, slots=True)
class FlowStatistics:
    """What a stream's policy did, for tests, benchmarks and dashboards."""

    #: ``credit``, ``window`` or ``xonxoff``.
    policy: str
    #: Bytes received and kept in gateway memory because the log could not
    #: store them (full, or its disk failing): the stream's held batches.
    held_bytes: int
    #: The most ever held at once.
    peak_held_bytes: int
    #: ``window``: the most batches ever in one writer's window at once.
    max_in_flight: int
    #: ``xonxoff``: how often the writers' connections were paused / resumed.
    pauses: int
    resumes: int
    #: ``xonxoff``: whether they are paused now.
    paused: bool
    #: ``xonxoff``: the most unreleased-or-held bytes ever seen.
    peak_level: int


class Flow:
    """The credit policy, and the base of the others."""

    policy = "credit"
    #: Whether a group commit moves this policy's credit (a window's slot is
    #: freed by durability), so that the stream rebalances after every
    #: commit; the credit policy's space moves only with releases, binds,
    #: frees, Absolves and use, so after a commit it rebalances now and then.
    durability_moves_credit = False

    def __init__(
        self,
        stream: Stream,
        settings: FlowSettings,
        *,
        max_message_size: int,
        mark_dirty: Callable[[], None],
    ) -> None:
        self.stream = stream
        self.settings = settings
        self._max_message_size = max_message_size
        self._mark_dirty = mark_dirty
        self.max_in_flight = 0

    def update(self, settings: FlowSettings) -> None:
        """New settings of the same policy (a reloaded configuration)."""
        self.settings = settings

    # -- events from the connection --

    def receive(
        self,
        writer: Writer,
        first_sequence: int,
        record_count: int,
        records: memoryview,
        *,
        now: float,
        timestamp_us: int,
    ) -> None:
        """A batch the writer's channel buffered: store it."""
        self.stream.append(
            writer, first_sequence, record_count, records, now=now, timestamp_us=timestamp_us
        )

    def on_absolved(self, writer: Writer, amount: int) -> None:
        """The writer absolved ``amount`` guarantees (its channel shrank already)."""

    @final
    def rebalance(self, now: float) -> None:
        """Move credit: open new writers' channels, grant what is free, take back what must go.

        Final (mypy refuses an override): every policy's channels open the
        same way. A writer new since the last rebalance gets its zero
        guarantee (the protocol's rule, :meth:`Stream.open_channel`: once,
        before anything else the policy grants on its channel), then
        :meth:`_opening`; then the policy moves credit (:meth:`_rebalance`).
        """
        stream = self.stream
        for w in stream.writers:
            if stream.open_channel(w):
                self._opening(w)
        self._rebalance(now)

    def _opening(self, writer: Writer) -> None:
        """What a policy grants a new writer right after the zero guarantee."""

    def _rebalance(self, now: float) -> None:
        """The policy's own moves, after new channels opened."""
        self._reclaim(now)
        self.stream.rebalance_credit(now)

    def _reclaim(self, now: float) -> None:
        # Lowering the capacity can leave more promised than the log holds.
        # Take back what was never issued first; plead writers above their
        # new share for the rest. Their buffers shrink as the consumer
        # releases (Stream._process_released), and the absolution shrinks them
        # at once.
        s = self.stream
        over = s.outstanding() + s.reserve - s.free_capacity
        if over <= 0:
            return
        for w in s.writers:
            state = w.inbound
            take = min(over, state.issuable, max(0, state.free))
            if take > 0:
                state.shrink(take)
                over -= take
        if over <= 0:
            return
        shares = s.shares(now)
        for w in s.writers:
            state = w.inbound
            excess = state.capacity - shares.get(id(w), 0)
            if excess > 0 and state.client_guarantees > 0:
                s.plead(w, max(0, state.client_guarantees - excess), now)

    # -- helpers for the policies that process their own channels --

    def _append(
        self,
        writer: Writer,
        first_sequence: int,
        record_count: int,
        records: memoryview,
        *,
        now: float,
        timestamp_us: int,
    ) -> AppendOutcome:
        """Append a batch the policy takes out of the channel itself, or hold it.

        Such a batch is not backed by log space: one that does not fit the
        log now is held by the stream (see :meth:`Stream.append`).
        """
        outcome = self.stream.append(
            writer,
            first_sequence,
            record_count,
            records,
            now=now,
            timestamp_us=timestamp_us,
            in_channel=False,
        )
        if outcome is not AppendOutcome.HELD:
            self._mark_dirty()
        return outcome

    def _store_held(self) -> None:
        """Store what the log has room for now of the stream's held batches."""
        if self.stream.store_held():
            self._mark_dirty()

    def statistics(self) -> FlowStatistics:
        held = self.stream.held
        return FlowStatistics(
            policy=self.policy,
            held_bytes=held.bytes,
            peak_held_bytes=held.peak_bytes,
            max_in_flight=self.max_in_flight,
            pauses=0,
            resumes=0,
            paused=False,
            peak_level=0,
        )


CreditFlow = Flow


@dataclass(slots=True)
class _InWindow:
    """A batch that holds one of its writer's window slots."""

    writer: Writer
    #: Where its frame ends in the log; None while the stream holds it.
    end: int | None
    #: Its ticket in the stream's held batches (when ``end`` is None).
    ticket: int


class WindowFlow(Flow):
    """A sliding window of batches per writer; guarantees are acknowledgements."""

    policy = "window"
    durability_moves_credit = True

    def __init__(
        self,
        stream: Stream,
        settings: FlowSettings,
        *,
        max_message_size: int,
        mark_dirty: Callable[[], None],
    ) -> None:
        super().__init__(stream, settings, max_message_size=max_message_size, mark_dirty=mark_dirty)
        #: Guarantees per window slot: what the largest batch costs.
        self.slot = batch_cost(max_message_size)
        # Slot remainders the writer absolved, given back with its batches' acks.
        self._absolved: dict[Writer, int] = {}
        # Window slots each live writer was given (its connection's share).
        self._slots: dict[Writer, int] = {}
        # Batches whose slot is taken, in arrival (and so log) order.
        self._unacked: deque[_InWindow] = deque()

    def receive(
        self,
        writer: Writer,
        first_sequence: int,
        record_count: int,
        records: memoryview,
        *,
        now: float,
        timestamp_us: int,
    ) -> None:
        in_flight = writer.inbound.buffered_messages
        self.max_in_flight = max(self.max_in_flight, in_flight)
        outcome = self._append(
            writer, first_sequence, record_count, records, now=now, timestamp_us=timestamp_us
        )
        if outcome is AppendOutcome.HELD:
            # The slot stays taken until the held batch is stored and durable.
            self._unacked.append(_InWindow(writer, None, self.stream.held.last_ticket))
        else:
            self._unacked.append(_InWindow(writer, self.stream.log.tail_position, 0))

    def on_absolved(self, writer: Writer, amount: int) -> None:
        self._absolved[writer] = self._absolved.get(writer, 0) + amount

    def _opening(self, writer: Writer) -> None:
        # The whole window at once: a producer that waits for guarantees has them.
        self._slots[writer] = 0
        self._give_slots([writer])

    def _give_slots(self, writers: list[Writer]) -> None:
        """Give each of ``writers`` what its connection has left of its window.

        A freed handle's batches that are not durable yet (or still held)
        keep their slots until they are: what the connection has in memory
        stays within one window however often it binds and frees.
        """
        used: dict[int, int] = {}
        for w, n in self._slots.items():
            if w.alive:  # a gone writer's slots count by its batches, below
                used[id(w.session)] = used.get(id(w.session), 0) + n
        for entry in self._unacked:
            if not entry.writer.alive:
                key = id(entry.writer.session)
                used[key] = used.get(key, 0) + 1
        for w in writers:
            give = self.settings.window - used.get(id(w.session), 0)
            if give > 0:
                self._slots[w] += give
                used[id(w.session)] = self.settings.window
                w.inbound.grow(give * self.slot)

    def _rebalance(self, now: float) -> None:
        s = self.stream
        gone = [w for w in self._slots if not w.alive]
        for w in gone:
            del self._slots[w]
        self._store_held()
        durable = s.log.durable_position
        while self._unacked:
            entry = self._unacked[0]
            if entry.end is None:
                if not s.held.left(entry.ticket):
                    break  # still held, and every later batch after it
                # Stored since it was held: its frame ends at or before the tail.
                entry.end = s.log.tail_position
            if entry.end > durable:
                break
            self._unacked.popleft()
            w = entry.writer
            if not w.alive:
                self._absolved.pop(w, None)
                gone.append(w)
                continue
            size = w.session.process(w.handle, reissue=True)
            back = min(self._absolved.get(w, 0), self.slot - size)
            if back > 0:
                w.inbound.grow(back)
                self._absolved[w] -= back
        if gone:
            self._give_slots(s.writers)  # slots of freed handles, to their siblings
        for w in s.writers:
            w.session.issue(w.channel)


class XonXoffFlow(Flow):
    """Pause whole connections at a high watermark, resume them at a low one."""

    policy = "xonxoff"
    durability_moves_credit = True

    def __init__(
        self,
        stream: Stream,
        settings: FlowSettings,
        *,
        max_message_size: int,
        mark_dirty: Callable[[], None],
    ) -> None:
        super().__init__(stream, settings, max_message_size=max_message_size, mark_dirty=mark_dirty)
        self.paused = False
        # Writers whose connection this stream paused, to resume exactly those.
        self._throttled: set[Writer] = set()
        self.pauses = 0
        self.resumes = 0
        self.peak_level = 0

    @property
    def reason(self) -> str:
        return f"xoff:{self.stream.name}"

    def level(self) -> int:
        """Bytes not consumed in the log plus bytes held in memory (retained ones never count)."""
        stream = self.stream
        return stream.log.tail_position - stream.consumed_position + stream.held.bytes

    def receive(
        self,
        writer: Writer,
        first_sequence: int,
        record_count: int,
        records: memoryview,
        *,
        now: float,
        timestamp_us: int,
    ) -> None:
        self._append(
            writer, first_sequence, record_count, records, now=now, timestamp_us=timestamp_us
        )
        # The channel is only a formality here: empty it at once.
        writer.session.process(writer.handle, reissue=True)
        level = self.level()
        self.peak_level = max(self.peak_level, level)
        if not self.paused and level >= self.settings.xoff:
            self.paused = True
            self.pauses += 1
            self._throttle(True)

    def _throttle(self, pause: bool) -> None:
        writers = set(self.stream.writers) if pause else self._throttled
        for w in writers:
            if w.throttle is not None:
                w.throttle(self.reason, pause)
        self._throttled = writers if pause else set()

    def _opening(self, writer: Writer) -> None:
        writer.inbound.grow(XONXOFF_CREDIT)
        if self.paused and writer.throttle is not None:
            writer.throttle(self.reason, True)
            self._throttled.add(writer)

    def _rebalance(self, now: float) -> None:
        s = self.stream
        self._store_held()
        if self.paused and self.level() <= self.settings.xon:
            self.paused = False
            self.resumes += 1
            self._throttle(False)
        for w in s.writers:
            # Top the formality up only when half is spent: no chatter per batch.
            if w.inbound.client_guarantees < XONXOFF_CREDIT // 2:
                w.session.issue(w.channel)

    def statistics(self) -> FlowStatistics:
        held = self.stream.held
        return FlowStatistics(
            policy=self.policy,
            held_bytes=held.bytes,
            peak_held_bytes=held.peak_bytes,
            max_in_flight=0,
            pauses=self.pauses,
            resumes=self.resumes,
            paused=self.paused,
            peak_level=self.peak_level,
        )


_FLOWS: dict[str, type[Flow]] = {
    "credit": CreditFlow,
    "window": WindowFlow,
    "xonxoff": XonXoffFlow,
}


def make_flow(
    stream: Stream,
    settings: FlowSettings,
    *,
    max_message_size: int,
    mark_dirty: Callable[[], None],
) -> Flow:
    """The policy object for a stream, by ``settings.policy``."""
    try:
        cls = _FLOWS[settings.policy]
    except KeyError:
        raise ValueError(f"unknown flow-control policy {settings.policy!r}") from None
    return cls(stream, settings, max_message_size=max_message_size, mark_dirty=mark_dirty)
