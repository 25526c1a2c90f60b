"""The bound on a stream's unacknowledged bytes, without I/O: what counts,
that an empty stream takes anything, and that waiting sends go one at a
time, in line, and close the fast path while they wait."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from headgate.client.buffer_bound import BoundedStream
from headgate.protocol.records import encode_records

BOUND = 10_000


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    try:
        yield loop
    finally:
        loop.close()


def test_what_counts_is_every_byte_not_acknowledged() -> None:
    s = BoundedStream("s", BOUND)
    assert s.has_room(10 * BOUND, BOUND, spool_full=True), "an empty stream takes anything"
    s.enqueue(encode_records([b"x" * 6000]), 1, None, 0.0)  # sealed, not acknowledged
    s.append(b"y" * 1000, None, 1 << 20, float("inf"))  # and the open batch
    held = s.buffered + s.open_bytes
    assert s.has_room(BOUND - held, BOUND, spool_full=False)
    assert not s.has_room(BOUND - held + 1, BOUND, spool_full=False)
    assert not s.has_room(1, BOUND, spool_full=True), "a full spool holds every send"


def test_waiting_sends_go_one_at_a_time_in_line(loop: asyncio.AbstractEventLoop) -> None:
    s = BoundedStream("s", BOUND)
    s.resume(0, 0, 0.0)  # the stream's initial Ack
    s.enqueue(encode_records([b"x" * 9000]), 1, None, 0.0)
    batch = s.front(1 << 20)
    assert batch is not None
    s.number(batch)
    s.sent()
    first, second = loop.create_future(), loop.create_future()
    s.wait_in_line(2000, first)
    assert s.room == 0, "later sends queue behind it, the fast path included"
    s.wait_in_line(10, second)
    s.admit(BOUND, spool_full=False)
    assert not first.done() and not second.done(), "no room yet; the small one does not overtake"
    assert s.ack(1, 9000, 1.0) == 1 and s.buffered == 0  # the gateway acknowledged it
    s.admit(BOUND, spool_full=False)
    assert first.done() and not second.done(), "one at a time"
    s.space_waiters.popleft()  # the first one appended and left the line
    s.admit(BOUND, spool_full=False)
    assert second.done()
    s.space_waiters.popleft()
    s.admit(BOUND, spool_full=True)
    assert s.room == 0, "a full spool keeps the fast path closed"
    s.admit(BOUND, spool_full=False)
    assert s.room == BOUND
