"""The producer's core, without I/O: one stream's batches, sequences and acknowledgements.

Every rule about which batch goes next, under which sequence number, and
what an acknowledgement or a lost connection does to the batches held lives
here, in :class:`StreamBatches`. The asyncio :class:`~headgate.client.Producer`
is its adapter: it seals batches, owns the timers and the socket, and calls
in with the gateway's answers and the time (``now`` is always an argument,
so tests drive a stream through reconnects in memory).

A stream's batches move along one path::

    enqueue ──> queue ──(send_front)──> unacked ──(ack)──> gone
                  ^                        │
                  └──(connection_lost)─────┘ in order, same sequences

Sequence numbers are given at first transmission, once the gateway's
initial Ack said where our sequence resumes (:meth:`StreamBatches.resume`;
when the gateway sends it and what it counts is the rule of
:mod:`headgate.protocol.opening`), and kept for every resend, so the
gateway stores each record once whatever the number of connections it took.
A batch larger than the gateway's frame limit is cut before it goes
(:meth:`StreamBatches.front`); its pieces keep its records' order and cover
its sequence range exactly.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Protocol

from headgate.client.batches import split_block, without_first
from headgate.latency import LatencyWindow

__all__ = ["Batch", "BatchWaiter", "StreamBatches", "check_resend_order"]


class BatchWaiter(Protocol):
    """Who waits for a batch's durability (a :class:`~headgate.client.Delivery`).

    One waiter may cover several batches: it learns the first sequence
    number, each batch's acknowledgement, how many more batches a cut made
    of one, and the failure of a stream that can deliver nothing more.
    """

    def _numbered(self, first_sequence: int) -> None: ...
    def _unnumbered(self, first_sequence: int) -> None: ...
    def _acked(self, durable_position: int) -> None: ...
    def _split(self, extra: int) -> None: ...
    def _fail(self, error: BaseException) -> None: ...


class Batch:
    """One sealed batch: its records block and where its records go in the sequence."""

    __slots__ = ("block", "closes", "count", "delivery", "first_sequence", "opened_at", "spooled")

    def __init__(
        self, block: bytes, count: int, delivery: BatchWaiter | None, opened_at: float
    ) -> None:
        self.block = block
        self.count = count
        self.delivery = delivery
        # When its first record was sent (the adapter's clock): its Ack's
        # latency is measured from there.
        self.opened_at = opened_at
        # Numbered at first transmission, once the gateway said where the
        # stream's sequence resumes; kept for every resend after that.
        self.first_sequence = -1
        # Written to the spool (under first_sequence, once numbered).
        self.spooled = False
        # Whether its acknowledgement completes a batch as sealed (False for
        # all but the last piece of a cut one): what flushes count.
        self.closes = True


class StreamBatches:
    """One stream's sealed batches: queued, in flight, and acknowledged.

    Counts what it holds (``buffered``, the bytes a producer's
    ``max_buffered_bytes`` bounds) and what was sealed and acknowledged, in
    batches as sealed, so that a flush waits for ``acked_batches`` to reach
    the ``sealed_batches`` of its call.
    """

    __slots__ = (
        "acked_batches",
        "batches_dropped",
        "buffered",
        "bytes_acked",
        "bytes_sent",
        "latency",
        "name",
        "next_sequence",
        "queue",
        "ready",
        "records_acked",
        "records_sent",
        "sealed_batches",
        "stored_end",
        "unacked",
    )

    def __init__(self, name: str) -> None:
        self.name = name
        # Waiting to be sent on this connection, then sent and not acknowledged.
        self.queue: deque[Batch] = deque()
        self.unacked: deque[Batch] = deque()
        # Bytes of the batches' blocks, queued or in flight.
        self.buffered = 0
        self.sealed_batches = 0
        self.acked_batches = 0
        #: The sequence number the next unnumbered batch gets; None before
        #: the first initial Ack.
        self.next_sequence: int | None = None
        #: Where the gateway's acknowledged copy of our sequence ends, once known.
        self.stored_end: int | None = None
        #: Whether this connection's initial Ack arrived: batches wait for it.
        self.ready = False
        # Send-to-durable-ack times of the latest acknowledged batches.
        self.latency = LatencyWindow()
        self.records_sent = 0
        self.records_acked = 0
        self.bytes_sent = 0
        self.bytes_acked = 0
        self.batches_dropped = 0

    # -- batches in ---------------------------------------------------------------

    def enqueue(
        self, block: bytes, count: int, delivery: BatchWaiter | None, opened_at: float
    ) -> Batch:
        """Queue a sealed batch behind the others."""
        batch = Batch(block, count, delivery, opened_at)
        self.queue.append(batch)
        self.sealed_batches += 1
        self.buffered += len(block)
        return batch

    def adopt(
        self,
        block: bytes,
        count: int,
        delivery: BatchWaiter | None,
        opened_at: float,
        first_sequence: int | None,
    ) -> Batch:
        """Queue a batch an earlier producer sealed (a spool, a give-up), under its own number.

        A numbered batch keeps its sequence numbers, so the gateway drops
        it if it stored it already; :meth:`resume` checks they run on.
        """
        batch = self.enqueue(block, count, delivery, opened_at)
        if first_sequence is not None:
            batch.first_sequence = first_sequence
            if delivery is not None:
                delivery._numbered(first_sequence)
        return batch

    @property
    def used(self) -> bool:
        """Whether anything was sealed or numbered on the stream (too late to adopt batches)."""
        return self.next_sequence is not None or bool(self.queue) or bool(self.unacked)

    def held(self) -> list[Batch]:
        """Every batch not acknowledged, in sequence order."""
        return [*self.unacked, *self.queue]

    # -- batches out --------------------------------------------------------------

    def front(self, limit: int) -> Batch | None:
        """The next batch to send, cut to ``limit`` bytes first; None if none may go yet.

        Nothing goes before the initial Ack. A batch sealed under a larger
        limit than the gateway's (before its Welcome, or for a gateway that
        since restarted with smaller frames) is replaced by its pieces, in
        order; a numbered one's pieces share its sequence range.

        Raises:
            ValueError: one of the batch's records alone exceeds ``limit``.
        """
        queue = self.queue
        if not self.ready or not queue:
            return None
        batch = queue[0]
        if len(batch.block) > limit:
            self._cut_front(batch, limit)
            batch = queue[0]
        return batch

    def _cut_front(self, batch: Batch, limit: int) -> None:
        blocks = split_block(batch.block, limit)
        sequence = batch.first_sequence
        pieces: list[Batch] = []
        for block, count in blocks:
            piece = Batch(block, count, batch.delivery, batch.opened_at)
            piece.spooled = batch.spooled
            piece.closes = False
            if sequence >= 0:
                piece.first_sequence = sequence
                sequence += count
            pieces.append(piece)
        pieces[-1].closes = batch.closes
        if batch.delivery is not None:
            batch.delivery._split(len(pieces) - 1)
        queue = self.queue
        queue.popleft()
        queue.extendleft(reversed(pieces))
        self.buffered += sum(len(p.block) for p in pieces) - len(batch.block)

    def number(self, batch: Batch) -> None:
        """Give ``batch`` the next sequence numbers, unless it has its own already."""
        if batch.first_sequence < 0:
            assert self.next_sequence is not None, "numbered only after the initial Ack"
            batch.first_sequence = self.next_sequence
            self.next_sequence += batch.count
            if batch.delivery is not None:
                batch.delivery._numbered(batch.first_sequence)

    def sent(self) -> Batch:
        """The front batch (numbered) went out: it waits for its acknowledgement."""
        batch = self.queue.popleft()
        self.unacked.append(batch)
        self.records_sent += batch.count
        self.bytes_sent += len(batch.block)
        return batch

    # -- the gateway's answers -------------------------------------------------------

    def resume(self, stored_end: int, durable_position: int, now: float) -> int:
        """The stream's initial Ack on a connection: the gateway's copy ends at ``stored_end``.

        Queued batches below it were stored before (a lost Ack, or an
        earlier run with this producer id) and count as acknowledged. The
        numbered batches left must run on from ``stored_end`` without a gap:
        the gateway refuses a batch that skips ahead. A gap means records the
        gateway never had are missing from what we hold (batches handed to
        ``resend`` with one missing, a damaged spool entry); since the gateway
        stores each producer's sequence contiguously, nothing from the gap
        on was stored, so those batches are numbered afresh.

        Returns how many batches lost their number that way.
        """
        self.ready = True
        self.stored_end = stored_end
        queue = self.queue
        while queue and 0 <= queue[0].first_sequence < stored_end:
            batch = queue[0]
            if batch.first_sequence + batch.count > stored_end:
                # The gateway holds a prefix of it: the batch went in pieces
                # (cut to a smaller frame limit) while it stayed whole here,
                # in the spool it was recovered from. The rest still goes.
                self._drop_prefix(batch, stored_end - batch.first_sequence)
                break
            self._acked(queue.popleft(), durable_position, now)
        expected = stored_end
        renumbered = 0
        for batch in queue:
            if batch.first_sequence < 0:
                break
            if renumbered or batch.first_sequence != expected:
                if batch.delivery is not None:
                    batch.delivery._unnumbered(batch.first_sequence)
                batch.first_sequence = -1
                renumbered += 1
            else:
                expected += batch.count
        if self.next_sequence is None or renumbered or self.next_sequence < expected:
            self.next_sequence = expected
        return renumbered

    def _drop_prefix(self, batch: Batch, stored: int) -> None:
        block = without_first(batch.block, stored)
        self.records_acked += stored
        self.bytes_acked += len(batch.block) - len(block)
        self.buffered += len(block) - len(batch.block)
        batch.block = block
        batch.count -= stored
        batch.first_sequence += stored

    def ack(self, next_sequence: int, durable_position: int, now: float) -> int:
        """An Ack after the initial one: everything below ``next_sequence`` is durable.

        Returns how many batches it acknowledged.
        """
        self.stored_end = next_sequence
        unacked = self.unacked
        done = 0
        while unacked and unacked[0].first_sequence < next_sequence:
            self._acked(unacked.popleft(), durable_position, now)
            done += 1
        return done

    def _acked(self, batch: Batch, durable_position: int, now: float) -> None:
        self.latency.observe(now - batch.opened_at, now)
        size = len(batch.block)
        if batch.closes:
            self.acked_batches += 1
        self.records_acked += batch.count
        self.bytes_acked += size
        self.buffered -= size
        if batch.delivery is not None:
            batch.delivery._acked(durable_position)

    def connection_lost(self) -> None:
        """Batches not known durable go back to the front, in order, to be resent first."""
        if self.unacked:
            self.queue.extendleft(reversed(self.unacked))
            self.unacked.clear()
        self.ready = False

    def number_all(self) -> None:
        """Number every held batch now (a spool about to record them needs their numbers)."""
        for batch in (*self.unacked, *self.queue):
            self.number(batch)

    def clear(self) -> list[Batch]:
        """Drop every held batch (the stream was refused); returns them, in order."""
        batches = [*self.unacked, *self.queue]
        self.unacked.clear()
        self.queue.clear()
        self.buffered = 0
        return batches


def check_resend_order(stream: str, batches: Iterable[tuple[int | None, int]]) -> None:
    """Check batches handed to a producer to send again: numbered ones first, in order.

    ``batches`` are (first sequence or None, record count) pairs. A
    numbered batch after an unnumbered one, or before the end of the one
    before it, could not be stored exactly once.

    Raises:
        ValueError: they are not in that order.
    """
    expected: int | None = None
    for first, count in batches:
        if first is None:
            expected = -1
        elif expected == -1 or (expected is not None and first < expected):
            raise ValueError(
                f"stream {stream!r}: pending batches must be in sequence order, numbered ones first"
            )
        else:
            expected = first + count
