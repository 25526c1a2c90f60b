"""The receive path's memory: a ring for bytes, a slab of headers, a FIFO.

This is the message API of seed freeradius-message-api.txt, on one event
loop. Each connection owns a :class:`ReceiveRing`. The transport reads
straight into it (``BufferedProtocol.get_buffer`` returns
:meth:`ReceiveRing.writable`), frames are decoded where they landed, and every
batch becomes a :class:`Message`: a fixed-size header, taken from the ring's
:class:`HeaderSlab`, that points at the batch's bytes in the ring. The log
writer receives references through a :class:`MessageQueue` and copies each
batch once, from the ring into the log's mmap.

The originator owns the memory. The writer only marks a message handled; the
ring reclaims its space later, when it next needs room, behind the oldest
message not yet handled::

      head                  frame          tail
       |  messages (in use)   | undecoded   |      free
    ---+----------------------+-------------+------------------
       ^ oldest unhandled       ^ part of one frame, waiting for the rest

When the bytes after ``tail`` cannot take a read (or the rest of the frame
being received), the undecoded part moves to the start of the ring if the
space before ``head`` is free (the ring wraps: messages stay where they are
and the upper segment ends at ``end``)::

      frame     tail           head            end
       | undecoded |    free     |  messages    |
    ---+-----------+-------------+--------------+---

and otherwise a ring twice as large is allocated (up to a limit); the old one
is kept until its messages are handled. The only bytes ever copied are those
of an incomplete frame, less than one frame each time. A ring that has been
mostly empty for a while shrinks back by halves to its initial size.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FREE",
    "HANDLED",
    "QUEUED",
    "HeaderSlab",
    "Message",
    "MessageQueue",
    "ReceiveRing",
    "Ring",
    "RingStatistics",
]

#: Message states.
FREE = 0
QUEUED = 1
HANDLED = 2

#: Reads that must see the ring at most a quarter full before it shrinks.
SHRINK_AFTER_READS = 64


class Message:
    """A fixed-size header for one received batch; lives in a :class:`HeaderSlab`.

    Fields are plain slots, reused from message to message: ``status`` (FREE,
    QUEUED, HANDLED), the ``ring`` and the ``offset`` and ``length`` of the
    batch's bytes in it, the ``origin`` (who owns it, to tell when handled),
    the decoded ``event`` that describes the batch, and when it ``arrived``
    (``time.monotonic()``, what its Ack's latency is measured from). (Its
    unit of debt is on its origin's ring loan, one for all of its batches.)
    """

    __slots__ = ("arrived", "event", "length", "offset", "origin", "ring", "status")

    def __init__(self) -> None:
        self.status = FREE
        self.ring: Ring | None = None
        self.offset = 0
        self.length = 0
        self.origin: Any = None
        self.event: Any = None
        self.arrived = 0.0

    @property
    def data(self) -> memoryview:
        """The batch's bytes, in the ring (valid until the message is reclaimed)."""
        assert self.ring is not None
        return self.ring.view[self.offset : self.offset + self.length]


class HeaderSlab:
    """Message headers, allocated once and reused; doubles when all are in use."""

    __slots__ = ("_free", "grows", "headers")

    def __init__(self, initial: int = 64) -> None:
        if initial < 1:
            raise ValueError("a slab needs at least one header")
        self.headers: list[Message] = [Message() for _ in range(initial)]
        self._free: list[Message] = list(reversed(self.headers))
        #: How many times the slab doubled.
        self.grows = 0

    @property
    def in_use(self) -> int:
        return len(self.headers) - len(self._free)

    def alloc(self) -> Message:
        if not self._free:
            more = [Message() for _ in range(len(self.headers))]
            self.headers += more
            self._free = more
            self.grows += 1
        message = self._free.pop()
        message.status = QUEUED
        return message

    def free(self, message: Message) -> None:
        # Drop every reference, so an old ring can be collected once drained.
        message.status = FREE
        message.ring = None
        message.origin = None
        message.event = None
        self._free.append(message)


class Ring:
    """One preallocated byte buffer and its offsets (see the module diagram)."""

    __slots__ = ("buffer", "end", "frame", "head", "messages", "size", "tail", "view", "wrapped")

    def __init__(self, size: int) -> None:
        self.size = size
        self.buffer = bytearray(size)
        self.view = memoryview(self.buffer)
        #: Oldest byte in use (start of the oldest unhandled message, or frame).
        self.head = 0
        #: First undecoded byte.
        self.frame = 0
        #: End of the bytes received.
        self.tail = 0
        #: While wrapped: where the upper segment's bytes end.
        self.end = 0
        self.wrapped = False
        #: Messages whose bytes are here, in ring order, not yet reclaimed.
        self.messages: deque[Message] = deque()

    def in_use(self) -> int:
        if self.wrapped:
            return self.end - self.head + self.tail
        return self.tail - self.head

    def reclaim(self, slab: HeaderSlab) -> None:
        """Free the headers of handled messages and the space behind them."""
        messages = self.messages
        while messages and messages[0].status == HANDLED:
            slab.free(messages.popleft())
        if messages:
            first = messages[0].offset
            if self.wrapped and first < self.tail:
                self.wrapped = False  # the upper segment is all handled
            self.head = first
        else:
            self.wrapped = False
            self.head = self.frame
            if self.frame == self.tail:
                # Empty: start again at zero, where reads get the most room.
                self.head = self.frame = self.tail = 0


@dataclass(frozen=True, slots=True)
class RingStatistics:
    """A snapshot of a connection's receive ring."""

    #: Bytes of the current ring.
    size: int
    #: Bytes in use (messages not yet reclaimed, plus an incomplete frame).
    in_use: int
    #: Older rings still holding messages.
    retired: int
    #: Messages whose headers are in use.
    messages: int
    #: Times the ring doubled, and shrank back.
    grows: int
    shrinks: int
    #: Bytes of incomplete frames moved (at a wrap or into a new ring).
    moved_bytes: int


class ReceiveRing:
    """A connection's receive memory: the current ring, older rings, the slab.

    The reading side calls :meth:`writable` for a buffer to read into,
    :meth:`received` with how much was read, then decodes the view it gets,
    makes a :meth:`message` for each batch and ends with :meth:`consumed`.

    Args:
        initial: bytes of the first ring.
        limit: the largest ring; at least ``initial``. It must hold the
            largest frame plus ``min_read``, or such a frame can never arrive.
        min_read: the least room offered to a read.
        read_limit: the largest ring that reads alone may grow it to
            (:meth:`writable`'s ``grow``); at most ``limit``.
    """

    def __init__(
        self,
        *,
        initial: int = 128 * 1024,
        limit: int = 8 << 20,
        min_read: int = 4096,
        read_limit: int = 0,
    ):
        if not 0 < min_read <= initial <= limit:
            raise ValueError("need 0 < min_read <= initial <= limit")
        self.initial = initial
        self.limit = limit
        self.min_read = min_read
        self.read_limit = min(max(read_limit, initial), limit)
        self.current = Ring(initial)
        self.retired: list[Ring] = []
        self.slab = HeaderSlab()
        #: Bytes the incomplete frame at ``frame`` needs in all (0: unknown).
        self.need = 0
        self.grows = 0
        self.shrinks = 0
        self.moved_bytes = 0
        #: The largest frame length seen lately (frames that spanned reads).
        self.expect = 0
        self._window_expect = 0
        self._reads = 0
        self._quiet_reads = 0

    def discard(self) -> None:
        """The connection is over: free the rings' memory (nothing is read or decoded after)."""
        self.retired = []
        self.current = Ring(self.min_read)
        self.need = 0

    # -- reading -------------------------------------------------------------------

    def _wanted(self, *, at_least: bool = False) -> tuple[int, int | None]:
        """(contiguous room the next read needs, most it may take).

        Inside a frame of known length, a read needs room for the rest of it;
        on a boundary, room for the largest frame seen lately, in one
        contiguous room (``at_least``: only ``min_read``, the fallback when
        that much cannot be had). Either way it may take all the room there
        is. A read is the only one a connection gets per pass of the event
        loop, so a read bounded to one frame (as an earlier version did, to
        save moving the incomplete frame it may end in) held a producer of
        large batches to one batch per pass: on a gateway busy with other
        connections, a few batches a millisecond, whatever its share of the
        turns. Moving an incomplete frame copies less than one frame, in C.
        """
        r = self.current
        partial = r.tail - r.frame
        if self.need > partial:
            return max(self.min_read, self.need - partial), None
        if partial or at_least or self.expect <= self.min_read:
            return self.min_read, None
        return self.expect, None

    def reclaim(self) -> None:
        """Take back the space of every handled message, oldest first."""
        if self.retired:
            for ring in self.retired:
                ring.reclaim(self.slab)
            self.retired = [r for r in self.retired if r.messages]
        self.current.reclaim(self.slab)

    def can_read(self) -> bool:
        """Whether :meth:`writable` can offer room now (after reclaiming)."""
        self.reclaim()
        wanted, _ = self._wanted()
        if self._place(wanted, None, move=False) is not None:
            return True
        if self._grown_size(wanted) is not None:
            return True
        fallback, _ = self._wanted(at_least=True)
        return self._place(fallback, None, move=False) is not None

    def writable(self, *, grow: bool = False) -> memoryview:
        """Room to read into, right after the bytes received so far.

        ``grow``: the reader asks for more room than the ring has (its last
        read filled the room it had, and all of it was handled at once): the
        ring doubles, up to ``read_limit``. A read is a connection's only one
        in a pass of the event loop, so on a gateway whose passes are long
        (other causes' turns) the room is what bounds a fast producer's rate.
        It shrinks back when reads no longer need it.

        Raises:
            BufferError: no room and the ring is at its limit: some messages
                must be handled first (check :meth:`can_read` before reading).
        """
        self.reclaim()
        self._maybe_shrink()
        r = self.current
        if grow and r.size < self.read_limit:
            self._replace(min(r.size * 2, self.read_limit))
            self.grows += 1
            r = self.current
        if 2 * max(self.expect, self.need) > r.size < self.limit:
            # Hold two of the largest frames, so that one can arrive while
            # the other waits for the writer, and few have to move.
            target = r.size * 2
            while target < 2 * max(self.expect, self.need):
                target *= 2
            self._replace(min(target, self.limit))
            self.grows += 1
        wanted, most = self._wanted()
        room = self._place(wanted, most, move=True)
        if room is not None:
            return room
        size = self._grown_size(wanted)
        if size is not None:
            self._replace(size)
            self.grows += 1
            room = self._place(wanted, most, move=True)
            assert room is not None
            return room
        wanted, most = self._wanted(at_least=True)
        room = self._place(wanted, most, move=True)
        if room is None:
            raise BufferError(f"receive ring full at its limit of {self.limit} bytes")
        return room

    def _place(self, wanted: int, most: int | None, *, move: bool) -> memoryview | None:
        """Room of at least ``wanted`` bytes after the undecoded ones, moving
        those to the start of the ring if that is where the room is."""
        r = self.current
        if r.wrapped:
            if r.head - r.tail < wanted:
                return None
            stop = r.head
        elif r.size - r.tail >= wanted:
            stop = r.size
        else:
            partial = r.tail - r.frame
            if r.head == r.frame:
                # Nothing in use but an incomplete frame: slide it to the start.
                if partial + wanted > r.size:
                    return None
                if move:
                    self._move(r, r, 0)
                    r.head = 0
                stop = r.size
            elif partial + wanted <= r.head:
                # Wrap: the undecoded bytes go first, before the oldest message.
                if move:
                    r.end = r.frame
                    self._move(r, r, 0)
                    r.wrapped = True
                stop = r.head
            else:
                return None
        if not move:
            return r.view[:0]
        if most is not None and r.tail + most < stop:
            stop = r.tail + most
        return r.view[r.tail : stop]

    def _grown_size(self, wanted: int) -> int | None:
        r = self.current
        required = (r.tail - r.frame) + wanted
        size = r.size * 2
        while size < required:
            size *= 2
        if size > self.limit:
            size = self.limit
            if size <= r.size or size < required:
                return None
        return size

    def _move(self, source: Ring, target: Ring, to: int) -> None:
        """Copy the incomplete frame of ``source`` to ``to`` in ``target``."""
        partial = source.tail - source.frame
        if partial:
            target.view[to : to + partial] = source.view[source.frame : source.tail]
            self.moved_bytes += partial
        target.frame = to
        target.tail = to + partial

    def _replace(self, size: int) -> None:
        old = self.current
        new = Ring(size)
        self._move(old, new, 0)
        old.tail = old.frame  # its undecoded bytes live in the new ring now
        old.reclaim(self.slab)
        if old.messages:
            self.retired.append(old)
        self.current = new
        self._quiet_reads = 0

    def _maybe_shrink(self) -> None:
        self._reads += 1
        if self._reads % SHRINK_AFTER_READS == 0:
            # The largest frame of the last two windows of reads.
            self.expect = self._window_expect
            self._window_expect = 0
        r = self.current
        if r.size <= self.initial:
            return
        if r.in_use() > r.size // 4:
            self._quiet_reads = 0
            return
        self._quiet_reads += 1
        if self._quiet_reads >= SHRINK_AFTER_READS and not r.messages and not self.retired:
            size = max(self.initial, r.size // 2)
            # Keep room for two of the largest frames seen lately.
            if r.tail - r.frame + 2 * max(self.min_read, self.expect) <= size:
                self._replace(size)
                self.shrinks += 1

    def received(self, count: int) -> memoryview | None:
        """``count`` bytes were read into :meth:`writable`'s buffer.

        Returns the undecoded bytes to decode, or ``None`` while the frame
        being received is known to be incomplete.
        """
        r = self.current
        r.tail += count
        if r.tail - r.frame < self.need:
            return None
        return r.view[r.frame : r.tail]

    def message(self, end: int, length: int) -> Message:
        """A header for the batch whose ``length`` bytes end at ``end`` (an offset
        in the view :meth:`received` returned); QUEUED, owned by this ring."""
        r = self.current
        message = self.slab.alloc()
        message.ring = r
        message.offset = r.frame + end - length
        message.length = length
        r.messages.append(message)
        return message

    def consumed(self, count: int, need: int) -> None:
        """Decoding took ``count`` bytes; the next frame needs ``need`` bytes in all."""
        r = self.current
        r.frame += count
        self.need = need
        if need > self._window_expect:
            self._window_expect = need
            if need > self.expect:
                self.expect = min(need, self.limit // 2)
        if not r.messages and r.frame == r.tail:
            r.head = r.frame = r.tail = 0
            r.wrapped = False

    @property
    def undecoded(self) -> int:
        r = self.current
        return r.tail - r.frame

    def statistics(self) -> RingStatistics:
        return RingStatistics(
            size=self.current.size,
            in_use=self.current.in_use() + sum(r.in_use() for r in self.retired),
            retired=len(self.retired),
            messages=self.slab.in_use,
            grows=self.grows,
            shrinks=self.shrinks,
            moved_bytes=self.moved_bytes,
        )


class MessageQueue:
    """The writer's FIFO of message references; signals only on empty -> non-empty.

    Args:
        signal: called when a push finds the queue empty (the gateway schedules
            its log writer with ``loop.call_soon``). While the queue holds
            messages the writer is already due, so later pushes say nothing.
    """

    __slots__ = ("_items", "_signal", "signals")

    def __init__(self, signal: Callable[[], None]) -> None:
        self._items: deque[Message] = deque()
        self._signal = signal
        #: How many times the writer was signalled.
        self.signals = 0

    def __len__(self) -> int:
        return len(self._items)

    def push(self, message: Message) -> bool:
        """Queue ``message``; return whether this push signalled the writer."""
        items = self._items
        items.append(message)
        if len(items) == 1:
            self.signals += 1
            self._signal()
            return True
        return False

    def pop(self) -> Message | None:
        """The oldest message, or ``None`` when the queue is empty."""
        return self._items.popleft() if self._items else None
