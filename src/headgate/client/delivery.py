"""What a :meth:`~headgate.client.Producer.send_many` call gets back: its records' durability.

A call's records may travel in several batches, over several connections;
:class:`Delivery` counts them down as the gateway acknowledges each (it is
the :class:`~headgate.client.producer_core.BatchWaiter` of its batches) and
resolves to one :class:`BatchResult` when the last is durable, or to the
stream's or producer's failure.
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

__all__ = ["BatchResult", "Delivery"]


@dataclass(frozen=True, slots=True)
class BatchResult:
    """Records of one :meth:`Producer.send_many` call, durable in the stream log."""

    #: The stream.
    stream: str
    #: The sequence number of the first record (records are numbered per stream
    #: and producer id; the rest follow consecutively).
    first_sequence: int
    #: How many records.
    record_count: int
    #: The log's durable end position when the last of them was acknowledged.
    durable_position: int


class Delivery:
    """The pending durability of one :meth:`Producer.send_many` call.

    Await it for a :class:`BatchResult`; it raises :class:`StreamRefused` or
    :class:`ProducerError` if the records cannot be delivered.
    """

    __slots__ = ("_count", "_error", "_first", "_pending", "_result", "_waiters", "stream")

    def __init__(self, stream: str) -> None:
        #: The stream the records were sent on.
        self.stream = stream
        self._pending = 0
        self._count = 0
        self._first: int | None = None
        self._result: BatchResult | None = None
        self._error: BaseException | None = None
        # Futures exist only while someone awaits, so an unawaited failed
        # delivery never leaves "exception was never retrieved" behind.
        self._waiters: list[asyncio.Future[None]] = []

    def done(self) -> bool:
        """Whether the records are durable or lost."""
        return self._result is not None or self._error is not None

    def result(self) -> BatchResult:
        """The result; raises the failure, or ``asyncio.InvalidStateError`` if pending."""
        if self._error is not None:
            raise self._error
        if self._result is None:
            raise asyncio.InvalidStateError("the records are not acknowledged yet")
        return self._result

    def __await__(self) -> Generator[Any, None, BatchResult]:
        if not self.done():
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                yield from waiter.__await__()
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        return self.result()

    def __repr__(self) -> str:
        state = "done" if self._result else "failed" if self._error else "pending"
        return f"<Delivery {self.stream!r} {self._count} records {state}>"

    # -- producer side --

    def _add(self, count: int) -> None:
        self._pending += 1
        self._count += count

    def _numbered(self, first_sequence: int) -> None:
        if self._first is None:
            self._first = first_sequence

    def _unnumbered(self, first_sequence: int) -> None:
        """A batch numbered ``first_sequence`` lost its number (a gap renumbers it).

        If it was our first batch, the number it gets next is our first: the
        batches of one delivery are queued, and so renumbered, in order.
        """
        if self._first == first_sequence:
            self._first = None

    def _split(self, extra: int) -> None:
        """One of our batches was cut into ``extra`` more (the gateway's frames are smaller)."""
        self._pending += extra

    def _acked(self, durable_position: int) -> None:
        self._pending -= 1
        if self._pending == 0 and not self.done():
            first = self._first if self._first is not None else 0
            self._result = BatchResult(self.stream, first, self._count, durable_position)
            self._wake()

    def _fail(self, error: BaseException) -> None:
        if not self.done():
            self._error = error
            self._wake()

    def _wake(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()
