"""What the fuzzers check, as plain functions of one input.

Each target takes arbitrary bytes and raises ``AssertionError`` (or any
exception that is not a ``ProtocolError``) when an invariant breaks:

* the frame decoder and the session raise only ``ProtocolError`` subclasses,
  whatever the input and however it is split into chunks;
* what they hold in memory is bounded by one frame (the decoder's partial
  frame) and by what the input asks them to answer;
* the decoder finds the same frames whether the input comes in one piece or
  in pieces (so a split can never change what a peer said);
* every batch the gateway's session hands on has all its sequences below
  ``SEQUENCE_LIMIT``, so that no sum of wire values reaches the log or an Ack
  out of range (issue 13: such a batch once stopped the gateway).

Hangs are caught by the fuzzer's per-input timeout. The input's first byte
chooses the split points, so the fuzzer explores splits as well as contents.
"""

from __future__ import annotations

from headgate.costs import batch_cost
from headgate.protocol import messages as m
from headgate.protocol.codec import FrameDecoder, encode_frame
from headgate.protocol.errors import ProtocolError
from headgate.protocol.frames import SendGlobal
from headgate.protocol.session import (
    BatchReceived,
    Event,
    HandleDeleted,
    HelloReceived,
    Role,
    Session,
    StreamBound,
)

#: The largest payload the targets accept; small, so that "too large" is reachable.
MAX_PAYLOAD = 4096
#: A frame header is at most 1 + 8 (channel) + 8 (length) bytes.
MAX_HEADER = 17


def chunks(data: bytes) -> list[bytes]:
    """Split ``data`` after its first byte into pieces whose sizes that byte picks."""
    if not data:
        return []
    step = data[0] % 17 + 1
    body = data[1:]
    return [body[i : i + step] for i in range(0, len(body), step)] or [b""]


def check_decoder(data: bytes) -> None:
    """Decode in pieces and whole; compare; bound the buffered bytes."""
    pieces = chunks(data)
    whole = b"".join(pieces)
    split = FrameDecoder(max_payload=MAX_PAYLOAD)
    frames_split = []
    error_split: ProtocolError | None = None
    for piece in pieces:
        try:
            frames_split += split.feed(piece)
        except ProtocolError as exc:
            error_split = exc
            break
        assert split.buffered <= MAX_HEADER + MAX_PAYLOAD, split.buffered
    one = FrameDecoder(max_payload=MAX_PAYLOAD)
    try:
        frames_whole = one.feed(whole)
        error_whole: ProtocolError | None = None
    except ProtocolError as exc:
        frames_whole, error_whole = [], exc
    assert (error_split is None) == (error_whole is None), (error_split, error_whole)
    if error_whole is None:
        assert frames_split == frames_whole
        # Every frame found re-encodes to a frame that decodes to itself.
        for frame in frames_whole:
            again = FrameDecoder(max_payload=MAX_PAYLOAD).feed(encode_frame(frame))
            assert again == [frame]
    else:
        assert error_split is not None and error_split.code == error_whole.code
        # A failed decoder stays failed.
        try:
            one.feed(b"\x00")
        except ProtocolError:
            pass
        else:
            raise AssertionError("a failed decoder accepted more bytes")


def _hello(role: Role) -> bytes:
    if role is Role.GATEWAY:
        message: m.GlobalMessage = m.Hello(producer_id=1, client_name="fuzz")
    else:
        message = m.Welcome(server_name="fuzz", max_message_size=MAX_PAYLOAD, idle_timeout_ms=0)
    return encode_frame(SendGlobal(payload=m.encode_message(message)))


def _act_as_gateway(session: Session, events: list[Event]) -> None:
    """What the gateway does with a session's events, minus the log."""
    for event in events:
        if isinstance(event, BatchReceived):
            assert event.first_sequence + event.record_count <= m.SEQUENCE_LIMIT, event
        if isinstance(event, HelloReceived):
            session.grant(m.STREAM_CHANNEL, 512)
        elif isinstance(event, StreamBound):
            session.grant(m.data_channel(event.handle), 2048)
        elif isinstance(event, BatchReceived):
            session.process(event.handle)
        elif isinstance(event, HandleDeleted) and not event.ours:
            session.issue(m.STREAM_CHANNEL)


def check_session(data: bytes) -> None:
    """Feed a session (gateway or producer side) the input after a valid opening.

    The second byte picks the role and whether the opening is sent first, so
    the fuzzer also reaches the before-Hello states.
    """
    if len(data) < 2:
        return
    role = Role.GATEWAY if data[1] & 1 == 0 else Role.PRODUCER
    session = Session(role, max_message_size=MAX_PAYLOAD, data_cost=batch_cost)
    if role is Role.PRODUCER:
        # The producer's own side of the opening: a Hello and one bind, so
        # that frames about its stream's channels have a state to meet.
        session.send_global(m.Hello(producer_id=1, client_name="fuzz"))
    pieces = chunks(data[:1] + data[2:])
    if data[1] & 2 == 0:
        pieces.insert(0, _hello(role))
    sent_out = 0
    received = 0
    for piece in pieces:
        if session.closed:
            # The peer refused the session in place of Welcome (or said
            # Goodbye); callers stop feeding a closed session, as the
            # gateway and the producer do.
            return
        received += len(piece)
        try:
            events = session.receive_data(piece)
        except ProtocolError as exc:
            out = session.fail(exc)
            assert out, "a failure must queue its Error"
            assert session.closed
            return
        assert isinstance(events, list)
        if role is Role.GATEWAY:
            _act_as_gateway(session, events)
        if (
            role is Role.PRODUCER
            and session.opened
            and session.streams.ours.next_handle == 0
            and session.outbound(m.STREAM_CHANNEL).can_send(8)
        ):
            session.bind_stream("s")
        assert session.receive_buffered <= MAX_HEADER + MAX_PAYLOAD
        sent_out += len(session.data_to_send())
        # Answers are bounded by the input: a Pong per Ping, an echo per
        # FreeHandle, an Absolve per Plead, an AnnounceDropping per message.
        assert sent_out <= 64 + 8 * received, (sent_out, received)
