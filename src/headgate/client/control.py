"""The release client: tells a gateway how far Spark has committed each stream.

Each client commits the positions of one named consumer (``consumer``,
``default`` unless given; see PROTOCOL.md, "Consumers").

The pipeline learns that a micro-batch is committed in Spark's
``StreamingQueryListener``, which runs on a py4j callback thread that Spark
shares with every other listener. So :meth:`ReleaseClient.release` never
waits: it records the newest position of the stream and wakes the client's
own event loop, which runs in a background thread
(:mod:`headgate.client.background_loop`) and does the talking over the same
:class:`~headgate.client.link.GatewayLink` as the Producer and the Reader:
the link connects, runs the session and its timers (keepalive Ping, idle and
handshake timeouts: the lifecycle's rules), and writes; this module decides
what to write.

Releases are cumulative, so only the newest position of each stream matters:
positions that pile up while the gateway is away collapse into one message
per stream. After each burst of Release messages the client sends a Ping. The
gateway handles messages in order, so its Pong proves that every Release
before it was applied; only then is a position *settled*. Positions that are
not settled when a connection is lost are sent again on the next one
(a Release at or below the gateway's current position changes nothing, so
sending one twice is harmless). The connection is re-established with
exponential backoff, forever, until :meth:`ReleaseClient.close`; a session
that the gateway closes within seconds of its opening counts as a failed
attempt, so the pauses keep growing (:mod:`headgate.client.backoff`).

A gateway that answers a Release with an Error (an unknown stream or
consumer, or a position beyond its log's tail, as after a gateway lost data it had not made
durable) closes the connection. Which Release it refused is not said, so
every position written on that connection counts as settled, the refusal is
logged, and the client reconnects: the next commit brings a newer position.
The same goes for a token without the ``admin`` right (``FORBIDDEN``): each
refused release is logged as an error. A gateway that does not know the
token (``UNAUTHENTICATED``) is logged as an error and tried again with the
backoff, as tokens files can be reloaded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import ssl
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

from headgate.client.address import GatewayAddress
from headgate.client.background_loop import BackgroundLoop
from headgate.client.backoff import Backoff
from headgate.client.link import GatewayLink, describe_failure
from headgate.client.security import ClientSecurity, SecurityError
from headgate.config import ConsumerSettings
from headgate.protocol import messages as m
from headgate.protocol.errors import ErrorCode, ProtocolError
from headgate.protocol.session import Event, MessageReceived, Role, Session, WelcomeReceived

__all__ = ["ReleaseClient", "ReleaseStatistics"]

log = logging.getLogger("headgate.release")

_BACKOFF_START = 0.05
# While closing: how long the gateway may stay silent, twice over, before
# the Pongs still awaited are given up (close() reports what they covered).
_CLOSING_SILENCE = 1.0


@dataclass(frozen=True, slots=True)
class ReleaseStatistics:
    """A snapshot of a release client."""

    #: Whether a session with the gateway is open now.
    connected: bool
    #: How many sessions were opened (1 after the first connect).
    connections: int
    #: Release messages written to a connection.
    releases_sent: int
    #: Connections the gateway closed with an Error after our releases.
    refusals: int
    #: Per stream, the newest position the gateway confirmed having applied.
    applied: dict[str, int]
    #: Per stream, the newest position done with: applied, or given up after a refusal.
    settled: dict[str, int]
    #: Per stream, the newest position asked for and not settled yet.
    pending: dict[str, int]
    #: The last connection problem, or None.
    last_error: str | None


class _Closed(Exception):
    """The connection ended; the message says why."""

    def __init__(
        self, reason: str, *, refused: bool = False, code: ErrorCode = ErrorCode.NONE
    ) -> None:
        super().__init__(reason)
        self.refused = refused
        self.code = code


class _Connection(GatewayLink):
    """One connection's link, and what the client keeps per connection."""

    def __init__(self, client: ReleaseClient, session: Session) -> None:
        super().__init__(client, session)
        loop = asyncio.get_running_loop()
        #: Resolved by the Welcome; fails with the :class:`_Closed` of an early end.
        self.opened: asyncio.Future[None] = loop.create_future()
        #: Why the connection ended; the first reason counts.
        self.ended: asyncio.Future[_Closed] = loop.create_future()
        #: Resolved once the transport is gone.
        self.gone: asyncio.Future[None] = loop.create_future()
        #: Positions written on this connection.
        self.written: dict[str, int] = {}
        #: Ping nonce -> the positions its Pong confirms.
        self.probes: dict[int, dict[str, int]] = {}

    def end(self, closed: _Closed) -> bool:
        """The connection ended; True if this is its first end (the one that counts)."""
        if self.ended.done():
            return False
        self.ended.set_result(closed)
        if not self.opened.done():
            self.opened.set_exception(closed)
            # Retrieved here: an attempt given up meanwhile leaves no warning.
            self.opened.exception()
        return True


