"""The release client: tells a gateway how far Spark has committed each stream.

Each client commits the positions of one named consumer (``consumer``,
``default`` unless given; see PROTOCOL.md, "Consumers").

The pipeline learns that a micro-batch is committed in Spark's
``StreamingQueryListener``, which runs on a py4j callback thread that Spark
shares with every other listener. So :meth:`ReleaseClient.release` never
waits: it records the newest position of the stream and wakes a background
thread, which owns the connection to the gateway and does the talking.

Releases are cumulative, so only the newest position of each stream matters:
positions that pile up while the gateway is away collapse into one message
per stream. After each burst of Release messages the thread sends a Ping. The
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

import contextlib
import logging
import select
import socket
import ssl
import threading
import time
from dataclasses import dataclass

from headgate.client.address import GatewayAddress
from headgate.client.backoff import Backoff
from headgate.client.link import describe_failure
from headgate.client.security import ClientSecurity, SecurityError
from headgate.config import ConsumerSettings
from headgate.protocol import messages as m
from headgate.protocol.errors import ErrorCode, ProtocolError
from headgate.protocol.session import MessageReceived, Role, Session, WelcomeReceived

__all__ = ["ReleaseClient", "ReleaseStatistics"]

log = logging.getLogger("headgate.release")

_BACKOFF_START = 0.05
_READ_SIZE = 64 * 1024


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
        # The background thread sleeps in select(); a byte on this pair wakes it.
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._thread = threading.Thread(
            target=self._run, name=f"headgate-release-{self.address}", daemon=True
        )
        self._thread.start()

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
        self._wake()

    def flush(self, timeout: float) -> bool:
        """Wait until the gateway confirmed every release so far; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._settled_cv:
            while self._unsettled():
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._thread.is_alive():
                    return False
                self._settled_cv.wait(remaining)
        return True

    def close(self, timeout: float = 5.0) -> bool:
        """Flush (up to ``timeout``), say Goodbye and stop; True if nothing was left unsent."""
        flushed = self.flush(timeout)
        with self._lock:
            self._closing = True
        self._wake()
        self._thread.join(timeout + 1.0)
        if not self._thread.is_alive():
            # (A thread still inside a connection attempt sees _closing and
            # ends by itself; its wake-up pair goes with the object.)
            self._wake_r.close()
            self._wake_w.close()
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
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"\0")

    # -- the background thread ---------------------------------------------------------

    def _run(self) -> None:
        backoff = Backoff(
            time.monotonic(),
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
                sock, session = self._open()
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
                self._sleep(backoff.failed(time.monotonic()) or 0.0)
                continue
            opened = time.monotonic()
            with self._lock:
                self._connected = True
                self._connections += 1
            log.info("releases go to the gateway at %s", self.address)
            try:
                self._serve(sock, session)
            except (OSError, _Closed) as exc:
                self._last_error = _describe(exc)
                if not (isinstance(exc, _Closed) and exc.refused):
                    log.warning("lost the gateway at %s: %s", self.address, self._last_error)
            finally:
                with self._lock:
                    self._connected = False
                sock.close()
            with self._lock:
                if self._closing:
                    return
            # Releases carry no acknowledgement worth the name: only time
            # makes a session healthy.
            pause = backoff.ended(opened, time.monotonic(), progressed=False)
            if pause:
                self._sleep(pause)

    def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(OSError, ValueError):
            select.select([self._wake_r], [], [], seconds)
        self._drain_wake()

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while self._wake_r.recv(4096):
                pass

    def _open(self) -> tuple[socket.socket, Session]:
        """Connect and complete the handshake; return the socket and the open session."""
        token = self._security.token_bytes()
        sock = self.address.connect_socket(self._connect_timeout)
        sock = self._security.wrap_socket(sock, None if self.address.is_unix else self.address.host)
        try:
            # The Welcome must come within connect_timeout: the session's
            # handshake clock.
            session = Session(
                Role.PRODUCER, now=time.monotonic(), handshake_timeout=self._connect_timeout
            )
            session.send_global(m.Hello(producer_id=0, client_name=self._client_name, token=token))
            sock.sendall(session.data_to_send())
            while True:
                due = session.get_timer()
                assert due is not None  # (the handshake clock runs until Welcome)
                sock.settimeout(max(0.01, due - time.monotonic()))
                try:
                    data = sock.recv(_READ_SIZE)
                except TimeoutError:
                    expired = session.handle_timer(time.monotonic())
                    if expired is None:
                        continue  # woken a little early
                    raise _Closed(str(expired.args[0])) from None
                if not data:
                    raise _Closed("the gateway closed the connection before Welcome")
                for event in self._receive(session, sock, data):
                    if isinstance(event, WelcomeReceived):
                        sock.setblocking(False)
                        return sock, session
        except BaseException:
            sock.close()
            raise

    def _receive(self, session: Session, sock: socket.socket, data: bytes) -> list[object]:
        """Feed the session; turn Error and Goodbye into :class:`_Closed`."""
        try:
            events = session.receive_data(data, time.monotonic())
        except ProtocolError as exc:
            with contextlib.suppress(OSError):
                sock.sendall(session.fail(exc))
            raise _Closed(f"the gateway broke the protocol: {exc}") from None
        # The gateway ended the session (the lifecycle's rule; it scopes an
        # Error to a handle only for a writer's stream, which we never bind).
        message = session.ending
        if isinstance(message, m.Error):
            text = f"{message.code.name}: {message.text}"
            refused = message.code in (
                ErrorCode.UNEXPECTED_FRAME,
                ErrorCode.FORBIDDEN,
                ErrorCode.UNKNOWN_CONSUMER,
            )
            raise _Closed(text, refused=refused, code=message.code)
        if isinstance(message, m.Goodbye):
            raise _Closed(f"the gateway said goodbye ({message.code.name})")
        self._send_all(sock, session)  # Pongs for the gateway's Pings
        return list(events)

    def _send_all(self, sock: socket.socket, session: Session) -> None:
        """Write what the session queued; raise if the gateway takes none of it for a while."""
        data = session.data_to_send()
        if not data:
            return
        sock.settimeout(self._connect_timeout)
        try:
            sock.sendall(data)
        finally:
            sock.setblocking(False)
        session.lifecycle.sent(time.monotonic())

    def _serve(self, sock: socket.socket, session: Session) -> None:
        """Send what is wanted, collect Pongs, until the connection ends or we close.

        The session's clocks (its lifecycle) say when a keepalive Ping is
        due, and when the gateway has been silent too long.
        """
        written: dict[str, int] = {}  # positions written on this connection
        declared: set[str] = set()  # streams whose consumer was declared on it
        probes: dict[int, dict[str, int]] = {}  # Ping nonce -> what it confirms
        nonce = 0
        closing_since: float | None = None
        try:
            while True:
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
                    self._send_all(sock, session)
                    with self._lock:
                        self._sent += len(todo)
                expired = session.handle_timer(time.monotonic())
                if expired is not None:
                    raise _Closed(str(expired.args[0]))
                self._send_all(sock, session)  # a keepalive Ping, if one was due
                if closing and not todo and not probes:
                    session.send_global(m.Goodbye(code=ErrorCode.NONE))
                    self._send_all(sock, session)
                    _linger(sock)
                    return
                # While closing, wait only a bounded time for the last Pongs.
                due = session.get_timer()
                wait = 1.0 if due is None else min(1.0, max(0.0, due - time.monotonic()))
                readable, _, _ = select.select([sock, self._wake_r], [], [], wait)
                if self._wake_r in readable:
                    self._drain_wake()
                if sock in readable:
                    self._read(sock, session, probes)
                elif closing and not readable:
                    closing_since = closing_since or time.monotonic()
                    if time.monotonic() - closing_since >= 1.0:
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

    def _read(
        self, sock: socket.socket, session: Session, probes: dict[int, dict[str, int]]
    ) -> None:
        chunks = []
        try:
            chunks.append(sock.recv(_READ_SIZE))
            # TLS may hold decrypted bytes that select() cannot see.
            while isinstance(sock, ssl.SSLSocket) and chunks[-1] and sock.pending():
                chunks.append(sock.recv(_READ_SIZE))
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            if not chunks:
                return
        data = b"".join(chunks)
        if not data:
            raise _Closed("the gateway closed the connection")
        for event in self._receive(session, sock, data):
            if isinstance(event, MessageReceived) and isinstance(event.message, m.Pong):
                confirmed = probes.pop(event.message.nonce, None)
                if confirmed is None:
                    continue
                for older in [n for n in probes if n < event.message.nonce]:
                    del probes[older]
                with self._settled_cv:
                    for stream, position in confirmed.items():
                        if position > self._settled.get(stream, -1):
                            self._settled[stream] = position
                        if position > self._applied.get(stream, -1):
                            self._applied[stream] = position
                    self._settled_cv.notify_all()


def _linger(sock: socket.socket) -> None:
    """Half-close and read to the end, so the gateway gets everything before the close."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(1.0)
        while sock.recv(_READ_SIZE):
            pass


def _describe(exc: BaseException) -> str:
    # Our own reasons (the gateway's words) as they are; the rest as every client words them.
    return str(exc) if isinstance(exc, _Closed) else describe_failure(exc)
