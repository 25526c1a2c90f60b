"""The receive ring, its header slab and the writer's FIFO (seed freeradius-message-api.txt)."""

from __future__ import annotations

import random

import pytest

from headgate.gateway.ring import (
    FREE,
    HANDLED,
    QUEUED,
    SHRINK_AFTER_READS,
    HeaderSlab,
    Message,
    MessageQueue,
    ReceiveRing,
)
from headgate.protocol.codec import FrameDecoder, encode_frame
from headgate.protocol.errors import ErrorCode, FrameError
from headgate.protocol.frames import SendChannel


def read(ring: ReceiveRing, data: bytes) -> memoryview | None:
    """What a transport does: read into the offered room, then say how much."""
    room = ring.writable()
    assert len(room) >= len(data), "the test reads only what fits"
    room[: len(data)] = data
    del room
    return ring.received(len(data))


class Peer:
    """Frames in, messages out: a ring and a decoder as the gateway uses them."""

    def __init__(self, ring: ReceiveRing, max_payload: int = 1 << 20) -> None:
        self.ring = ring
        self.decoder = FrameDecoder(max_payload=max_payload)
        self.messages: list[Message] = []
        self.payloads: list[bytes] = []

    def receive(self, data: bytes) -> None:
        pos = 0
        while pos < len(data):
            room = self.ring.writable()
            count = min(len(room), len(data) - pos)
            room[:count] = data[pos : pos + count]
            del room
            pos += count
            view = self.ring.received(count)
            if view is None:
                continue
            frames, ends, consumed, need = self.decoder.decode_in_place(view)
            for frame, end in zip(frames, ends, strict=True):
                assert isinstance(frame, SendChannel)
                message = self.ring.message(end, len(frame.payload))
                # The header points at exactly the payload's bytes in the ring.
                assert bytes(message.data) == bytes(frame.payload)
                self.messages.append(message)
            del view, frames
            self.ring.consumed(consumed, need)

    def handle_all(self) -> list[bytes]:
        out = []
        for message in self.messages:
            out.append(bytes(message.data))
            message.status = HANDLED
        self.messages.clear()
        self.payloads += out
        return out


def frame(n: int, size: int) -> bytes:
    return encode_frame(SendChannel(channel=2, payload=bytes([n % 251]) * size))


def test_reads_go_straight_into_the_ring_and_messages_point_at_their_bytes() -> None:
    ring = ReceiveRing(initial=4096, limit=16384, min_read=256)
    peer = Peer(ring)
    data = frame(1, 100) + frame(2, 50)
    peer.receive(data)
    assert [m.offset for m in peer.messages] == [2, 102 + 2]
    assert all(m.ring is ring.current and m.status == QUEUED for m in peer.messages)
    assert peer.handle_all() == [bytes([1]) * 100, bytes([2]) * 50]
    ring.reclaim()
    assert ring.current.head == ring.current.tail == 0, "empty: back to the start"
    assert ring.slab.in_use == 0


def test_the_ring_wraps_keeping_unhandled_messages_where_they_are() -> None:
    ring = ReceiveRing(initial=1024, limit=1024, min_read=64)
    peer = Peer(ring)
    third = frame(2, 300)
    peer.receive(frame(0, 400) + frame(1, 400) + third[:50])  # 856 of 1024 bytes
    first, second = peer.messages
    first.status = HANDLED
    peer.messages.pop(0)
    current = ring.current
    # The rest of the third frame does not fit after the tail: its start moves
    # to the front of the ring, into the space the first message gave back.
    peer.receive(third[50:] + frame(3, 60))
    assert current.wrapped and ring.current is current and ring.grows == 0
    assert ring.moved_bytes > 0
    # The unhandled message was not moved; the new frames sit before it.
    assert bytes(second.data) == bytes([1]) * 400
    assert all(m.offset < second.offset for m in peer.messages[1:])
    assert peer.handle_all() == [bytes([1]) * 400, bytes([2]) * 300, bytes([3]) * 60]
    ring.reclaim()
    assert not current.wrapped and ring.slab.in_use == 0


