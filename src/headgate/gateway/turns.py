"""Take turns: no connection's bytes hold the event loop for long.

One read from a socket can bring hundreds of KiB. As a few large batches that is
cheap to handle, but as 26,000 ten-byte Pings it costs hundreds of
milliseconds of Python, during which no other connection is served: a
cheap way for one peer to stall every producer on the gateway. So a
connection's bytes go to its session in slices, and a connection gets one
*turn* at a time: slices until ``TURN_BYTES``, ``TURN_SECONDS`` or
``TURN_COST`` (units of :class:`~headgate.gateway.budget.Cost`, told with
:meth:`TurnTaker.spend`) is used up, then the rest waits (with the
socket's reading paused) for a later pass of the event loop, after every
other connection that is ready has had its
turn.

A slice's size follows what the connection's bytes cost: it shrinks at once
to what fits a quarter of the turn's time (or cost) at the cost per byte just seen
(down to ``MIN_SLICE``), and grows back by ``SLICE_STEP`` per cheap slice
(up to ``MAX_SLICE``). Large batches are cheap per byte and go in large
slices, which is as fast as feeding whole reads; a flood of tiny frames goes
in small ones. Growing slowly means a peer cannot buy a large slice of
expensive bytes with a short stretch of cheap ones.

Turns are weighted by cost, not by bytes or frames: a connection that sends
expensive frames (listings, binds, Pings) ends its turn after fewer of
them, even on a machine fast enough that the clock alone would not end it.

Time belongs to a *cause*, not to a connection: the connections of one
token (of one address before Hello, and always without a tokens file) share
a quantum of the loop's time per pass (:class:`TurnShare`, deficit round
robin, :data:`QUANTUM_SECONDS`), and the
log writer's appends of a cause's batches are taken from it too, so sixty
connections writing tiny batches at full speed get what one gets, data
within guarantees included. Once a cause has used its time, its
connections wait for later passes. This holds only while more than one
cause uses a fair part of the passes (:class:`Passes`): a gateway that
serves one cause alone gives it every pass, and a cause that wants little
(a Ping, a keep-alive, a flood its budget holds) makes nobody wait. A cause
alone still uses no more than :data:`ALONE_SECONDS` of a pass, its
connections one after another, so that one that comes never waits for a
long pass. The loop's time reading a cause's connections and writing their
answers is the cause's too (``GatewayConnection.charge_time``).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

__all__ = ["Passes", "SharedWork", "TurnShare", "TurnTaker"]

#: Bounds of the bytes handed to the session at once, and its first size.
MIN_SLICE = 256
MAX_SLICE = 32 * 1024
FIRST_SLICE = 16 * 1024
#: How much a slice grows after a cheap one.
SLICE_STEP = 4096
#: Bytes one connection may have processed in one turn.
TURN_BYTES = 256 * 1024
#: Time one connection may spend in one turn (checked after each slice).
TURN_SECONDS = 0.002
#: Cost units one connection may spend in one turn (about TURN_SECONDS of work).
TURN_COST = 2000.0
#: The time a cause earns per pass while others want turns (see
#: :class:`TurnShare`): short, so that a pass stays short and a cause that
#: uses less than this per pass (a producer of large batches, whose bytes per
#: pass are bounded by one read) comes round again soon.
QUANTUM_SECONDS = 0.0005
#: The loop's time in a pass that makes a cause one of those that share it
#: (:meth:`Passes.contended`): a quarter of its quantum.
HEAVY_SECONDS = QUANTUM_SECONDS / 4
#: How many passes the loop stays shared (:meth:`Passes.contended`) after
#: one in which two causes or more used a fair part of it. A producer that
#: waits for its Acks between sends wants the loop only every few passes; if
#: the loop were shared only in the passes it is busy in, a flooding cause
#: would take whole turns (and the appends of all they decoded) in between,
#: and each of the producer's sends would wait for one of those long passes.
CONTENDED_PASSES = 8
#: The most passes a cause's debt can make it wait (see :class:`TurnShare`).
MAX_DEBT_PASSES = 32
#: The loop's time a cause's turns may take in one pass while no other cause
#: shares the loop: one turn's (the appends of what they decoded follow in
#: the next pass, in proportion; a lone connection is bounded by its turn as
#: before). Its connections then take turns one after another, a pass each,
#: instead of one turn each in every pass: a pass stays about
#: this long however many connections a cause opens, so a cause that comes
#: (a producer's next batch, a Hello) waits for one such pass, not for
#: sixteen turns and the appends of all they decoded (at the start of a
#: flood of one-record batches from 16 connections, passes of 0.5 to 2 s
#: were measured before this bound). It costs a cause alone nothing but
#: more, shorter passes.
ALONE_SECONDS = TURN_SECONDS


class TurnShare:
    """The time that the connections of one cause share, pass by pass.

    Deficit round robin by time: each pass in which the cause wants a turn
    adds :data:`QUANTUM_SECONDS` to its ``credit`` (which never holds more than
    that), and everything the cause's bytes cost the event loop is taken
    from it: its turns' decoding, and the log writer's appends of its
    batches (told with :meth:`Passes.spent`, after the turn). A cause whose
    batches cost more to store than to decode (many tiny ones) so runs into
    debt and waits for passes until it is paid off; time, not turns, is
    what the causes share.
    """

    __slots__ = (
        "bytes",
        "cost",
        "credit",
        "heavy",
        "pass_number",
        "turned",
        "turned_pass",
        "used",
        "used_pass",
        "waiting",
    )

    def __init__(self) -> None:
        #: Seconds of the loop the cause may still use (negative: its debt).
        self.credit = QUANTUM_SECONDS
        #: Bytes decoded and cost units spent in this pass.
        self.bytes = 0
        self.cost = 0.0
        #: The pass these figures are of (:attr:`Passes.number`).
        self.pass_number = -1
        #: Seconds of the loop charged to the cause in pass ``used_pass``,
        #: and whether that made it one of the pass's heavy causes.
        self.used = 0.0
        self.used_pass = -1
        self.heavy = False
        #: Seconds the cause's turns took in pass ``turned_pass`` (their
        #: decoding, without the appends and reads charged to it).
        self.turned = 0.0
        self.turned_pass = -1
        #: The cause's connections that were put off, in order: the first
        #: has the cause's next turn, so every connection of it has turns.
        self.waiting: deque[TurnTaker] = deque()

    def used_up(self) -> bool:
        """Whether the cause has had its share of this pass (while others want theirs)."""
        return self.credit <= 0 or self.bytes >= TURN_BYTES or self.cost >= TURN_COST

    def turned_in(self, number: int) -> float:
        """Seconds the cause's turns took in pass ``number`` so far."""
        return self.turned if self.turned_pass == number else 0.0

    def turn_took(self, number: int, seconds: float) -> None:
        """One of the cause's turns in pass ``number`` took ``seconds``."""
        if self.turned_pass != number:
            self.turned_pass = number
            self.turned = 0.0
        self.turned += seconds


