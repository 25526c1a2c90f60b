"""Admission: who may come in, and how many of each kind may be in at once.

A peer passes these doors, each with its own limit from ``GatewayConfig``:

- a TLS handshake is the dearest thing a peer can ask for before it has
  said anything, so it is admitted first (``handshake_rate`` per address,
  ``max_pending_handshakes`` in all; :meth:`Admission.admit_handshake`);
- a connection takes a slot (``max_connections``), and the last
  ``writer_slots`` of them are kept for writers: a connection that gets one
  must bind a stream to write within the handshake timeout
  (:meth:`Admission.attach`, :meth:`Admission.hold_writer_slot`);
- its Hello's token is authenticated (``auth``), and with a tokens file the
  peers of one token may hold at most ``connections_per_token``, paying
  from the token's work budget (``budget``) instead of their address's
  (:meth:`Admission.pay_as_token`).

These are one room, apart from the connection that asks and the gateway
that owns it, so that every limit on who is in is read in one place. What
a peer may do once in (its rights on each stream, its stream quota) is
checked by the connection as its frames arrive; who writes for a producer
id is :mod:`headgate.gateway.identity`'s rule.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from headgate.config import GatewayConfig
from headgate.gateway.auth import ALL_RIGHTS, Rights, TokenTable, load_tokens
from headgate.gateway.budget import (
    UNITS_PER_MS,
    HandshakeBudgets,
    PeerShare,
    PeerShares,
    address_key,
    token_key,
)
from headgate.protocol.errors import ErrorCode, ProtocolError


class Entrant(Protocol):
    """A connection as admission sees it."""

    conn_id: int
    #: Whether it has bound a stream to write (it holds a writer slot).
    is_writer: bool
    #: The work budget it pays from (its address's, then its token's).
    share: PeerShare | None


C = TypeVar("C", bound=Entrant)


class Admission(Generic[C]):
    """The gateway's doors: connection slots, TLS handshakes, tokens and their shares.

    ``config`` returns the gateway's configuration now (a reload may
    replace it); the budgets are sized from it once, here.
    """

    def __init__(self, config: Callable[[], GatewayConfig]) -> None:
        self._config = config
        settings = config()
        #: Every connection that holds a slot, by id.
        self.connections: dict[int, C] = {}
        #: The work budgets, shared per token (per address before Hello, or
        #: without a tokens file).
        rate = settings.work_budget_ms * UNITS_PER_MS
        self.shares = PeerShares(rate, rate)
        #: TLS handshakes each address may start, and how many are in progress.
        self.handshakes = HandshakeBudgets(
            settings.handshake_rate,
            max_hold=settings.handshake_timeout_ms / 1000,
            max_held=settings.max_pending_handshakes,
        )
        self.tls_pending = 0
        #: Connections that have bound a stream to write (they hold writer slots).
        self.writer_connections = 0
        #: Accepted tokens, or None when every peer may do anything.
        self.tokens: TokenTable | None = (
            None if settings.auth_file is None else load_tokens(settings.auth_file)
        )

    def attach(self, conn: C) -> str | None:
        """Count a new connection in: in which slot, or None if it is one too many.

        ``"any"``: an ordinary slot. ``"writer"``: only the slots kept for
        writers are left, and it holds one on condition that it binds a
        stream to write within the handshake timeout.
        """
        config = self._config()
        if len(self.connections) >= config.max_connections:
            return None
        self.connections[conn.conn_id] = conn
        others = len(self.connections) - 1 - self.writer_connections
        if others >= config.max_connections - config.writer_slots_kept:
            return "writer"
        return "any"

    def detach(self, conn: C) -> None:
        """A connection ended: its slot and its share of the work budget are given back."""
        if self.connections.pop(conn.conn_id, None) is not None and conn.is_writer:
            self.writer_connections -= 1
        if conn.share is not None:
            self.shares.leave(conn.share, time.monotonic())
            conn.share = None

    def hold_writer_slot(self, conn: C) -> bool:
        """``conn`` bound a stream to write: it is a writer; True if it was not one yet."""
        if conn.is_writer:
            return False
        conn.is_writer = True
        self.writer_connections += 1
        return True

    def writer_slot_expired(self) -> ProtocolError:
        """Why a connection in a slot kept for writers is closed when it bound nothing in time."""
        config = self._config()
        return ProtocolError(
            f"the last {config.writer_slots_kept} of {config.max_connections} connection "
            f"slots are kept for writers, and this connection bound no stream to write "
            f"within {config.handshake_timeout_ms:.0f} ms",
            code=ErrorCode.RESOURCE_EXHAUSTED,
        )

    def admit_handshake(self, host: str) -> str | None:
        """Why a new TLS connection from ``host`` may not start its handshake, or None."""
        config = self._config()
        if self.tls_pending >= config.max_pending_handshakes:
            return f"{self.tls_pending} TLS handshakes are already in progress"
        if not self.handshakes.admit(address_key(host), time.monotonic()):
            return f"more than {config.handshake_rate:g} TLS handshakes a second from {host}"
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

    def pay_as_token(self, conn: C, rights: Rights | None) -> None:
        """Hello accepted: with a tokens file, ``conn`` pays from (and counts in) the token's share.

        Raises:
            ProtocolError: the token's peers already hold ``connections_per_token``.
        """
        if self.tokens is None or rights is None or conn.share is None:
            return  # without tokens, the address's share stays
        held = self.shares.get(token_key(rights.name))
        cap = self._config().token_connections
        if held is not None and held.connections >= cap:
            raise ProtocolError(
                f"token {rights.name!r} holds its maximum of {cap} connections",
                code=ErrorCode.RESOURCE_EXHAUSTED,
            )
        old = conn.share
        conn.share = self.shares.join(token_key(rights.name), time.monotonic())
        self.shares.leave(old, time.monotonic())

    def forget_idle(self, now: float) -> None:
        """Drop the handshake budgets and shares that are full again (housekeeping)."""
        self.handshakes.forget_refilled(now)
        self.shares.prune(now)
