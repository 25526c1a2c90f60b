"""Two sessions talking in memory: a producer end and a gateway end.

Like h11's ConnectionPair, bytes move only when a test says so, so a test can
hold frames in flight in either direction and reorder nothing else.
"""

from __future__ import annotations

import pytest

from headgate.protocol import messages as m
from headgate.protocol.codec import FrameDecoder, encode_frame
from headgate.protocol.errors import ErrorCode, ProtocolError
from headgate.protocol.frames import (
    Absolve,
    AnnounceDropping,
    Apologise,
    IssueGuarantees,
    SendChannel,
    SendGlobal,
)
from headgate.protocol.records import encode_records
from headgate.protocol.session import (
    Absolved,
    AckReceived,
    BatchDropped,
    BatchReceived,
    Event,
    GuaranteesReceived,
    HandleDeleted,
    HelloReceived,
    MessageReceived,
    MessagesDropped,
    Role,
    Session,
    StreamBound,
    TailReceived,
    WelcomeReceived,
)

HELLO = m.Hello(producer_id=7, client_name="test")
WELCOME = m.Welcome(server_name="gw", max_message_size=1 << 20, idle_timeout_ms=30_000)


class Pair:
    """A producer session and a gateway session with explicit delivery."""

    def __init__(self, *, optimistic: bool = False) -> None:
        self.producer = Session(Role.PRODUCER, optimistic=optimistic)
        self.gateway = Session(Role.GATEWAY)
        self.up = b""  # producer -> gateway, in flight
        self.down = b""  # gateway -> producer, in flight

    def flush_up(self) -> list[Event]:
        self.up += self.producer.data_to_send()
        data, self.up = self.up, b""
        return self.gateway.receive_data(data)

    def flush_down(self) -> list[Event]:
        self.down += self.gateway.data_to_send()
        data, self.down = self.down, b""
        return self.producer.receive_data(data)

    def open(self, bind_budget: int = 4096) -> None:
        self.producer.send_global(HELLO)
        assert self.flush_up() == [HelloReceived(hello=HELLO)]
        self.gateway.send_global(WELCOME)
        self.gateway.grant(m.STREAM_CHANNEL, bind_budget)
        events = self.flush_down()
        assert events[0] == WelcomeReceived(welcome=WELCOME)
        assert isinstance(events[1], GuaranteesReceived)
        assert events[1].amount == bind_budget


def batches(events: list[Event]) -> list[BatchReceived]:
    return [e for e in events if isinstance(e, BatchReceived)]


def records(*values: bytes) -> bytes:
    return encode_records(list(values))


def test_opening_binding_and_a_batch_reach_the_gateway() -> None:
    pair = Pair()
    pair.open()
    handle = pair.producer.bind_stream("ticks")
    assert handle == 0
    events = pair.flush_up()
    assert events == [StreamBound(handle=0, stream="ticks")]
    pair.gateway.grant(m.data_channel(0), 1000)
    events = pair.flush_down()
    assert events == [GuaranteesReceived(channel=2, handle=0, amount=1000, guarantees=1000)]

    block = records(b"a", b"bb")
    assert pair.producer.send_batch(0, 0, block)
    got = batches(pair.flush_up())
    assert len(got) == 1
    assert (got[0].stream, got[0].first_sequence, got[0].record_count) == ("ticks", 0, 2)
    assert bytes(got[0].records) == block
    assert got[0].size == pair.producer.batch_cost(len(block))
    assert pair.gateway.inbound(2).buffered_bytes == got[0].size
    assert pair.gateway.process(0) == got[0].size
    assert pair.gateway.inbound(2).issuable == got[0].size


def test_the_session_must_open_with_hello() -> None:
    gateway = Session(Role.GATEWAY)
    frame = encode_frame(SendGlobal(payload=m.encode_message(m.Ping(nonce=1))))
    with pytest.raises(ProtocolError) as info:
        gateway.receive_data(frame)
    assert info.value.code is ErrorCode.BAD_HELLO
    gateway2 = Session(Role.GATEWAY)
    with pytest.raises(ProtocolError) as info:
        gateway2.receive_data(encode_frame(Apologise(channel=0)))
    assert info.value.code is ErrorCode.BAD_HELLO


