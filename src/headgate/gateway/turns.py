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
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

__all__ = ["TurnTaker"]

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
    """

    __slots__ = (
        "_closing",
        "_done",
        "_handle",
        "_held_until",
        "_set_backlogged",
        "_slice",
        "_step",
        "_turn_cost",
        "last_hold",
    )

    def __init__(
        self,
        step: Callable[[int], int],
        done: Callable[[], None],
        set_backlogged: Callable[[bool], None],
        closing: Callable[[], bool],
    ) -> None:
        self._step = step
        self._done = done
        self._set_backlogged = set_backlogged
        self._closing = closing
        self._handle: asyncio.Handle | None = None
        self._slice = FIRST_SLICE
        self._held_until = 0.0
        #: When the budget last held this connection (monotonic seconds; 0: never).
        self.last_hold = 0.0
        self._turn_cost = 0.0

    @property
    def waiting(self) -> bool:
        """Whether a later turn is scheduled."""
        return self._handle is not None

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
        if self._handle is not None:
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
        started = now = time.monotonic()
        fed = 0
        self._turn_cost = 0.0
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
            now = time.monotonic()
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
                or self._held_until > now
            ):
                more = True
                break
        self._done()
        if more and not self._closing():
            self._schedule()
        else:
            self._set_backlogged(False)

    def cancel(self) -> None:
        """The connection is gone: no more turns."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
