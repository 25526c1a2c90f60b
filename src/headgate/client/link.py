"""One connection to a gateway and its protocol session: what every client shares.

The :class:`~headgate.client.Producer`, the :class:`~headgate.client.Reader`
and the :class:`~headgate.client.ReleaseClient` each talk to a gateway over
one :class:`GatewayLink`: it opens the
connection (TCP, TLS or a Unix socket, :mod:`headgate.client.address`), feeds
what arrives to the sans-IO :class:`~headgate.protocol.session.Session`,
answers a peer that breaks the protocol with the session's Error, runs the
session's timers (keepalive Ping, idle timeout: the lifecycle decides when
and why, :mod:`headgate.protocol.lifecycle`), and writes what the session
queued. What the events mean is its owner's business (:class:`LinkOwner`).

:func:`describe_failure` is the one wording of why a connection failed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Protocol

from headgate.client.security import SecurityError, describe_tls_failure
from headgate.protocol import messages as m
from headgate.protocol.errors import ProtocolError
from headgate.protocol.session import Event, Session

__all__ = ["GatewayLink", "LinkOwner", "describe_failure"]


class LinkOwner(Protocol):
    """The client a link reports to; each call comes from the event loop."""

    def link_events(self, link: GatewayLink, events: Iterable[Event]) -> None:
        """What the session made of bytes that arrived (Welcome included)."""

    def link_ending(self, link: GatewayLink, message: m.Goodbye | m.Error) -> None:
        """The gateway ended the session (a Goodbye, or an Error about all of it)."""

    def link_broken(self, link: GatewayLink, error: ProtocolError) -> None:
        """The gateway broke the protocol; the link answered with an Error and closes."""

    def link_expired(self, link: GatewayLink, reason: str) -> None:
        """The gateway was silent past the idle timeout (or the handshake's); the link aborts."""

    def link_lost(self, link: GatewayLink, exc: Exception | None) -> None:
        """The connection is gone."""

    def link_drained(self, link: GatewayLink) -> None:
        """The transport's buffer went below its low-water mark: writing may go on."""


class GatewayLink(asyncio.Protocol):
    """One connection and its session; the owner does the thinking.

    Args:
        owner: who hears what happens (:class:`LinkOwner`).
        session: the session, with its Hello queued: it is written as soon
            as the connection is made.
        write_buffer: the transport's high-water mark, where the owner
            writes whole batches (None: asyncio's default).
    """

    def __init__(
        self, owner: LinkOwner, session: Session, *, write_buffer: int | None = None
    ) -> None:
        self.owner = owner
        self.session = session
        self.transport: asyncio.Transport | None = None
        #: Whether the transport asked us to stop writing (its buffer is full).
        self.paused = False
        self._write_buffer = write_buffer
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._lost = False

    # -- asyncio's side --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if self._write_buffer is not None:
            transport.set_write_buffer_limits(high=self._write_buffer, low=self._write_buffer // 4)
        self.flush()

    def data_received(self, data: bytes) -> None:
        session = self.session
        if self._lost or session.closed:
            return
        try:
            events = session.receive_data(data, self._loop.time())
        except ProtocolError as error:
            if self.transport is not None:
                self.transport.write(session.fail(error))
            self.owner.link_broken(self, error)
            self.close()
            return
        self.owner.link_events(self, events)
        if session.ending is not None:
            self.owner.link_ending(self, session.ending)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self.stop_timer()
        self.owner.link_lost(self, exc)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self.owner.link_drained(self)

    # -- the owner's side --

    @property
    def writable(self) -> bool:
        """Whether bytes written now would go out (the connection is neither closing nor gone)."""
        transport = self.transport
        return transport is not None and not transport.is_closing()

    def send(self, data: bytes) -> None:
        """Write ``data`` (the session's bytes) now; the session's keepalive clock learns of it."""
        transport = self.transport
        if data and transport is not None and not transport.is_closing():
            transport.write(data)
            self.session.lifecycle.sent(self._loop.time())

    def flush(self) -> None:
        """Write what the session queued."""
        self.send(self.session.data_to_send())

    def start_timer(self) -> None:
        """Wake for the session's next timer (from Welcome on: keepalive and idle)."""
        self.stop_timer()
        due = self.session.get_timer()
        if due is not None and not self._lost:
            self._timer = self._loop.call_at(due, self._on_timer)

    def stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        """A keepalive Ping, or the gateway's silence past the idle timeout."""
        self._timer = None
        if self._lost or self.session.closed:
            return
        expired = self.session.handle_timer(self._loop.time())
        if expired is not None:
            self.owner.link_expired(self, str(expired.args[0]))
            self.abort()
            return
        self.flush()  # the Ping, if one was due
        self.start_timer()

    def close(self) -> None:
        """Close after what is written went out."""
        self.stop_timer()
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        """Close at once, dropping what is not written."""
        self.stop_timer()
        if self.transport is not None:
            self.transport.abort()


def describe_failure(exc: BaseException) -> str:
    """Why a connection attempt or a connection failed, in a few words, for logs and errors."""
    tls = describe_tls_failure(exc)
    if tls is not None:
        return tls
    if isinstance(exc, SecurityError):
        return str(exc)
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, FileNotFoundError):
        return "no such socket"
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