def test_a_second_hello_and_a_wrong_version_are_refused() -> None:
    pair = Pair()
    pair.open()
    pair.producer.send_global(HELLO)
    with pytest.raises(ProtocolError) as info:
        pair.flush_up()
    assert info.value.code is ErrorCode.BAD_HELLO
    gateway = Session(Role.GATEWAY)
    old = m.encode_message(m.Hello(version=2, producer_id=1, client_name="x"))
    with pytest.raises(ProtocolError, match="version"):
        gateway.receive_data(encode_frame(SendGlobal(payload=old)))


def test_without_guarantees_a_waiting_producer_does_not_send() -> None:
    pair = Pair()
    pair.open()
    pair.producer.bind_stream("a")
    pair.flush_up()
    assert not pair.producer.can_send_batch(0, 16)
    assert pair.producer.send_batch(0, 0, records(b"x")) is False
    assert pair.producer.data_to_send() == b""


def test_one_full_stream_does_not_stop_another_on_the_same_connection() -> None:
    pair = Pair()
    pair.open()
    a = pair.producer.bind_stream("a")
    b = pair.producer.bind_stream("b")
    assert a == 0 and b == 1
    pair.flush_up()
    block = records(b"payload")
    cost = pair.producer.batch_cost(len(block))
    pair.gateway.grant(m.data_channel(a), cost)  # room for exactly one batch of A
    pair.gateway.grant(m.data_channel(b), 100 * cost)
    pair.flush_down()
    assert pair.producer.send_batch(a, 0, block)
    assert not pair.producer.send_batch(a, 1, block), "A is out of guarantees"
    sent_b = sum(pair.producer.send_batch(b, i, block) for i in range(50))
    assert sent_b == 50
    got = batches(pair.flush_up())
    assert [g.stream for g in got].count("b") == 50
    # The gateway processes A's batch (Spark released it): A may send again.
    pair.gateway.process(a)
    pair.gateway.issue(m.data_channel(a))
    pair.flush_down()
    assert pair.producer.send_batch(a, 1, block)


def test_optimistic_batches_that_do_not_fit_are_resent_transparently_in_order() -> None:
    pair = Pair(optimistic=True)
    pair.open()
    pair.producer.bind_stream("s")
    pair.flush_up()
    block = records(b"0123456789")
    cost = pair.producer.batch_cost(len(block))
    pair.gateway.grant(2, 2 * cost)  # room for two
    pair.flush_down()
    for seq in range(5):
        assert pair.producer.send_batch(0, seq, block, optimistic=True)
    events = pair.flush_up()
    got = [e.first_sequence for e in batches(events)]
    assert got == [0, 1]
    assert sum(isinstance(e, BatchDropped) for e in events) == 3
    # Spark catches up: the gateway processes both and issues their space.
    pair.gateway.process(0)
    pair.gateway.process(0)
    pair.gateway.issue(2)
    events = pair.flush_down()
    dropped = [e for e in events if isinstance(e, MessagesDropped)]
    assert dropped == [MessagesDropped(channel=2, handle=0, count=3, size=3 * cost)]
    events = pair.flush_up()  # apology, then the resent batches
    resent = [e.first_sequence for e in batches(events)]
    assert resent[:2] == [2, 3]
    # Everything eventually arrives exactly once and in order.
    seen = got + resent
    for _ in range(10):
        while pair.gateway.inbound(2).buffered_messages:
            pair.gateway.process(0)
        pair.gateway.issue(2)
        pair.flush_down()
        seen += [e.first_sequence for e in batches(pair.flush_up())]
        if len(seen) >= 5:
            break
    assert seen == [0, 1, 2, 3, 4]
    assert pair.producer.in_doubt(0) == 0


def test_plead_is_answered_with_exactly_the_absolution_needed() -> None:
    pair = Pair()
    pair.open()
    pair.producer.bind_stream("s")
    pair.flush_up()
    pair.gateway.grant(2, 700)
    pair.flush_down()
    pair.gateway.plead(2, 300)
    pair.flush_down()
    assert pair.producer.outbound(2).guarantees == 300
    assert pair.flush_up() == [Absolved(channel=2, handle=0, amount=400)]
    assert pair.gateway.inbound(2).capacity == 300


