"""The gateway: an asyncio server that turns frames into log appends and credit.

Each connection is a :class:`GatewayConnection` driving one sans-IO
:class:`~headgate.protocol.session.Session`.

The receive path follows seed freeradius-message-api.txt
(:mod:`headgate.gateway.ring`). A connection is an ``asyncio.BufferedProtocol``
that reads straight into its preallocated :class:`~headgate.gateway.ring.ReceiveRing`
and decodes the frames where they landed (``Session.receive_in_place``).
Each batch becomes a message header from the ring's slab, pointing at the
batch's bytes, and goes into the gateway's :class:`~headgate.gateway.ring.MessageQueue`;
the first message into an empty queue schedules the log writer
(:meth:`Gateway.write_messages`) with ``call_soon``. The writer copies each
batch once, from the ring into the log's mmap (however many batches one read
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

Who gets in and what a peer can make the gateway hold are decided here too,
with the pieces in their own modules: TLS (``tls``), tokens and rights
(``auth``: a Hello is authenticated, a bind is checked against the token's
write patterns and stream quota, a Release against its admin right), turns
and slices of received bytes (``turns``), and what each request costs and
the per-token budgets that pay for it (``budget``). A share of the
connection slots is kept for writers (``writer_slots``), and the peers of
one token may hold at most ``connections_per_token``. Timeouts and the cap
on bytes queued for a peer that does not read are per connection, from
``GatewayConfig``. Which of them applies when (the handshake before Hello,
then the idle and frame deadlines of
:class:`~headgate.protocol.deadlines.ReceiveDeadlines`) is the session's
lifecycle's rule (:mod:`headgate.protocol.lifecycle`); the handshake has a
timer of its own, and they and the Plead deadline are checked by the
gateway's 0.1 s housekeeping loop
(:meth:`Gateway.check_deadlines`), which also re-shares credit. Binds,
frees and Absolves only mark their stream; it is re-shared once per pass of
the event loop (:meth:`Gateway.rebalance_soon`).

Durability is a group commit: a task wakes every ``group_commit_interval_ms``,
fsyncs every log with new appends in a worker thread, then sends the
cumulative acks that the new durable positions allow.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import os
import socket
import ssl
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from headgate.config import (
    ConfigError,
    ConsumerSettings,
    GatewayConfig,
    StreamSettings,
    format_address,
)
from headgate.costs import batch_cost
from headgate.gateway import commit_trace
from headgate.gateway.accounts import Account, DurabilityLoans, Loan, ReadPauses
from headgate.gateway.auth import ALL_RIGHTS, Rights, TokenTable, load_tokens
from headgate.gateway.budget import (
    UNITS_PER_MS,
    Cost,
    HandshakeBudgets,
    LogLimiter,
    PeerShare,
    PeerShares,
    address_key,
    token_key,
)
from headgate.gateway.consumers import PendingSave, consumers_file, declare_before_the_stream
from headgate.gateway.dedup import DedupSnapshot
from headgate.gateway.fleet import FleetMembership, metadata_without_cluster
from headgate.gateway.identity import ProducerOwners, hello_owner
from headgate.gateway.policies import Flow, FlowStatistics, make_flow
from headgate.gateway.readers import ReaderConnection, TailHub
from headgate.gateway.recovery import StreamRecovery
from headgate.gateway.ring import HANDLED, MessageQueue, ReceiveRing
from headgate.gateway.statistics import (
    ConnectionStatistics,
    GatewaySnapshot,
    StreamCounters,
    StreamSnapshot,
)
from headgate.gateway.streams import GatewayStreamStatistics, Stream, Writer
from headgate.gateway.tls import server_context
from headgate.gateway.turns import MIN_SLICE, Passes, SharedWork, TurnTaker
from headgate.log import LogError
from headgate.log.lock import DirectoryLock
from headgate.protocol import messages as m
from headgate.protocol.deadlines import ReceiveDeadlines
from headgate.protocol.errors import ErrorCode, ProtocolError
from headgate.protocol.records import load_accelerator
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

if TYPE_CHECKING:
    from headgate.gateway.metrics import MetricsServer

log = logging.getLogger("headgate.gateway")

#: How long a closing connection may take to deliver its last bytes before
#: it is aborted (a peer that does not read would otherwise hold it forever).
CLOSE_GRACE_S = 2.0
#: The file in the data directory whose lock says which gateway writes it.
DATA_LOCK_FILE_NAME = "gateway.lock"
#: How often idle writers are re-checked and credit re-shared.
REBALANCE_INTERVAL_S = 0.1
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
#: Streams recovered at once after a start, each in its own thread: a
#: stream's recovery waits mostly on fsyncs, an unlink and the reservation of
#: its next term, which overlap across streams. Not more: while recovery
#: reads frame headers (Python), each thread takes the interpreter lock from
#: the event loop (with 4, a loop round trip took up to 100 ms; with 1 or 2,
#: about 30 ms).
RECOVERY_THREADS = 2
#: The event loop's work for one read that the gateway cannot time (the
#: selector's report, the transport's call into the connection): charged to
#: the peer beside the read's own time (``GatewayConnection.charge_time``).
READ_SECONDS = 5e-6
#: How soon a thread waiting for the interpreter lock (the group commit's
#: fsyncs, the term preparer) gets it from a busy event loop (Python's
#: default: 5 ms). Set for the process when the gateway starts listening.
GIL_SWITCH_INTERVAL_S = 0.0005
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


class AddressInUse(OSError):
    """An address the gateway should listen on (its own, or its metrics') is taken.

    Usually a gateway already running there, or another program on the
    port; ``address`` is the ``host:port`` that was asked for.
    """

    def __init__(self, address: str) -> None:
        super().__init__(errno.EADDRINUSE, f"{address} is already in use")
        self.address = address


@contextlib.contextmanager
def _binding(host: str, port: int) -> Iterator[None]:
    """Turn the OS's "address in use" into :class:`AddressInUse`, naming the address."""
    try:
        yield
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise AddressInUse(format_address(host, port)) from exc
        raise


class GatewayConnection(asyncio.BufferedProtocol):
    """One peer: a producer, a pipeline reporting releases, or a reader."""

    def __init__(self, gateway: Gateway, conn_id: int, *, tls: bool = False) -> None:
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
        slot = gw.attach(self)
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
        self.share = gw.shares.join(address_key(self.host), time.monotonic())
        if slot == "writer":
            self._writer_deadline = loop.call_later(
                config.handshake_timeout_ms / 1000, self._writer_slot_expired
            )
        if self._tls_pending:
            self._tls_counted = True
            gw.tls_pending += 1
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
            self.gateway.tls_pending -= 1

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
            events, consumed, need = session.receive_in_place(piece)
            while not consumed and len(piece) < need <= len(view):
                # One frame larger than the slice: take it whole (large frames
                # are cheap per byte; the flood that slices bound is of small ones).
                piece = view[:need]
                events, consumed, need = session.receive_in_place(piece)
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
            # A bug, not the peer's doing (as in Gateway.write_messages): this
            # connection ends with INTERNAL, the gateway and its other
            # connections go on. Nothing a peer sends may stop the process.
            log.exception("handling a frame from %s failed", self.peer)
            with contextlib.suppress(Exception):
                gw.write_messages()
            self.refuse(ProtocolError("internal error", code=ErrorCode.INTERNAL))
            return 0

    def write_batch(
        self, event: BatchReceived, now: float, timestamp_us: int, arrived: float
    ) -> None:
        """The log writer's part: append one batch, borrow until it is durable.

        ``arrived`` is when the batch came in (``time.monotonic()``), which
        its Ack's latency is measured from.
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
        gw.durability.add(stream.name, stream.log.tail_position, self.account, gw.write_pass)
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
        if gw.recovery.recovering(name):
            gw.recovery.want(name)
            return ProtocolError(
                f"stream {name!r} is still being recovered after the gateway's restart; "
                "try again soon",
                code=ErrorCode.RECOVERING,
            )
        failure = gw.recovery.failure(name)
        if failure is not None:
            return ProtocolError(
                f"stream {name!r} could not be recovered: {failure}",
                code=ErrorCode.STORAGE_UNAVAILABLE,
            )
        quota = rights.max_streams
        if quota is None:
            quota = gw.config.streams_per_token
        if gw.tokens is not None and gw.created_by.get(rights.name, 0) >= quota:
            return ProtocolError(
                f"token {rights.name!r} created its maximum of {quota} streams",
                code=ErrorCode.RESOURCE_EXHAUSTED,
            )
        if len(gw.streams) + gw.recovery.count >= gw.config.max_streams:
            return ProtocolError(
                f"the gateway holds its maximum of {gw.config.max_streams} streams",
                code=ErrorCode.RESOURCE_EXHAUSTED,
            )
        return None

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
                self.rights = gw.authenticate(hello.token)
                self._pay_as_token()
                self.producer_id = hello.producer_id
                self.producer_owner, secret = hello_owner(
                    None if gw.tokens is None else self.rights.name, hello.secret
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
        if self.gateway.tokens is None or self.rights is None:
            return None
        return self.rights.name

    def _pay_as_token(self) -> None:
        """Hello accepted: with a tokens file, pay from (and count in) the token's share.

        Raises:
            ProtocolError: the token's peers already hold ``connections_per_token``.
        """
        gw = self.gateway
        rights = self.rights
        if gw.tokens is None or rights is None or self.share is None:
            return  # without tokens, the address's share stays
        held = gw.shares.get(token_key(rights.name))
        cap = gw.config.token_connections
        if held is not None and held.connections >= cap:
            raise ProtocolError(
                f"token {rights.name!r} holds its maximum of {cap} connections",
                code=ErrorCode.RESOURCE_EXHAUSTED,
            )
        old = self.share
        self.share = gw.shares.join(token_key(rights.name), time.monotonic())
        gw.shares.leave(old, time.monotonic())

    def _hold_writer_slot(self) -> None:
        """It bound a stream to write: it is a writer (for the slots kept for writers)."""
        if not self.is_writer:
            self.is_writer = True
            self.gateway.writer_connections += 1
            if self._writer_deadline is not None:
                self._writer_deadline.cancel()
                self._writer_deadline = None

    def _writer_slot_expired(self) -> None:
        self._writer_deadline = None
        if self.is_writer or self._closing:
            return
        config = self.gateway.config
        self.refuse(
            ProtocolError(
                f"the last {config.writer_slots_kept} of {config.max_connections} connection "
                f"slots are kept for writers, and this connection bound no stream to write "
                f"within {config.handshake_timeout_ms:.0f} ms",
                code=ErrorCode.RESOURCE_EXHAUSTED,
            )
        )


class TlsDoor(asyncio.Protocol):
    """Where a TLS connection waits while the gateway decides whether to let it in.

    A TLS handshake is the dearest thing a peer can ask for before it has
    said anything, so it is admitted first (``handshake_rate`` per address,
    ``max_pending_handshakes`` in all), before anything is built for the
    connection: a refused one costs an accept and an abort, and a flood of
    them is logged at a bounded rate. An admitted one is handed to a new
    :class:`GatewayConnection`, which runs the handshake.
    """

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        gw = self.gateway
        peer = transport.get_extra_info("peername")
        host = str(peer[0]) if isinstance(peer, tuple) else "unix"
        refusal = gw.admit_handshake(host)
        if refusal is not None:
            where = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else host
            gw.refusals.warning(time.monotonic(), "refused %s: %s", where, refusal)
            # Held unread until its address may have a handshake again, then
            # closed (budget.HandshakeBudgets.hold: a flood refused at once retries at once).
            key, hold = gw.handshakes.hold(address_key(host), time.monotonic())
            if hold > 0:
                transport.pause_reading()
                asyncio.get_running_loop().call_later(hold, self._close_held, transport, key)
            else:
                transport.abort()
            return
        conn = GatewayConnection(gw, next(gw._ids), tls=True)
        transport.set_protocol(conn)
        conn.connection_made(transport)

    def _close_held(self, transport: asyncio.Transport, key: str) -> None:
        self.gateway.handshakes.release(key)
        transport.abort()

    def data_received(self, data: bytes) -> None:
        """Nothing is read before the connection is handed over."""


class Gateway:
    """The headgate gateway. ``await start()``, serve, ``await stop()``."""

    def __init__(self, config: GatewayConfig, *, name: str = "headgate") -> None:
        self.config = config.validate()
        self.name = name
        self.streams: dict[str, Stream] = {}
        #: Each open stream's flow-control policy, by stream name (the gateway
        #: owns them; a Stream does not know its policy).
        self.flows: dict[str, Flow] = {}
        self.tails = TailHub()
        self.connections: dict[int, GatewayConnection] = {}
        self._ids = itertools.count(1)
        self._servers: list[asyncio.Server] = []
        self._dirty: set[Stream] = set()
        # Streams whose credit is re-shared at the end of this loop pass.
        self._to_rebalance: dict[Stream, None] = {}
        self._rebalance_scheduled = False
        self._tasks: list[asyncio.Task[None]] = []
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="headgate-fsync")
        # Set while an eager group commit waits for something to commit.
        self._commit_wanted: asyncio.Future[float] | None = None
        #: Per group commit, where its time went (off unless HEADGATE_COMMIT_TRACE is set).
        self._trace = commit_trace.from_environment(
            0.0
            if self.config.group_commit_mode == "eager"
            else self.config.group_commit_interval_ms / 1000,
            self.config.term_length,
        )
        # Consumers files are written beside the log's fsync, not behind it.
        self._consumer_executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="headgate-consumers"
        )
        self._consumer_saves: set[asyncio.Task[None]] = set()
        #: The streams found on disk at start that are not recovered yet.
        self.recovery = StreamRecovery()
        # Recovery runs in threads of its own: a group commit of the streams
        # already serving never waits behind a stream being recovered.
        self._recovery_executor = ThreadPoolExecutor(
            max_workers=RECOVERY_THREADS, thread_name_prefix="headgate-recovery"
        )
        self._recovery_task: asyncio.Task[None] | None = None
        #: Seconds from listening to every stream recovered (None until then).
        self.recovery_seconds: float | None = None
        # Releases of streams still recovering: applied once they are.
        self._held_releases: dict[str, dict[str, int]] = {}
        self._stopping = False
        #: The lock on the data directory, from start() to stop().
        self._data_lock: DirectoryLock | None = None
        self.address: tuple[str, int] = config.listen
        #: Batches received and not yet written to their log, oldest first.
        self.queue = MessageQueue(self._signal_writer)
        #: Loans of batches appended and not yet durable.
        self.durability = DurabilityLoans()
        #: The log writer's pass (write_messages) under way: a run of durability loans.
        self.write_pass = 0
        self._counters: dict[str, StreamCounters] = {}
        self._metrics: MetricsServer | None = None
        #: Where the Prometheus endpoint listens, once started (None: off).
        self.metrics_address: tuple[str, int] | None = None
        #: The listener's TLS context, or None for plain TCP.
        self.ssl_context = server_context(self.config)
        #: New streams created by the peers of each token, by token name.
        self.created_by: dict[str, int] = {}
        #: Streams not created yet with a consumer declared (``declare_consumer``).
        self._declared_ahead: set[str] = set()
        #: Owners of producer ids; :meth:`start` reads the table on disk.
        self.owners = ProducerOwners(
            Path(self.config.data_dir) / "state" / "producers.log",
            {},
            limit=self.config.max_producer_ids,
        )
        #: The work budgets, shared per token (per address before Hello, or
        #: without a tokens file).
        rate = self.config.work_budget_ms * UNITS_PER_MS
        self.shares = PeerShares(rate, rate)
        #: The connection over which each producer id's owner writes now
        #: (GatewayConnection._fence_older_connection).
        self.producer_connections: dict[int, GatewayConnection] = {}
        #: The passes of the event loop in which connections take turns,
        #: one turn per cause (token or address) and pass (``turns``).
        self.passes = Passes()
        #: TLS handshakes each address may start, and how many are in progress.
        self.handshakes = HandshakeBudgets(
            self.config.handshake_rate,
            max_hold=self.config.handshake_timeout_ms / 1000,
            max_held=self.config.max_pending_handshakes,
        )
        self.tls_pending = 0
        #: Connections that have bound a stream to write (they hold writer slots).
        self.writer_connections = 0
        #: Refusals are logged at a bounded rate: a flood of them costs no flood of lines.
        self.refusals = LogLimiter(log)
        #: Accepted tokens, or None when every peer may do anything.
        self.tokens: TokenTable | None = (
            None if self.config.auth_file is None else load_tokens(self.config.auth_file)
        )
        #: This gateway's place in a fleet (the cluster file), or None on its own.
        self.fleet: FleetMembership | None = None
        if self.config.cluster is not None and self.config.cluster_name is not None:
            self.fleet = FleetMembership.load(self.config.cluster, self.config.cluster_name)
            self.name = self.fleet.name
            if (mismatch := self.fleet.listen_mismatch(self.config.listen)) is not None:
                log.warning("%s", mismatch)

    # -- lifecycle ---------------------------------------------------------------

    async def start(self) -> None:
        """Open the data directory, start listening, and recover every stream.

        Returns once every stream on disk is recovered (connections are
        accepted meanwhile, see :meth:`listen`). A stream that cannot be
        recovered stops the gateway again and its error is raised, so a
        broken log is reported at start, not at the first producer.
        """
        await self.listen()
        try:
            await self.recovered()
        except BaseException:
            await self.stop()
            raise

    async def listen(self) -> None:
        """Lock the data directory, listen, and recover the streams in the background.

        Returns as soon as connections are accepted. The streams found on
        disk are recovered a few at a time, off the event loop
        (:mod:`headgate.gateway.recovery` says what peers see meanwhile);
        :meth:`recovered` waits for them.
        """
        # Not at the first batch, on the event loop, while producers wait.
        load_accelerator()
        # The group commit's thread needs the interpreter lock between its
        # fsyncs; while the event loop is busy (a flood of tiny batches), it
        # waited the default 5 ms at each turn, and a commit took 20-180 ms:
        # every producer's acks waited for the busiest peer's traffic.
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        data = Path(self.config.data_dir)
        # One gateway per data directory: a second one would open the same
        # logs. Taken before listening; held until stop(), or until this
        # process dies.
        self._data_lock = DirectoryLock.acquire(data, DATA_LOCK_FILE_NAME)
        try:
            await self._open_and_listen(data)
        except BaseException:
            if self._metrics is not None:  # started before the listener failed
                self._metrics.close()
                self._metrics = None
            for server in self._servers:
                server.close()
            self._data_lock.release()
            raise
        self._recovery_task = asyncio.create_task(self._recover_streams())

    async def recovered(self) -> None:
        """Wait until every stream found at start is recovered (or the gateway stops).

        Raises:
            Exception: the error of the first stream that could not be
                recovered (a :class:`~headgate.log.LogError` naming the file).
        """
        if self._recovery_task is not None:
            await asyncio.shield(self._recovery_task)
        for error in self.recovery.failures.values():
            raise error

    async def _open_and_listen(self, data: Path) -> None:
        (data / "streams").mkdir(parents=True, exist_ok=True)
        self.owners = ProducerOwners.open(
            data / "state" / "producers.log", limit=self.config.max_producer_ids
        )
        # Streams on disk are recovered after the listener is up (they are
        # refused, or their requests wait, until then): what is stored does
        # not delay the first connection.
        on_disk = [
            entry.name
            for entry in sorted((data / "streams").iterdir())
            if entry.is_dir() and m.is_valid_name(entry.name)
        ]
        self.recovery = StreamRecovery(on_disk)
        # Consumers declared on streams not created yet (declare_consumer)
        # keep counting against max_streams after a restart.
        logs, suffix = set(on_disk), ".consumers.json"
        self._declared_ahead = {
            entry.name.removesuffix(suffix)
            for entry in (data / "state").glob(f"*{suffix}")
            if entry.name.removesuffix(suffix) not in logs
        }
        if self.fleet is not None and (misplaced := self.fleet.misplaced(on_disk)) is not None:
            log.warning("%s", misplaced)
        loop = asyncio.get_running_loop()
        if self.config.metrics is not None:
            # Imported only here: prometheus-client is not on the start-up
            # path of a gateway without --metrics.
            from headgate.gateway.metrics import MetricsServer

            self._metrics = MetricsServer(self.snapshot, loop)
            with _binding(*self.config.metrics):
                self.metrics_address = self._metrics.start(*self.config.metrics)
            log.info("metrics on http://%s:%d/metrics", *self.metrics_address)
        host, port = self.config.listen
        tls = self.ssl_context is not None
        with _binding(host, port):
            server = await loop.create_server(
                (lambda: TlsDoor(self))
                if tls
                else (lambda: GatewayConnection(self, next(self._ids))),
                host,
                port,
                reuse_address=True,
            )
        self._servers.append(server)
        sockname = server.sockets[0].getsockname()
        self.address = (sockname[0], sockname[1])
        if self.config.unix_socket is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.unix_socket)
            self._servers.append(
                await loop.create_unix_server(
                    lambda: GatewayConnection(self, next(self._ids)), str(self.config.unix_socket)
                )
            )
        self._tasks.append(asyncio.create_task(self._group_commit()))
        self._tasks.append(asyncio.create_task(self._rebalance_loop()))
        if self._trace is not None:
            self._tasks.append(asyncio.create_task(self._trace.watch_loop()))
        log.info("listening on %s:%d, data in %s", self.address[0], self.address[1], data)

    def attach(self, conn: GatewayConnection) -> str | None:
        """Count a new connection in: in which slot, or None if it is one too many.

        ``"any"``: an ordinary slot. ``"writer"``: only the slots kept for
        writers are left, and it holds one on condition that it binds a
        stream to write within the handshake timeout.
        """
        config = self.config
        if len(self.connections) >= config.max_connections:
            return None
        self.connections[conn.conn_id] = conn
        others = len(self.connections) - 1 - self.writer_connections
        if others >= config.max_connections - config.writer_slots_kept:
            return "writer"
        return "any"

    def admit_handshake(self, host: str) -> str | None:
        """Why a new TLS connection from ``host`` may not start its handshake, or None."""
        if self.tls_pending >= self.config.max_pending_handshakes:
            return f"{self.tls_pending} TLS handshakes are already in progress"
        if not self.handshakes.admit(address_key(host), time.monotonic()):
            return f"more than {self.config.handshake_rate:g} TLS handshakes a second from {host}"
        return None

    def authenticate(self, token: bytes) -> Rights:
        """The rights of a Hello's token; raises UNAUTHENTICATED if it has none."""
        if self.tokens is None:
            return ALL_RIGHTS
        rights = self.tokens.authenticate(token)
        if rights is None:
            # The reason never includes the token, not even in part.
            reason = "no token" if not token else "unknown token"
            raise ProtocolError(f"authentication failed: {reason}", code=ErrorCode.UNAUTHENTICATED)
        return rights

    def buffered_bytes(self) -> int:
        """Bytes all connections hold in memory (see GatewayConnection.buffered_bytes)."""
        return sum(conn.buffered_bytes for conn in self.connections.values())

    async def stop(self) -> None:
        """Stop accepting, make everything durable, ack it, say goodbye, close."""
        if self._stopping:
            return
        self._stopping = True
        for server in self._servers:
            server.close()
        if self._metrics is not None:
            # Its shutdown waits for the server thread's poll: not on the loop.
            await asyncio.get_running_loop().run_in_executor(None, self._metrics.close)
            self._metrics = None
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.recovery.abandon()
        if self._recovery_task is not None:
            # Ends after the stream it is opening (which is then closed below).
            with contextlib.suppress(Exception):
                await self._recovery_task
        self._recovery_executor.shutdown(wait=True)
        self.write_messages()
        await self._commit(list(self.streams.values()))
        try:
            self.owners.sync()  # claims under which nothing was written yet
        except OSError as exc:
            log.warning("producer ids table not durable at stop: %s", exc)
        for conn in list(self.connections.values()):
            if not conn.session.closed:
                with contextlib.suppress(RuntimeError):
                    conn.session.send_global(
                        m.Goodbye(code=ErrorCode.SHUTTING_DOWN, text="gateway stopping")
                    )
            conn.close_with(conn.session.data_to_send())
        for server in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 2.0)
        # Saves in flight end first; Stream.close stores what came after.
        await self.consumers_saved()
        self._consumer_executor.shutdown(wait=True)
        for stream in self.streams.values():
            stream.close()
        self._executor.shutdown(wait=True)
        if self._trace is not None:
            self._trace.close()
        if self.config.unix_socket is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.unix_socket)
        if self._data_lock is not None:
            self._data_lock.release()

    # -- streams -------------------------------------------------------------------

    def stream(self, name: str) -> Stream:
        """The stream called ``name``, opened (or created) on first use.

        Raises:
            LogError: the stream is on disk and not recovered yet, or could
                not be recovered.
        """
        stream = self.streams.get(name)
        if stream is None:
            if self.recovery.recovering(name) or self.recovery.failure(name) is not None:
                raise LogError(f"stream {name} is not recovered (yet)")
            stream = self._open_stream(name)
            self._install(stream)
            self._declared_ahead.discard(name)
        return stream

    def _open_stream(self, name: str) -> Stream:
        """Open (or create) a stream's log and rebuild its dedup state.

        Touches nothing of the gateway's: it runs in the recovery thread
        for the streams found at start.
        """
        return Stream.open(
            name,
            Path(self.config.data_dir),
            capacity=self.config.stream_capacity_for(name),
            term_length=self.config.term_length,
            max_message_size=self.config.max_message_size,
            consumers=self.config.consumers_for(name),
            retention=self.config.retention_for(name),
        )

    def _install(self, stream: Stream) -> None:
        """Make an opened stream serve (on the event loop)."""
        capacity = self.config.stream_capacity_for(stream.name)
        if stream.capacity != capacity:
            # An existing log keeps the capacity it was created with; the
            # configuration is what the operator wants now.
            stream.set_capacity(capacity)
        self.flows[stream.name] = self._make_flow(stream)
        stream.on_append = self._offer_to_tails
        stream.commit_soon = partial(self.mark_dirty, stream)
        stream.snapshot_soon = partial(self._snapshot_soon, stream)
        stream.on_acks_written = self._acks_written
        stream.max_party_credit = self.config.max_stream_credit
        self.streams[stream.name] = stream

    async def _recover_streams(self) -> None:
        """Recover the streams found at start, off the event loop.

        :data:`RECOVERY_THREADS` streams at a time, each opened by one
        thread; a stream serves only once it is installed here on the
        loop: nothing appends to a log while it is being recovered.
        """
        began = time.monotonic()
        recovery = self.recovery
        await asyncio.gather(*(self._recovery_worker() for _ in range(RECOVERY_THREADS)))
        if recovery.finished and not self._stopping:
            self.recovery_seconds = time.monotonic() - began
            log.debug(  # headgate serve says it at its default verbosity
                "recovered %d streams in %.3f s%s",
                recovery.done,
                self.recovery_seconds,
                f" ({len(recovery.failures)} failed)" if recovery.failures else "",
            )

    async def _recovery_worker(self) -> None:
        """Recover the next stream in the queue until none is left (or the gateway stops)."""
        loop = asyncio.get_running_loop()
        recovery = self.recovery
        while not self._stopping and (name := recovery.next_name()) is not None:
            try:
                stream = await loop.run_in_executor(
                    self._recovery_executor, self._open_stream, name
                )
            except Exception as exc:  # reported by recovered() and by every bind of it
                recovery.failed(name, exc)
                log.error("stream %s cannot be recovered: %s", name, exc)
            else:
                self._install(stream)
                recovery.recovered(name)
            # Requests first: a Fetch that waited was checked against the log
            # before any Release that came while it waited.
            self._serve_held_requests()
            if name in self.streams:
                self._apply_held_release(self.streams[name])

    def _serve_held_requests(self) -> None:
        """A stream was recovered (or failed): serve reader requests that waited for it."""
        for conn in list(self.connections.values()):
            try:
                conn.readers.recovered()
            except ProtocolError as error:
                conn.refuse(error)

    def _apply_held_release(self, stream: Stream) -> None:
        for consumer, position in self._held_releases.pop(stream.name, {}).items():
            try:
                self.release(stream.name, position, consumer)
            except ProtocolError as error:
                log.warning("a Release received while recovering was refused: %s", error)

    def _acks_written(self, stream: Stream, arrivals: list[float]) -> None:
        """Acks for batches that arrived at ``arrivals`` were just written out."""
        histogram = self.counters(stream.name).ack_latency
        assert histogram is not None
        now = time.monotonic()
        histogram.observe_since(arrivals, now)
        if self._trace is not None:
            self._trace.acks(stream.name, now, arrivals)

    def _offer_to_tails(
        self,
        stream: Stream,
        writer: Writer,
        first_sequence: int,
        records: memoryview,
        timestamp_us: int,
    ) -> None:
        self.tails.on_append(
            stream,
            writer.producer_id,
            first_sequence,
            records,
            timestamp_us,
            account=writer.account,
        )

    def _make_flow(self, stream: Stream) -> Flow:
        return make_flow(
            stream,
            self.config.flow_for(stream.name),
            max_message_size=self.config.max_message_size,
            mark_dirty=lambda: self.mark_dirty(stream),
        )

    def flow(self, stream: Stream) -> Flow:
        """The flow-control policy of an open stream (opened through :meth:`stream`)."""
        return self.flows[stream.name]

    def rebalance(self, stream: Stream, now: float) -> None:
        """Let the stream's policy move credit now (grant what is free, plead the excess)."""
        stream.rebalanced_at = now
        self.flows[stream.name].rebalance(now)

    def flow_statistics(self, name: str) -> FlowStatistics:
        return self.flow(self.streams[name]).statistics()

    def set_capacity(self, name: str, capacity: int) -> None:
        """Resize stream ``name`` now (opening it if needed).

        Raising it grants the new space at once. Lowering it takes back
        guarantees not yet issued and pleads writers down to their new share;
        once they have absolved, what is promised plus what is unreleased fits
        the new capacity, and a log already fuller than that accepts nothing
        until the consumer's releases bring it under.

        Raises:
            LogError: the capacity is not a valid log capacity.
        """
        if capacity < 2 * self.config.term_length:
            raise ConfigError(
                f"capacity of {name} ({capacity}) must be at least two terms "
                f"({2 * self.config.term_length})"
            )
        stream = self.stream(name)
        stream.set_capacity(capacity)
        self.rebalance(stream, time.monotonic())
        stream.flush_writers()

    def reconfigure(self, config: GatewayConfig) -> None:
        """Apply a reloaded configuration to the running gateway.

        Capacities and XON/XOFF watermarks change at once; a new window size
        applies to writers that bind after the reload. Settings that need
        a new socket or a new log layout (listen address, data directory,
        term length, maximum message size) and a stream's policy keep their
        running values until a restart; each one that differs is logged.
        """
        config = config.validate()
        old = self.config
        for key in (
            "listen",
            "unix_socket",
            "data_dir",
            "term_length",
            "max_message_size",
            "cluster",
            "cluster_name",
        ):
            if getattr(old, key) != getattr(config, key):
                log.warning("reload: %s changes only at restart", key)
        kept = replace(
            config,
            cluster=old.cluster,
            cluster_name=old.cluster_name,
            listen=old.listen,
            unix_socket=old.unix_socket,
            data_dir=old.data_dir,
            term_length=old.term_length,
            max_message_size=old.max_message_size,
        )
        for name, stream in self.streams.items():
            flow = self.flow(stream)
            settings = kept.flow_for(name)
            if settings.policy != flow.policy:
                log.warning(
                    "reload: stream %s keeps policy %s until restart (asked for %s)",
                    name,
                    flow.policy,
                    settings.policy,
                )
                streams = dict(kept.streams)
                streams[name] = replace(streams.get(name, StreamSettings()), policy=flow.policy)
                kept = replace(kept, streams=streams)
                settings = kept.flow_for(name)
            flow.update(settings)
        self.config = kept.validate()
        for name, stream in self.streams.items():
            # Consumers the reload declares are created now; one whose
            # settings changed keeps its stored ones (the log says so), and
            # one it no longer declares goes at the next start.
            for consumer, wanted in self.config.consumers_for(name).items():
                try:
                    stream.declare_consumer(consumer, wanted, origin="config")
                except ProtocolError as exc:
                    log.warning("reload: %s", exc)
        for name in list(self.streams):
            retention = self.config.retention_for(name)
            if retention != self.streams[name].retention:
                log.info("stream %s: retention %s", name, retention)
                self.streams[name].set_retention(retention)
            capacity = self.config.stream_capacity_for(name)
            if capacity != self.streams[name].capacity:
                log.info(
                    "stream %s: capacity %d -> %d", name, self.streams[name].capacity, capacity
                )
                self.set_capacity(name, capacity)

    # -- a fleet of gateways ------------------------------------------------------

    def check_placement(self, name: str) -> None:
        """Raise the connection-wide error for a read of a log this gateway of a fleet
        does not hold (a partition of another gateway, a partitioned stream's name)."""
        if self.fleet is not None and (misplaced := self.fleet.refusal(name)) is not None:
            raise misplaced

    def cluster_metadata(self, request_id: int) -> m.ClusterMetadata:
        """The answer to Metadata: the fleet's assignment (empty on its own)."""
        if self.fleet is None:
            return metadata_without_cluster(request_id, self.name)
        return self.fleet.metadata(request_id)

    def mark_dirty(self, stream: Stream) -> None:
        self._dirty.add(stream)
        wanted = self._commit_wanted
        if wanted is not None:
            # An eager group commit waits for this (group_commit_mode).
            self._commit_wanted = None
            if not wanted.done():  # (cancelled at stop)
                wanted.set_result(time.monotonic())

    # -- the log writer ----------------------------------------------------------------

    def _signal_writer(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # fed by hand outside a loop: write at once
            self.write_messages()
            return
        loop.call_soon(self.write_messages)

    def write_messages(self) -> None:
        """Write every queued batch to its log, mark it handled, repay its loan.

        A batch whose connection has been refused meanwhile is only marked
        handled: nothing after a protocol error is stored.
        """
        queue = self.queue
        if not len(queue):
            return
        self.write_pass += 1
        now = time.monotonic()
        timestamp_us = time.time_ns() // 1000
        # Each origin's batches written in this pass: its ring loan's units.
        origins: dict[GatewayConnection, int] = {}
        # The appends' time is charged to the cause of each run of batches
        # from one connection (``turns``: causes share the loop's time).
        run_origin: GatewayConnection | None = None
        run_started = now
        while (message := queue.pop()) is not None:
            conn: GatewayConnection = message.origin
            if conn is not run_origin:
                run_started = self._charge_appends(run_origin, run_started)
                run_origin = conn
            try:
                if not conn._closing:
                    conn.write_batch(message.event, now, timestamp_us, message.arrived)
            except ProtocolError as error:
                conn.refuse(error)
            except LogError as error:
                log.error("stream storage failed for %s: %s", conn.peer, error)
                conn.refuse(ProtocolError(str(error), code=ErrorCode.STORAGE_UNAVAILABLE))
            except Exception:
                # A bug, not the peer's doing: that connection ends, the
                # others and the queue go on.
                log.exception("writing a batch from %s failed", conn.peer)
                conn.refuse(ProtocolError("internal error", code=ErrorCode.INTERNAL))
            finally:
                message.status = HANDLED
                message.event = None
                origins[conn] = origins.get(conn, 0) + 1
        ended = self._charge_appends(run_origin, run_started)
        if self._trace is not None:
            self._trace.appends(now, ended, len(origins))
        for conn, written in origins.items():
            conn.written(written)
            conn.after_write()

    def _charge_appends(self, conn: GatewayConnection | None, since: float) -> float:
        """Charge the appends of ``conn``'s batches since ``since`` to its cause; now."""
        now = time.monotonic()
        if conn is not None and conn.share is not None:
            self.passes.spent(conn.share.turn, now - since)
        return now

    def counters(self, name: str) -> StreamCounters:
        """The gateway's own counters for stream ``name``."""
        counters = self._counters.get(name)
        if counters is None:
            counters = self._counters[name] = StreamCounters()
        return counters

    def release(self, name: str, position: int, consumer: str = m.DEFAULT_CONSUMER) -> bool:
        """Consumer ``consumer`` is done with ``name`` before ``position``: reclaim and re-share.

        Returns whether the consumer moved.
        """
        stream = self.streams.get(name)
        if stream is None and self.recovery.recovering(name):
            # Applied as soon as the stream is recovered (releases are
            # cumulative: only the highest position matters).
            self.recovery.want(name)
            held = self._held_releases.setdefault(name, {})
            held[consumer] = max(position, held.get(consumer, 0))
            return False
        if stream is None:
            raise ProtocolError(f"no stream called {name!r}", code=ErrorCode.UNEXPECTED_FRAME)
        moved = stream.release(position, consumer, now=time.monotonic(), store=False)
        if moved:
            stream.released_at_us = time.time_ns() // 1000
            self.save_consumers(stream)
        # The next group commit stores the release and deletes the terms it
        # frees, even if nothing is appended to this stream meanwhile.
        self.mark_dirty(stream)
        self.rebalance(stream, time.monotonic())
        stream.flush_writers()
        return moved

    def save_consumers(self, stream: Stream) -> None:
        """Store ``stream``'s consumer positions in a thread, unless saved or a save is in flight.

        Releases that arrive while one save is written go into the next, so
        many cost one write; the log frees what they allow once it is done
        (``headgate.gateway.consumers``). A failed save is retried after the
        next group commit.
        """
        pending = stream.begin_consumer_save()
        if pending is None:
            return
        task = asyncio.get_running_loop().create_task(self._write_consumers(stream, pending))
        self._consumer_saves.add(task)
        task.add_done_callback(self._consumer_saves.discard)

    def _snapshot_soon(self, stream: Stream) -> None:
        """Write ``stream``'s producer-state snapshot in the consumers' thread, not on the loop.

        Written on the event loop, its fsyncs held every connection for their
        length, once per release that freed the log (about 90 ms of loop time
        in 10 s of 1 KiB records released every 250 ms, sampled with py-spy).
        It shares the thread of the consumers' saves, so the two kinds of
        state file are written in the order asked, never two at once.
        """
        snapshot = stream.take_snapshot()
        if snapshot is None:
            return
        task = asyncio.get_running_loop().create_task(self._write_snapshot(stream, snapshot))
        self._consumer_saves.add(task)
        task.add_done_callback(self._consumer_saves.discard)

    async def _write_snapshot(self, stream: Stream, snapshot: DedupSnapshot) -> None:
        error: OSError | None = None
        try:
            await asyncio.get_running_loop().run_in_executor(
                self._consumer_executor, stream.write_taken_snapshot, snapshot
            )
        except OSError as exc:
            error = exc
        stream.snapshot_written(snapshot, error)
        self._after_freeing(stream)

    def _after_freeing(self, stream: Stream) -> None:
        """A save let ``stream``'s log free: delete the terms (next commit), hand out the credit."""
        self.mark_dirty(stream)
        self.rebalance(stream, time.monotonic())
        stream.flush_writers()

    async def consumers_saved(self, timeout: float = 10.0) -> None:
        """Wait until what was released is stored and freed (at most ``timeout`` s).

        That is: no save of consumer positions in flight, and no stream
        waiting for the producer-state snapshot that its freeing needs
        (written in the consumers' thread). Releases that keep arriving
        meanwhile extend the wait by one save each.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._consumer_saves:
                await asyncio.gather(*list(self._consumer_saves), return_exceptions=True)
            elif any(s.snapshot_pending for s in self.streams.values()):
                await asyncio.sleep(self.config.group_commit_interval_ms / 1000)
            else:
                return

    async def _write_consumers(self, stream: Stream, pending: PendingSave) -> None:
        error: OSError | None = None
        try:
            await asyncio.get_running_loop().run_in_executor(
                self._consumer_executor, stream.consumers.write, pending
            )
        except OSError as exc:
            error = exc
        stream.end_consumer_save(pending, error)
        if error is not None:
            self.mark_dirty(stream)  # the next group commit tries again
            return
        # The next group commit deletes the terms this save freed.
        self._after_freeing(stream)
        self.save_consumers(stream)  # the Releases that came in meanwhile

    def _consumers_stream(self, name: str) -> Stream:
        """The stream a consumer request names; refused if there is none, or not yet."""
        stream = self.streams.get(name)
        if stream is not None:
            return stream
        if self.recovery.recovering(name):
            self.recovery.want(name)
            raise ProtocolError(
                f"stream {name!r} is still being recovered after a restart: try again soon",
                code=ErrorCode.RECOVERING,
            )
        raise ProtocolError(f"no stream called {name!r}", code=ErrorCode.UNEXPECTED_FRAME)

    def declare_consumer(self, declare: m.DeclareConsumer) -> tuple[int, bool]:
        """Create (or find) a named consumer of a stream; its position, and if new.

        A stream not created yet keeps the declaration until it is (see
        :func:`~headgate.gateway.consumers.declare_before_the_stream`): a
        pipeline that starts before its producers holds the stream from its
        first record. Until then the name counts against ``max_streams``.
        """
        name = declare.stream
        settings = ConsumerSettings(
            blocking=declare.blocking, on_data_loss="skip" if declare.skip_data_loss else "fail"
        )
        if (
            name not in self.streams
            and not self.recovery.recovering(name)
            and self.recovery.failure(name) is None
        ):
            if name not in self._declared_ahead and (
                len(self.streams) + self.recovery.count + len(self._declared_ahead)
                >= self.config.max_streams
            ):
                raise ProtocolError(
                    f"stream {name!r} does not exist and the gateway holds its maximum of "
                    f"{self.config.max_streams} streams (with those declared ahead)",
                    code=ErrorCode.RESOURCE_EXHAUSTED,
                )
            answer = declare_before_the_stream(
                name,
                consumers_file(Path(self.config.data_dir), name),
                declare.consumer,
                settings,
                declared=self.config.consumers_for(name),
            )
            self._declared_ahead.add(name)
            return answer
        stream = self._consumers_stream(name)
        return stream.declare_consumer(declare.consumer, settings)

    def change_consumer(self, change: m.ResetConsumer | m.DeleteConsumer) -> int:
        """Reset or delete a consumer (an admin's request); its position now (or last)."""
        stream = self._consumers_stream(change.stream)
        now = time.monotonic()
        if isinstance(change, m.ResetConsumer):
            position = stream.reset_consumer(change.consumer, change.to, now)
        else:
            position = stream.delete_consumer(change.consumer)
        self.mark_dirty(stream)
        self.rebalance(stream, now)
        stream.flush_writers()
        return position

    def consumer_infos(self, name: str) -> tuple[m.ConsumerInfo, ...]:
        """The consumers of stream ``name`` as ListConsumers answers them, by name."""
        stream = self._consumers_stream(name)
        settings = stream.consumers.consumers
        return tuple(
            m.ConsumerInfo(
                consumer=c.name,
                position=c.position,
                lag_bytes=c.lag_bytes,
                lag_ms=round((c.lag_seconds or 0.0) * 1000),
                blocking=c.blocking,
                skip_data_loss=settings[c.name].on_data_loss == "skip",
                detached=c.detached,
                idle=c.idle,
                lag_records=c.lag_records,
            )
            for c in stream.statistics(time.time_ns() // 1000).consumers
        )

    def records_scanned(self, name: str) -> int:
        """Frame headers read so far to count stream ``name``'s records (0: no such stream)."""
        stream = self.streams.get(name)
        return 0 if stream is None else stream.records_scanned

    def record_counts(
        self, name: str, positions: tuple[int, ...]
    ) -> tuple[int, tuple[int | None, ...]]:
        """The record index's epoch, and its count at each of ``positions`` (CountRecords)."""
        stream = self._consumers_stream(name)
        return stream.records.epoch, tuple(stream.count_known(p) for p in positions)

    def check_consumers(self, now: float) -> None:
        """The idle rule of every stream's blocking consumers at ``now`` (housekeeping)."""
        for stream in self.streams.values():
            if stream.expire_retained():
                self.mark_dirty(stream)  # the next commit stores it and deletes the terms
            idle_after, policy = self.config.idle_rule_for(stream.name)
            if any(a.policy == "detach" for a in stream.check_idle(now, idle_after, policy)):
                self.mark_dirty(stream)
                self.rebalance(stream, now)
                stream.flush_writers()

    def detach(self, conn: GatewayConnection) -> None:
        """A connection ended: its writers' unused credit goes back to the pool."""
        if self.connections.pop(conn.conn_id, None) is not None and conn.is_writer:
            self.writer_connections -= 1
        if conn.share is not None:
            self.shares.leave(conn.share, time.monotonic())
            conn.share = None
        self.drop_writers(conn)

    def drop_writers(self, conn: GatewayConnection) -> None:
        """Take the connection's writers off their streams; share out what they held.

        Once per stream, however many handles the connection bound on it.
        """
        streams: dict[str, Stream] = {}
        for writer in conn.writers.values():
            stream = self.streams[writer.stream]
            stream.remove_writer(writer)
            streams[stream.name] = stream
        conn.writers.clear()
        now = time.monotonic()
        for stream in streams.values():
            self.rebalance(stream, now)
            stream.flush_writers()

    def rebalance_soon(self, stream: Stream) -> None:
        """Re-share ``stream``'s credit once, after what this pass of the loop does.

        Binds, frees and Absolves only mark the stream: however many of them
        a peer sends, its streams are rebalanced once per pass, not once per
        frame (a rebalance visits every writer of the stream).
        """
        self._to_rebalance[stream] = None
        if self._rebalance_scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # fed by hand outside a loop: at once
            self.rebalance_marked()
            return
        self._rebalance_scheduled = True
        loop.call_soon(self.rebalance_marked)

    def rebalance_marked(self) -> None:
        """Re-share the credit of the streams :meth:`rebalance_soon` marked."""
        self._rebalance_scheduled = False
        streams, self._to_rebalance = self._to_rebalance, {}
        if self._stopping:
            return  # (the streams may be closed already; nobody needs credit now)
        now = time.monotonic()
        for stream in streams:
            self.rebalance(stream, now)
            stream.flush_writers()

    def statistics(self) -> list[GatewayStreamStatistics]:
        now_us = time.time_ns() // 1000  # consumers' lag in seconds is wall-clock age
        return [s.statistics(now_us) for s in self.streams.values()]

    def snapshot(self) -> GatewaySnapshot:
        """Everything a metrics scrape exposes, now (call on the event loop)."""
        streams = []
        for stats in self.statistics():
            counters = self.counters(stats.name)
            fsync = counters.fsync
            ack = counters.ack_latency
            assert fsync is not None and ack is not None
            streams.append(
                StreamSnapshot(
                    stats=stats,
                    dropped_batches=counters.dropped_batches,
                    fsync_buckets=fsync.cumulative(),
                    fsync_sum=fsync.total,
                    ack_buckets=ack.cumulative(),
                    ack_sum=ack.total,
                )
            )
        return GatewaySnapshot(
            streams=streams,
            connections=self.connection_statistics(),
            queued_messages=len(self.queue),
            durability_loans=self.durability.outstanding(),
            streams_recovering=self.recovery.count,
        )

    def connection_statistics(self) -> list[ConnectionStatistics]:
        """Each connection's account, pauses and receive ring."""
        return [c.statistics() for c in self.connections.values()]

    async def commit(self) -> None:
        """Write what is queued, make every log durable now and send the acks."""
        self.write_messages()
        dirty, self._dirty = list(self._dirty), set()
        await self._commit(dirty)

    # -- background work -------------------------------------------------------------

    async def _commit(self, streams: list[Stream], due: float | None = None) -> bool:
        """Sync ``streams``, then send the acks it allows; False if a stream's sync failed."""
        if not streams:
            return True
        loop = asyncio.get_running_loop()
        trace = self._trace
        woke = time.monotonic()
        # When the fsync thread began and ended (for the trace).
        thread_times = [0.0, 0.0]
        owners = self.owners

        def sync_all() -> tuple[list[float | None], dict[Stream, LogError]]:
            took: list[float | None] = []
            failed: dict[Stream, LogError] = {}
            thread_times[0] = time.monotonic()
            # New producer ids first: the data about to be made durable (and
            # so acknowledged) may be under them (identity.py).
            try:
                owners.sync()
            except OSError as exc:
                error = LogError(f"producer ids table {owners.path} not durable: {exc}")
                thread_times[1] = time.monotonic()
                return [None] * len(streams), dict.fromkeys(streams, error)
            for stream in streams:
                start = time.perf_counter()
                try:
                    stream.log.sync()
                except LogError as exc:
                    failed[stream] = exc
                    took.append(None)
                    continue
                took.append(time.perf_counter() - start)
            try:
                # Claims made while the logs were synced, for data appended
                # under them meanwhile (none: no fsync).
                owners.sync()
            except OSError as exc:
                error = LogError(f"producer ids table {owners.path} not durable: {exc}")
                failed = dict.fromkeys(streams, error)
                took = [None] * len(streams)
            thread_times[1] = time.monotonic()
            return took, failed

        took, failed = await loop.run_in_executor(self._executor, sync_all)
        resumed = time.monotonic()
        for stream, seconds in zip(streams, took, strict=True):
            if seconds is not None:
                fsync = self.counters(stream.name).fsync
                assert fsync is not None
                fsync.observe(seconds)
        for stream in streams:
            # The stream's writers' causes pay for its Acks and credit (turns.SharedWork).
            writers = [
                t
                for w in stream.writers
                if w.account is not None and (t := w.account.turn_of()) is not None
            ]
            with SharedWork(self.passes, writers):
                if stream in failed:
                    # Nothing is acknowledged that is not durable; the stream is
                    # held (logged once) and the next commit tries again.
                    stream.sync_failed(failed[stream])
                    self._dirty.add(stream)
                else:
                    stream.on_durable()
                    self.durability.settle(stream.name, stream.log.durable_position)
                    self.save_consumers(stream)  # one that failed is retried
                now = time.monotonic()
                # A rebalance visits every writer of the stream: under the
                # credit policy, not after each of hundreds of commits a second
                # (binds, frees, Absolves, releases and use rebalance it, and
                # the housekeeping loop every REBALANCE_INTERVAL_S).
                if (
                    self.flow(stream).durability_moves_credit
                    or stream in failed
                    or now - stream.rebalanced_at >= REBALANCE_INTERVAL_S
                ):
                    self.rebalance(stream, now)
                stream.flush_writers()
        if trace is not None:
            trace.commit(
                due,
                woke,
                thread_times[0],
                thread_times[1],
                resumed,
                time.monotonic(),
                [(s.name, s.log.tail_position, t) for s, t in zip(streams, took, strict=True)],
            )
        return not failed

    async def _group_commit(self) -> None:
        interval = self.config.group_commit_interval_ms / 1000
        eager = self.config.group_commit_mode == "eager"
        loop = asyncio.get_running_loop()
        ok = True
        while True:
            if eager and ok:
                # The next commit starts once the last one is done and
                # something waits: a batch waits for at most the rest of the
                # commit under way and its own, never for an interval.
                due = time.monotonic()
                if not self._dirty:
                    self._commit_wanted = loop.create_future()
                    due = await self._commit_wanted
            else:
                # (Eager too, after a failed sync: a failing disk is retried
                # once per interval, not in a loop.)
                due = time.monotonic() + interval
                await asyncio.sleep(interval)
            dirty, self._dirty = list(self._dirty), set()
            try:
                ok = await self._commit(dirty, due)
            except LogError as exc:
                # Nothing is acknowledged that is not durable; producers keep
                # their batches and the next commit tries again.
                log.error("group commit failed: %s", exc)
                self._dirty.update(dirty)
                ok = False
            except Exception:
                # A bug: without this task nothing would ever be acknowledged
                # again, so it is logged and the next interval goes on.
                log.exception("group commit failed")
                ok = False

    async def _rebalance_loop(self) -> None:
        while True:
            await asyncio.sleep(REBALANCE_INTERVAL_S)
            now = time.monotonic()
            self.handshakes.forget_refilled(now)
            self.shares.prune(now)
            try:
                self.check_consumers(now)
            except Exception:
                log.exception("checking consumers failed")
            for stream in self.streams.values():
                if stream.storage_error is not None and stream.retry_storage():
                    self.mark_dirty(stream)
                if stream.writers:
                    self.rebalance(stream, now)
                    stream.flush_writers()
            try:
                self.check_deadlines(now)
            except Exception:
                # A bug, not a peer's doing: this loop also moves all credit.
                log.exception("checking deadlines failed")
            if self._trace is not None:
                self._trace.flush()

    def check_deadlines(self, now: float) -> None:
        """Close the connections past a deadline: idle, a frame, or a Plead.

        A pure function of ``now`` and the state (the loop calls it every
        ``REBALANCE_INTERVAL_S``). A writer that has not absolved what a Plead
        asked within ``plead_deadline_ms`` loses its connection with TIMEOUT,
        and its guarantees go back to the stream at once; but not while the
        gateway itself is not reading the connection (its Absolve may wait
        unread in the socket), nor within ``PLEAD_READ_GRACE_S`` of reading
        again, unless the peer itself is why it is not read
        (:meth:`GatewayConnection.pauses_own_reads`).
        """
        for conn in list(self.connections.values()):
            conn.check_deadlines(now)
        deadline_ms = self.config.plead_deadline_ms
        if deadline_ms <= 0:
            return
        overdue = [
            (stream, writer, amount)
            for stream in self.streams.values()
            for writer, amount in stream.overdue_pleas(now, deadline_ms / 1000)
        ]
        if not overdue:
            return
        by_session = {id(c.session): c for c in self.connections.values()}
        for stream, writer, amount in overdue:
            late = by_session.get(id(writer.session))
            if late is None or late._closing or late.session.closed:
                continue
            if late.deadlines.reading_for(now) < PLEAD_READ_GRACE_S and not late.pauses_own_reads(
                now
            ):
                continue
            late.refuse(
                ProtocolError(
                    f"did not absolve {amount} bytes of stream {stream.name!r} within "
                    f"{deadline_ms} ms of the gateway's Plead",
                    code=ErrorCode.TIMEOUT,
                )
            )
            self.drop_writers(late)