class ReleaseClient:
    """Sends Release(stream, position) to a gateway, from any thread, never blocking.

    Args:
        address: the gateway, ``host:port`` or ``unix:PATH``
            (see :mod:`headgate.client.address`).
        client_name: shown in the gateway's logs.
        connect_timeout: how long one connection attempt (connect and
            handshake) may take.
        max_backoff: the longest pause between two connection attempts.
        security: token and TLS settings (:class:`ClientSecurity`); Release
            needs a token with the ``admin`` right, or a ``consume`` pattern
            matching ``stream/consumer``, on a gateway with tokens.
        consumer: the consumer whose positions this client commits, on every
            stream it releases (see PROTOCOL.md, "Consumers"); the default,
            ``default``, is the one consumer of a stream declaring none, and
            of a data directory from before consumers.
        declare: if given, the consumer is declared with these settings
            (DeclareConsumer) on each connection, before its first Release of
            each stream: created at the stream's oldest held position if the
            gateway does not have it, left alone if it does (with other
            settings the gateway refuses, and the refusal is logged).

    Use it as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        address: str | tuple[str, int] | GatewayAddress,
        *,
        client_name: str = "headgate-pipeline",
        connect_timeout: float = 5.0,
        max_backoff: float = 2.0,
        security: ClientSecurity | None = None,
        consumer: str = m.DEFAULT_CONSUMER,
        declare: ConsumerSettings | None = None,
    ) -> None:
        if connect_timeout <= 0 or max_backoff <= 0:
            raise ValueError("connect_timeout and max_backoff must be positive")
        if not m.is_valid_name(consumer):
            raise ValueError(f"{consumer!r} is not a consumer name")
        #: The consumer every Release of this client names.
        self.consumer = consumer
        self._declare = declare
        self.address = GatewayAddress.parse(address)
        self._security = security or ClientSecurity()
        # Fail now, in the caller's thread, on settings that cannot work.
        self._security.check_address(self.address)
        self._security.ssl_context()
        self._client_name = client_name
        self._connect_timeout = connect_timeout
        self._max_backoff = max_backoff
        self._lock = threading.Lock()
        self._settled_cv = threading.Condition(self._lock)
        self._wanted: dict[str, int] = {}
        self._settled: dict[str, int] = {}
        self._applied: dict[str, int] = {}
        self._closing = False
        self._connected = False
        self._connections = 0
        self._sent = 0
        self._refusals = 0
        self._last_error: str | None = None
        # The loop waits on this between its rounds: set by a release or
        # close (through the loop: _wake), the last Pong awaited while
        # closing, and the connection's end. Only the first two cut a
        # pause between connection attempts short (``_called``).
        self._wakeup = asyncio.Event()
        self._called = False
        # A wake-up is on its way to the loop (under _lock): a burst of
        # releases costs the loop one, not one each.
        self._wake_pending = False
        self._background = BackgroundLoop(f"headgate-release-{self.address}")
        self._runner = self._background.submit(self._run())

    # -- the caller's side ----------------------------------------------------------

    def release(self, stream: str, position: int) -> None:
        """The consumer committed everything of ``stream`` before ``position``; returns at once."""
        if not m.is_valid_name(stream):
            raise ValueError(f"{stream!r} is not a stream name")
        if not 0 <= position < 1 << 64:
            raise ValueError(f"position must be an unsigned 64-bit integer, got {position}")
        with self._lock:
            if self._closing:
                raise RuntimeError("the release client is closed")
            if position <= self._wanted.get(stream, -1):
                return
            self._wanted[stream] = position
            if self._wake_pending:
                return  # the loop has yet to look: it will see this one too
            self._wake_pending = True
        self._wake()

    def flush(self, timeout: float) -> bool:
        """Wait until the gateway confirmed every release so far; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._settled_cv:
            while self._unsettled():
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._runner.done():
                    return False
                self._settled_cv.wait(remaining)
        return True

    def close(self, timeout: float = 5.0) -> bool:
        """Flush (up to ``timeout``), say Goodbye and stop; True if nothing was left unsent."""
        flushed = self.flush(timeout)
        with self._lock:
            self._closing = True
            self._wake_pending = True
        self._wake()
        concurrent.futures.wait([self._runner], timeout + 1.0)
        # (What still runs, a connection attempt, is cancelled.)
        self._background.stop()
        if not flushed:
            with self._lock:
                unsettled = self._unsettled()
            log.warning(
                "closing with releases the gateway at %s did not confirm: %s",
                self.address,
                unsettled,
            )
        return flushed

    def __enter__(self) -> ReleaseClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def statistics(self) -> ReleaseStatistics:
        """A snapshot of what was sent, settled and is still pending."""
        with self._lock:
            return ReleaseStatistics(
                connected=self._connected,
                connections=self._connections,
                releases_sent=self._sent,
                refusals=self._refusals,
                applied=dict(self._applied),
                settled=dict(self._settled),
                pending=self._unsettled(),
                last_error=self._last_error,
            )

    def _unsettled(self) -> dict[str, int]:
        return {s: p for s, p in self._wanted.items() if p > self._settled.get(s, -1)}

    def _wake(self) -> None:
        self._background.call(self._on_call)

    def _on_call(self) -> None:
        with self._lock:
            self._wake_pending = False  # what comes later wakes the loop again
        self._called = True
        self._wakeup.set()

    # -- the background loop ---------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._connect_forever()
        except Exception:
            log.exception("the release client for the gateway at %s stopped", self.address)
            raise

    async def _connect_forever(self) -> None:
        loop = asyncio.get_running_loop()
        backoff = Backoff(
            loop.time(),
            give_up_after=None,
            first=_BACKOFF_START,
            longest=self._max_backoff,
            jitter=0.0,
        )
        while True:
            with self._lock:
                if self._closing:
                    return
            try:
                conn = await self._open()
            except (OSError, _Closed, SecurityError) as exc:
                with self._lock:
                    if self._closing:
                        return
                reason = _describe(exc)
                if reason != self._last_error:
                    level = logging.WARNING
                    if isinstance(exc, SecurityError | ssl.SSLError) or (
                        isinstance(exc, _Closed) and exc.code is ErrorCode.UNAUTHENTICATED
                    ):
                        level = logging.ERROR  # waiting will not fix it by itself
                    log.log(level, "cannot reach the gateway at %s: %s", self.address, reason)
                self._last_error = reason
                await self._sleep(backoff.failed(loop.time()) or 0.0)
                continue
            opened = loop.time()
            with self._lock:
                self._connected = True
                self._connections += 1
            log.info("releases go to the gateway at %s", self.address)
            try:
                await self._serve(conn)
            except _Closed as exc:
                self._last_error = _describe(exc)
                if not exc.refused:
                    log.warning("lost the gateway at %s: %s", self.address, self._last_error)
            finally:
                with self._lock:
                    self._connected = False
                conn.abort()
            with self._lock:
                if self._closing:
                    return
            # Releases carry no acknowledgement worth the name: only time
            # makes a session healthy.
            pause = backoff.ended(opened, loop.time(), progressed=False)
            if pause:
                await self._sleep(pause)

    async def _sleep(self, seconds: float) -> None:
        """Pause ``seconds``, or less if a release or close comes (or came) meanwhile."""
        if not self._called:
            self._wakeup.clear()  # (set by the connection's end)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._wakeup.wait()
        self._wakeup.clear()
        self._called = False

    async def _open(self) -> _Connection:
        """Connect and complete the handshake; return the open connection."""
        token = self._security.token_bytes()
        context = self._security.ssl_context()
        loop = asyncio.get_running_loop()

        def link() -> _Connection:
            # The Welcome must come within connect_timeout of the connection:
            # the session's handshake clock, which the link runs.
            session = Session(
                Role.PRODUCER, now=loop.time(), handshake_timeout=self._connect_timeout
            )
            session.send_global(m.Hello(producer_id=0, client_name=self._client_name, token=token))
            return _Connection(self, session)

        async with asyncio.timeout(self._connect_timeout):
            _, conn = await self.address.connect(
                link, ssl=context, server_hostname=self._security.server_name
            )
        try:
            conn.start_timer()
            await conn.opened
        except BaseException:
            conn.abort()
            raise
        return conn

    async def _serve(self, conn: _Connection) -> None:
        """Send what is wanted until the connection ends or we close; Pongs settle it.

        The link runs the session's clocks (its lifecycle): keepalive Pings,
        and the end of a gateway silent too long. Pongs are taken as they
        arrive (:meth:`link_events`).
        """
        loop = asyncio.get_running_loop()
        session = conn.session
        written = conn.written
        probes = conn.probes
        declared: set[str] = set()  # streams whose consumer was declared on it
        nonce = 0
        closing_since: float | None = None
        wakeup = self._wakeup
        try:
            while True:
                wakeup.clear()
                self._called = False  # what it asked for is read below
                if conn.ended.done():
                    raise conn.ended.result()
                with self._lock:
                    closing = self._closing
                    todo = {
                        s: p
                        for s, p in self._wanted.items()
                        if p > max(written.get(s, -1), self._settled.get(s, -1))
                    }
                if todo:
                    for stream, position in sorted(todo.items()):
                        if self._declare is not None and stream not in declared:
                            declared.add(stream)
                            session.send_global(
                                m.DeclareConsumer(
                                    request_id=len(declared),
                                    stream=stream,
                                    consumer=self.consumer,
                                    blocking=self._declare.blocking,
                                    skip_data_loss=self._declare.on_data_loss == "skip",
                                )
                            )
                        session.send_global(
                            m.Release(stream=stream, position=position, consumer=self.consumer)
                        )
                    written.update(todo)
                    nonce += 1
                    probes[nonce] = dict(written)
                    session.send_global(m.Ping(nonce=nonce))
                    conn.flush()
                    with self._lock:
                        self._sent += len(todo)
                if closing and not todo and not probes:
                    session.send_global(m.Goodbye(code=ErrorCode.NONE))
                    conn.flush()
                    await _linger(conn)
                    return
                # Until a release, close(), the last Pong or the
                # connection's end wakes us; while closing, a bounded time.
                try:
                    async with asyncio.timeout(_CLOSING_SILENCE if closing else None):
                        await wakeup.wait()
                except TimeoutError:
                    closing_since = closing_since or loop.time()
                    if loop.time() - closing_since >= _CLOSING_SILENCE:
                        probes.clear()  # the gateway is silent; close() reports the rest
        except _Closed as exc:
            if exc.refused:
                # Which Release was refused is not said: give up on all of them
                # rather than send the bad one again forever.
                log.error("the gateway at %s refused a release: %s", self.address, exc)
                with self._settled_cv:
                    self._refusals += 1
                    for stream, position in written.items():
                        if position > self._settled.get(stream, -1):
                            self._settled[stream] = position
                    self._settled_cv.notify_all()
            raise

    # The link's reports (headgate.client.link.LinkOwner), on the loop; each
    # names its connection.

    def link_events(self, link: GatewayLink, events: Iterable[Event]) -> None:
        conn = cast("_Connection", link)
        if conn.session.ending is not None:
            # link_ending follows: a Pong that came with the gateway's Error
            # confirms nothing (the refusal settles what was written).
            return
        for event in events:
            if isinstance(event, MessageReceived) and isinstance(event.message, m.Pong):
                self._confirmed(conn, event.message.nonce)
            elif isinstance(event, WelcomeReceived):
                conn.start_timer()  # from the handshake's clock to keepalive and idle
                if not conn.opened.done():
                    conn.opened.set_result(None)
        conn.flush()  # Pongs for the gateway's Pings

    def _confirmed(self, conn: _Connection, nonce: int) -> None:
        """A Pong: the Releases before its Ping are applied."""
        probes = conn.probes
        confirmed = probes.pop(nonce, None)
        if confirmed is None:
            return
        for older in [n for n in probes if n < nonce]:
            del probes[older]
        with self._settled_cv:
            for stream, position in confirmed.items():
                if position > self._settled.get(stream, -1):
                    self._settled[stream] = position
                if position > self._applied.get(stream, -1):
                    self._applied[stream] = position
            self._settled_cv.notify_all()
        if self._closing and not probes:
            self._wakeup.set()  # a closing client waits for the last Pong

    def link_ending(self, link: GatewayLink, message: m.Goodbye | m.Error) -> None:
        # The gateway ended the session (the lifecycle's rule; it scopes an
        # Error to a handle only for a writer's stream, which we never bind).
        if isinstance(message, m.Error):
            text = f"{message.code.name}: {message.text}"
            refused = message.code in (
                ErrorCode.UNEXPECTED_FRAME,
                ErrorCode.FORBIDDEN,
                ErrorCode.UNKNOWN_CONSUMER,
            )
            self._ended(link, _Closed(text, refused=refused, code=message.code))
        else:
            self._ended(link, _Closed(f"the gateway said goodbye ({message.code.name})"))

    def link_broken(self, link: GatewayLink, error: ProtocolError) -> None:
        self._ended(link, _Closed(f"the gateway broke the protocol: {error}"))

    def link_expired(self, link: GatewayLink, reason: str) -> None:
        self._ended(link, _Closed(reason))

    def link_lost(self, link: GatewayLink, exc: Exception | None) -> None:
        conn = cast("_Connection", link)
        if exc is not None:
            self._ended(conn, _Closed(describe_failure(exc)))
        elif not conn.opened.done():
            self._ended(conn, _Closed("the gateway closed the connection before Welcome"))
        else:
            self._ended(conn, _Closed("the gateway closed the connection"))
        if not conn.gone.done():
            conn.gone.set_result(None)

    def link_drained(self, link: GatewayLink) -> None:
        pass  # a few small messages at a time; the transport buffers them

    def _ended(self, link: GatewayLink, closed: _Closed) -> None:
        if cast("_Connection", link).end(closed):
            self._wakeup.set()  # (a later report of the same end must not cut a pause short)


async def _linger(conn: _Connection) -> None:
    """Half-close and wait for the gateway's close, so it gets everything before ours."""
    transport = conn.transport
    if transport is not None and transport.can_write_eof():
        with contextlib.suppress(OSError, RuntimeError):
            transport.write_eof()
    await asyncio.wait([conn.gone], timeout=1.0)
    conn.close()


def _describe(exc: BaseException) -> str:
    # Our own reasons (the gateway's words) as they are; the rest as every client words them.
    return str(exc) if isinstance(exc, _Closed) else describe_failure(exc)