def test_an_unasked_absolution_shrinks_both_books_and_cannot_exceed_the_guarantees() -> None:
    # The window policy's producer gives back the rest of a slot after each batch.
    pair = Pair()
    pair.open()
    pair.producer.bind_stream("s")
    pair.flush_up()
    pair.gateway.grant(2, 700)
    pair.flush_down()
    pair.producer.absolve(0, 250)
    assert pair.producer.outbound(2).guarantees == 450
    assert pair.flush_up() == [Absolved(channel=2, handle=0, amount=250)]
    assert pair.gateway.inbound(2).capacity == 450
    assert pair.gateway.inbound(2).client_guarantees == 450
    with pytest.raises(ValueError, match="cannot absolve 451"):
        pair.producer.absolve(0, 451)
    assert pair.producer.outbound(2).guarantees == 450


def test_three_step_free_deletes_the_binding_on_both_sides_once_unreferenced() -> None:
    pair = Pair()
    pair.open()
    pair.producer.bind_stream("s")
    pair.flush_up()
    pair.gateway.grant(2, 10_000)
    pair.flush_down()
    pair.producer.send_batch(0, 0, records(b"x"))
    pair.flush_up()
    pair.producer.free_stream(0)
    events = pair.flush_up()
    # The gateway still buffers a batch that references the handle.
    assert not any(isinstance(e, HandleDeleted) for e in events)
    assert pair.gateway.streams.theirs.references(0) == 1
    events = pair.flush_down()  # the gateway's confirming FreeHandle
    assert events == [HandleDeleted(handle_type=m.HandleType.STREAM, handle=0, ours=True)]
    with pytest.raises(ValueError):
        pair.producer.send_batch(0, 1, records(b"y"))
    before = pair.gateway.inbound(0).capacity
    pair.gateway.process(0)
    assert 0 not in pair.gateway.streams.theirs
    # The bind's bytes are bind-channel space again.
    assert pair.gateway.inbound(0).capacity > before


def test_acks_and_other_globals_surface_as_events_and_pings_are_answered() -> None:
    pair = Pair()
    pair.open()
    ack = m.Ack(handle=0, next_sequence=10, durable_position=4096)
    pair.gateway.send_global(ack)
    pair.gateway.send_global(m.Ping(nonce=5))
    assert pair.flush_down() == [AckReceived(ack=ack)]
    assert pair.flush_up() == [MessageReceived(message=m.Pong(nonce=5))]


def test_fail_tells_the_peer_the_code_and_closes() -> None:
    pair = Pair()
    pair.open()
    data = pair.gateway.fail(ProtocolError("nope", code=ErrorCode.ABSOLVED_TOO_MUCH))
    assert pair.gateway.closed
    events = pair.producer.receive_data(data)
    assert len(events) == 1 and isinstance(events[0], MessageReceived)
    error = events[0].message
    assert isinstance(error, m.Error)
    assert error.code is ErrorCode.ABSOLVED_TOO_MUCH
    assert "nope" in error.text


@pytest.mark.parametrize(
    "ending",
    [
        m.Goodbye(code=ErrorCode.NONE),
        m.Goodbye(code=ErrorCode.SHUTTING_DOWN, text="gateway stopping"),
        m.Error(code=ErrorCode.TIMEOUT, text="idle"),
    ],
)
def test_a_goodbye_or_an_unscoped_error_after_open_ends_the_session(
    ending: m.Goodbye | m.Error,
) -> None:
    pair = Pair()
    pair.open()
    pair.gateway.send_global(ending)
    pair.gateway.send_global(m.Ping(nonce=9))  # after the end: not for us, not answered
    assert not pair.producer.closed
    assert pair.flush_down() == [MessageReceived(message=ending)]
    assert pair.producer.closed
    assert pair.producer.data_to_send() == b""  # no Pong
    assert pair.producer.receive_data(b"\x00" * 8) == []  # later bytes are moot too


def test_after_the_peers_goodbye_what_came_before_it_may_still_be_answered() -> None:
    pair = Pair()
    pair.open()
    pair.producer.send_global(m.Release(stream="s", position=0))
    pair.producer.send_global(m.Goodbye(code=ErrorCode.NONE))
    events = pair.flush_up()
    assert [type(e.message) for e in events if isinstance(e, MessageReceived)] == [
        m.Release,
        m.Goodbye,
    ]
    assert pair.gateway.closed
    refusal = ProtocolError("may not release", code=ErrorCode.FORBIDDEN)
    data = pair.gateway.fail(refusal)  # the answer it owes still goes out
    (frame,) = FrameDecoder(max_payload=1 << 20).feed(data)
    assert isinstance(frame, SendGlobal)
    assert m.decode_global(frame.payload) == m.Error(
        code=ErrorCode.FORBIDDEN, text="may not release"
    )