def test_reclaim_stops_at_the_oldest_unhandled_message() -> None:
    ring = ReceiveRing(initial=4096, limit=4096, min_read=128)
    peer = Peer(ring)
    peer.receive(b"".join(frame(i, 100) for i in range(5)))
    a, b, c, d, _ = peer.messages
    b.status = HANDLED
    c.status = HANDLED
    ring.reclaim()
    assert ring.current.head == a.offset and ring.slab.in_use == 5, "a still holds the ring"
    a.status = HANDLED
    ring.reclaim()
    assert ring.current.head == d.offset and ring.slab.in_use == 2
    assert (a.status, b.status, c.status) == (FREE, FREE, FREE), "headers back in the slab"


def test_a_full_ring_doubles_and_the_old_one_is_kept_until_it_drains() -> None:
    ring = ReceiveRing(initial=1024, limit=8192, min_read=256)
    peer = Peer(ring)
    old = ring.current
    peer.receive(b"".join(frame(i, 200) for i in range(4)))  # 812 bytes, nothing handled
    peer.receive(frame(9, 300))
    assert ring.grows == 1 and ring.current.size == 2048
    assert ring.retired == [old], "the old ring holds unhandled messages"
    assert bytes(peer.messages[0].data) == bytes([0]) * 200
    assert peer.messages[-1].ring is ring.current
    peer.handle_all()
    ring.reclaim()
    assert ring.retired == [], "drained, the old ring is let go"
    assert ring.slab.in_use == 0


def test_growth_stops_at_the_limit_and_reads_wait_for_the_writer() -> None:
    ring = ReceiveRing(initial=1024, limit=2048, min_read=256)
    peer = Peer(ring)
    while ring.can_read():
        peer.receive(frame(len(peer.messages), 200))
        assert len(peer.messages) < 50
    assert ring.current.size == 2048
    with pytest.raises(BufferError, match="limit"):
        ring.writable()
    # The writer handles messages in order; reading resumes as soon as the
    # space behind the oldest unhandled one can take a read, before all are done.
    handled = 0
    while not ring.can_read():
        peer.messages[handled].status = HANDLED
        handled += 1
    assert handled < len(peer.messages)
    assert len(ring.writable()) >= 256
    del peer.messages[:handled]  # reclaimed: their headers are free again
    peer.handle_all()
    ring.reclaim()
    assert ring.statistics().in_use == 0 and ring.retired == []


def test_a_frame_larger_than_the_ring_grows_it_and_it_shrinks_back() -> None:
    ring = ReceiveRing(initial=1024, limit=16384, min_read=128)
    peer = Peer(ring)
    big = frame(7, 5000)
    for i in range(0, len(big), 700):  # in pieces, as TCP delivers it
        peer.receive(big[i : i + 700])
    assert peer.handle_all() == [bytes([7]) * 5000]
    assert ring.current.size >= 5000 + 128
    grown = ring.current.size
    small = frame(1, 20)
    for _ in range(SHRINK_AFTER_READS * 8):
        peer.receive(small)
        peer.handle_all()
        if ring.current.size == 1024:
            break
    assert ring.shrinks >= 1 and ring.current.size == 1024 < grown
    assert len(peer.payloads) > 1 and set(peer.payloads[1:]) == {bytes([1]) * 20}


def test_an_incomplete_frame_is_not_decoded_until_it_can_progress() -> None:
    ring = ReceiveRing(initial=4096, limit=4096, min_read=128)
    big = frame(3, 1000)
    assert read(ring, big[:10]) is not None
    ring.consumed(0, len(big))
    assert read(ring, big[10:500]) is None, "still short of the declared length"
    view = read(ring, big[500:])
    assert view is not None and bytes(view) == big


