"""The asyncio producer: records in, durable acknowledgements out.

A :class:`Producer` keeps one connection to a gateway and any number of
streams on it. Each stream has an *open batch* (plain lists that
:meth:`Producer.send` appends to), a queue of sealed batches waiting for
credit, and the batches sent but not yet acknowledged. Nothing is per record
except a list append: the records block is encoded when a batch is sealed,
and durability is tracked per batch.

This module is the adapter that wires the rooms, each of which does one job:

- :mod:`~headgate.client.producer_core`: which batch goes next, under which
  sequence number, and what an Ack or a lost connection does to the
  batches held (sans-IO);
- :mod:`~headgate.client.open_batch`: what a record adds to the open batch
  and when the batch is cut (sans-IO);
- :mod:`~headgate.client.buffer_bound`: the bound on a stream's bytes not
  acknowledged, and the line of sends waiting for room (sans-IO);
- :mod:`~headgate.client.batches`: ``send_many``'s records cut into blocks;
- :mod:`~headgate.client.handover`: what a give-up hands back, and what
  :meth:`Producer.resend` takes (sans-IO);
- :mod:`~headgate.client.spooling`: what goes to the spool when, and what
  is sent again from it (sans-IO); :mod:`~headgate.client.spool_sync`:
  a round's bytes leave only after the fsync of its spool entries;
- :mod:`~headgate.client.link`: the connection, its session and timers;
- :mod:`~headgate.client.delivery`, :mod:`~headgate.client.producer_options`
  and :mod:`~headgate.client.producer_statistics`: what callers get back,
  pass in, and read.

What stays here is what needs the event loop: the linger and rebind timers,
awaiting room and acknowledgements, the sending rounds, and reconnecting.

Sending is driven by :meth:`Producer._pump`, called whenever something could
let a batch go out (a seal, guarantees, an initial Ack, a new connection, the
transport draining). It visits only the streams marked as having work, one
batch per stream per round, so a stream without credit never holds up another,
and it hands the socket one write per round.

Every batch stays in memory until the gateway acknowledges it durable, so each
stream holds at most ``max_buffered_bytes`` that are not acknowledged (its
sealed batches and its open batch, however they were sealed): a send that
would go beyond waits, in line, for acknowledgements to make room, and
``send_nowait`` raises :class:`BufferFull` instead.

After a lost connection the producer reconnects with the same producer id,
binds its streams again, learns from each stream's initial Ack where the
gateway's copy ends, forgets what that covers and resends the rest with the
same sequence numbers, which the gateway deduplicates. It tries again with
backoff and gives up after ``reconnect_timeout`` (see
:mod:`headgate.client.backoff`), also when the gateway keeps closing
sessions as soon as they open. Giving up raises :class:`ProducerGaveUp`
with every unacknowledged batch and its sequence, for :meth:`Producer.resend`;
with a spool (:mod:`headgate.client.spool`) they are on disk already, written
before they were sent, for the next producer on the spool.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl as ssl_module
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from headgate.client.address import GatewayAddress
from headgate.client.backoff import Backoff
from headgate.client.batches import encode_blocks, record_bytes
from headgate.client.buffer_bound import BoundedStream
from headgate.client.delivery import BatchResult, Delivery
from headgate.client.errors import (
    BufferFull,
    PendingBatch,
    ProducerError,
    ProducerGaveUp,
    SessionRefused,
    StreamRefused,
)
from headgate.client.handover import pending_of, resend_by_stream
from headgate.client.link import GatewayLink, describe_failure
from headgate.client.open_batch import CUT
from headgate.client.producer_core import Batch
from headgate.client.producer_options import Policy, ProducerOptions, check_options
from headgate.client.producer_statistics import ProducerStatistics, StreamStatistics
from headgate.client.security import ClientSecurity
from headgate.client.spool import Spool
from headgate.client.spool_sync import SyncedWrites
from headgate.client.spooling import ProducerSpool
from headgate.costs import batch_cost
from headgate.protocol import messages as m
from headgate.protocol.errors import ErrorCode, ProtocolError
from headgate.protocol.records import (
    RECORD_OVERHEAD,
)
from headgate.protocol.session import (
    AckReceived,
    Event,
    GuaranteesReceived,
    MessageReceived,
    MessagesDropped,
    Role,
    Session,
    WelcomeReceived,
)

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger("headgate.producer")

__all__ = [
    "BatchResult",
    "Delivery",
    "Policy",
    "Producer",
    "ProducerOptions",
    "ProducerStatistics",
    "StreamStatistics",
]

# The room of a record let in by _wait_room: it goes whatever the bound.
_UNBOUNDED = float("inf")
_BACKOFF_START = 0.05
_BACKOFF_MAX = 2.0
_MIN_ATTEMPT = 0.5
# One connection attempt's bound when the producer never gives up.
_ATTEMPT_WITHOUT_DEADLINE = 10.0

# Codes after which talking to the same gateway again can succeed; any other
# unscoped Error means this producer cannot be served as it is.
_RETRYABLE = frozenset(
    {
        ErrorCode.RESOURCE_EXHAUSTED,
        ErrorCode.STORAGE_UNAVAILABLE,
        ErrorCode.TIMEOUT,
        ErrorCode.SHUTTING_DOWN,
        ErrorCode.INTERNAL,
    }
)


# --- internal state -------------------------------------------------------------


class _Stream(BoundedStream):
    """One stream of the producer: its batches (sealed, open, within the bound) and its waiters."""

    __slots__ = (
        "failure",
        "flush_waiters",
        "handle",
        "rebind",
        "recovery_backoff",
        "refusal_reported",
        "scheduled",
        "storage_full",
    )

    def __init__(self, name: str, bound: int) -> None:
        super().__init__(name, bound)
        # The gateway's STORAGE_FULL notice, until an Ack or guarantees come.
        self.storage_full: str | None = None
        # Per connection: our handle (its initial Ack sets ``ready``).
        self.handle: int | None = None
        # While the gateway is still recovering the stream after a restart
        # (RECOVERING): the pauses between binds, and the next bind's timer.
        self.recovery_backoff: Backoff | None = None
        self.rebind: asyncio.TimerHandle | None = None
        self.scheduled = False
        self.failure: ProducerError | None = None
        self.refusal_reported = False
        self.flush_waiters: list[tuple[int, asyncio.Future[None]]] = []


class _ConnectionFailed(Exception):
    """A connection attempt failed in a way worth retrying."""


class _Fatal(Exception):
    """A connection attempt failed in a way retrying cannot fix."""

    def __init__(self, error: ProducerError) -> None:
        super().__init__(str(error))
        self.error = error


class _Connection(GatewayLink):
    """One connection to the gateway, with what the producer keeps per connection."""

    def __init__(self, producer: Producer, session: Session) -> None:
        # Whole batches go to the transport; the default 64 KiB high-water
        # mark would pause writing after every one of them.
        super().__init__(
            producer, session, write_buffer=max(1 << 20, 4 * producer._max_batch_bytes)
        )
        loop = asyncio.get_running_loop()
        self.opened: asyncio.Future[None] = loop.create_future()
        self.closed: asyncio.Future[str] = loop.create_future()
        self.welcome: m.Welcome | None = None
        self.handles: dict[int, _Stream] = {}
        self.bind_blocked: list[_Stream] = []
        self.reason: str | None = None
        self.fatal: ProducerError | None = None
        # Whether the gateway acknowledged a batch on this connection: what
        # makes a short session healthy (see headgate.client.backoff).
        self.progressed = False
        # With a spool: writes wait for its fsync (headgate.client.spool_sync).
        spooling = producer._spool
        self.synced_writes = (
            None
            if spooling is None
            else SyncedWrites(
                spooling.spool, self.send, lambda: self.writable, producer._spool_failed
            )
        )

    def end(self, reason: str) -> None:
        """Close, remembering the first reason given (what the producer reports)."""
        if self.reason is None:
            self.reason = reason
        self.close()


# --- the producer -------------------------------------------------------------


class Producer:
    """Sends records on named streams to one gateway, with per-stream flow control.

    Args:
        address: the gateway: ``"host:port"``, ``"unix:/path/to.sock"`` or
            ``(host, port)`` (see :mod:`headgate.client.address`).
        producer_id: identity the gateway deduplicates by, below 2**63; reuse
            it to resume after a crash. Random if None.
        producer_secret: what proves to a gateway without a tokens file that
            ``producer_id`` is ours (see README, "Producer identity"). The
            gateway issues it in the first Welcome; the producer keeps it
            (:attr:`producer_secret`) and presents it on every reconnect. To
            resume an earlier producer (after a restart, from a spool), pass
            its ``producer_id`` and this secret together; a gateway with
            tokens ties the id to the token instead and needs none.
        policy: ``"wait"`` sends a batch only within guarantees; ``"optimistic"``
            sends at once and resends what the gateway drops; ``"window"`` is
            ``"wait"`` for streams with the gateway's window policy: each
            batch spends a whole window slot (it absolves the rest), so the
            window counts batches.
        linger_ms: an open batch is sealed this long after its first record,
            full or not.
        max_batch_bytes: the largest records block per batch (also bounded by
            the gateway's max_message_size; batches sealed before its Welcome
            said less are cut to it before they go, records and sequence
            numbers in order).
        max_buffered_bytes: per stream, the most bytes of records the gateway
            has not acknowledged yet (the records blocks of sealed batches,
            queued or in flight, plus the open batch), however its batches
            were sealed. A record that would go beyond it makes ``send`` and
            ``send_many`` wait, and ``send_nowait`` raise :class:`BufferFull`,
            until acknowledgements make room; a record or ``send_many`` call
            larger than the bound goes alone, once the stream holds nothing.
        client_name: shown in the gateway's logs and dashboards.
        reconnect_timeout: how long to keep trying to reach the gateway
            (from the moment ``connect`` starts, or a healthy session is
            lost) before every pending and later call raises
            :class:`ProducerError`. Pauses between attempts grow from 50 ms
            to 2 s. A session the gateway closes before it acknowledged a
            batch and within 5 s (or ``reconnect_timeout``, if shorter) of
            its opening is one more failed attempt, not a fresh start.
            None: never give up (for a device whose gateway may be away for
            hours); the pauses still grow to 2 s, and each attempt is
            bounded by 10 s.
        security: the token (``headgate token`` makes one; sent in Hello)
            and TLS settings, as one :class:`ClientSecurity`, the way every
            client takes them; None: plain TCP without a token. Its token
            is read, and its TLS files loaded, here.
        spool: a directory where every batch is written and fsynced, with
            its sequence, before it is sent, until the gateway acknowledges
            it (see :mod:`headgate.client.spool`). A producer created on a
            spool that holds batches (after a crash, an :meth:`abort` or a
            give-up, when the producer spools all it holds) takes the
            spool's producer id and secret and sends them first, under
            their sequences, so the gateway stores each once. None: no spool.
        spool_max_bytes: the most bytes the spool's files take; a batch
            beyond waits, and so do sends, as for ``max_buffered_bytes``.
        cluster: a cluster file: makes a
            :class:`~headgate.client.fleet.FleetProducer` (as a list of
            addresses for ``address`` does), see below.

    Without a spool, a producer that gives up raises
    :class:`ProducerGaveUp`, whose ``pending`` batches :meth:`resend` sends
    again exactly once from a producer with the same id and secret.

    Use it as ``async with Producer(...) as p:``; leaving the block normally
    flushes and closes, leaving it by an exception aborts.

    ``Producer(cluster="cluster.toml")`` or ``Producer(["gw1:7878", ...])``
    (a list of gateways to bootstrap from) makes a
    :class:`~headgate.client.fleet.FleetProducer` instead: partitioned
    streams over a fleet of gateways, one of these per gateway.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # A fleet: the same call, another class (see headgate.client.fleet).
        address = args[0] if args else kwargs.get("address")
        if cls is Producer and (kwargs.get("cluster") is not None or isinstance(address, list)):
            from headgate.client.fleet import FleetProducer

            kwargs.pop("address", None)
            return FleetProducer(address, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        address: str | tuple[str, int] | GatewayAddress | list[str] | None = None,
        *,
        producer_id: int | None = None,
        producer_secret: bytes | None = None,
        policy: Policy = "wait",
        linger_ms: float = 5.0,
        max_batch_bytes: int = 256 * 1024,
        max_buffered_bytes: int = 64 * 1024 * 1024,
        client_name: str = "headgate-python",
        reconnect_timeout: float | None = 30.0,
        security: ClientSecurity | None = None,
        spool: str | os.PathLike[str] | None = None,
        spool_max_bytes: int = 256 * 1024 * 1024,
        cluster: str | os.PathLike[str] | None = None,
    ) -> None:
        if address is None or isinstance(address, list) or cluster is not None:
            # __new__ made a FleetProducer for a list or a cluster; only None is left.
            raise TypeError("a Producer needs the gateway's address (or cluster=...)")
        explicit_id = producer_id
        security = security or ClientSecurity()
        producer_id, secret = check_options(
            producer_id=producer_id,
            producer_secret=producer_secret,
            policy=policy,
            linger_ms=linger_ms,
            max_batch_bytes=max_batch_bytes,
            max_buffered_bytes=max_buffered_bytes,
            reconnect_timeout=reconnect_timeout,
        )
        self._address = GatewayAddress.parse(address)
        #: The producer id the gateway deduplicates by.
        self.producer_id = producer_id
        # Presented in every Hello once known (see producer_secret).
        self._secret = secret
        self._policy: Policy = policy
        self._optimistic = policy == "optimistic"
        # Window policy: guarantees per batch slot, known from Welcome.
        self._slot = 0
        self._linger = linger_ms / 1000.0
        self._max_batch_bytes = max_batch_bytes
        # The records-block limit: max_batch_bytes until Welcome says less.
        self._limit = max_batch_bytes
        self._max_buffered = max_buffered_bytes
        self._client_name = client_name
        self._reconnect_timeout = reconnect_timeout
        self._token = security.token_bytes()
        self._ssl = security.ssl_context()
        self._server_hostname = security.server_name
        self._streams: dict[str, _Stream] = {}
        self._dirty: deque[_Stream] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: asyncio.Task[None] | None = None
        self._conn: _Connection | None = None
        self._connect_waiters: list[asyncio.Future[None]] = []
        self._failure: ProducerError | None = None
        self._closed = False
        self._reconnects = 0
        self._last_error: str | None = None
        # The spool and its rules (headgate.client.spooling), or None.
        self._spool: ProducerSpool | None = None
        if spool is not None:
            self._open_spool(Path(spool), spool_max_bytes, explicit_id, producer_secret)

    def _open_spool(
        self, directory: Path, max_bytes: int, explicit_id: int | None, secret: bytes | None
    ) -> None:
        """Take the spool's identity (or give it ours) and queue what it holds to be sent again."""
        spool = Spool(directory, max_bytes)
        try:
            self.producer_id, self._secret = ProducerSpool.identity(
                spool,
                self.producer_id,
                self._secret,
                explicit_id=explicit_id,
                explicit_secret=secret,
            )
        except BaseException:
            spool.close()
            raise
        self._spool = ProducerSpool(spool)
        # The loop's clock is the monotonic one.
        self._spool.replay(self._stream, time.monotonic())

    # -- lifecycle --------------------------------------------------------------

    @property
    def address(self) -> GatewayAddress:
        """The gateway's address."""
        return self._address

    @property
    def linger_ms(self) -> float:
        """How long an open batch waits for more records before it is sealed."""
        return self._linger * 1000.0

    @property
    def producer_secret(self) -> bytes | None:
        """The secret that ties :attr:`producer_id` to this producer, or None.

        Issued by a gateway without a tokens file in the first Welcome (or
        given to the constructor). Keep it with the id to resume this
        producer later; it is never logged, nor in :meth:`statistics`.
        None before the first session, and with a token (which owns the id).
        """
        return self._secret or None

    @property
    def connected(self) -> bool:
        """Whether a session with the gateway is open now."""
        return self._conn is not None

    async def connect(self) -> None:
        """Open the session (retrying within ``reconnect_timeout``); idempotent.

        Raises:
            ProducerError: the gateway could not be reached or refused us.
        """
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise ProducerError("the producer is closed")
        if self._conn is not None:
            return
        loop = asyncio.get_running_loop()
        if self._runner is None:
            self._start()
        waiter: asyncio.Future[None] = loop.create_future()
        self._connect_waiters.append(waiter)
        await waiter

    def _start(self) -> None:
        """Start connecting in the background (from the event loop's thread)."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._runner = loop.create_task(self._run(), name="headgate-producer")

    async def close(self) -> None:
        """Flush every stream, say Goodbye and close; idempotent.

        Raises what :meth:`flush` raises, after closing: in particular the
        :class:`ProducerError` of a producer that gave up, so that records
        it could not deliver are never lost silently. :meth:`abort` is the
        quiet way out once that was handled.
        """
        if self._closed:
            return
        delivered = False
        try:
            if self._runner is None and any(s.queue for s in self._streams.values()):
                self._start()  # batches found in the spool still go
            if self._runner is not None:
                await self.flush()
            delivered = True
        finally:
            await self._shutdown(goodbye=True, delivered=delivered)

    async def abort(self) -> None:
        """Close at once; unacknowledged records are lost (their waiters raise)."""
        if not self._closed:
            await self._shutdown(goodbye=False)

    async def __aenter__(self) -> Producer:
        await self.connect()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            await self.close()
        else:
            await self.abort()

    async def _shutdown(self, *, goodbye: bool, delivered: bool = False) -> None:
        self._closed = True
        conn = self._conn
        if conn is not None and conn.writable:
            if goodbye:
                conn.session.send_global(m.Goodbye(code=ErrorCode.NONE))
                conn.flush()
            conn.end("the producer closed")
        runner = self._runner
        if runner is not None and not runner.done():
            runner.cancel()
            try:
                await runner
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise
        self._fail(ProducerError("the producer is closed"))
        spooling = self._spool
        if spooling is not None:
            self._spool = None
            if delivered:
                spooling.spool.clear()  # the gateway has everything; the identity stays
            spooling.spool.close()

    # -- sending ------------------------------------------------------------------

    async def send(self, stream: str, value: bytes, key: bytes | None = None) -> None:
        """Append one record to ``stream``; await the result.

        Completes at once while the stream's buffer has room, and waits,
        in line with the stream's other waiting sends, while the record would
        take the stream's unacknowledged bytes beyond ``max_buffered_bytes``.
        Durability is :meth:`flush`'s business.

        Raises:
            StreamRefused: the gateway refused this stream.
            ProducerError: the producer gave up or is closed.
            ValueError: the record alone exceeds the batch size limit.
        """
        # The fast path: the stream exists and is healthy, there are no keys
        # in the open batch, and the record fits in the batch and in the
        # stream's room. Everything else (and every check that needs to wait
        # or raise) is in _send_slow.
        s = self._streams.get(stream)
        if (
            s is not None
            and key is None
            and s.keys is None
            and s.failure is None
            and type(value) is bytes
        ):
            size = s.open_bytes + len(value) + RECORD_OVERHEAD
            if size <= self._limit and s.buffered + size <= s.room:
                values = s.values
                if not values:
                    self._arm_linger(s)
                values.append(value)
                s.open_bytes = size
                return
        await self._send_slow(stream, value, key)

    def _append_nowait(self, stream: str, value: bytes) -> bool:
        """send()'s fast path for a keyless record, without a coroutine; False to use send().

        For callers that feed many records from inside the loop (the sync
        wrapper's drainer), where a coroutine per record is most of the cost.
        False also when the stream has no room: send() waits for it.
        """
        s = self._streams.get(stream)
        if s is None or s.keys is not None or s.failure is not None or type(value) is not bytes:
            return False
        size = s.open_bytes + len(value) + RECORD_OVERHEAD
        if size > self._limit or s.buffered + size > s.room:
            return False
        values = s.values
        if not values:
            self._arm_linger(s)
        values.append(value)
        s.open_bytes = size
        return True

    async def _send_slow(self, stream: str, value: object, key: object) -> None:
        s = await self._stream_for_send(stream)
        data = value if type(value) is bytes else record_bytes(value, "value")
        key_data = None if key is None else key if type(key) is bytes else record_bytes(key, "key")
        outcome = self._append(s, data, key_data)
        if outcome < 0:
            await self._wait_room(s, -outcome)
            try:
                outcome = self._append(s, data, key_data, admitted=True)
            finally:
                self._admit(s)
        if outcome:
            await self._after_seal(s)
        elif s.handle is None:
            self._pump()  # bind now, so the initial Ack is back before the batch is sealed

    def send_nowait(self, stream: str, value: bytes, key: bytes | None = None) -> None:
        """Append one record to ``stream`` if its buffer has room; never waits.

        For code that must not suspend: it takes the record as :meth:`send`
        does, or raises :class:`BufferFull` where :meth:`send` would wait.
        A stream not bound yet, or a producer not connected yet, is no
        reason to refuse: the record waits for the session with the others
        (the first call starts connecting, so call it from the event loop's
        thread). It never yields to the event loop either, so a loop of
        these calls must await something now and then for batches to go out.

        Raises:
            BufferFull: the record would take the stream beyond ``max_buffered_bytes``
                (or sends are already waiting for room); nothing was taken.
            StreamRefused: the gateway refused this stream.
            ProducerError: the producer gave up or is closed.
            ValueError: the record alone exceeds the batch size limit.
            TypeError: the value or key is not bytes.
        """
        s = self._stream(stream)
        if self._runner is None:
            self._start()
        data = value if type(value) is bytes else record_bytes(value, "value")
        key_data = None if key is None else key if type(key) is bytes else record_bytes(key, "key")
        # As _append, with its common case inline (one call per record).
        outcome = s.append(data, key_data, self._limit, s.room)
        if outcome:  # not APPENDED
            outcome = self._appended(s, data, key_data, outcome)
            if outcome < 0:
                raise BufferFull(stream, self._max_buffered)
        if outcome or s.handle is None:
            self._pump()

    def _append(
        self, s: _Stream, value: bytes, key: bytes | None, *, admitted: bool = False
    ) -> int:
        """Add a record to the open batch, if the stream has room for it.

        Returns True if a full batch was sealed first, False if not, or,
        when the stream has no room for the record (and it was not
        ``admitted`` by :meth:`_wait_room`), minus the bytes it needs, having
        added nothing.

        Raises:
            ValueError: the record does not fit in any batch.
        """
        # s.room settles the common case (room, nobody waiting) as the fast
        # path does; _has_room has the rule for the rest.
        outcome = s.append(value, key, self._limit, _UNBOUNDED if admitted else s.room)
        return self._appended(s, value, key, outcome) if outcome else False

    def _appended(self, s: _Stream, value: bytes, key: bytes | None, outcome: int) -> int:
        """What :meth:`_append` does when the record did not simply go into the open batch.

        ``outcome`` is what :meth:`OpenBatchStream.append` returned, not
        ``APPENDED``: without room, the rule for buffered bytes decides
        (and the record is taken beyond ``s.room`` if it may be); the first
        record of a batch arms its linger timer; a cut batch has work.
        """
        if outcome < 0:
            if s.space_waiters or not self._has_room(s, -outcome):
                return outcome
            outcome = s.append(value, key, self._limit, _UNBOUNDED)
            if not outcome:
                return False
        self._arm_linger(s)
        if outcome == CUT:
            self._mark(s)
            return True
        return False

    async def _after_seal(self, s: _Stream) -> None:
        self._pump()
        # A caller that never suspends would starve the reader of acks and
        # guarantees; one yield per sealed batch keeps them flowing.
        await asyncio.sleep(0)

    # -- the bound on buffered bytes ----------------------------------------------------

    def _spool_full(self) -> bool:
        """Whether a batch waits for room in the spool (then every send waits too)."""
        spooling = self._spool
        return spooling is not None and bool(spooling.waiting)

    def _has_room(self, s: _Stream, needed: int) -> bool:
        """Whether ``needed`` more bytes keep ``s`` within ``max_buffered_bytes``.

        (The rule is :meth:`BoundedStream.has_room`'s.)
        """
        return s.has_room(needed, self._max_buffered, spool_full=self._spool_full())

    async def _wait_room(self, s: _Stream, needed: int) -> None:
        """Wait, behind the stream's earlier waiting sends, until ``needed`` bytes fit.

        The caller appends its records as soon as this returns (without
        suspending), then calls :meth:`_admit` to let the next one in.
        """
        # Only acknowledgements make room, so the open batch goes now
        # rather than after its linger time.
        self._seal(s)
        self._pump()
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = s.wait_in_line(needed, waiter)
        waiters = s.space_waiters
        try:
            self._admit(s)
            await waiter
        except BaseException:
            if entry in waiters:
                waiters.remove(entry)
                self._admit(s)  # it may have been this one's turn
            if s.failure is not None:
                s.refusal_reported = True
            raise
        if waiters and waiters[0] is entry:
            waiters.popleft()
        if s.failure is not None:
            s.refusal_reported = True
            raise s.failure

    def _admit(self, s: _Stream) -> None:
        """Let the first waiting send go if it fits now; with none waiting, reopen the fast path.

        One at a time: a send let in stays first in line until it has
        appended, so that nothing overtakes it, then calls this again.
        """
        s.admit(self._max_buffered, spool_full=self._spool_full())

    async def send_many(
        self,
        stream: str,
        values: Sequence[bytes] | pa.Array | pa.ChunkedArray | pa.RecordBatch | pa.Table,
        keys: Sequence[bytes | None] | pa.Array | pa.ChunkedArray | None = None,
    ) -> Delivery:
        """Send many records at once; await the returned :class:`Delivery` for durability.

        ``values`` is a list of bytes, a pyarrow binary/string array, or a
        RecordBatch/Table with a ``value`` column and an optional ``key``
        column. Arrow input is encoded without a Python loop per record. The
        records are split into batches of at most ``max_batch_bytes`` and
        queued in one go, after anything sent before on the stream, so that
        their sequence numbers are consecutive. Before that it waits, as
        :meth:`send` does, until the stream's buffer has room for all of
        them, or holds nothing for a call larger than ``max_buffered_bytes``.
        """
        s = await self._stream_for_send(stream)
        blocks = encode_blocks(values, keys, self._limit)
        needed = sum(len(block) for block, _ in blocks)
        waited = bool(s.space_waiters) or not self._has_room(s, needed)
        if waited:
            await self._wait_room(s, needed)
        self._seal(s)
        delivery = Delivery(stream)
        assert self._loop is not None
        now = self._loop.time()
        for block, count in blocks:
            self._enqueue(s, block, count, delivery, now)
        if not blocks:
            delivery._result = BatchResult(stream, s.next_sequence or 0, 0, 0)
        if waited:
            self._admit(s)
        self._pump()
        return delivery

    async def flush(self, stream: str | None = None) -> None:
        """Seal open batches and wait until everything sent so far is durable.

        With ``stream``, only that stream. Without, every stream; a stream the
        gateway refused raises its :class:`StreamRefused` once, after the
        other streams are flushed.

        Raises:
            StreamRefused: the stream (or, without ``stream``, one of them) was refused.
            ProducerError: the producer gave up or is closed.
        """
        if stream is not None:
            s = self._streams.get(stream)
            if s is None:
                if self._failure is not None:
                    raise self._failure
                return
            self._seal(s)
            self._pump()
            s.refusal_reported = True
            await self._wait_acked(s)
            return
        if self._failure is not None:
            raise self._failure
        states = list(self._streams.values())
        for s in states:
            self._seal(s)
        self._pump()
        for s in states:
            if s.failure is None:
                await self._wait_acked(s)
        for s in states:
            if s.failure is not None and not s.refusal_reported:
                s.refusal_reported = True
                raise s.failure

    async def _wait_acked(self, s: _Stream) -> None:
        if s.failure is not None:
            raise s.failure
        target = s.sealed_batches
        if s.acked_batches >= target:
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        s.flush_waiters.append((target, waiter))
        await waiter

    async def _stream_for_send(self, name: str) -> _Stream:
        s = self._streams.get(name)
        if s is None or s.failure is not None or self._failure is not None:
            s = self._stream(name)
        if self._conn is None and self._runner is None:
            await self.connect()
        return s

    def _stream(self, name: str) -> _Stream:
        """The stream to send on, made on first use; raises its failure or the producer's."""
        if self._failure is not None:
            raise self._failure
        s = self._streams.get(name)
        if s is None:
            if not isinstance(name, str):
                raise TypeError(f"a stream name must be a str, not {type(name).__name__}")
            # The gateway would refuse a bad name only after a round trip;
            # the encoder knows the rules now.
            m.encode_message(m.BindStream(stream=name))
            s = self._streams[name] = _Stream(name, self._max_buffered)
            self._mark(s)
        if s.failure is not None:
            s.refusal_reported = True
            raise s.failure
        return s

    def _pending_batches(self) -> dict[str, list[PendingBatch]]:
        """Every stream's records not acknowledged, as batches: what a give-up hands back."""
        pending: dict[str, list[PendingBatch]] = {}
        for s in self._streams.values():
            if s.failure is None and (batches := pending_of(s)):
                pending[s.name] = batches
        return pending

    def resend(
        self, pending: Mapping[str, Iterable[PendingBatch]] | Iterable[PendingBatch]
    ) -> dict[str, Delivery]:
        """Send again the batches an earlier producer could not deliver, exactly once.

        ``pending`` is :attr:`ProducerGaveUp.pending` (or its batches in a
        list). This producer must have the earlier one's ``producer_id``
        (and ``producer_secret``), and must not have sent on those streams
        yet. Numbered batches go under their own sequences, so the gateway
        drops those it stored already (its acknowledgement was lost); the
        others are numbered after them. Call it from the event loop; await
        the returned deliveries (one per stream) or :meth:`flush`.

        Raises:
            ValueError: a stream was already used by this producer, or its
                numbered batches are out of order or after unnumbered ones.
        """
        by_stream = resend_by_stream(pending, self._used)
        deliveries: dict[str, Delivery] = {}
        now = time.monotonic()  # the loop's clock; resent batches are timed from here
        for name, stream_batches in by_stream.items():
            s = self._stream(name)
            delivery = deliveries[name] = Delivery(name)
            for batch in stream_batches:
                delivery._add(batch.record_count)
                s.adopt(batch.block, batch.record_count, delivery, now, batch.first_sequence)
            self._mark(s)
        if self._runner is None:
            self._start()
        self._pump()
        return deliveries

    def _used(self, name: str) -> bool:
        """Whether this producer took records on stream ``name`` already."""
        s = self._streams.get(name)
        return s is not None and (s.used or bool(s.values))

    # -- batches ------------------------------------------------------------------

    def _arm_linger(self, s: _Stream) -> None:
        # Called for the open batch's first record: its latency starts now.
        loop = self._loop
        assert loop is not None
        s.opened_at = now = loop.time()
        s.linger = loop.call_at(now + self._linger, self._linger_expired, s)

    def _linger_expired(self, s: _Stream) -> None:
        s.linger = None
        if s.values:
            self._seal(s)
            self._pump()

    def _seal(self, s: _Stream) -> None:
        if s.seal() is not None:
            self._mark(s)

    def _enqueue(
        self, s: _Stream, block: bytes, count: int, delivery: Delivery | None, opened_at: float
    ) -> Batch:
        batch = s.enqueue(block, count, delivery, opened_at)
        if delivery is not None:
            delivery._add(count)
        self._mark(s)
        return batch

    def _mark(self, s: _Stream) -> None:
        if not s.scheduled:
            s.scheduled = True
            self._dirty.append(s)

    def _pump(self) -> None:
        """Bind streams and send batches that may go now; write once."""
        conn = self._conn
        if conn is None or not conn.writable:
            return
        session = conn.session
        dirty = self._dirty
        optimistic = self._optimistic
        chunk = max(1 << 20, 4 * self._max_batch_bytes)
        while dirty and not conn.paused:
            s = dirty.popleft()
            s.scheduled = False
            if s.failure is not None:
                continue
            handle = s.handle
            if handle is None:
                if s.rebind is not None:
                    continue  # the gateway is recovering it: bound when the pause ends
                if s.queue or s.values:
                    handle = session.bind_stream(s.name)
                    if handle is None:
                        conn.bind_blocked.append(s)
                    else:
                        s.handle = handle
                        conn.handles[handle] = s
                # Batches wait for the stream's initial Ack in any case.
                continue
            try:
                batch = s.front(self._limit)
            except ValueError:
                self._too_large(s)
                continue
            if batch is None:
                continue
            spooling = self._spool
            if spooling is not None and not batch.spooled and not self._spool_room(s, batch):
                continue  # an acknowledgement marks the stream again
            s.number(batch)
            if spooling is not None:
                # Durable before its bytes leave: _write syncs the spool first.
                try:
                    spooling.write(s, batch)
                except OSError as exc:
                    self._spool_failed(exc)
                    return
            # can_send_batch first: a refused send_batch would still have
            # copied the whole batch.
            if not optimistic and not session.can_send_batch(handle, len(batch.block)):
                continue  # no credit: GuaranteesReceived marks the stream again
            session.send_batch(handle, batch.first_sequence, batch.block, optimistic=optimistic)
            if self._slot:
                self._spend_slot(session, handle, len(batch.block))
            s.sent()
            if s.queue:
                self._mark(s)  # back of the line: one batch per stream per round
            if session.pending_output >= chunk:
                self._write(conn)
        self._write(conn)

    def _spool_room(self, s: _Stream, batch: Batch) -> bool:
        """Whether the spool can take ``batch`` now; if not, ``s`` waits, and so do sends."""
        spooling = self._spool
        assert spooling is not None
        waits = spooling.full
        if spooling.room(s, batch, self._streams.values()):
            return True
        if spooling.full != waits:  # the first batch to wait: sends queue behind it
            for t in self._streams.values():
                if not t.space_waiters:
                    t.room = 0  # (see _admit)
        return False

    def _spool_failed(self, exc: OSError) -> None:
        """The spool cannot be written (a full or failing disk): nothing more may be sent."""
        spooling = self._spool
        where = "" if spooling is None else f" {spooling.spool.directory}"
        self._fail(ProducerError(f"cannot write the spool{where}: {exc}"))
        if self._conn is not None:
            self._conn.end("the spool failed")

    def _spend_slot(self, session: Session, handle: int, block_length: int) -> None:
        # Window policy: a batch takes a whole slot, whatever its size.
        rest = self._slot - session.batch_cost(block_length)
        held = session.outbound(m.data_channel(handle)).guarantees
        if rest > 0 and held > 0:
            session.absolve(handle, min(rest, held))

    def _write(self, conn: _Connection) -> None:
        data = conn.session.data_to_send()
        if data and conn.writable:
            synced_writes = conn.synced_writes
            if synced_writes is None:
                conn.send(data)
            else:
                synced_writes.write(data)

    # -- connection management -------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        # A session the gateway closes soon after it opened counts as a
        # failed attempt: backoff and deadline go on (no reconnect storm).
        backoff = Backoff(
            loop.time(),
            give_up_after=self._reconnect_timeout,
            first=_BACKOFF_START,
            longest=_BACKOFF_MAX,
        )
        while True:
            deadline = backoff.deadline
            try:
                conn = await self._open(deadline)
            except _Fatal as exc:
                self._fail(exc.error)
                return
            except (OSError, TimeoutError, _ConnectionFailed) as exc:
                self._last_error = describe_failure(exc)
                pause = backoff.failed(loop.time())
            else:
                opened = loop.time()
                reason = await conn.closed
                if conn.fatal is not None:
                    self._fail(conn.fatal)
                    return
                if self._closed:
                    return
                self._last_error = reason
                self._reconnects += 1
                pause = backoff.ended(opened, loop.time(), progressed=conn.progressed)
            if pause is None:
                try:
                    if self._spool is not None:
                        self._spool.spool_everything(
                            s for s in self._streams.values() if s.failure is None
                        )
                except OSError as exc:
                    log.error("cannot write the spool on giving up: %s", exc)
                self._fail(
                    ProducerGaveUp(
                        f"gave up on the gateway at {self._address} after trying for "
                        f"{self._reconnect_timeout:g} s; last error: {self._last_error}",
                        producer_id=self.producer_id,
                        producer_secret=self.producer_secret,
                        pending=self._pending_batches(),
                    )
                )
                return
            if pause > 0:
                await asyncio.sleep(pause)

    async def _open(self, deadline: float | None) -> _Connection:
        loop = asyncio.get_running_loop()
        session = Session(
            Role.PRODUCER, data_cost=batch_cost, optimistic=self._optimistic, now=loop.time()
        )
        session.send_global(
            m.Hello(
                producer_id=self.producer_id,
                client_name=self._client_name,
                token=self._token,
                flags=m.HelloFlags.OPTIMISTIC if self._optimistic else m.HelloFlags.NONE,
                secret=self._secret,
            )
        )
        transport: asyncio.Transport | None = None
        try:
            # The attempt right at the deadline still gets a fair chance, so
            # that its error (say, refused) is what the give-up reports.
            attempt = (
                _ATTEMPT_WITHOUT_DEADLINE
                if deadline is None
                else max(_MIN_ATTEMPT, deadline - loop.time())
            )
            async with asyncio.timeout(attempt):
                transport, conn = await self._address.connect(
                    lambda: _Connection(self, session),
                    ssl=self._ssl,
                    server_hostname=self._server_hostname,
                )
                await conn.opened
        except ssl_module.SSLCertVerificationError as exc:
            # Trying again will meet the same certificate.
            raise _Fatal(
                ProducerError(
                    f"the gateway at {self._address} failed TLS verification: {exc.verify_message}"
                )
            ) from None
        except BaseException:
            if transport is not None:
                transport.abort()
            raise
        return conn

    # The link's reports (headgate.client.link.LinkOwner); each names its
    # connection, which is not the current one any more after it was lost.

    def link_events(self, link: GatewayLink, events: Iterable[Event]) -> None:
        conn = cast("_Connection", link)
        for event in events:
            if isinstance(event, AckReceived):
                self._on_ack(conn, event.ack)
            elif isinstance(event, GuaranteesReceived):
                if event.handle is None:
                    for blocked in conn.bind_blocked:
                        self._mark(blocked)
                    conn.bind_blocked.clear()
                else:
                    granted = conn.handles.get(event.handle)
                    if granted is not None:
                        if event.amount > 0:
                            # Guarantees after STORAGE_FULL end it; the
                            # channel's opening zero guarantee does not.
                            granted.storage_full = None
                        self._mark(granted)
            elif isinstance(event, MessageReceived):
                self._on_message(conn, event.message)
            elif isinstance(event, WelcomeReceived):
                self._attach(conn, event.welcome)
            elif isinstance(event, MessagesDropped) and event.handle is not None:
                dropped = conn.handles.get(event.handle)
                if dropped is not None:
                    dropped.batches_dropped += event.count
        if conn.session.ending is None:  # else link_ending follows and closes
            self._pump()

    def link_broken(self, link: GatewayLink, error: ProtocolError) -> None:
        conn = cast("_Connection", link)
        conn.fatal = ProducerError(f"the gateway at {self._address} broke the protocol: {error}")
        conn.end(str(conn.fatal))

    def link_expired(self, link: GatewayLink, reason: str) -> None:
        cast("_Connection", link).end(reason)

    def link_drained(self, link: GatewayLink) -> None:
        self._pump()

    def _on_message(self, conn: _Connection, message: m.GlobalMessage) -> None:
        # (An Error about the whole session is its ending: link_ending.)
        if (
            isinstance(message, m.Error)
            and (scope := message.scope) is not None
            and scope.handle_type is m.HandleType.STREAM
        ):
            s = conn.handles.get(scope.handle)
            if s is not None and message.code is ErrorCode.STORAGE_FULL:
                # A notice, not a refusal: the gateway keeps what it
                # has and sends guarantees again once it can store.
                s.storage_full = message.text or "the gateway's storage is full"
            elif s is not None and message.code is ErrorCode.RECOVERING:
                self._bind_again_later(conn, s, scope.handle, message.text)
            elif s is not None:
                self._refuse(s, StreamRefused(s.name, message.code, message.text))

    def link_ending(self, link: GatewayLink, message: m.Goodbye | m.Error) -> None:
        """The gateway ended the session (the lifecycle's rule): close, maybe for good."""
        refused = isinstance(message, m.Error)
        if refused:
            text = f"the gateway at {self._address} refused the session ({message.code.name})"
        else:
            text = f"the gateway said goodbye ({message.code.name})"
        if message.text:
            text += f": {message.text}"
        conn = cast("_Connection", link)
        if refused and message.code not in _RETRYABLE:
            conn.fatal = SessionRefused(text, message.code, message.text)
        conn.end(text)

    def _bind_again_later(self, conn: _Connection, s: _Stream, handle: int, text: str) -> None:
        """The gateway is still recovering stream ``s`` after its restart: bind it again soon.

        Nothing was sent on the refused handle (batches wait for the bind's
        Ack), so it is freed and a new bind follows a pause from the same
        schedule as reconnecting (:class:`Backoff`: growing pauses, and the
        stream is given up with ``RECOVERING`` after ``reconnect_timeout``).
        The stream's records stay queued meanwhile, unnumbered, so what is
        sent once the gateway takes the bind is stored exactly once.
        """
        loop = self._loop
        assert loop is not None
        now = loop.time()
        if s.recovery_backoff is None:
            s.recovery_backoff = Backoff(
                now,
                give_up_after=self._reconnect_timeout,
                first=_BACKOFF_START,
                longest=_BACKOFF_MAX,
            )
        conn.handles.pop(handle, None)
        s.handle = None
        s.ready = False
        with contextlib.suppress(ValueError):
            conn.session.free_stream(handle)
        pause = s.recovery_backoff.failed(now)
        if pause is None:
            self._refuse(
                s,
                StreamRefused(
                    s.name,
                    ErrorCode.RECOVERING,
                    f"{text} (still recovering after {self._reconnect_timeout:g} s)",
                ),
            )
            return
        s.rebind = loop.call_later(pause, self._bind_again, s)

    def _bind_again(self, s: _Stream) -> None:
        s.rebind = None
        self._mark(s)
        self._pump()

    def _attach(self, conn: _Connection, welcome: m.Welcome) -> None:
        loop = self._loop
        assert loop is not None
        conn.welcome = welcome
        self._conn = conn
        if welcome.producer_secret:
            # Ours from now on: every later Hello proves the id with it.
            self._secret = welcome.producer_secret
            if self._spool is not None:
                # Before any batch is spooled (none is numbered before an Ack).
                self._spool.spool.write_identity(self.producer_id, self._secret)
        self._limit = min(self._max_batch_bytes, welcome.max_message_size - m.BATCH_HEADER_SIZE)
        if self._policy == "window":
            self._slot = batch_cost(welcome.max_message_size)
        conn.start_timer()
        for s in self._streams.values():
            if s.failure is None and (s.queue or s.values):
                self._mark(s)
        if not conn.opened.done():
            conn.opened.set_result(None)
        for waiter in self._connect_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._connect_waiters.clear()

    def link_lost(self, link: GatewayLink, exc: Exception | None) -> None:
        conn = cast("_Connection", link)
        if conn.reason is not None:
            reason = conn.reason
        elif exc is not None:
            reason = f"connection lost: {describe_failure(exc)}"
        else:
            reason = "the gateway closed the connection"
        if self._conn is conn:
            self._detach(conn)
        if not conn.opened.done():
            if conn.fatal is not None:
                conn.opened.set_exception(_Fatal(conn.fatal))
            else:
                conn.opened.set_exception(_ConnectionFailed(reason))
            # Retrieved here so that an attempt nobody awaits any more
            # (timed out) leaves no "never retrieved" warning.
            conn.opened.exception()
        if not conn.closed.done():
            conn.closed.set_result(reason)

    def _detach(self, conn: _Connection) -> None:
        self._conn = None
        conn.stop_timer()
        for s in self._streams.values():
            s.connection_lost()
            s.handle = None
            if s.rebind is not None:
                # A new connection binds at once; the give-up deadline runs on.
                s.rebind.cancel()
                s.rebind = None
        conn.handles.clear()
        conn.bind_blocked.clear()

    # -- acknowledgements and failures ------------------------------------------------

    def _on_ack(self, conn: _Connection, ack: m.Ack) -> None:
        s = conn.handles.get(ack.handle)
        if s is None or s.failure is not None:
            return
        s.storage_full = None  # no Ack comes while the gateway cannot store
        next_sequence = ack.next_sequence
        assert self._loop is not None
        now = self._loop.time()
        if not s.ready:
            # The stream's initial Ack: where the gateway's copy of our
            # sequence ends (see StreamBatches.resume).
            s.recovery_backoff = None
            renumbered = s.resume(next_sequence, ack.durable_position, now)
            if self._spool is not None:
                self._spool.respool(s, renumbered)
            self._mark(s)
        elif s.ack(next_sequence, ack.durable_position, now):
            conn.progressed = True
        if self._spool is not None:
            waited = self._spool.acked(s, next_sequence)
            if waited:
                # Room may have been made: waiting batches and sends try again.
                for t in waited:
                    self._mark(cast("_Stream", t))
                for t in self._streams.values():
                    self._admit(t)
        self._wake(s)

    def _too_large(self, s: _Stream) -> None:
        """A record of ``s`` exceeds the gateway's frame limit, learnt after it was taken."""
        self._refuse(
            s,
            StreamRefused(
                s.name,
                ErrorCode.FRAME_TOO_LARGE,
                f"a record does not fit in a batch of at most {self._limit} bytes "
                "(the gateway's max_message_size)",
            ),
        )

    def _wake(self, s: _Stream) -> None:
        if s.flush_waiters:
            acked = s.acked_batches
            remaining = []
            for target, waiter in s.flush_waiters:
                if target <= acked:
                    if not waiter.done():
                        waiter.set_result(None)
                else:
                    remaining.append((target, waiter))
            s.flush_waiters = remaining
        if s.space_waiters:
            self._admit(s)

    def _refuse(self, s: _Stream, error: ProducerError) -> None:
        """Stream ``s`` can deliver nothing more: fail everything waiting on it."""
        if s.failure is not None:
            return
        s.failure = error
        s.discard_open()
        if s.rebind is not None:
            s.rebind.cancel()
            s.rebind = None
        for batch in s.clear():
            if batch.delivery is not None:
                batch.delivery._fail(error)
        for _, waiter in s.flush_waiters:
            if not waiter.done():
                waiter.set_exception(error)
        s.flush_waiters.clear()
        for _, waiter in s.space_waiters:
            if not waiter.done():
                waiter.set_exception(error)
        s.space_waiters.clear()

    def _fail(self, error: ProducerError) -> None:
        """The producer can deliver nothing more."""
        if self._failure is None:
            self._failure = error
        for s in self._streams.values():
            self._refuse(s, error)
        for waiter in self._connect_waiters:
            if not waiter.done():
                waiter.set_exception(error)
        self._connect_waiters.clear()

    # -- statistics ---------------------------------------------------------------

    def statistics(self) -> ProducerStatistics:
        """A snapshot of the producer and each of its streams."""
        conn = self._conn
        # The loop's clock, which the acks were timed on (no loop yet: no acks).
        now = self._loop.time() if self._loop is not None else 0.0
        spooling = self._spool
        streams: dict[str, StreamStatistics] = {}
        for name, s in self._streams.items():
            guarantees = None
            if conn is not None and s.handle is not None:
                guarantees = conn.session.outbound(m.data_channel(s.handle)).guarantees
            refused = None
            if isinstance(s.failure, StreamRefused):
                refused = str(s.failure)
            streams[name] = StreamStatistics.of(
                s,
                now,
                records_spooled=0 if spooling is None else spooling.records_spooled.get(name, 0),
                guarantees=guarantees,
                refused=refused,
                storage_full=s.storage_full,
            )
        return ProducerStatistics(
            producer_id=self.producer_id,
            address=self._address,
            policy=self._policy,
            connected=conn is not None,
            reconnects=self._reconnects,
            last_error=self._last_error,
            failure=str(self._failure) if self._failure is not None else None,
            streams=streams,
            spool_bytes=None if spooling is None else spooling.spool.bytes_used,
            spool_full=0 if spooling is None else spooling.full,
        )