class Passes:
    """The passes of the event loop, as the turns see them, and who wanted turns in them.

    A pass ends when the callback it scheduled at its first turn runs (the
    loop runs callbacks scheduled in one pass in the next one).
    """

    __slots__ = ("_scheduled", "_shared_until", "heavy", "heavy_before", "number", "turn")

    def __init__(self) -> None:
        self.number = 0
        #: The turn being taken now, if any: time charged to a cause while it
        #: runs (:meth:`spent`) is not its own (see :meth:`TurnTaker.exclude`).
        self.turn: TurnTaker | SharedWork | None = None
        #: Causes that used a fair part of this pass (:data:`HEAVY_SECONDS`,
        #: or a quarter of a turn's bytes or cost), and of the one before.
        self.heavy = 0
        self.heavy_before = 0
        #: The last pass that is shared because of an earlier one (CONTENDED_PASSES).
        self._shared_until = -1
        self._scheduled = False

    def visit(self, share: TurnShare) -> None:
        """``share``'s cause wants a turn in this pass: its first visit in a pass pays it."""
        if share.pass_number != self.number:
            share.pass_number = self.number
            share.bytes = 0
            share.cost = 0.0
            if self.contended():
                share.credit = min(QUANTUM_SECONDS, share.credit + QUANTUM_SECONDS)
            else:
                # Alone, a cause owes nobody: debts are only between causes.
                share.credit = QUANTUM_SECONDS
        self._end_later()

    def spent(self, share: TurnShare, seconds: float) -> None:
        """The cause's bytes cost ``seconds`` more (the log writer's appends).

        Done inside a turn (a turn writes the queued batches, other
        connections' too, before it acts on a control message), those
        seconds are charged here and not again to the turn's own cause.
        """
        # Bounded, so that a cause that was alone a moment ago and used the
        # whole loop does not wait for many passes once others come.
        share.credit = max(-MAX_DEBT_PASSES * QUANTUM_SECONDS, share.credit - seconds)
        self.used(share, seconds)
        if self.turn is not None:
            self.turn.exclude(seconds)

    def used(self, share: TurnShare, seconds: float, *, put_off: bool = False) -> None:
        """The cause used ``seconds`` of this pass (a turn, appends, reads, writes).

        ``put_off``: it was refused a turn (over its share, or in debt): it
        wants the loop as much as one that used it.
        """
        if share.used_pass != self.number:
            share.used_pass = self.number
            share.used = 0.0
            share.heavy = False
        share.used += seconds
        if not share.heavy and (
            put_off
            or share.used >= HEAVY_SECONDS
            or (
                share.pass_number == self.number
                and (share.bytes >= TURN_BYTES // 4 or share.cost >= TURN_COST / 4)
            )
        ):
            share.heavy = True
            self.heavy += 1

    def _end_later(self) -> None:
        # Scheduled by every pass in which a turn is taken or put off, so a
        # turn put off always finds a new pass next time.
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._next)

    def _next(self) -> None:
        if self.heavy > 1:
            self._shared_until = self.number + CONTENDED_PASSES
        self.number += 1
        self.heavy_before, self.heavy = self.heavy, 0
        self._scheduled = False

    def contended(self) -> bool:
        """Whether the loop is shared: more than one cause used a fair part of
        this pass, or of one of the :data:`CONTENDED_PASSES` before.

        A cause that only wants a little (a Ping, a reader's keep-alive, a
        flood its budget holds) takes its turns as they come and makes nobody
        wait: only causes that both want the loop share it.
        """
        return self.heavy > 1 or self.number <= self._shared_until