def test_random_traffic_with_random_handling_keeps_every_byte() -> None:
    """Whatever the sizes, cuts and handling order, every payload comes out
    intact and in order, and the ring ends empty."""
    rng = random.Random(7)
    ring = ReceiveRing(initial=2048, limit=32768, min_read=256)
    peer = Peer(ring)
    sent: list[bytes] = []
    stream = bytearray()
    for i in range(600):
        size = rng.choice([1, 10, 100, 700, 3000])
        stream += frame(i, size)
        sent.append(bytes([i % 251]) * size)
    pos = 0
    got: list[bytes] = []
    pending: list[Message] = []
    for _ in range(10_000):
        if pos >= len(stream):
            break
        if not ring.can_read():
            # The writer must handle some before more can be read.
            assert pending
        else:
            cut = rng.randint(1, 900)
            before = len(peer.messages)
            peer.receive(bytes(stream[pos : pos + cut]))
            pos += cut
            pending += peer.messages[before:]
        # The writer handles a random prefix of the queue, in order.
        for message in pending[: rng.randint(0, len(pending))]:
            got.append(bytes(message.data))
            message.status = HANDLED
            pending.remove(message)
            peer.messages.remove(message)
    for message in pending:
        got.append(bytes(message.data))
        message.status = HANDLED
    ring.reclaim()
    assert got == sent
    assert ring.statistics().in_use == 0 and ring.slab.in_use == 0 and ring.retired == []


