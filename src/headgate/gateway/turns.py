"""Take turns: no connection's bytes hold the event loop for long.

One read from a socket can bring 256 KiB. As a few large batches that is
cheap to handle, but as 26,000 ten-byte Pings it costs hundreds of
milliseconds of Python, during which no other connection is served: a
cheap way for one peer to stall every producer on the gateway. So a
connection's bytes go to its session in small slices, and a connection gets
one *turn* at a time: slices until ``turn_bytes`` or ``turn_seconds`` is
used up, then the rest waits (with the socket's reading paused) for a later
pass of the event loop, after every other connection that is ready has had
its turn.

The cost of a turn is bounded by one slice past the time budget, whatever
the bytes are; a peer of large batches keeps nearly all of its speed,
because its slices cost little.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

__all__ = ["TurnTaker"]

#: Bytes handed to the session at once.
FEED_SLICE = 2048
#: Bytes one connection may have processed in one turn.
TURN_BYTES = 256 * 1024
#: Time one connection may spend in one turn (checked after each slice).
TURN_SECONDS = 0.002


class TurnTaker:
    """Feeds one connection's received bytes in bounded turns.

    Args:
        feed: hands a slice to the session and acts on it (no flush).
        done: called after each turn (flush output, for one write per turn).
        set_backlogged: told True when bytes wait for a later turn (pause
            reading the socket) and False when they are all processed.
        closing: whether the connection is closing (stop feeding).
    """

    __slots__ = ("_backlog", "_closing", "_done", "_feed", "_handle", "_set_backlogged")

    def __init__(
        self,
        feed: Callable[[memoryview], None],
        done: Callable[[], None],
        set_backlogged: Callable[[bool], None],
        closing: Callable[[], bool],
    ) -> None:
        self._feed = feed
        self._done = done
        self._set_backlogged = set_backlogged
        self._closing = closing
        self._backlog: memoryview | None = None
        self._handle: asyncio.Handle | None = None

    @property
    def backlog(self) -> int:
        """Received bytes waiting for a turn."""
        return 0 if self._backlog is None else len(self._backlog)

    def received(self, data: bytes) -> None:
        """Bytes from the socket: process a turn's worth now, the rest later."""
        if self._backlog is not None:
            # Only if the transport delivered despite the pause: keep order.
            self._backlog = memoryview(bytes(self._backlog) + data)
            return
        self._backlog = memoryview(data)
        self._turn()

    def _turn(self) -> None:
        self._handle = None
        view = self._backlog
        assert view is not None
        started = time.perf_counter()
        fed = 0
        while view and not self._closing():
            piece = view[:FEED_SLICE]
            view = view[FEED_SLICE:]
            self._feed(piece)
            fed += len(piece)
            if fed >= TURN_BYTES or time.perf_counter() - started >= TURN_SECONDS:
                break
        self._done()
        if view and not self._closing():
            self._set_backlogged(True)
            self._backlog = view
            self._handle = asyncio.get_running_loop().call_soon(self._turn)
        else:
            self._backlog = None
            self._set_backlogged(False)

    def cancel(self) -> None:
        """The connection is gone: drop what waits."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._backlog = None
