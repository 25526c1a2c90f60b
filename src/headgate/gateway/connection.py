"""The connection adapter: one peer's socket driving one sans-IO session.

Each connection is a :class:`GatewayConnection` driving one sans-IO
:class:`~headgate.protocol.session.Session`. It lives apart from the
:class:`~headgate.gateway.server.Gateway` that accepts it because it is the
one place where bytes meet the protocol core: what it asks of the gateway
(streams, credit, consumers, the log writer's queue) is
:class:`ConnectionHost`, and nothing here knows how the gateway does it.

The receive path follows seed freeradius-message-api.txt
(:mod:`headgate.gateway.ring`). A connection is an ``asyncio.BufferedProtocol``
that reads straight into its preallocated :class:`~headgate.gateway.ring.ReceiveRing`
and decodes the frames where they landed (``Session.receive_in_place``).
Each batch becomes a message header from the ring's slab, pointing at the
batch's bytes, and goes into the gateway's :class:`~headgate.gateway.ring.MessageQueue`;
the first message into an empty queue schedules the log writer
(``LogWriter.write_messages``) with ``call_soon``. The writer copies each batch
once, from the ring into the log's mmap (however many batches one read
brought), and marks it handled; the connection, told once per writer pass,
reclaims the ring space behind the oldest message still unhandled. Control
messages are acted on at once, after the batches that preceded them are
written, so their order is kept. :meth:`GatewayConnection.feed` is the seam
for tests: bytes in as if read from the socket.

Every connection has an :class:`~headgate.gateway.accounts.Account` (seed
broker-internal-flow-control.txt): a batch borrows one unit while it waits
in the ring for the writer, and one while it waits for the disk. Above its
threshold (``max_connection_debt``) the connection stops reading its socket;
so does it while its ring is full at its limit, or while the peer does not
read what the gateway sends. It reads again when no reason holds.

What a peer may do once in is checked here as its frames arrive, with the
pieces in their own modules: tokens and rights (``auth``: a Hello is
authenticated, a bind is checked against the token's write patterns and
stream quota, a Release against its admin right), turns and slices of
received bytes (``turns``), and what each request costs and the per-token
budgets that pay for it (``budget``). Timeouts and the cap on bytes queued
for a peer that does not read are per connection, from ``GatewayConfig``.
Which of them applies when (the handshake before Hello, then the idle and
frame deadlines of :class:`~headgate.protocol.deadlines.ReceiveDeadlines`)
is the session's lifecycle's rule (:mod:`headgate.protocol.lifecycle`); the
handshake has a timer of its own, and the gateway's housekeeping loop
checks the others (:meth:`GatewayConnection.check_deadlines`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from typing import Protocol

from headgate.config import GatewayConfig
from headgate.costs import batch_cost
from headgate.gateway.accounts import Account, DurabilityLoans, Loan, ReadPauses
from headgate.gateway.admission import Admission
from headgate.gateway.auth import Rights
from headgate.gateway.budget import (
    Cost,
    LogLimiter,
    PeerShare,
    address_key,
)
from headgate.gateway.fleet import FleetMembership
from headgate.gateway.identity import ProducerOwners, hello_owner
from headgate.gateway.policies import Flow
from headgate.gateway.readers import ReaderConnection, TailHub
from headgate.gateway.recovery import StreamRecovery
from headgate.gateway.ring import MessageQueue, ReceiveRing
from headgate.gateway.statistics import ConnectionStatistics, StreamCounters
from headgate.gateway.streams import Stream, Writer
from headgate.gateway.turns import MIN_SLICE, Passes, TurnTaker
from headgate.log import LogError
from headgate.protocol import messages as m
from headgate.protocol.deadlines import ReceiveDeadlines
from headgate.protocol.errors import ErrorCode, ProtocolError
from headgate.protocol.session import (
    Absolved,
    BatchDropped,
    BatchReceived,
    Event,
    GuaranteesReceived,
    HandleDeleted,
    HelloReceived,
    MessageReceived,
    Role,
    Session,
    StreamBound,
)

log = logging.getLogger("headgate.gateway")

#: How long a closing connection may take to deliver its last bytes before
#: it is aborted (a peer that does not read would otherwise hold it forever).
CLOSE_GRACE_S = 2.0
#: How long the gateway must have been reading a connection before a Plead
#: deadline can end it: an Absolve still unread in the socket is not late.
PLEAD_READ_GRACE_S = 0.5
#: What the gateway's handling of each event costs, beyond its frame's
#: (readers.py charges the reader requests, with what they serve).
EVENT_COSTS: dict[type, float] = {
    StreamBound: Cost.BIND,
    HelloReceived: Cost.HELLO,
    Absolved: Cost.ABSOLVE,
}
#: The event loop's work for one read that the gateway cannot time (the
#: selector's report, the transport's call into the connection): charged to
#: the peer beside the read's own time (``GatewayConnection.charge_time``).
READ_SECONDS = 5e-6
#: Bytes of a connection's first receive ring.
RING_INITIAL = 128 * 1024
#: The least room a read is offered.
RING_MIN_READ = 16 * 1024
#: The largest ring a connection's reads alone may grow it to: while each read
#: fills the room it is offered and is handled in the turn that follows (data,
#: not a backlog), room for two turns' worth of bytes (``turns.TURN_BYTES``).
RING_READ_LIMIT = 4 * RING_INITIAL


#: TCP states (``tcpi_state`` of Linux's TCP_INFO) in which the peer has
#: closed its end: CLOSE (reset), CLOSE_WAIT (FIN received), LAST_ACK.
_TCP_PEER_CLOSED = frozenset({7, 8, 9})

#: Where a closing connection reads what its peer still sends, to drop it.
_DISCARD = memoryview(bytearray(RING_MIN_READ))


def _later(delay: float, call: Callable[[], None]) -> object:
    """Run ``call`` on the event loop after ``delay`` seconds (0: soon)."""
    loop = asyncio.get_running_loop()
    if delay > 0:
        return loop.call_later(delay, call)
    return loop.call_soon(call)


def ring_limit(max_message_size: int) -> int:
    """The largest receive ring: room for the largest frame twice, at least 4 MiB."""
    return max(4 << 20, 2 * (max_message_size + 64) + RING_MIN_READ)


class ConnectionHost(Protocol):
    """What a connection asks of the gateway that accepted it.

    The :class:`~headgate.gateway.server.Gateway` is the one host; this says
    which of its parts a connection touches, so that this module needs
    nothing from the one above it.
    """

    config: GatewayConfig
    #: The gateway's name, as its Welcome says it.
    name: str
    streams: dict[str, Stream]
    tails: TailHub
    recovery: StreamRecovery
    #: Every connection that holds a slot, by id.
    connections: dict[int, GatewayConnection]
    #: The ids of new connections.
    connection_ids: Iterator[int]
    #: The log writer's queue of received batches and its durability loans.
    queue: MessageQueue
    durability: DurabilityLoans
    passes: Passes
    refusals: LogLimiter
    ssl_context: ssl.SSLContext | None
    fleet: FleetMembership | None
    owners: ProducerOwners
    producer_connections: dict[int, GatewayConnection]
    created_by: dict[str, int]
    #: Who may come in: slots, TLS handshakes, tokens and their shares.
    admission: Admission[GatewayConnection]

    def detach(self, conn: GatewayConnection) -> None: ...
    def write_messages(self) -> None: ...
    def mark_dirty(self, stream: Stream) -> None: ...
    def drop_writers(self, conn: GatewayConnection) -> None: ...
    def stream(self, name: str) -> Stream: ...
    def stream_slot_refusal(self, name: str) -> ProtocolError | None: ...
    def flow(self, stream: Stream) -> Flow: ...
    def rebalance_soon(self, stream: Stream) -> None: ...
    def rebalance_marked(self) -> None: ...
    def counters(self, name: str) -> StreamCounters: ...
    def check_placement(self, name: str) -> None: ...
    def cluster_metadata(self, request_id: int) -> m.ClusterMetadata: ...
    def release(self, name: str, position: int, consumer: str = m.DEFAULT_CONSUMER) -> bool: ...
    def change_consumer(self, change: m.ResetConsumer | m.DeleteConsumer) -> int: ...
    def declare_consumer(self, declare: m.DeclareConsumer) -> tuple[int, bool]: ...
    def consumer_infos(self, name: str) -> tuple[m.ConsumerInfo, ...]: ...
    def records_scanned(self, name: str) -> int: ...
    def record_counts(
        self, name: str, positions: tuple[int, ...]
    ) -> tuple[int, tuple[int | None, ...]]: ...


class GatewayConnection(asyncio.BufferedProtocol):
    """One peer: a producer, a pipeline reporting releases, or a reader."""

    def __init__(self, gateway: ConnectionHost, conn_id: int, *, tls: bool = False) -> None:
        self.gateway = gateway
        self.conn_id = conn_id
        config = gateway.config
        started = time.monotonic()
        #: The idle and frame deadlines, checked by the gateway's loop.
        self.deadlines = ReceiveDeadlines(
            idle_timeout=config.idle_timeout_ms / 1000,
            frame_timeout=config.frame_timeout_ms / 1000,
            now=started,
        )
        # They and the handshake timeout are the clocks of the session's
        # lifecycle (headgate.protocol.lifecycle), which decides when each
        # applies; the gateway's loop (check_deadlines) and the handshake
        # timer run them.
        self.session = Session(
            Role.GATEWAY,
            max_message_size=config.max_message_size,
            data_cost=batch_cost,
            now=started,
            handshake_timeout=config.handshake_timeout_ms / 1000,
            deadlines=self.deadlines,
        )
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        #: The peer's host (IP address, or ``unix``): whose budget it pays from before Hello.
        self.host = "?"
        #: The budget this connection pays from (its address's, then its token's).
        self.share: PeerShare | None = None
        #: Whether it has bound a stream to write (it holds a writer slot).
        self.is_writer = False
        #: While it holds a slot kept for writers: closes it unless it binds in time.
        self._writer_deadline: asyncio.TimerHandle | None = None
        self._tls_counted = False
        #: Whether its last slice cost anything (a spender waits for a budget in
        #: debt). A new connection may be one more of a token in debt: it waits.
        self._spending = True
        self.producer_id = 0
        #: Who the peer is as an owner of producer ids (from its Hello).
        self.producer_owner = ""
        #: Whether this connection holds its producer id (claimed at its first bind).
        self.producer_claimed = False
        self.writers: dict[int, Writer] = {}
        self._handshake: asyncio.TimerHandle | None = None
        self._closing = False
        # Whether _leave gave back what the connection held.
        self._left = False
        self.ring = ReceiveRing(
            initial=RING_INITIAL,
            limit=ring_limit(gateway.config.max_message_size),
            min_read=RING_MIN_READ,
            read_limit=RING_READ_LIMIT,
        )
        #: Whether the last read filled the room it was offered and was all
        #: handled in the turn that followed: the next read is offered more.
        self._read_more = False
        self._offered = 0
        self.account = Account(
            f"connection {conn_id}", gateway.config.max_connection_debt, self._on_debt
        )
        self.account.turn_of = lambda: None if self.share is None else self.share.turn
        #: The debt of this connection's batches in the ring, a unit each
        #: (grown as they are decoded, repaid as the log writer handles them).
        self._ring_loan: Loan | None = None
        self.reads = ReadPauses(self._pause_transport, self._resume_transport)
        #: What the peer may do; None until its Hello is accepted.
        self.rights: Rights | None = None
        #: Stream handles of the peer's that were refused (nothing is stored for them).
        self.refused: dict[int, str] = {}
        #: Monotonic time (the event loop's clock) of the last bytes received:
        #: the frames they complete are dated by it (``deadlines``); bytes
        #: alone are no activity.
        self.last_received = 0.0
        #: When the read now under way began (``get_buffer``).
        self._read_started = 0.0
        self._tls_pending = tls
        self._tls_task: asyncio.Task[None] | None = None
        self._turns = TurnTaker(
            self._decode_slice,
            self._after_turn,
            lambda backlogged: self.reads.set("turn", backlogged),
            lambda: self._closing,
            gateway.passes,
            lambda: None if self.share is None else self.share.turn,
        )
        # Fetches and subscriptions, if the peer is a reader (readers.py).
        self.readers = ReaderConnection(
            self.session,
            gateway.streams,
            gateway.tails,
            flush=self.flush,
            backlog=self._write_backlog,
            later=_later,
            fail=lambda error: self.refuse(error),
            recovery=gateway.recovery,
            charge=self.charge,
            share=lambda: self.share,
            max_subscriptions=gateway.config.max_subscriptions,
            subscriptions_per_token=gateway.config.subscriptions_per_token,
        )

    # -- asyncio.BufferedProtocol ------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer or "unix")
        self.host = str(peer[0]) if isinstance(peer, tuple) else "unix"
        loop = asyncio.get_running_loop()
        self.last_received = loop.time()
        config = self.gateway.config
        gw = self.gateway
        handshake_due = self.session.get_timer()
        if handshake_due is not None:
            self._handshake = loop.call_later(
                max(0.0, handshake_due - time.monotonic()), self._handshake_expired
            )
        slot = gw.admission.attach(self)
        if slot is None:
            if self._tls_pending:
                gw.refusals.warning(time.monotonic(), "refused %s: too many connections", self.peer)
                self._closing = True
                transport.abort()
            else:
                self.refuse(
                    ProtocolError("too many connections", code=ErrorCode.RESOURCE_EXHAUSTED)
                )
            return
        self.share = gw.admission.shares.join(address_key(self.host), time.monotonic())
        if slot == "writer":
            self._writer_deadline = loop.call_later(
                config.handshake_timeout_ms / 1000, self._writer_slot_expired
            )
        if self._tls_pending:
            self._tls_counted = True
            gw.admission.tls_pending += 1
            context = self.gateway.ssl_context
            assert context is not None
            transport.pause_reading()
            self._tls_task = loop.create_task(self._start_tls(transport, context))

    async def _start_tls(self, raw: asyncio.Transport, context: ssl.SSLContext) -> None:
        loop = asyncio.get_running_loop()
        try:
            tls = await loop.start_tls(
                raw,
                self,
                context,
                server_side=True,
                ssl_handshake_timeout=self.gateway.config.handshake_timeout_ms / 1000,
            )
        except Exception as exc:  # ssl.SSLError, OSError, TimeoutError, a closed transport
            self._tls_finished()
            if not self._closing:
                log.warning("refused %s: TLS handshake failed: %s", self.peer, exc or "timeout")
            self._closing = True
            raw.abort()
            self.connection_lost(None)
            return
        self._tls_finished()
        if tls is None or self._closing:
            # Cut off meanwhile (the handshake timeout), and logged then.
            raw.abort()
            if tls is not None:
                tls.abort()
            return
        self._tls_pending = False
        self.transport = tls
        if self.reads.paused:
            tls.pause_reading()
        self.last_received = loop.time()
        self.charge(Cost.TLS_HANDSHAKE)
        # Bytes that came with the end of the handshake wait in the ring.
        self._turns.received()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._closing:
            return _DISCARD  # lingering (close_with): what comes now is dropped
        self._read_started = time.monotonic()
        room = self.ring.writable(grow=self._read_more)
        self._offered = len(room)
        return room

    def buffer_updated(self, nbytes: int) -> None:
        if self._closing:
            return
        self.ring.received(nbytes)
        # The read (the ring's room, the socket's copy, the loop's call) is
        # the peer's work too: a peer of many connections is read many
        # times a pass, which its turns alone would not charge.
        self.charge_time(self._read_started - READ_SECONDS)
        if self._tls_pending:
            # Decrypted bytes that came with the end of the TLS handshake,
            # before start_tls returned the transport to answer on: they wait
            # in the ring until then.
            return
        self.last_received = time.monotonic()
        if not self._closing:
            self._turns.received()
            # A read that filled its room and was handled at once (no backlog,
            # no turn put off, nothing charged to the budget): the peer sends
            # faster than one read a pass carries, and is served as fast.
            self._read_more = (
                nbytes == self._offered
                and not self._spending
                and not self._turns.waiting
                and not self.ring.undecoded
            )
        if not self._closing and not self.ring.can_read():
            # Full at its limit: read again once the writer has handled some.
            self.reads.set("ring", True)

    def pause_writing(self) -> None:
        # The peer does not read what we send: stop reading what it sends,
        # so that nothing it makes us produce can pile up here.
        self.reads.set("writing", True)

    def resume_writing(self) -> None:
        self.reads.set("writing", False)
        self.readers.resume()

    def throttle(self, reason: str, pause: bool) -> None:
        """Pause reading the peer for ``reason`` (an XOFF stream), or drop that reason."""
        self.reads.set(reason, pause)

    @property
    def reading_paused(self) -> bool:
        return self.reads.paused

    def pauses_own_reads(self, now: float) -> bool:
        """Whether the peer itself is why the gateway does not read it now.

        It does not read what the gateway sends ("writing"), or it spent its
        budget (held within the last ``PLEAD_READ_GRACE_S``). Such a pause
        does not stop its Plead deadline: otherwise a writer could keep its
        guarantees for ever by flooding Pings, or by not reading.
        """
        return "writing" in self.reads.reasons or now - self._turns.last_hold < PLEAD_READ_GRACE_S

    def _write_backlog(self) -> int:
        return 0 if self.transport is None else self.transport.get_write_buffer_size()

    def _tls_finished(self) -> None:
        """The TLS handshake ended (either way): it no longer counts as in progress."""
        if self._tls_counted:
            self._tls_counted = False
            self.gateway.admission.tls_pending -= 1

    def connection_lost(self, exc: Exception | None) -> None:
        self._tls_finished()
        if self._writer_deadline is not None:
            self._writer_deadline.cancel()
        # What arrived before the end is stored, as it arrived, before the
        # connection's writers leave their streams.
        self.gateway.write_messages()
        self._leave()
        self.gateway.detach(self)
        # Let go of the buffers now: the connection object may live on as
        # garbage in a reference cycle until the collector's next full pass,
        # and with it its receive ring and the transport's TLS buffers
        # (hundreds of KiB a connection: a flood of short connections piled
        # them up).
        self.ring.discard()
        self.transport = None

    def _leave(self) -> None:
        """Give back the connection's credit and subscriptions; once.

        At the end of the connection, or as soon as the gateway closes it
        (close_with), while its socket lingers for the peer to read the end.
        Its connection slot is given back only when the socket is gone, so
        lingering sockets stay bounded by ``max_connections``.
        """
        if self._left:
            return
        self._left = True
        if self._handshake is not None:
            self._handshake.cancel()
        self._turns.cancel()
        self.readers.close()
        self.gateway.drop_writers(self)
        if self.gateway.producer_connections.get(self.producer_id) is self:
            del self.gateway.producer_connections[self.producer_id]

    @property
    def buffered_bytes(self) -> int:
        """Bytes this connection holds in memory: its ring, and output not yet sent."""
        queued = 0
        if self.transport is not None and not self._tls_pending:
            queued = self.transport.get_write_buffer_size()
        return self.ring.statistics().in_use + self.session.pending_output + queued

    def _pause_transport(self) -> None:
        # A frame cannot progress while we do not read: its clock stops.
        self.deadlines.paused(time.monotonic(), True)
        if self.transport is not None and not self._tls_pending:
            self.transport.pause_reading()

    def _resume_transport(self) -> None:
        self.deadlines.paused(time.monotonic(), False)
        if self.transport is not None and not self._closing and not self._tls_pending:
            self.transport.resume_reading()

    def _note_decoded(self) -> None:
        """Tell the deadlines what a decoding turn left: complete frames, a partial one."""
        ring = self.ring
        # Bytes still undecoded are an incomplete frame, unless a later turn
        # is due for them (then reading is paused and no clock runs).
        partial = ring.undecoded > 0 and not self._turns.waiting
        # Frames count from when their bytes arrived, not from when a turn
        # got to them: a backlog decoded while reading is paused is no news.
        self.deadlines.decoded(
            self.last_received,
            frames=self.session.frames_received,
            partial=partial,
            need=ring.need,
        )

    def check_deadlines(self, now: float) -> None:
        """Close the connection with TIMEOUT if it is idle or a frame is overdue."""
        if self._closing or self._tls_pending or self.session.closed:
            return  # (the handshake timer covers TLS)
        if self.reads.paused and self.ring.undecoded and self._peer_gone():
            self._drop_gone_peer()
            return
        # Time the gateway did not read the peer for reasons of its own (the
        # turns of other peers, the disk, a full ring) is not the peer's silence.
        self.deadlines.excuse(now, self.reads.paused and not self.pauses_own_reads(now))
        expired = self.session.handle_timer(now)
        if expired is not None:
            self.refuse(expired)

    def _peer_gone(self) -> bool:
        """Whether the peer has closed its end (FIN or reset) of a TCP connection.

        While the gateway does not read a connection (its turns wait, its
        budget is spent), the end of the peer's bytes waits unread in the
        socket behind what it sent before; this asks the kernel instead. (A
        FIN itself arrives only once what precedes it fits the socket's
        window; a reset overtakes everything.)
        """
        transport = self.transport
        info = getattr(socket, "TCP_INFO", None)
        if transport is None or info is None:
            return False
        sock = transport.get_extra_info("socket")
        if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return False
        try:
            state = sock.getsockopt(socket.IPPROTO_TCP, info, 1)[0]
        except OSError:
            return True
        return state in _TCP_PEER_CLOSED

    def _drop_gone_peer(self) -> None:
        """The peer closed while its bytes waited to be decoded: drop them, end the connection.

        Nothing it sent is lost that was acknowledged: what was decoded is
        stored (as at any end of a connection), and the rest is let go
        undecoded, as if it had never arrived (a producer resends what was
        not acknowledged); no work is spent on a peer that is gone.
        """
        log.info("%s closed with %d bytes not yet decoded: dropped", self.peer, self.ring.undecoded)
        self.gateway.write_messages()
        self._closing = True
        self._leave()
        transport = self.transport
        if transport is not None:
            transport.abort()

    def _after_turn(self) -> None:
        self._note_decoded()
        self.flush()
        if "ring" in self.reads.reasons and self.ring.can_read():
            self.reads.set("ring", False)

    def charge_time(self, since: float) -> None:
        """The event loop worked for this peer from ``since`` until now: its cause pays.

        Time it spends in a turn is charged by the turn; this is for the
        rest (reads, writes of acks and credit), so that the causes share
        all of the loop's time, not only that of their decoding and appends.
        """
        share = self.share
        if share is not None and not self._turns.busy:
            self.gateway.passes.spent(share.turn, time.monotonic() - since)

    def _on_debt(self, over: bool) -> None:
        self.reads.set("debt", over)

    def charge(self, units: float) -> float:
        """Pay ``units`` of work from this connection's share; seconds to wait (0: none).

        Everything the peer causes is charged here, whenever it is done (in
        a turn, or serving a fetch later). While the share is in debt the
        connection is not read from: its turns are held until it is not.
        """
        share = self.share
        if share is None:
            return 0.0
        self._turns.spend(units)
        wait = share.charge(units, time.monotonic())
        if wait > 0:
            self._turns.hold(wait)
        return wait

    # -- the receive path ----------------------------------------------------------

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Bytes from the peer, as if read from the socket (the seam for tests).

        Everything fed is decoded before this returns (no turns are taken).
        """
        source = memoryview(data).cast("B")
        pos = 0
        self.last_received = time.monotonic()
        while pos < len(source) and not self._closing:
            # On the loop the writer, scheduled by the last read, runs before
            # the next read; here too.
            self.gateway.write_messages()
            room = self.ring.writable()
            count = min(len(room), len(source) - pos)
            room[:count] = source[pos : pos + count]
            pos += count
            del room
            self.ring.received(count)
            while not self._closing and self._decode_slice(1 << 30):
                pass
            if not self._closing and not self.ring.can_read():
                self.reads.set("ring", True)
        self._note_decoded()
        # As on the loop, the credit decisions of what was fed are made now.
        self.gateway.rebalance_marked()
        self.flush()

    def _decode_slice(self, limit: int) -> int:
        """Decode about ``limit`` bytes of what the ring holds; how many were taken.

        Batches go to the log writer's queue as headers pointing into the ring;
        anything else is handled at once, after the batches queued before it.
        Returns 0 when nothing more can be decoded until more bytes arrive.
        """
        if self._closing:
            return 0
        view = self.ring.received(0)
        if view is None or not len(view):
            return 0
        gw = self.gateway
        share = self.share
        if self._spending and share is not None:
            # Its share is in debt (its other connections, or its last slice,
            # spent it): decode nothing until it is paid off. A connection
            # whose slices cost nothing (data within guarantees) goes on.
            wait = share.wait(time.monotonic())
            if wait > 0:
                self._turns.hold(wait)
                return 0
            # No more than the budget can pay for, at the dearest bytes' price
            # (the frames are acted on before they are charged).
            limit = min(limit, max(MIN_SLICE, int(share.budget.balance / Cost.DEAREST_BYTE)))
        queue = gw.queue
        ring = self.ring
        session = self.session
        control = session.control_received
        frames = session.frames_received
        stored = 0
        spent = 0.0
        try:
            piece = view[:limit]
            events, consumed, need = session.receive_in_place(piece, self.last_received)
            while not consumed and len(piece) < need <= len(view):
                # One frame larger than the slice: take it whole (large frames
                # are cheap per byte; the flood that slices bound is of small ones).
                piece = view[:need]
                events, consumed, need = session.receive_in_place(piece, self.last_received)
            for event in events:
                if self._closing:
                    break  # refused by an event before: nothing after it is acted on
                if type(event) is BatchReceived and event.handle in self.writers:
                    message = ring.message(event.end, len(event.records))
                    message.origin = self
                    message.event = event
                    # A unit of debt per batch in the ring, on one loan
                    # for all of them (repaid by the log writer's pass).
                    ring_loan = self._ring_loan
                    if ring_loan is None or ring_loan.repaid:
                        self._ring_loan = self.account.loan(1)
                    else:
                        ring_loan.grow(1)
                    # The latest read, which is no earlier than the frame's
                    # first byte and no later than its header being parsed.
                    message.arrived = self.last_received
                    queue.push(message)
                    stored += 1
                else:
                    if type(event) is BatchDropped:
                        spent += Cost.DROPPED + Cost.of_bytes(event.size)
                    if len(queue):
                        gw.write_messages()  # what came before goes first
                    spent += EVENT_COSTS.get(type(event), 0.0)
                    self._handle(event)
            ring.consumed(consumed, need)
            controls = session.control_received - control
            # Every frame but a batch within guarantees is charged, empty ones too.
            spent += (
                controls * Cost.CONTROL
                + (session.frames_received - frames - controls - stored) * Cost.FRAME
            )
            self._spending = spent > 0
            if spent:
                self.charge(spent)
            return consumed
        except ProtocolError as error:
            gw.write_messages()
            self.refuse(error)
            return 0
        except LogError as error:
            gw.write_messages()
            log.error("stream storage failed for %s: %s", self.peer, error)
            self.refuse(ProtocolError(str(error), code=ErrorCode.STORAGE_UNAVAILABLE))
            return 0
        except Exception:
            # A bug, not the peer's doing (as in LogWriter.write_messages): this
            # connection ends with INTERNAL, the gateway and its other
            # connections go on. Nothing a peer sends may stop the process.
            log.exception("handling a frame from %s failed", self.peer)
            with contextlib.suppress(Exception):
                gw.write_messages()
            self.refuse(ProtocolError("internal error", code=ErrorCode.INTERNAL))
            return 0

    def write_batch(
        self, event: BatchReceived, now: float, timestamp_us: int, arrived: float, write_pass: int
    ) -> None:
        """The log writer's part: append one batch, borrow until it is durable.

        ``arrived`` is when the batch came in (``time.monotonic()``), which
        its Ack's latency is measured from; ``write_pass`` is the writer's
        pass under way (batches of one pass share a durability loan).
        """
        gw = self.gateway
        stream = gw.streams[event.stream]
        writer = self.writers[event.handle]
        writer.batch_arrived = arrived
        gw.flow(stream).receive(
            writer,
            event.first_sequence,
            event.record_count,
            event.records,
            now=now,
            timestamp_us=timestamp_us,
        )
        gw.durability.add(stream.name, stream.log.tail_position, self.account, write_pass)
        gw.mark_dirty(stream)
        if stream.wants_credit(writer, now):
            gw.rebalance_soon(stream)

    def written(self, batches: int) -> None:
        """The log writer handled ``batches`` of this connection's batches in the ring."""
        loan = self._ring_loan
        assert loan is not None
        loan.repay_part(batches)

    def after_write(self) -> None:
        """The writer handled some of our messages: reclaim, answer, maybe read again.

        The writer only marks messages handled; taking back their headers and
        ring space is the ring's own work, done here once per writer pass
        (so an idle connection does not hold a drained ring until it reads).
        """
        started = time.monotonic()
        self.ring.reclaim()
        if "ring" in self.reads.reasons and self.ring.can_read():
            self.reads.set("ring", False)
        self.charge_time(started)
        self.flush()  # (charged on its own)

    def statistics(self) -> ConnectionStatistics:
        return ConnectionStatistics(
            conn_id=self.conn_id,
            peer=self.peer,
            producer_id=self.producer_id,
            account=self.account.statistics(),
            paused=self.reads.paused,
            pause_reasons=tuple(sorted(self.reads.reasons)),
            pauses=self.reads.pauses,
            ring=self.ring.statistics(),
        )

    def flush(self) -> None:
        """Write whatever the session has queued, in one write."""
        if self.transport is None or self._closing or self.transport.is_closing():
            # (The writer may still flush a connection whose peer has gone.)
            return
        started = time.monotonic()
        out = self.session.data_to_send()
        if out:
            self.transport.write(out)
            self.charge_time(started)
            if self.transport.get_write_buffer_size() > self.gateway.config.max_write_buffer:
                # Reading stopped long ago (pause_writing); what the timers
                # still produce must not pile up either.
                self.refuse(
                    ProtocolError(
                        "the peer does not read what the gateway sends",
                        code=ErrorCode.RESOURCE_EXHAUSTED,
                    )
                )

    def refuse(self, error: ProtocolError) -> None:
        """Tell the peer what it did wrong, once, log it once, and close."""
        log.warning("closing %s: %s", self.peer, error)
        if self.rights is None:
            # Not welcomed: the refusal is the only frame it gets (not, say,
            # an AnnounceDropping for a bind it sent along with its Hello).
            self.session.data_to_send()
        self.close_with(self.session.fail(error))

    def close_with(self, data: bytes) -> None:
        if self.transport is None or self._closing:
            return
        self._closing = True
        transport = self.transport
        if self._tls_pending:
            transport.abort()  # nothing can be said before TLS is up
            self.connection_lost(None)  # the TLS layer may never report it
            return
        if data:
            transport.write(data)
        # Its batches still queued are let go (write_messages skips a closing
        # connection), so what it holds can go back at once.
        self._leave()
        # Only a connection that holds a slot lingers (one refused for lack
        # of a slot is closed at once: its socket would be counted nowhere).
        lingering = transport.can_write_eof() and self.conn_id in self.gateway.connections
        if lingering:
            # A lingering close: our last bytes, then FIN, while we go on
            # reading (and dropping) what the peer still sends until it closes
            # too. Closing the socket at once would answer the peer's next
            # bytes (a slowloris keeps sending) with a reset, and a reset
            # makes its kernel throw away the Error it has not read yet.
            try:
                transport.write_eof()
                transport.resume_reading()
            except OSError:  # the peer is gone already
                lingering = False
        if not lingering:
            transport.close()
        asyncio.get_running_loop().call_later(CLOSE_GRACE_S, transport.abort)

    def _handshake_expired(self) -> None:
        if self._tls_pending and not self._closing:
            log.warning("refused %s: TLS handshake failed: not finished in time", self.peer)
            self.close_with(b"")
        elif not self._closing and not self.session.closed:
            expired = self.session.handle_timer(time.monotonic())
            if expired is not None:
                self.refuse(expired)

    def _bind_refusal(self, name: str) -> ProtocolError | None:
        """Why the peer may not bind stream ``name``, or None if it may."""
        rights = self.rights
        assert rights is not None
        if not rights.can_write(name):
            return ProtocolError(
                f"token {rights.name!r} may not write stream {name!r}", code=ErrorCode.FORBIDDEN
            )
        gw = self.gateway
        if gw.fleet is not None and (misplaced := gw.fleet.refusal(name)) is not None:
            return misplaced
        if name in gw.streams:
            return None
        if (recovering := gw.recovery.refusal(name)) is not None:
            return recovering
        failure = gw.recovery.failure(name)
        if failure is not None:
            return ProtocolError(
                f"stream {name!r} could not be recovered: {failure}",
                code=ErrorCode.STORAGE_UNAVAILABLE,
            )
        quota = rights.max_streams
        if quota is None:
            quota = gw.config.streams_per_token
        if gw.admission.tokens is not None and gw.created_by.get(rights.name, 0) >= quota:
            return ProtocolError(
                f"token {rights.name!r} created its maximum of {quota} streams",
                code=ErrorCode.RESOURCE_EXHAUSTED,
            )
        return gw.stream_slot_refusal(name)

    def refuse_stream(self, handle: int, name: str, error: ProtocolError) -> None:
        """Refuse one bound stream; the peer's other streams go on.

        No guarantees are ever issued on its channel, so whatever the peer
        sends there optimistically is dropped, never stored.
        """
        if error.code is not ErrorCode.RECOVERING:  # expected while starting: no warning
            self.gateway.refusals.warning(
                time.monotonic(), "refused stream %r to %s: %s", name, self.peer, error
            )
        self.refused[handle] = name
        text = str(error.args[0]) if error.args else ""
        self.session.send_global(
            m.Error(
                code=error.code,
                scope=m.HandleRef(handle_type=m.HandleType.STREAM, handle=handle),
                text=text,
            )
        )

    # -- events ------------------------------------------------------------------

    def _handle(self, event: Event) -> None:
        gw = self.gateway
        match event:
            case BatchDropped(handle=handle) if handle in self.writers:
                gw.counters(self.writers[handle].stream).dropped_batches += 1
            case BatchReceived():
                # Batches of bound streams go to the log writer's queue; this
                # is one of a refused stream, whose channel has no buffer, so
                # it cannot happen; if it did, the batch is let go, never stored.
                self.session.process(event.handle, reissue=False)
            case StreamBound(handle=handle, stream=name) if (
                refusal := self._bind_refusal(name)
            ) is not None:
                self.refuse_stream(handle, name, refusal)
            case StreamBound(handle=handle, stream=name) if (
                fenced := self._claim_producer_id()
            ) is not None:
                self.refuse_stream(handle, name, fenced)
            case StreamBound(handle=handle, stream=name):
                if name not in gw.streams:
                    assert self.rights is not None
                    gw.created_by[self.rights.name] = gw.created_by.get(self.rights.name, 0) + 1
                stream = gw.stream(name)
                writer = Writer(
                    session=self.session,
                    stream=name,
                    flush=self.flush,
                    handle=handle,
                    producer_id=self.producer_id,
                    last_active=time.monotonic(),
                    throttle=self.throttle,
                    account=self.account,
                    refuse=self.refuse,
                    party=self.share_party,
                )
                self.writers[handle] = writer
                self._hold_writer_slot()
                stream.add_writer(writer)
                # Tell the producer where its sequence numbers resume.
                stream.announce_resume(writer)
                gw.rebalance_soon(stream)
            case HelloReceived(hello=hello):
                if self._handshake is not None:
                    self._handshake.cancel()
                self.rights = gw.admission.authenticate(hello.token)
                gw.admission.pay_as_token(self, self.rights)
                self.producer_id = hello.producer_id
                self.producer_owner, secret = hello_owner(
                    None if gw.admission.tokens is None else self.rights.name, hello.secret
                )
                self.session.send_global(
                    m.Welcome(
                        server_name=gw.name,
                        max_message_size=gw.config.max_message_size,
                        idle_timeout_ms=gw.config.idle_timeout_ms,
                        producer_secret=secret,
                        plead_deadline_ms=gw.config.plead_deadline_ms,
                    )
                )
                self.session.grant(m.STREAM_CHANNEL, gw.config.bind_budget)
            case Absolved(handle=handle) if handle is not None and handle in self.writers:
                writer = self.writers[handle]
                stream = gw.streams[writer.stream]
                gw.flow(stream).on_absolved(writer, event.amount)
                # The absolved space is free now: share it with who pleaded
                # for it, once for all the Absolves of this pass (an Absolve
                # costs O(1), however many handles the stream has).
                gw.rebalance_soon(stream)
            case HandleDeleted(handle=handle, ours=False):
                # The binding's bytes are bind-channel space again.
                self.session.issue(m.STREAM_CHANNEL)
                self.refused.pop(handle, None)
                if handle in self.writers:
                    writer = self.writers.pop(handle)
                    stream = gw.streams[writer.stream]
                    stream.remove_writer(writer)
                    gw.rebalance_soon(stream)
            case MessageReceived(
                message=m.Fetch() | m.Subscribe() | m.ListStreams() | m.DescribeStreams() as request
            ):
                rights = self.rights
                assert rights is not None
                if isinstance(request, m.Fetch | m.Subscribe) and not rights.can_read(
                    request.stream
                ):
                    raise ProtocolError(
                        f"token {rights.name!r} may not read stream {request.stream!r}",
                        code=ErrorCode.FORBIDDEN,
                    )
                if isinstance(request, m.Fetch | m.Subscribe):
                    gw.check_placement(request.stream)
                self.readers.on_request(request, visible=rights.can_read)
            case GuaranteesReceived(channel=channel):
                self.readers.on_guarantees(channel)
            case MessageReceived(
                message=m.Release(stream=name, position=position, consumer=consumer)
            ):
                assert self.rights is not None
                if not self.rights.can_consume(name, consumer):
                    raise ProtocolError(
                        f"token {self.rights.name!r} may not release consumer {consumer!r} "
                        f"of stream {name!r} (needs admin, or a consume pattern matching "
                        f"{name}/{consumer})",
                        code=ErrorCode.FORBIDDEN,
                    )
                gw.check_placement(name)
                if gw.release(name, position, consumer):
                    self.charge(Cost.CONSUMER_RELEASE)
            case MessageReceived(message=m.ResetConsumer() | m.DeleteConsumer() as change):
                assert self.rights is not None
                if not self.rights.can_administer():
                    raise ProtocolError(
                        f"token {self.rights.name!r} may not reset or delete consumer "
                        f"{change.consumer!r} of stream {change.stream!r} (needs admin)",
                        code=ErrorCode.FORBIDDEN,
                    )
                self.charge(Cost.CONSUMER_WRITE)
                position = gw.change_consumer(change)
                self.session.send_global(
                    m.ConsumerPosition(request_id=change.request_id, position=position)
                )
            case MessageReceived(message=m.ListConsumers(request_id=request_id, stream=name)):
                assert self.rights is not None
                if not self.rights.can_read(name):
                    raise ProtocolError(
                        f"token {self.rights.name!r} may not read stream {name!r}",
                        code=ErrorCode.FORBIDDEN,
                    )
                scanned = gw.records_scanned(name)
                infos = gw.consumer_infos(name)
                scanned = gw.records_scanned(name) - scanned
                self.charge(
                    Cost.LIST_STREAMS + Cost.LIST_ENTRY * len(infos) + Cost.READ_FRAME * scanned
                )
                self.session.send_global(m.ConsumerList(request_id=request_id, consumers=infos))
            case MessageReceived(
                message=m.CountRecords(request_id=request_id, stream=name, positions=positions)
            ):
                assert self.rights is not None
                if not self.rights.can_read(name):
                    raise ProtocolError(
                        f"token {self.rights.name!r} may not read stream {name!r}",
                        code=ErrorCode.FORBIDDEN,
                    )
                scanned = gw.records_scanned(name)
                epoch, counts = gw.record_counts(name, positions)
                scanned = gw.records_scanned(name) - scanned
                self.charge(
                    Cost.LIST_STREAMS + Cost.LIST_ENTRY * len(positions) + Cost.READ_FRAME * scanned
                )
                self.session.send_global(
                    m.RecordCounts(request_id=request_id, epoch=epoch, counts=counts)
                )
            case MessageReceived(message=m.DeclareConsumer() as declare):
                assert self.rights is not None
                if not self.rights.can_consume(declare.stream, declare.consumer):
                    raise ProtocolError(
                        f"token {self.rights.name!r} may not declare consumer "
                        f"{declare.consumer!r} of stream {declare.stream!r} (needs admin, or "
                        f"a consume pattern matching {declare.stream}/{declare.consumer})",
                        code=ErrorCode.FORBIDDEN,
                    )
                gw.check_placement(declare.stream)
                position, created = gw.declare_consumer(declare)
                if created:
                    self.charge(Cost.CONSUMER_WRITE)
                self.session.send_global(
                    m.ConsumerPosition(request_id=declare.request_id, position=position)
                )
            case MessageReceived(message=m.Metadata(request_id=request_id)):
                self.charge(Cost.LIST_STREAMS)
                self.session.send_global(gw.cluster_metadata(request_id))
            case MessageReceived(message=ending) if ending is self.session.ending:
                # The peer ended the session (its Goodbye, or an Error about
                # all of it: the lifecycle's rule): what it is owed goes out,
                # then the connection closes. (No idle clock runs for an
                # ended session: left open, it would stay.)
                self.close_with(self.session.data_to_send())
            case _:
                pass

    def _claim_producer_id(self) -> ProtocolError | None:
        """Tie the Hello's producer id to this peer at its first writing bind.

        Why the bind must be refused (the id is another's, see
        ``headgate.gateway.identity``), or None. Only writers claim: readers
        and release clients say Hello with some id too and never bind.
        """
        if self.producer_claimed:
            return None
        gw = self.gateway
        owners = gw.owners
        if owners.owner(self.producer_id) is None:
            self.charge(Cost.CLAIM)  # its fsync, whether it is taken or refused
        refusal = owners.claim(self.producer_id, self.producer_owner)
        self.producer_claimed = refusal is None
        if refusal is None:
            self._fence_older_connection()
        return refusal

    def _fence_older_connection(self) -> None:
        """The producer id's owner writes over this connection now: close any older one.

        A producer that reconnects (after a timeout, a crash, or from its
        spool) leaves its old connection behind, whose bytes the gateway may
        not have decoded yet. Were they stored after this connection's
        resume Ack, that Ack would be stale: the producer would number its
        resends over records stored meanwhile. So the older connection is
        closed at once with PRODUCER_FENCED, and what it sent that was not
        stored yet is let go (it was never acknowledged, and its producer
        resends it here), as Kafka fences an older producer epoch.
        """
        gw = self.gateway
        older = gw.producer_connections.get(self.producer_id)
        if older is not None and older is not self:
            older.refuse(
                ProtocolError(
                    f"producer id {self.producer_id:#x} writes over a newer connection now "
                    f"(from {self.peer}); this one is fenced",
                    code=ErrorCode.PRODUCER_FENCED,
                )
            )
        gw.producer_connections[self.producer_id] = self

    @property
    def share_party(self) -> str | None:
        """Whom this connection's writers' credit is shared for (streams.fair_shares).

        The token, where the gateway has a tokens file, so that more
        connections with one token take no more of a stream; else None, the
        connection itself.
        """
        if self.gateway.admission.tokens is None or self.rights is None:
            return None
        return self.rights.name

    def _hold_writer_slot(self) -> None:
        """It bound a stream to write: it is a writer (for the slots kept for writers)."""
        if self.gateway.admission.hold_writer_slot(self) and self._writer_deadline is not None:
            self._writer_deadline.cancel()
            self._writer_deadline = None

    def _writer_slot_expired(self) -> None:
        self._writer_deadline = None
        if self.is_writer or self._closing:
            return
        self.refuse(self.gateway.admission.writer_slot_expired())