@pytest.mark.parametrize(
    "header",
    [
        "70 ff ff ff ff ff ff ff ff",  # SendChannel, channel 0, length 2^64-1
        "8f ff ff ff ff ff ff ff ff",  # SendGlobal, length 2^64-1
        "63 00 10 00 01",  # SendChannel, channel 3, length 2^20 + 1
    ],
)
def test_a_hostile_header_split_across_the_wrap_point_is_refused(header: str) -> None:
    ring = ReceiveRing(initial=1024, limit=1024, min_read=64)
    peer = Peer(ring)
    # Fill the ring so that the next frame starts just before its end.
    peer.receive(frame(0, 500) + frame(1, 500 - 3 - len(bytes.fromhex(header)) // 2))
    peer.messages[0].status = HANDLED
    peer.messages.pop(0)
    bad = bytes.fromhex(header)
    cut = len(bad) // 2
    tail_room = ring.current.size - ring.current.tail
    peer.receive(bad[:cut])
    assert tail_room < 64, "the first half landed at the very end of the ring"
    with pytest.raises(FrameError) as raised:
        peer.receive(bad[cut:])  # the rest arrives after the ring wrapped
    assert raised.value.code is ErrorCode.FRAME_TOO_LARGE
    assert ring.current.wrapped, "the partial header moved to the start, before the message"
    with pytest.raises(FrameError):
        peer.decoder.decode_in_place(memoryview(b"\x00"))


def test_a_valid_frame_split_across_the_wrap_point_arrives_whole() -> None:
    ring = ReceiveRing(initial=1024, limit=1024, min_read=64)
    peer = Peer(ring)
    peer.receive(frame(0, 500) + frame(1, 450))
    peer.messages[0].status = HANDLED
    held = peer.messages[1]
    peer.messages.pop(0)
    split = frame(2, 300)
    peer.receive(split[:40])  # lands at the end of the ring
    peer.receive(split[40:])
    assert ring.current.wrapped and ring.moved_bytes == 40
    assert bytes(peer.messages[-1].data) == bytes([2]) * 300
    assert bytes(held.data) == bytes([1]) * 450, "the unhandled message was not touched"


def test_the_slab_reuses_headers_and_doubles_when_all_are_taken() -> None:
    slab = HeaderSlab(initial=2)
    a, b = slab.alloc(), slab.alloc()
    assert slab.grows == 0 and slab.in_use == 2
    c = slab.alloc()
    assert slab.grows == 1 and len(slab.headers) == 4
    slab.free(a)
    assert slab.alloc() is a, "a freed header is the next one used"
    assert {id(h) for h in slab.headers} >= {id(a), id(b), id(c)}


def test_the_queue_signals_only_when_it_goes_from_empty_to_non_empty() -> None:
    signals: list[int] = []
    queue = MessageQueue(lambda: signals.append(len(queue)))
    slab = HeaderSlab()
    messages = [slab.alloc() for _ in range(3)]
    assert queue.push(messages[0]) is True
    assert queue.push(messages[1]) is False and queue.push(messages[2]) is False
    assert signals == [1]
    assert [queue.pop() for _ in range(4)] == [*messages, None], "first in, first out"
    assert queue.push(messages[0]) is True and signals == [1, 1] and queue.signals == 2


def test_a_read_after_large_frames_may_take_many_of_them() -> None:
    """A connection gets one read per pass of the event loop: if that read
    could hold only one large frame, a producer of large batches would get one
    batch per pass however much it had sent (a gateway busy with other
    connections then served it a few batches a millisecond)."""
    ring = ReceiveRing(initial=128 * 1024, limit=4 << 20, min_read=16 * 1024)
    peer = Peer(ring)
    large = 33 * 1024
    # Frames that span reads teach the ring how large this peer's frames are.
    data = b"".join(frame(n, large) for n in range(6))
    for start in range(0, len(data), 20 * 1024):
        chunk = data[start : start + 20 * 1024]
        room = ring.writable()
        room[: len(chunk)] = chunk
        del room
        view = ring.received(len(chunk))
        if view is not None:
            frames, ends, consumed, need = peer.decoder.decode_in_place(view)
            for f, end in zip(frames, ends, strict=True):
                assert isinstance(f, SendChannel)
                peer.messages.append(ring.message(end, len(f.payload)))
            del view, frames
            ring.consumed(consumed, need)
        peer.handle_all()
    assert ring.expect >= large
    assert len(peer.payloads) == 6
    # On a frame boundary, with everything handled, the next read may fill
    # the ring: several frames' worth, not one.
    assert len(ring.writable()) >= 3 * large


def test_a_discarded_ring_lets_its_memory_go() -> None:
    """At the end of a connection its ring shrinks to the least read, whatever it grew to."""
    ring = ReceiveRing(initial=128 * 1024, limit=4 << 20, min_read=16 * 1024)
    peer = Peer(ring)
    peer.receive(frame(1, 300 * 1024))  # grows the ring past its first size
    assert ring.current.size > 128 * 1024
    peer.handle_all()
    ring.discard()
    assert ring.current.size == 16 * 1024 and not ring.retired


def test_reads_that_fill_the_room_grow_the_ring_to_its_read_limit_and_no_further() -> None:
    """A connection gets one read per pass: when each read fills the room and is
    handled at once, the peer sends faster than the ring carries it, and the
    reader asks for more (``grow``); the ring doubles up to ``read_limit``,
    then shrinks back once reads no longer need the room."""
    ring = ReceiveRing(initial=128 * 1024, limit=4 << 20, min_read=16 * 1024, read_limit=512 * 1024)
    assert len(ring.writable()) == 128 * 1024
    assert len(ring.writable()) == 128 * 1024, "not asked: it stays"
    sizes = [len(ring.writable(grow=True)) for _ in range(4)]
    assert sizes == [256 * 1024, 512 * 1024, 512 * 1024, 512 * 1024]
    peer = Peer(ring)
    for n in range(140):  # small reads: the room is not needed any more (halves per 64)
        peer.receive(frame(n, 100))
        peer.handle_all()
    assert ring.current.size == 128 * 1024
    assert ReceiveRing(initial=128 * 1024, limit=256 * 1024, read_limit=1 << 30).read_limit == (
        256 * 1024
    )