def test_a_goodbye_ends_the_gateway_session_too_and_frames_after_it_are_moot() -> None:
    pair = Pair()
    pair.open()
    pair.producer.send_global(m.Goodbye(code=ErrorCode.NONE))
    pair.producer.send_global(m.Ping(nonce=3))
    data = pair.producer.data_to_send()
    events, consumed, need = pair.gateway.receive_in_place(memoryview(data))
    assert events == [MessageReceived(message=m.Goodbye(code=ErrorCode.NONE))]
    assert (consumed, need) == (len(data), 0)
    assert pair.gateway.closed
    assert pair.gateway.data_to_send() == b""


def test_a_scoped_error_leaves_the_session_open() -> None:
    pair = Pair()
    pair.open()
    scoped = m.Error(
        code=ErrorCode.FORBIDDEN,
        scope=m.HandleRef(handle_type=m.HandleType.STREAM, handle=0),
        text="may not write",
    )
    pair.gateway.send_global(scoped)
    assert pair.flush_down() == [MessageReceived(message=scoped)]
    assert not pair.producer.closed
    pair.producer.send_global(m.Ping(nonce=2))
    assert pair.flush_up() == []  # answered, not surfaced
    assert pair.flush_down() == [MessageReceived(message=m.Pong(nonce=2))]


# --- hostile peers: raw frames against a gateway session ---------------------


def opened_gateway() -> Session:
    gateway = Session(Role.GATEWAY)
    gateway.receive_data(encode_frame(SendGlobal(payload=m.encode_message(HELLO))))
    gateway.grant(m.STREAM_CHANNEL, 4096)
    gateway.data_to_send()
    return gateway


def bind(name: str) -> bytes:
    return encode_frame(SendChannel(channel=0, payload=m.encode_message(m.BindStream(stream=name))))


def batch(handle: int, seq: int, block: bytes) -> bytes:
    payload = m.encode_batch_header(seq) + block
    return encode_frame(SendChannel(channel=m.data_channel(handle), payload=payload))


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        (batch(0, 0, records(b"x")), ErrorCode.UNKNOWN_HANDLE),
        (bind("s") + encode_frame(Absolve(channel=2, amount=1)), ErrorCode.ABSOLVED_TOO_MUCH),
        (bind("s") + encode_frame(Apologise(channel=2)), ErrorCode.UNEXPECTED_APOLOGY),
        (encode_frame(Apologise(channel=9)), ErrorCode.UNEXPECTED_FRAME),
        (encode_frame(IssueGuarantees(channel=5, amount=1)), ErrorCode.UNEXPECTED_FRAME),
        (encode_frame(AnnounceDropping(channel=77)), ErrorCode.UNEXPECTED_FRAME),
        (bind("s") + batch(0, 0, b"\x01\x00\x00\x00garbage"), ErrorCode.MALFORMED_MESSAGE),
        (
            encode_frame(SendChannel(channel=0, payload=b"\xff\xfe")),
            ErrorCode.MALFORMED_MESSAGE,
        ),
        (
            encode_frame(
                SendGlobal(
                    payload=m.encode_message(
                        m.FreeHandle(handle_type=m.HandleType.STREAM, handle=3, mine=True)
                    )
                )
            ),
            ErrorCode.UNKNOWN_HANDLE,
        ),
    ],
)
def test_violations_raise_the_code_the_peer_is_told(frames: bytes, code: ErrorCode) -> None:
    gateway = opened_gateway()
    with pytest.raises(ProtocolError) as info:
        gateway.receive_data(frames)
    assert info.value.code is code


def test_a_double_free_is_refused() -> None:
    gateway = opened_gateway()
    free = encode_frame(
        SendGlobal(
            payload=m.encode_message(
                m.FreeHandle(handle_type=m.HandleType.STREAM, handle=0, mine=True)
            )
        )
    )
    gateway.receive_data(bind("s") + free)
    with pytest.raises(ProtocolError) as info:
        gateway.receive_data(free)
    assert info.value.code is ErrorCode.HANDLE_FREED