class SharedWork:
    """The loop's work for several causes at once, paid by them in equal parts.

    After a group commit the gateway sends a stream's Acks and credit to all
    its writers at once, in one piece of work whose length grows with the
    writers (sixteen connections of one token writing one stream cost it
    sixteen times what one writer costs): each writer's cause pays its part,
    as the broker seed charges fan-out to the cause. Time charged inside it
    to one cause already (a connection's own write of its answers, see
    :meth:`Passes.spent`) is not charged again::

        with SharedWork(passes, [turn of each writer's cause]):
            ...  # the stream's Acks, credit, writes

    Args:
        passes: the gateway's passes.
        shares: one entry per writer (a cause with two writers appears twice).
    """

    __slots__ = ("_excluded", "_outer", "_passes", "_shares", "_started")

    def __init__(self, passes: Passes, shares: list[TurnShare]) -> None:
        self._passes = passes
        self._shares = shares
        self._outer: TurnTaker | SharedWork | None = None
        self._started = 0.0
        self._excluded = 0.0

    def __enter__(self) -> SharedWork:
        self._outer, self._passes.turn = self._passes.turn, self
        self._excluded = 0.0
        self._started = time.monotonic()
        return self

    def exclude(self, seconds: float) -> None:
        """``seconds`` of it were charged to one cause already (:meth:`Passes.spent`)."""
        self._excluded += seconds

    def __exit__(self, *_: object) -> None:
        passes = self._passes
        passes.turn = self._outer
        elapsed = time.monotonic() - self._started - self._excluded
        if elapsed > 0 and self._shares:
            part = elapsed / len(self._shares)
            for share in self._shares:
                passes.spent(share, part)