class TlsDoor(asyncio.Protocol):
    """Where a TLS connection waits while the gateway decides whether to let it in.

    A TLS handshake is the dearest thing a peer can ask for before it has
    said anything, so it is admitted first (``handshake_rate`` per address,
    ``max_pending_handshakes`` in all), before anything is built for the
    connection: a refused one costs an accept and an abort, and a flood of
    them is logged at a bounded rate. An admitted one is handed to a new
    :class:`GatewayConnection`, which runs the handshake.
    """

    def __init__(self, gateway: ConnectionHost) -> None:
        self.gateway = gateway

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        gw = self.gateway
        peer = transport.get_extra_info("peername")
        host = str(peer[0]) if isinstance(peer, tuple) else "unix"
        refusal = gw.admission.admit_handshake(host)
        if refusal is not None:
            where = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else host
            gw.refusals.warning(time.monotonic(), "refused %s: %s", where, refusal)
            # Held unread until its address may have a handshake again, then
            # closed (budget.HandshakeBudgets.hold: a flood refused at once retries at once).
            key, hold = gw.admission.handshakes.hold(address_key(host), time.monotonic())
            if hold > 0:
                transport.pause_reading()
                asyncio.get_running_loop().call_later(hold, self._close_held, transport, key)
            else:
                transport.abort()
            return
        conn = GatewayConnection(gw, next(gw.connection_ids), tls=True)
        transport.set_protocol(conn)
        conn.connection_made(transport)

    def _close_held(self, transport: asyncio.Transport, key: str) -> None:
        self.gateway.admission.handshakes.release(key)
        transport.abort()

    def data_received(self, data: bytes) -> None:
        """Nothing is read before the connection is handed over."""