def test_an_optimistic_reference_binds_pending_binds_first() -> None:
    # A bind and a batch that references it arrive in one chunk: the batch
    # finds the handle beyond the bound ones and binds the pending bind first.
    gateway = opened_gateway()
    events = gateway.receive_data(bind("s") + batch(0, 0, records(b"x")))
    assert isinstance(events[0], StreamBound)
    assert isinstance(events[1], BatchDropped), "no guarantees yet on the data channel"


def test_a_reference_to_a_handle_whose_bind_was_dropped_is_dropped_silently() -> None:
    gateway = Session(Role.GATEWAY)
    gateway.receive_data(encode_frame(SendGlobal(payload=m.encode_message(HELLO))))
    # No bind guarantees at all: the optimistic bind is dropped and announced.
    events = gateway.receive_data(bind("s") + batch(0, 0, records(b"x")))
    assert events == []
    out = FrameDecoder(max_payload=1 << 20).feed(gateway.data_to_send())
    assert out == [AnnounceDropping(channel=0)]
    assert gateway.streams.theirs.next_handle == 0


def test_the_gateway_survives_any_byte_string_with_only_protocol_errors() -> None:
    import random

    rng = random.Random(1234)
    valid = bind("s") + batch(0, 0, records(b"abc"))
    for _ in range(300):
        gateway = opened_gateway()
        data = bytearray(valid)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            gateway.receive_data(bytes(data))
        except ProtocolError as exc:
            assert exc.code is not ErrorCode.NONE


def test_a_producer_accepts_a_refusal_in_place_of_welcome() -> None:
    producer = Session(Role.PRODUCER)
    producer.send_global(HELLO)
    refusal = m.Error(code=ErrorCode.UNAUTHENTICATED, text="bad token")
    events = producer.receive_data(encode_frame(SendGlobal(payload=m.encode_message(refusal))))
    assert events == [MessageReceived(message=refusal)]
    assert producer.closed and not producer.opened


def test_tail_records_flow_down_within_the_subscribers_own_guarantees() -> None:
    """The session is symmetric: the subscriber is the LCMUX server of the down data
    channel, grants its buffer, and the gateway sends only within it."""
    pair = Pair()
    pair.open()
    # The subscriber grants bind credit; the gateway binds its stream handle.
    pair.producer.grant(m.STREAM_CHANNEL, 1024)
    assert isinstance(pair.flush_up()[0], GuaranteesReceived)
    handle = pair.gateway.bind_stream("clicks")
    assert handle == 0
    (bound,) = pair.flush_down()
    assert bound == StreamBound(handle=0, stream="clicks")
    block = records(b"r1", b"r2")
    header = m.TailHeader(7, 4096, 4160, 42, 1_700_000_000_000_000)
    # No guarantees yet on the data channel: nothing may be sent.
    assert not pair.gateway.send_tail(0, header, block)
    cost = pair.gateway.tail_cost(len(block))
    pair.producer.grant(m.data_channel(0), cost)
    pair.flush_up()
    assert pair.gateway.send_tail(0, header, block)
    assert not pair.gateway.send_tail(0, header, block), "the buffer is full"
    (tail,) = pair.flush_down()
    assert isinstance(tail, TailReceived)
    assert (tail.handle, tail.stream, tail.header, tail.record_count) == (0, "clicks", header, 2)
    assert bytes(tail.records) == block and tail.size == cost
    # Processed: its space is issued again, and the next one fits.
    pair.producer.process(0)
    pair.producer.issue(m.data_channel(0))
    pair.flush_up()
    assert pair.gateway.send_tail(0, header, block)


def test_a_batch_event_built_the_fast_way_is_the_dataclass_event() -> None:
    """The session's per-batch shortcut makes exactly the event the dataclass would."""
    from headgate.protocol.session import _batch_received

    records = memoryview(b"\1\0\0\0\0\0\0\0\0\0\0\0\1\0\0\0x")
    fast = _batch_received(3, "s", 7, 1, records, 48, 21)
    assert fast == BatchReceived(
        handle=3, stream="s", first_sequence=7, record_count=1, records=records, size=48, end=21
    )
    assert type(fast) is BatchReceived and repr(fast).startswith("BatchReceived(handle=3,")
