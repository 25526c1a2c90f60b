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
    the log waits in gateway memory, and the window (at most ``window`` slots
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
    memory if not.

Nothing here touches a socket: pausing goes through each writer's
``throttle`` callback, and the caller passes ``now``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from headgate.config import FlowSettings
from headgate.costs import batch_cost
from headgate.gateway.streams import Stream, Writer
from headgate.log import LogFullError
from headgate.protocol.errors import ProtocolError

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
    #: Bytes received and kept in gateway memory because the log was full.
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


@dataclass(slots=True)
class _Held:
    writer: Writer
    first_sequence: int
    record_count: int
    records: bytes
    timestamp_us: int


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
        self._held: deque[_Held] = deque()
        # Writers whose channel got its opening zero guarantee.
        self._opened: set[Writer] = set()
        self.held_bytes = 0
        self.peak_held_bytes = 0
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

    def rebalance(self, now: float) -> None:
        """Move credit: grant what is free, take back what must go."""
        self._open_channels()
        self._reclaim(now)
        self.stream.rebalance_credit(now)

    def _open_channels(self) -> None:
        self._opened = {w for w in self._opened if w.alive}
        for w in self.stream.writers:
            if w not in self._opened:
                self._opened.add(w)
                # LCMUX: zero guarantees first say "this server issues in
                # advance", so a client that never sends optimistically knows
                # it will not wait forever.
                w.session.issue(w.channel, 0)
                self._opening(w)

    def _opening(self, writer: Writer) -> None:
        """What a policy grants a new writer right after the zero guarantee."""

    def _reclaim(self, now: float) -> None:
        # Lowering the capacity can leave more promised than the log holds.
        # Take back what was never issued first; plead writers above their
        # new share for the rest. Their buffers shrink as the consumer
        # releases (Stream._process_released), and the absolution shrinks them
        # at once.
        s = self.stream
        over = s.outstanding() + s.reserve - s.log.free_capacity
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

    def _store(self, held: _Held, now: float, records: memoryview | None = None) -> bool:
        """Append to the log; False if it does not fit now.

        A batch the stream refuses (out of sequence) ends its writer's
        connection and is let go: stored later than it arrived, it has no
        caller left to refuse it.
        """
        try:
            self.stream.append(
                held.writer,
                held.first_sequence,
                held.record_count,
                memoryview(held.records) if records is None else records,
                now=now,
                timestamp_us=held.timestamp_us,
                in_channel=False,
            )
        except LogFullError:
            return False
        except ProtocolError as error:
            if held.writer.refuse is None:
                raise
            held.writer.refuse(error)
            return True
        self._mark_dirty()
        self._stored(held.writer)
        return True

    def _stored(self, writer: Writer) -> None:
        """A batch reached the log."""

    def _receive_or_hold(
        self,
        writer: Writer,
        first_sequence: int,
        record_count: int,
        records: memoryview,
        *,
        now: float,
        timestamp_us: int,
    ) -> None:
        held = _Held(writer, first_sequence, record_count, b"", timestamp_us)
        if not self._held and self._store(held, now, records):
            return
        # Order per stream: once one batch waits, every later one waits too.
        held.records = bytes(records)
        self._held.append(held)
        self.held_bytes += len(held.records)
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)

    def _drain(self, now: float) -> None:
        while self._held and self._store(self._held[0], now):
            self.held_bytes -= len(self._held.popleft().records)

    def statistics(self) -> FlowStatistics:
        return FlowStatistics(
            policy=self.policy,
            held_bytes=self.held_bytes,
            peak_held_bytes=self.peak_held_bytes,
            max_in_flight=self.max_in_flight,
            pauses=0,
            resumes=0,
            paused=False,
            peak_level=0,
        )


CreditFlow = Flow


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
        # Appended batches waiting to be durable: (end position, writer).
        self._unacked: deque[tuple[int, Writer]] = deque()

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
        self._receive_or_hold(
            writer, first_sequence, record_count, records, now=now, timestamp_us=timestamp_us
        )

    def _stored(self, writer: Writer) -> None:
        self._unacked.append((self.stream.log.tail_position, writer))

    def on_absolved(self, writer: Writer, amount: int) -> None:
        self._absolved[writer] = self._absolved.get(writer, 0) + amount

    def _opening(self, writer: Writer) -> None:
        # The whole window at once: a producer that waits for guarantees has them.
        self._slots[writer] = 0
        self._give_slots([writer])

    def _give_slots(self, writers: list[Writer]) -> None:
        """Give each of ``writers`` what its connection has left of its window."""
        used: dict[int, int] = {}
        for w, n in self._slots.items():
            used[id(w.session)] = used.get(id(w.session), 0) + n
        for w in writers:
            give = self.settings.window - used.get(id(w.session), 0)
            if give > 0:
                self._slots[w] += give
                used[id(w.session)] = self.settings.window
                w.inbound.grow(give * self.slot)

    def rebalance(self, now: float) -> None:
        s = self.stream
        gone = [w for w in self._slots if not w.alive]
        for w in gone:
            del self._slots[w]
        self._open_channels()
        if gone:
            self._give_slots(s.writers)  # slots of freed handles, to their siblings
        self._drain(now)
        durable = s.log.durable_position
        while self._unacked and self._unacked[0][0] <= durable:
            _, w = self._unacked.popleft()
            if not w.alive:
                self._absolved.pop(w, None)
                continue
            size = w.session.process(w.handle, reissue=True)
            back = min(self._absolved.get(w, 0), self.slot - size)
            if back > 0:
                w.inbound.grow(back)
                self._absolved[w] -= back
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
        """Bytes unreleased in the log plus bytes held in memory."""
        log = self.stream.log
        return log.tail_position - log.release_position + self.held_bytes

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
        self._receive_or_hold(
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

    def rebalance(self, now: float) -> None:
        s = self.stream
        self._open_channels()
        self._drain(now)
        if self.paused and self.level() <= self.settings.xon:
            self.paused = False
            self.resumes += 1
            self._throttle(False)
        for w in s.writers:
            # Top the formality up only when half is spent: no chatter per batch.
            if w.inbound.client_guarantees < XONXOFF_CREDIT // 2:
                w.session.issue(w.channel)

    def statistics(self) -> FlowStatistics:
        return FlowStatistics(
            policy=self.policy,
            held_bytes=self.held_bytes,
            peak_held_bytes=self.peak_held_bytes,
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