class TurnTaker:
    """Decodes one connection's received bytes in bounded turns.

    The bytes themselves stay where they were read (the connection's receive
    ring); this only decides how much of them is decoded when.

    Args:
        step: decodes about as many bytes as it is given of what waits,
            acts on them (no flush), and returns how many it took; 0 when
            nothing more can be decoded until more bytes arrive.
        done: called after each turn (flush output, for one write per turn).
        set_backlogged: told True when bytes wait for a later turn (pause
            reading the socket) and False when they are all processed.
        closing: whether the connection is closing (stop decoding).
        passes: the gateway's passes (one for all its connections); None:
            this connection's turns are its own.
        share: the turn of the connection's cause now (it changes at Hello).
    """

    __slots__ = (
        "_closing",
        "_done",
        "_excluded",
        "_handle",
        "_held_until",
        "_parked",
        "_passes",
        "_queued_in",
        "_set_backlogged",
        "_share",
        "_slice",
        "_step",
        "_turn_cost",
        "busy",
        "last_hold",
    )

    def __init__(
        self,
        step: Callable[[int], int],
        done: Callable[[], None],
        set_backlogged: Callable[[bool], None],
        closing: Callable[[], bool],
        passes: Passes | None = None,
        share: Callable[[], TurnShare | None] = lambda: None,
    ) -> None:
        self._step = step
        self._passes = passes
        self._share = share
        #: The share in whose queue this connection waits for its cause's turn.
        self._queued_in: TurnShare | None = None
        self._done = done
        self._set_backlogged = set_backlogged
        self._closing = closing
        self._handle: asyncio.Handle | None = None
        #: Put off behind another connection of its cause: no turn is
        #: scheduled; the cause's queue wakes it when it is next (``_wake``).
        self._parked = False
        self._slice = FIRST_SLICE
        self._held_until = 0.0
        #: When the budget last held this connection (monotonic seconds; 0: never).
        self.last_hold = 0.0
        self._turn_cost = 0.0
        #: Seconds of the turn under way already charged to some cause (:meth:`exclude`).
        self._excluded = 0.0
        #: Whether a turn is being taken now: its time is charged to the
        #: cause when it ends, output flushed in it included.
        self.busy = False

    @property
    def waiting(self) -> bool:
        """Whether a later turn is scheduled, or the connection waits for its cause's."""
        return self._handle is not None or self._parked

    def hold(self, seconds: float) -> None:
        """Decode nothing more for ``seconds`` (the connection's budget is spent)."""
        now = time.monotonic()
        self.last_hold = now
        self._held_until = max(self._held_until, now + seconds)

    def spend(self, units: float) -> None:
        """The slice being decoded cost ``units``: counted against this turn."""
        self._turn_cost += units

    def received(self) -> None:
        """New bytes wait: decode a turn's worth now, the rest later."""
        if self._handle is not None or self._parked:
            return  # a turn is already due; it takes these too, in order
        if self._held_until > time.monotonic():
            self._schedule()
        else:
            self._turn()

    def _schedule(self) -> None:
        self._set_backlogged(True)
        loop = asyncio.get_running_loop()
        wait = self._held_until - time.monotonic()
        if wait > 0:
            self._handle = loop.call_later(wait, self._turn)
        else:
            self._handle = loop.call_soon(self._turn)

    def _turn(self) -> None:
        self._handle = None
        passes = self._passes
        share = self._share() if passes is not None else None
        if share is not None:
            assert passes is not None
            if not self._may_turn(passes, share):
                if share.waiting[0] is self:
                    self._schedule()  # next: it asks again in the next pass
                else:
                    # Behind another of its cause's connections: it waits
                    # unscheduled (a pass's callbacks do not grow with the
                    # connections of a cause that is over its share).
                    self._parked = True
                    self._set_backlogged(True)
                return
        started = time.monotonic()
        self._turn_cost = 0.0
        self._excluded = 0.0
        self.busy = True
        outer = None
        if passes is not None:
            outer, passes.turn = passes.turn, self
        try:
            more, fed = self._decode_turn(passes, share, started)
            # The turn's output is written now: its cause pays for that too.
            self._done()
        finally:
            self.busy = False
            if passes is not None:
                passes.turn = outer
        if share is not None:
            assert passes is not None
            share.bytes += fed
            share.cost += self._turn_cost
            elapsed = max(0.0, time.monotonic() - started - self._excluded)
            share.credit -= elapsed
            passes.used(share, elapsed)
            share.turn_took(passes.number, elapsed)
        if more and not self._closing():
            self._schedule()
        else:
            self._set_backlogged(False)

    def exclude(self, seconds: float) -> None:
        """``seconds`` of the turn under way were charged to a cause already
        (:meth:`Passes.spent`): its own cause does not pay them again."""
        self._excluded += seconds

    def _decode_turn(
        self, passes: Passes | None, share: TurnShare | None, started: float
    ) -> tuple[bool, int]:
        """Decode slices until the turn is used up; (whether bytes wait for later, bytes fed)."""
        now = started
        fed = 0
        more = False
        while not self._closing():
            before = now
            cost_before = self._turn_cost
            took = self._step(self._slice)
            if not took:
                # Nothing more to decode, or the step held the connection
                # (its budget is in debt): then the rest waits for later.
                more = self._held_until > time.monotonic()
                break
            # Time charged elsewhere (appends of queued batches) is not this
            # turn's: not in its slices' rate, nor in its length.
            clock = time.monotonic()
            now = clock - self._excluded
            fed += took
            fits = min(
                (TURN_SECONDS / 4) * took / max(now - before, 1e-9),
                (TURN_COST / 4) * took / max(self._turn_cost - cost_before, 1e-9),
            )
            self._slice = max(MIN_SLICE, min(MAX_SLICE, int(fits), self._slice + SLICE_STEP))
            if (
                fed >= TURN_BYTES
                or now - started >= TURN_SECONDS
                or self._turn_cost >= TURN_COST
                or self._held_until > clock
                or (
                    share is not None
                    and passes is not None
                    and self._over(passes, share, fed, self._turn_cost, now - started)
                )
            ):
                more = True
                break
        return more, fed

    @staticmethod
    def _over(passes: Passes, share: TurnShare, fed: int, cost: float, elapsed: float) -> bool:
        """Whether the cause has had its part of this pass, with the turn under way's
        ``fed`` bytes, ``cost`` units and ``elapsed`` seconds (not yet counted in ``share``).

        While other causes want turns: its share (:class:`TurnShare`). Alone:
        :data:`ALONE_SECONDS` of the pass.
        """
        if passes.contended():
            return (
                share.bytes + fed >= TURN_BYTES
                or share.credit <= elapsed
                or share.cost + cost >= TURN_COST
            )
        return share.turned_in(passes.number) + elapsed >= ALONE_SECONDS

    def _may_turn(self, passes: Passes, share: TurnShare) -> bool:
        """Whether this connection may take its cause's turn now; if not, it queues for it.

        While other causes want turns, a cause has its share of the loop's
        time (:class:`TurnShare`); alone, :data:`ALONE_SECONDS` of each pass.
        Its connections that were put off have it first, in the order they
        were put off.
        """
        passes.visit(share)
        waiting = share.waiting
        while waiting and waiting[0] is not self and not waiting[0].waiting:
            # Gone, or it had its bytes decoded meanwhile: not waiting.
            waiting.popleft()._queued_in = None
        if waiting and waiting[0] is not self:
            waiting[0]._wake()
        if self._over(passes, share, 0, 0.0, 0.0) or (waiting and waiting[0] is not self):
            passes.used(share, 0.0, put_off=True)
            if self._queued_in is not share:
                self._dequeue()
                self._queued_in = share
                waiting.append(self)
            return False
        self._dequeue()
        return True

    def _dequeue(self) -> None:
        queue = self._queued_in
        if queue is not None:
            self._queued_in = None
            if queue.waiting and queue.waiting[0] is self:
                queue.waiting.popleft()
                if queue.waiting:
                    queue.waiting[0]._wake()  # the next of its cause
            else:
                queue.waiting.remove(self)

    def _wake(self) -> None:
        """It is next of its cause's connections: it asks for its turn in the next pass."""
        if self._parked:
            self._parked = False
            self._schedule()

    def cancel(self) -> None:
        """The connection is gone: no more turns."""
        self._parked = False
        self._dequeue()
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
