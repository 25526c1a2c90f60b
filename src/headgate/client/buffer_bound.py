"""The bound on a stream's bytes not acknowledged, and the sends that wait for room.

Every batch stays in memory until the gateway acknowledges it durable, so a
producer bounds each stream's unacknowledged bytes (``max_buffered_bytes``):
its sealed batches' records blocks, queued or in flight, plus its open
batch's, however its batches were sealed. A send that would go beyond waits,
in line behind the stream's earlier waiting sends, until acknowledgements
make room; a stream that holds nothing takes anything, so that a record or a
``send_many`` call larger than the bound still goes, alone. While the spool
is full (:mod:`headgate.client.spooling`), every send waits the same way.

:class:`BoundedStream` keeps that rule and the line of waiting sends. The
waiting itself is the adapter's (:class:`~headgate.client.Producer` awaits
the futures that :meth:`BoundedStream.admit` resolves); ``room`` is what
``send``'s fast path compares with, so it lives on the stream beside the
open batch.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from headgate.client.open_batch import OpenBatchStream

if TYPE_CHECKING:
    import asyncio

__all__ = ["BoundedStream"]


class BoundedStream(OpenBatchStream):
    """One stream's batches, sealed and open, within the bound on its bytes not acknowledged.

    Args:
        name: the stream.
        bound: ``max_buffered_bytes``.
    """

    __slots__ = ("room", "space_waiters")

    def __init__(self, name: str, bound: int) -> None:
        super().__init__(name)
        #: What a send's fast path lets the stream's bytes (sealed and open)
        #: reach: the bound, or 0 while sends wait for room (or the spool
        #: is full), so that later sends queue behind them.
        self.room = bound
        #: Sends waiting for room, in order, with the bytes each needs; the
        #: first one's future is resolved when it may go.
        self.space_waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    def has_room(self, needed: int, bound: int, *, spool_full: bool) -> bool:
        """Whether ``needed`` more bytes keep the stream within ``bound``.

        What counts is everything not acknowledged: the sealed batches'
        blocks and the open batch's (as its size estimate). A stream that
        holds nothing takes anything. The fast paths of ``send`` make the
        same comparison against :attr:`room`.
        """
        if self.buffered == 0 and not self.values:
            return True
        if spool_full:
            return False
        return self.buffered + self.open_bytes + needed <= bound

    def wait_in_line(
        self, needed: int, waiter: asyncio.Future[None]
    ) -> tuple[int, asyncio.Future[None]]:
        """Queue a send that needs ``needed`` bytes behind the others; returns its place.

        The fast path closes until the line is empty again.
        """
        entry = (needed, waiter)
        self.space_waiters.append(entry)
        self.room = 0
        return entry

    def admit(self, bound: int, *, spool_full: bool) -> None:
        """Let the first waiting send go if it fits now; with none waiting, reopen the fast path.

        One at a time: a send let in stays first in line until it has
        appended, so that nothing overtakes it, then calls this again.
        """
        waiters = self.space_waiters
        if not waiters:
            self.room = 0 if spool_full else bound
            return
        needed, waiter = waiters[0]
        if not waiter.done() and self.has_room(needed, bound, spool_full=spool_full):
            waiter.set_result(None)
