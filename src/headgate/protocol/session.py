"""One end of a headgate connection: bytes in, events and bytes out.

A connection carries two LCMUX sessions, one per direction. Each end is the
LCMUX *client* for the channels it sends on and the LCMUX *server* for the
channels it receives on, so one class serves the producer, the gateway and a
tail subscriber alike; only the opening handshake and the layout of data
messages depend on the :class:`Role`.

What travels where (``h`` is a stream handle that the *sending* end created)::

    channel 0        BindStream     binds the sender's next stream handle
    channel 1        BindSchema     binds the sender's next schema handle
    channel 2 + h    Batch          records for stream h (producer -> gateway)
                     TailRecords    records for stream h (gateway -> subscriber)
    SendGlobal       Hello, Welcome, Ack, Error, FreeHandle, Release, Ping, ...

Like h11 and h2 the session never performs I/O: feed it bytes with
:meth:`Session.receive_data`, act on the events it returns, and write out
whatever :meth:`Session.data_to_send` hands back. A peer's violation raises a
:class:`~headgate.protocol.errors.ProtocolError` whose ``code`` is what the
peer should be told (:meth:`Session.fail` queues exactly that).

Retransmission is transparent: when the peer announces that it dropped
messages on a channel, the session apologises and sends those messages again,
in order and before anything new on that channel, within guarantees (or
optimistically, if the session was created with ``optimistic=True``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from headgate.protocol import messages as m
from headgate.protocol.c64 import U64_MAX
from headgate.protocol.channel import ClientChannel, MessageDropped, ServerChannel
from headgate.protocol.codec import FrameDecoder, encode_frame, encode_frame_into
from headgate.protocol.deadlines import ReceiveDeadlines
from headgate.protocol.errors import ErrorCode, FlowControlError, ProtocolError
from headgate.protocol.frames import (
    Absolve,
    AnnounceDropping,
    Apologise,
    Frame,
    IssueGuarantees,
    LimitReceiving,
    LimitSending,
    Plead,
    SendChannel,
    SendGlobal,
)
from headgate.protocol.handles import FrameUse, FreeRule, HandleSpace, UnboundReference
from headgate.protocol.lifecycle import Answer, Input, Lifecycle, TimerAction
from headgate.protocol.records import validate_records

__all__ = [
    "Absolved",
    "AckReceived",
    "BatchDropped",
    "BatchReceived",
    "Event",
    "GuaranteesReceived",
    "HandleDeleted",
    "HelloReceived",
    "MessageReceived",
    "MessagesDropped",
    "Role",
    "SchemaBound",
    "Session",
    "StreamBound",
    "TailReceived",
    "WelcomeReceived",
]


class Role(Enum):
    """Which end of a connection a session is."""

    #: Opens the connection with Hello; sends batches, receives tail records.
    PRODUCER = "producer"
    #: Answers Hello with Welcome; receives batches, sends tail records.
    GATEWAY = "gateway"


# --- events ------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class HelloReceived:
    """The peer opened the session (gateway side)."""

    #: The peer's opening message.
    hello: m.Hello


@dataclass(frozen=True, slots=True, kw_only=True)
class WelcomeReceived:
    """The gateway accepted the session (producer side)."""

    #: The gateway's answer to Hello.
    welcome: m.Welcome


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamBound:
    """The peer bound one of its stream handles; its data channel now exists."""

    #: The peer's handle for the stream.
    handle: int
    #: The stream name.
    stream: str


@dataclass(frozen=True, slots=True, kw_only=True)
class SchemaBound:
    """The peer bound one of its schema handles."""

    #: The peer's handle for the schema.
    handle: int
    #: The bind message (schema name and text).
    schema: m.BindSchema


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchReceived:
    """A batch of records is buffered on a stream's channel (gateway side).

    It stays in the channel's buffer, holding its guarantees and a reference
    to its stream handle, until :meth:`Session.process` takes it out.
    """

    #: The peer's stream handle.
    handle: int
    #: The stream name the handle is bound to.
    stream: str
    #: The sequence number of the first record.
    first_sequence: int
    #: How many records the batch holds.
    record_count: int
    #: The records block (validated), a view into the received bytes.
    records: memoryview
    #: What the batch costs in guarantees.
    size: int
    #: With :meth:`Session.receive_in_place`, the offset just past the batch's
    #: frame in the view received (``records`` ends there); 0 otherwise.
    end: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchDropped:
    """A batch was dropped whole (gateway side); the producer will resend it."""

    #: The peer's stream handle.
    handle: int
    #: The batch's cost in guarantees.
    size: int


# The session builds BatchReceived events through their slot descriptors (as
# the codec builds SendChannel frames): what the frozen dataclass __init__
# does, minus its per-field object.__setattr__ lookups, at a third of the
# cost, for the event made once per batch (a flood of one-record batches).
_BATCH_RECEIVED_SETTERS = tuple(
    BatchReceived.__dict__[name].__set__
    for name in ("handle", "stream", "first_sequence", "record_count", "records", "size", "end")
)


def _batch_received(
    handle: int,
    stream: str,
    first_sequence: int,
    record_count: int,
    records: memoryview,
    size: int,
    end: int,
) -> BatchReceived:
    """``BatchReceived(handle=handle, stream=stream, ...)``, the same event, made faster."""
    event: BatchReceived = object.__new__(BatchReceived)
    set_handle, set_stream, set_first, set_count, set_records, set_size, set_end = (
        _BATCH_RECEIVED_SETTERS
    )
    set_handle(event, handle)
    set_stream(event, stream)
    set_first(event, first_sequence)
    set_count(event, record_count)
    set_records(event, records)
    set_size(event, size)
    set_end(event, end)
    return event


@dataclass(frozen=True, slots=True, kw_only=True)
class TailReceived:
    """Records of a stream that the gateway delivers live (subscriber side)."""

    #: The gateway's stream handle.
    handle: int
    #: The stream name.
    stream: str
    #: The log frame's header: sequence, positions, producer, timestamp.
    header: m.TailHeader
    #: How many records the batch holds.
    record_count: int
    #: The records block (validated).
    records: memoryview
    #: What the message costs in guarantees (what :meth:`Session.process` frees).
    size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class GuaranteesReceived:
    """Guarantees arrived on one of our sending channels."""

    #: The logical channel.
    channel: int
    #: Our stream handle, or None for the bind channels.
    handle: int | None
    #: How many bytes were granted.
    amount: int
    #: Our guarantees on that channel now (negative while in optimistic debt).
    guarantees: int


@dataclass(frozen=True, slots=True, kw_only=True)
class MessagesDropped:
    """The peer dropped messages of ours; they are queued for resending."""

    #: The logical channel.
    channel: int
    #: Our stream handle, or None for the bind channels.
    handle: int | None
    #: How many messages were dropped.
    count: int
    #: Their total cost.
    size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Absolved:
    """The peer gave up guarantees on a channel we receive on; its buffer shrank."""

    #: The logical channel.
    channel: int
    #: The peer's stream handle, or None for the bind channels.
    handle: int | None
    #: How many bytes the peer absolved.
    amount: int


@dataclass(frozen=True, slots=True, kw_only=True)
class AckReceived:
    """The gateway made batches durable (producer side)."""

    #: The cumulative acknowledgement.
    ack: m.Ack


@dataclass(frozen=True, slots=True, kw_only=True)
class HandleDeleted:
    """A binding is gone on our side: both peers freed it and nothing uses it."""

    #: The handle type.
    handle_type: m.HandleType
    #: The handle.
    handle: int
    #: Whether we created the handle.
    ours: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class MessageReceived:
    """Any other global message (Error, Release, Goodbye, Pong, Fetch, ...)."""

    #: The message.
    message: m.GlobalMessage


Event = (
    HelloReceived
    | WelcomeReceived
    | StreamBound
    | SchemaBound
    | BatchReceived
    | BatchDropped
    | TailReceived
    | GuaranteesReceived
    | MessagesDropped
    | Absolved
    | AckReceived
    | HandleDeleted
    | MessageReceived
)


def _identity_cost(payload_length: int) -> int:
    return payload_length


#: Keepalive Pings count their nonces from here, apart from the small nonces an
#: adapter uses for Pings of its own (the release client's probes).
KEEPALIVE_NONCE_BASE = 1 << 63

# A buffered inbound data message is remembered by its handle only: the
# records themselves belong to the receive buffer and to the log, not here.
_Inbound = int
_Binding = str | m.BindSchema


#: The global messages that are inputs of the lifecycle table; every other
#: message is an ordinary frame (Input.FRAME).
_LIFECYCLE_INPUTS: dict[type, Input] = {
    m.Hello: Input.HELLO,
    m.Welcome: Input.WELCOME,
    m.Goodbye: Input.GOODBYE,
    m.Error: Input.ERROR,
    m.FreeHandle: Input.FREE_HANDLE,
}


def _check_opener(message: m.Hello | m.Welcome) -> None:
    """Refuse an opener this end cannot accept (before the session opens with it)."""
    if message.version != m.PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {message.version} is not supported "
            f"(this end speaks {m.PROTOCOL_VERSION})",
            code=ErrorCode.BAD_HELLO,
        )
    if isinstance(message, m.Hello) and message.producer_id >= m.PRODUCER_ID_LIMIT:
        # Spark reads producer ids as a signed long.
        raise ProtocolError(
            f"producer id {message.producer_id} must be below 2**63",
            code=ErrorCode.BAD_HELLO,
        )


class Session:
    """The protocol state of one end of one connection.

    Args:
        role: which end this is.
        max_message_size: the largest frame payload accepted from the peer.
        data_cost: what a data channel message of a given payload length costs
            in guarantees. Both ends must use the same function; headgate
            charges a batch the log space it will take (``headgate.costs``).
        optimistic: resend dropped messages optimistically rather than
            waiting for guarantees (the producer's ``optimistic`` policy).
        now: when the connection started (seconds, any monotonic origin):
            the clocks of :attr:`lifecycle` start there.
        handshake_timeout: seconds the peer's opener may take (0: no limit).
        deadlines: the gateway's receive deadlines (its idle rule); None for
            a client, which keeps alive by the idle timeout of the Welcome.
    """

    def __init__(
        self,
        role: Role,
        *,
        max_message_size: int = 1 << 20,
        data_cost: Callable[[int], int] = _identity_cost,
        optimistic: bool = False,
        now: float = 0.0,
        handshake_timeout: float = 0.0,
        deadlines: ReceiveDeadlines | None = None,
    ) -> None:
        self.role = role
        self._decoder = FrameDecoder(max_payload=max_message_size)
        self._data_cost = data_cost
        self._optimistic = optimistic
        self._out = bytearray()
        #: The connection's state and clocks: the one home of the opening,
        #: ending and keepalive rules (:mod:`headgate.protocol.lifecycle`).
        self.lifecycle = Lifecycle(
            Input.HELLO if role is Role.GATEWAY else Input.WELCOME,
            now=now,
            handshake_timeout=handshake_timeout,
            deadlines=deadlines,
        )
        # When the bytes being decoded arrived (receive_data's ``now``).
        self._now = now
        self._keepalive_nonce = KEEPALIVE_NONCE_BASE
        # The nonces of the peer's Pings not answered yet (see data_to_send).
        self._pongs_owed: list[int] = []
        # We send nothing more: fail() was called, or the gateway refused us.
        self._closed = False
        #: The peer's message that ended the session (its Goodbye, or its
        #: Error about the whole session: the lifecycle's rule), or None.
        #: It also arrives as a :class:`MessageReceived`, the last one.
        self.ending: m.Goodbye | m.Error | None = None
        # Receiving side (we are the LCMUX server).
        self._bind_in: ServerChannel[_Binding] = ServerChannel(m.STREAM_CHANNEL)
        self._schema_in: ServerChannel[_Binding] = ServerChannel(m.SCHEMA_CHANNEL)
        # Only the end that bound a handle proposes its free (PROTOCOL.md,
        # "Channels and handles"): a peer cannot take our handles away.
        self.streams: HandleSpace[_Binding] = HandleSpace(
            m.HandleType.STREAM, bind_channel=self._bind_in, free_rule=FreeRule.CREATOR
        )
        self.schemas: HandleSpace[_Binding] = HandleSpace(
            m.HandleType.SCHEMA, bind_channel=self._schema_in, free_rule=FreeRule.CREATOR
        )
        self._inbound: dict[int, ServerChannel[_Inbound]] = {}
        # Sending side (we are the LCMUX client).
        self._outbound: dict[int, ClientChannel[bytes]] = {
            m.STREAM_CHANNEL: ClientChannel(m.STREAM_CHANNEL),
            m.SCHEMA_CHANNEL: ClientChannel(m.SCHEMA_CHANNEL),
        }
        self._resend: dict[int, deque[bytes]] = {}
        # Handles of the peer's below these numbers have been announced.
        self._announced_streams = 0
        self._announced_schemas = 0
        # Events of the receive_data call in progress.
        self._events: list[Event] = []
        # With receive_in_place: the end offset of the frame being dispatched.
        self._frame_end = 0
        #: Frames received that carry no channel message (SendGlobal and the
        #: control frames): what a peer can make us do without any credit.
        self.control_received = 0
        #: Complete frames received, of every kind: what counts as activity
        #: for the receive deadlines (:mod:`headgate.protocol.deadlines`), and
        #: what the gateway charges for (all but batches within guarantees,
        #: empty frames included).
        self.frames_received = 0

    # -- plumbing -------------------------------------------------------------

    def data_to_send(self) -> bytes:
        """Everything queued for the peer since the last call.

        The peer's Pings are answered here, after what the adapter did with
        the frames decoded with them: a Pong never goes out ahead of the
        Welcome, and it tells the peer that what it sent before the Ping
        was acted on. After our ending (the lifecycle's ``said_last``) they
        are not answered: the Ping came after the frame we refused.
        """
        if self._pongs_owed:
            for nonce in self._pongs_owed:
                self._emit(SendGlobal(payload=m.encode_message(m.Pong(nonce=nonce))))
            self._pongs_owed.clear()
        if not self._out:
            return b""
        data = bytes(self._out)
        self._out.clear()
        return data

    @property
    def pending_output(self) -> int:
        """Bytes queued for the peer and not yet taken by :meth:`data_to_send`.

        The Pongs owed count too (they are written when the output is taken).
        """
        if self._pongs_owed and not self.lifecycle.said_last:
            return len(self._out) + sum(
                len(encode_frame(SendGlobal(payload=m.encode_message(m.Pong(nonce=nonce)))))
                for nonce in self._pongs_owed
            )
        return len(self._out)

    @property
    def receive_buffered(self) -> int:
        """Received bytes held for a frame that has not fully arrived (at most one frame)."""
        return self._decoder.buffered

    @property
    def opened(self) -> bool:
        """Whether the peer's opening message (Hello or Welcome) has arrived."""
        return self.lifecycle.opened

    @property
    def closed(self) -> bool:
        """Whether the session ended: :meth:`fail` was called, the peer's
        Goodbye or unscoped Error arrived (before or after the session
        opened), a timer ran out (:meth:`handle_timer`), or we said Goodbye
        before the session opened (the lifecycle's CLOSED state).

        Either way nothing more is decoded: bytes the peer sent after its
        Goodbye are moot. After the peer's Goodbye (or Error) this end may
        still send what it owes for the frames that came before it (a
        Welcome, the answer to a request, an Error), until the adapter
        closes the connection; after :meth:`fail`, or our Goodbye, it sends
        nothing more (the lifecycle's ``said_last``).
        """
        return self._closed or self.lifecycle.ended

    def _emit(self, frame: Frame) -> None:
        if self.lifecycle.said_last:
            return  # our Goodbye or Error was the last frame (the lifecycle's rule)
        encode_frame_into(frame, self._out)

    def send_global(self, message: m.GlobalMessage) -> None:
        """Queue a control message; it needs no guarantees and is never buffered.

        A Goodbye moves the lifecycle to CLOSING (or, before the session
        opened, CLOSED).
        """
        if self._closed:
            raise RuntimeError("the session is closed")
        self._emit(SendGlobal(payload=m.encode_message(message)))
        if type(message) is m.Goodbye:
            self.lifecycle.receive(Input.SAY_GOODBYE)

    # -- timers ---------------------------------------------------------------

    def get_timer(self) -> float | None:
        """When :meth:`handle_timer` should next be called, or None (see the lifecycle)."""
        return self.lifecycle.get_timer()

    def handle_timer(self, now: float) -> ProtocolError | None:
        """Run the connection's clocks at ``now``: queue a keepalive Ping when due.

        Returns the ``TIMEOUT`` error when a clock ended the connection (no
        opener in time, idle): the session is then closed; the gateway sends
        the error to its peer (:meth:`fail`), a client just closes.
        """
        action = self.lifecycle.handle_timer(now)
        if action is TimerAction.PING and not self._closed:
            self._keepalive_nonce = (self._keepalive_nonce + 1) & U64_MAX
            self._emit(SendGlobal(payload=m.encode_message(m.Ping(nonce=self._keepalive_nonce))))
        elif action is TimerAction.EXPIRE:
            return self.lifecycle.expired
        return None

    def fail(self, error: ProtocolError) -> bytes:
        """Queue the Error that ``error`` owes the peer; return all pending output.

        After this the session accepts nothing more; the caller closes the
        connection once the bytes are written.
        """
        if not self._closed:
            text = str(error.args[0]) if error.args else ""
            # The text is for people; cut it to what the message allows.
            text = text.encode()[: m.MAX_TEXT_BYTES].decode("utf-8", "ignore")
            self._emit(SendGlobal(payload=m.encode_message(m.Error(code=error.code, text=text))))
            self._closed = True
            self.lifecycle.receive(Input.FAIL)
        return self.data_to_send()

    # -- receiving ------------------------------------------------------------

    def receive_data(
        self, data: bytes | bytearray | memoryview, now: float | None = None
    ) -> list[Event]:
        """Feed bytes from the peer; return what happened, in order.

        Args:
            now: when the bytes arrived: a sign of life for the client's
                clocks (:meth:`handle_timer`). The gateway, whose idle rule
                counts frames, not bytes, keeps its own receive deadlines.

        Raises:
            ProtocolError: the peer broke the protocol; ``code`` says how.
        """
        if self._closed:
            raise RuntimeError("the session is closed")
        events: list[Event] = []
        lifecycle = self.lifecycle
        if lifecycle.ended:
            return events  # after the peer's Goodbye: moot
        if now is not None:
            lifecycle.heard(now)
            self._now = now
        self._events = events
        for frame in self._decoder.feed(data):
            if self._closed or lifecycle.ended:
                break  # a refusal in place of Welcome, or a Goodbye: the rest is moot
            self._dispatch(frame, events)
        self._bind_pending(events)
        return events

    def receive_in_place(
        self, view: memoryview, now: float | None = None
    ) -> tuple[list[Event], int, int]:
        """Decode the complete frames at the start of ``view`` without copying them.

        The zero-copy form of :meth:`receive_data`, for a caller that reads
        into a buffer of its own: a :class:`BatchReceived` carries its records
        as a slice of ``view`` and the offset where its frame ends, so the
        caller must keep those bytes unchanged until it is done with the
        event. An incomplete frame at the end of ``view`` is not consumed.

        Returns ``(events, consumed, need)``: ``consumed`` bytes of ``view``
        were whole frames; the frame that starts there needs ``need`` bytes
        in all before offering it again can make progress (0 if none started).
        Do not mix with :meth:`receive_data` inside a frame. ``now``: when
        the bytes arrived (the gateway's latest read), as for :meth:`receive_data`.

        Raises:
            ProtocolError: the peer broke the protocol; ``code`` says how.
        """
        if self._closed:
            raise RuntimeError("the session is closed")
        events: list[Event] = []
        if self.lifecycle.ended:
            return events, len(view), 0  # after the peer's Goodbye: moot
        if now is not None:
            self._now = now
        self._events = events
        frames, ends, consumed, need = self._decoder.decode_in_place(view)
        try:
            for frame, end in zip(frames, ends, strict=True):
                if self.lifecycle.ended:
                    break  # the peer's Goodbye or Error came first; the rest is moot
                self._frame_end = end
                self._dispatch(frame, events)
        finally:
            self._frame_end = 0
        self._bind_pending(events)
        return events, consumed, need

    def _dispatch(self, frame: Frame, events: list[Event]) -> None:
        self.frames_received += 1
        if type(frame) is not SendChannel:
            self.control_received += 1
        if not self.lifecycle.opened and not isinstance(frame, SendGlobal):
            # (Once open, the table takes every frame until the end: only a
            # session not yet open needs asking, which keeps batches cheap.)
            self.lifecycle.receive(Input.FRAME, name=type(frame).__name__)
        match frame:
            case SendChannel(channel=channel, payload=payload):
                self._on_channel_message(channel, payload, events)
            case SendGlobal(payload=payload):
                self._on_global(m.decode_global(payload), events)
            case Absolve(channel=channel, amount=amount):
                state = self._peer_frame_inbound(channel, Absolve)
                if state is not None:
                    state.on_absolve(amount)
                    events.append(
                        Absolved(
                            channel=channel, handle=m.handle_of_channel(channel), amount=amount
                        )
                    )
            case Apologise(channel=channel):
                state = self._peer_frame_inbound(channel, Apologise)
                if state is not None:
                    state.on_apologise()
            case LimitSending(channel=channel, bound=bound):
                state = self._peer_frame_inbound(channel, LimitSending)
                if state is not None:
                    state.on_limit_sending(bound)
            case IssueGuarantees(channel=channel, amount=amount):
                self._on_guarantees(channel, amount, events)
            case Plead(channel=channel, target=target):
                out = self._outbound_channel(channel, Plead)
                if out is not None:
                    absolve = out.on_plead(target)
                    if absolve is not None:
                        self._emit(absolve)
            case LimitReceiving(channel=channel, bound=bound):
                out = self._outbound_channel(channel, LimitReceiving)
                if out is not None:
                    out.on_limit_receiving(bound)
            case AnnounceDropping(channel=channel):
                self._on_announce_dropping(channel, events)

    def _peer_frame_inbound(
        self, channel: int, kind: type
    ) -> ServerChannel[_Binding] | ServerChannel[_Inbound] | None:
        """The channel a peer's frame (as its client) is about; None: ignore the frame.

        What a frame about a stream handle's channel may do is the handle
        table's rule (:meth:`HandleTable.on_channel_frame`): None when it
        crossed our FreeHandle, HANDLE_FREED when the peer had freed it.
        """
        handle = m.handle_of_channel(channel)
        if handle is None:
            return self._inbound_channel(channel, kind)
        if handle >= self._announced_streams:
            # A frame about a stream whose bind may still wait in the buffer.
            self._bind_pending(self._events)
        verdict = self.streams.theirs.on_channel_frame(handle)
        if verdict is FrameUse.IGNORE:
            return None
        return self._inbound_channel(channel, kind)

    def _freed_inbound(self, channel: int) -> bool:
        """Whether we sent a FreeHandle for the handle of the peer's ``channel`` (so: silence)."""
        handle = m.handle_of_channel(channel)
        theirs = self.streams.theirs
        return handle is not None and handle < theirs.next_handle and not theirs.may_refer(handle)

    def _inbound_channel(
        self, channel: int, kind: type
    ) -> ServerChannel[_Binding] | ServerChannel[_Inbound]:
        if channel == m.STREAM_CHANNEL:
            return self._bind_in
        if channel == m.SCHEMA_CHANNEL:
            return self._schema_in
        state = self._inbound.get(channel)
        handle = m.handle_of_channel(channel)
        if state is None and handle is not None and handle >= self._announced_streams:
            # A frame about a stream whose bind may still wait in the buffer.
            self._bind_pending(self._events)
            state = self._inbound.get(channel)
        if state is None:
            raise FlowControlError(
                f"{kind.__name__} on channel {channel}, which carries no stream of yours",
                code=ErrorCode.UNEXPECTED_FRAME,
            )
        return state

    def _outbound_channel(self, channel: int, kind: type) -> ClientChannel[bytes] | None:
        """The channel of ours a peer's frame (as our server) is about; None: ignore it.

        As for :meth:`_peer_frame_inbound`, the handle table rules: a frame
        that crossed our FreeHandle is ignored (and so not answered: no
        Absolve for a crossing Plead), one after the peer's is HANDLE_FREED.
        """
        handle = m.handle_of_channel(channel)
        verdict = None if handle is None else self.streams.ours.on_channel_frame(handle)
        if verdict is FrameUse.IGNORE:
            return None
        state = self._outbound.get(channel)
        if state is not None:
            return state
        raise FlowControlError(
            f"{kind.__name__} for channel {channel}, on which we never sent",
            code=ErrorCode.UNEXPECTED_FRAME,
        )

    def _on_channel_message(
        self, channel: int, payload: bytes | bytearray | memoryview, events: list[Event]
    ) -> None:
        if channel == m.STREAM_CHANNEL:
            bind = m.decode_bind_stream(payload)
            self._receive_bind(self._bind_in, bind.stream, len(payload), events)
            return
        if channel == m.SCHEMA_CHANNEL:
            schema = m.decode_bind_schema(payload)
            self._receive_bind(self._schema_in, schema, len(payload), events)
            return
        handle = m.handle_of_channel(channel)
        assert handle is not None  # channels 0 and 1 were handled above
        reference = self.streams.theirs.on_reference(handle)
        if isinstance(reference, UnboundReference):
            # Its bind was dropped and announced; the peer will resend both.
            return
        state = self._inbound.get(channel)
        if state is None:
            self._bind_pending(events)
            state = self._inbound[channel]
        size = self._data_cost(len(payload))
        try:
            if self.role is Role.GATEWAY:
                first, count, records = m.decode_batch(payload)
                validate_records(records)
            else:
                tail_header, count, records = m.decode_tail_records(payload)
                validate_records(records)
            outcome = state.receive(handle, size)
        except BaseException:
            self.streams.theirs.release(handle)
            raise
        stream = reference.value
        assert isinstance(stream, str)
        if isinstance(outcome, MessageDropped):
            self.streams.theirs.release(handle)
            for frame in outcome.frames:
                self._emit(frame)
            events.append(BatchDropped(handle=handle, size=size))
            return
        if self.role is Role.GATEWAY:
            events.append(
                _batch_received(handle, stream, first, count, records, size, self._frame_end)
            )
        else:
            events.append(
                TailReceived(
                    handle=handle,
                    stream=stream,
                    header=tail_header,
                    record_count=count,
                    records=records,
                    size=size,
                )
            )

    def _receive_bind(
        self, channel: ServerChannel[_Binding], value: _Binding, size: int, events: list[Event]
    ) -> None:
        outcome = channel.receive(value, size)
        if isinstance(outcome, MessageDropped):
            for frame in outcome.frames:
                self._emit(frame)

    def _bind_pending(self, events: list[Event]) -> None:
        # Bind messages wait in their channel's buffer until a reference needs
        # them (the handle table binds them then) or the received chunk ends;
        # either way they bind in order. Announce whatever became bound.
        theirs = self.streams.theirs
        theirs.bind_pending()
        for handle in range(self._announced_streams, theirs.next_handle):
            if handle in theirs:
                stream = theirs.dereference(handle)
                assert isinstance(stream, str)
                self._inbound[m.data_channel(handle)] = ServerChannel(m.data_channel(handle))
                events.append(StreamBound(handle=handle, stream=stream))
        self._announced_streams = theirs.next_handle
        schemas = self.schemas.theirs
        schemas.bind_pending()
        for handle in range(self._announced_schemas, schemas.next_handle):
            if handle in schemas:
                schema = schemas.dereference(handle)
                assert isinstance(schema, m.BindSchema)
                events.append(SchemaBound(handle=handle, schema=schema))
        self._announced_schemas = schemas.next_handle

    def _on_global(self, message: m.GlobalMessage, events: list[Event]) -> None:
        kind = type(message)
        input_ = _LIFECYCLE_INPUTS.get(kind, Input.FRAME)
        if isinstance(message, m.Error) and message.scope is not None:
            input_ = Input.FRAME  # about one handle: the session goes on
        lifecycle = self.lifecycle
        if isinstance(message, m.Hello | m.Welcome) and lifecycle.would_open(input_):
            _check_opener(message)
        answer = lifecycle.receive(input_, name=kind.__name__)
        if answer is not Answer.HANDLE:
            if answer is Answer.OPEN:
                if isinstance(message, m.Hello):
                    events.append(HelloReceived(hello=message))
                else:
                    assert isinstance(message, m.Welcome)
                    lifecycle.welcomed(message.idle_timeout_ms, self._now)
                    events.append(WelcomeReceived(welcome=message))
            elif answer is Answer.REFUSED or answer is Answer.END:
                # REFUSED: the gateway refused the session instead of
                # welcoming it; we send nothing more. END: the peer ends the
                # session and sends nothing after it: what follows in the same
                # read is moot (and no Ping in it is answered).
                assert isinstance(message, m.Goodbye | m.Error)
                self._closed = self._closed or answer is Answer.REFUSED
                self.ending = message
                events.append(MessageReceived(message=message))
            return
        match message:
            case m.FreeHandle():
                self._on_free_handle(message, events)
            case m.Ping(nonce=nonce):
                refusal = self.lifecycle.pinged(self._now, self.frames_received)
                if refusal is not None:
                    raise refusal
                self._pongs_owed.append(nonce)  # answered by data_to_send
            case m.Ack():
                events.append(AckReceived(ack=message))
            case _:
                events.append(MessageReceived(message=message))

    def _on_free_handle(self, message: m.FreeHandle, events: list[Event]) -> None:
        space = self.streams if message.handle_type is m.HandleType.STREAM else self.schemas
        outcome = space.on_free_handle(message)
        if isinstance(outcome, UnboundReference):
            return
        inbound = self._inbound.get(m.data_channel(message.handle))
        if message.handle_type is m.HandleType.STREAM and message.mine and inbound is not None:
            # The peer freed the handle it sends on: it will never send on its
            # channel again (as if LimitSending(0)), so what guarantees it held
            # there are given up, and no Plead of ours is left unanswered.
            inbound.close_sending()
        if outcome.reply is not None:
            self.send_global(outcome.reply)
        if outcome.deleted:
            self._deleted(message.handle_type, message.handle, ours=not message.mine, events=events)

    def _deleted(
        self, handle_type: m.HandleType, handle: int, *, ours: bool, events: list[Event]
    ) -> None:
        if handle_type is m.HandleType.STREAM:
            if ours:
                self._outbound.pop(m.data_channel(handle), None)
                self._resend.pop(m.data_channel(handle), None)
            else:
                self._inbound.pop(m.data_channel(handle), None)
        events.append(HandleDeleted(handle_type=handle_type, handle=handle, ours=ours))

    def _on_guarantees(self, channel: int, amount: int, events: list[Event]) -> None:
        out = self._outbound_channel(channel, IssueGuarantees)
        if out is None:
            return
        for _ in out.on_issue_guarantees(amount):
            pass  # confirmed as buffered; nothing more to do with them
        self._flush_resend(channel)
        events.append(
            GuaranteesReceived(
                channel=channel,
                handle=m.handle_of_channel(channel),
                amount=amount,
                guarantees=out.guarantees,
            )
        )

    def _on_announce_dropping(self, channel: int, events: list[Event]) -> None:
        out = self._outbound_channel(channel, AnnounceDropping)
        if out is None:
            return
        dropped, apology = out.on_announce_dropping()
        self._emit(apology)
        if channel == m.STREAM_CHANNEL or channel == m.SCHEMA_CHANNEL:
            # Binds are only ever sent within guarantees (see bind_stream), so
            # a correct gateway never drops one.
            raise FlowControlError(
                f"the peer dropped a bind on channel {channel} that guarantees covered",
                code=ErrorCode.UNEXPECTED_FRAME,
            )
        queue = self._resend.setdefault(channel, deque())
        # Dropped messages go first, before anything still waiting, in order.
        queue.extendleft(reversed(dropped))
        events.append(
            MessagesDropped(
                channel=channel,
                handle=m.handle_of_channel(channel),
                count=len(dropped),
                size=sum(self._data_cost(len(p)) for p in dropped),
            )
        )
        self._flush_resend(channel)

    def _flush_resend(self, channel: int) -> None:
        queue = self._resend.get(channel)
        out = self._outbound.get(channel)
        while queue and out is not None:
            payload = queue[0]
            size = self._data_cost(len(payload))
            if not out.fits_bounds(size):
                return  # the peer's LimitReceiving leaves it no room: it waits, unsent
            if not out.can_send(size) and not self._optimistic:
                return
            queue.popleft()
            out.send(payload, size, optimistic=self._optimistic)
            self._emit(SendChannel(channel=channel, payload=payload))

    # -- receiving side controls (we are the LCMUX server) ---------------------

    def inbound(self, channel: int) -> ServerChannel[_Binding] | ServerChannel[_Inbound]:
        """The state of a channel we receive on (for decisions and metrics)."""
        return self._inbound_channel(channel, IssueGuarantees)

    def grant(self, channel: int, amount: int) -> None:
        """Grow a receiving channel's buffer by ``amount`` and issue all issuable.

        Nothing happens on the channel of a handle we sent a FreeHandle for
        (as for :meth:`issue` and :meth:`plead`): we never refer to it again.
        """
        if self._freed_inbound(channel):
            return
        state = self._inbound_channel(channel, IssueGuarantees)
        state.grow(amount)
        self.issue(channel)

    def issue(self, channel: int, amount: int | None = None) -> int:
        """Issue guarantees on a receiving channel (all issuable by default)."""
        if self._freed_inbound(channel):
            return 0
        frame = self._inbound_channel(channel, IssueGuarantees).issue(amount)
        if frame is None:
            return 0
        self._emit(frame)
        return frame.amount

    def plead(self, channel: int, target: int) -> None:
        """Ask the peer to absolve guarantees on a channel down to ``target``."""
        if self._freed_inbound(channel):
            return
        self._emit(self._inbound_channel(channel, Plead).plead(target))

    def process(
        self, handle: int, *, reissue: bool = True, count: int = 1, size: int | None = None
    ) -> int:
        """The oldest buffered batch of the peer's stream ``handle`` is done.

        Its space becomes issuable again (or, without ``reissue``, the buffer
        shrinks by as much); its reference to the handle is released. Returns
        the batch's size. With ``count``, that many of the oldest batches are
        done at once, ``size`` bytes in all (see :meth:`ServerChannel.process`;
        a channel that coalesces needs the size of part of a run).
        """
        state = self._inbound.get(m.data_channel(handle))
        if state is None:
            raise ValueError(f"stream handle {handle} has no channel")
        buffered_handle, size = state.process(reissue=reissue, count=count, size=size)
        released = self.streams.theirs.release(buffered_handle, count)
        if released.deleted:
            self._inbound.pop(m.data_channel(handle), None)
        return size

    # -- sending side (we are the LCMUX client) --------------------------------

    def outbound(self, channel: int) -> ClientChannel[bytes]:
        """The state of a channel we send on."""
        state = self._outbound.get(channel)
        if state is None:
            raise ValueError(f"we do not send on channel {channel}")
        return state

    def bind_stream(self, stream: str) -> int | None:
        """Bind our next stream handle to ``stream``; None if guarantees lack.

        Binds go out only within guarantees, so a handle we use is certain to
        be bound by the peer and needs no optimistic bookkeeping (the gateway
        grants bind guarantees as soon as the session opens). Wait for
        :class:`GuaranteesReceived` on channel 0 and try again.
        """
        payload = m.encode_message(m.BindStream(stream=stream))
        out = self._outbound[m.STREAM_CHANNEL]
        if not out.can_send(len(payload)):
            return None
        out.send(payload, len(payload))
        handle = self.streams.ours.bind(stream, size=len(payload))
        self._outbound[m.data_channel(handle)] = ClientChannel(m.data_channel(handle))
        self._emit(SendChannel(channel=m.STREAM_CHANNEL, payload=payload))
        return handle

    def free_stream(self, handle: int) -> None:
        """Propose to free one of our stream handles; we never use it again.

        Raises:
            ValueError: messages on its channel are still in doubt or waiting
                to be resent; they would be lost.
        """
        channel = m.data_channel(handle)
        out = self._outbound.get(channel)
        if out is not None and (out.in_doubt or self._resend.get(channel)):
            raise ValueError(f"stream handle {handle} still has messages in doubt")
        self.send_global(self.streams.ours.free(handle))

    def absolve(self, handle: int, amount: int) -> None:
        """Give up ``amount`` guarantees on our stream ``handle`` without being pleaded.

        Raises:
            ValueError: more than the guarantees held, or we proposed to free
                the handle (and so never refer to it again).
        """
        self.streams.ours.use(handle)
        self._emit(self._outbound[m.data_channel(handle)].absolve(amount))

    def batch_cost(self, records_length: int) -> int:
        """What a batch with a records block of this length costs in guarantees."""
        return self._data_cost(m.BATCH_HEADER_SIZE + records_length)

    def can_send_batch(self, handle: int, records_length: int) -> bool:
        """Whether a batch of that size fits our guarantees and nothing waits before it."""
        channel = m.data_channel(handle)
        if self._resend.get(channel):
            return False
        return self._outbound[channel].can_send(self.batch_cost(records_length))

    def send_batch(
        self,
        handle: int,
        first_sequence: int,
        records: bytes | bytearray | memoryview,
        *,
        optimistic: bool = False,
    ) -> bool:
        """Send a batch on our stream ``handle``; False if guarantees lack.

        With ``optimistic`` the batch goes out even beyond our guarantees; if
        the peer drops it, the session resends it transparently.
        """
        self.streams.ours.use(handle)
        channel = m.data_channel(handle)
        out = self._outbound[channel]
        payload = m.encode_batch_header(first_sequence) + bytes(records)
        size = self._data_cost(len(payload))
        queue = self._resend.get(channel)
        if queue or not out.can_send(size):
            if not optimistic:
                return False
            if queue:
                # Order per channel: anything waiting to be resent goes first.
                queue.append(payload)
                self._flush_resend(channel)
                return True
        out.send(payload, size, optimistic=optimistic)
        self._emit(SendChannel(channel=channel, payload=payload))
        return True

    def tail_cost(self, records_length: int) -> int:
        """What TailRecords with a records block of this length costs in guarantees."""
        return self._data_cost(m.TAIL_HEADER_SIZE + records_length)

    def send_tail(
        self,
        handle: int,
        header: m.TailHeader,
        records: bytes | bytearray | memoryview,
    ) -> bool:
        """Send a stored batch to a reader on our stream ``handle`` (gateway side).

        Only within the reader's guarantees: what does not fit is the caller's
        to decide (a fetch waits for guarantees, a live tail skips it), never
        queued here.
        """
        self.streams.ours.use(handle)
        channel = m.data_channel(handle)
        out = self._outbound[channel]
        size = self._data_cost(m.TAIL_HEADER_SIZE + len(records))
        if not out.can_send(size):
            return False
        payload = m.encode_tail_header(header) + bytes(records)
        out.send(payload, size)
        self._emit(SendChannel(channel=channel, payload=payload))
        return True

    def in_doubt(self, handle: int) -> int:
        """How many of our messages on stream ``handle`` may still be dropped."""
        channel = m.data_channel(handle)
        waiting = len(self._resend.get(channel, ()))
        return len(self._outbound[channel].in_doubt) + waiting
