"""The gateway: an asyncio server that turns frames into log appends and credit.

Each connection is a :class:`GatewayConnection` driving one sans-IO
:class:`~headgate.protocol.session.Session`. The receive path is one small
seam, :meth:`GatewayConnection.feed`: bytes in, session events handled, bytes
out. A later change replaces what calls it (a preallocated ring buffer read
with ``BufferedProtocol``) without touching what it does.

Who gets in and what a peer can make the gateway hold are decided here too,
with the pieces in their own modules: TLS (``tls``), tokens and rights
(``auth``: a Hello is authenticated, a bind is checked against the token's
write patterns and stream quota, a Release against its admin right), turns
and slices of received bytes (``turns``), and the budget of credit-free
frames (``budget``). Timeouts (handshake, idle) and the cap on bytes queued
for a peer that does not read are per connection, from ``GatewayConfig``.

Durability is a group commit: a task wakes every ``group_commit_interval_ms``,
fsyncs every log with new appends in a worker thread, then sends the
cumulative acks that the new durable positions allow.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import ssl
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from headgate.config import GatewayConfig
from headgate.costs import batch_cost
from headgate.gateway.auth import ALL_RIGHTS, Rights, TokenTable, load_tokens
from headgate.gateway.budget import FrameBudget
from headgate.gateway.streams import Stream, StreamStatistics, Writer
from headgate.gateway.tls import server_context
from headgate.gateway.turns import TurnTaker
from headgate.log import LogError
from headgate.protocol import messages as m
from headgate.protocol.errors import ErrorCode, ProtocolError
from headgate.protocol.session import (
    Absolved,
    BatchDropped,
    BatchReceived,
    Event,
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
#: How often idle writers are re-checked and credit re-shared.
REBALANCE_INTERVAL_S = 0.1


class GatewayConnection(asyncio.Protocol):
    """One peer: a producer, a pipeline reporting releases, or a reader."""

    def __init__(self, gateway: Gateway, conn_id: int, *, tls: bool = False) -> None:
        self.gateway = gateway
        self.conn_id = conn_id
        self.session = Session(
            Role.GATEWAY,
            max_message_size=gateway.config.max_message_size,
            data_cost=batch_cost,
        )
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.producer_id = 0
        self.writers: dict[int, Writer] = {}
        self._handshake: asyncio.TimerHandle | None = None
        self._closing = False
        #: What the peer may do; None until its Hello is accepted.
        self.rights: Rights | None = None
        #: Stream handles of the peer's that were refused (nothing is stored for them).
        self.refused: dict[int, str] = {}
        #: Event-loop time of the last bytes received (for the idle timeout).
        self.last_received = 0.0
        self._idle: asyncio.TimerHandle | None = None
        self._tls_pending = tls
        self._tls_task: asyncio.Task[None] | None = None
        self._early: list[bytes] = []
        self._write_paused = False
        self._backlogged = False
        self._turns = TurnTaker(
            self._receive, self.flush, self._set_backlogged, lambda: self._closing
        )
        rate = gateway.config.max_control_rate
        self._budget = FrameBudget(rate, rate, time.monotonic())

    # -- asyncio.Protocol -----------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer or "unix")
        loop = asyncio.get_running_loop()
        self.last_received = loop.time()
        config = self.gateway.config
        self._handshake = loop.call_later(
            config.handshake_timeout_ms / 1000, self._handshake_expired
        )
        if not self.gateway.attach(self):
            if self._tls_pending:
                log.warning("refused %s: too many connections", self.peer)
                self._closing = True
                transport.abort()
            else:
                self.refuse(
                    ProtocolError("too many connections", code=ErrorCode.RESOURCE_EXHAUSTED)
                )
            return
        if self._tls_pending:
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
            if not self._closing:
                log.warning("refused %s: TLS handshake failed: %s", self.peer, exc or "timeout")
            self._closing = True
            raw.abort()
            self.connection_lost(None)
            return
        if tls is None or self._closing:
            # Cut off meanwhile (the handshake timeout), and logged then.
            raw.abort()
            if tls is not None:
                tls.abort()
            return
        self._tls_pending = False
        self.transport = tls
        early, self._early = self._early, []
        for data in early:
            self.data_received(data)

    def data_received(self, data: bytes) -> None:
        if self._tls_pending:
            # Reading was paused until the TLS layer took over, so these are
            # decrypted bytes that came with the end of the handshake, before
            # start_tls returned the transport to answer on: keep them.
            self._early.append(data)
            return
        self.last_received = asyncio.get_running_loop().time()
        self._turns.received(data)

    def pause_writing(self) -> None:
        # The peer does not read what we send: stop reading what it sends,
        # so that nothing it makes us produce can pile up here.
        self._write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._update_reading()

    def _set_backlogged(self, backlogged: bool) -> None:
        self._backlogged = backlogged
        self._update_reading()

    def _update_reading(self) -> None:
        transport = self.transport
        if transport is None or self._closing or self._tls_pending:
            return
        if self._write_paused or self._backlogged:
            transport.pause_reading()
        else:
            transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._handshake is not None:
            self._handshake.cancel()
        if self._idle is not None:
            self._idle.cancel()
        self._turns.cancel()
        self.gateway.detach(self)

    @property
    def buffered_bytes(self) -> int:
        """Bytes this connection holds in memory: a partial frame in, output not yet sent."""
        queued = 0
        if self.transport is not None and not self._tls_pending:
            queued = self.transport.get_write_buffer_size()
        return (
            self._turns.backlog
            + self.session.receive_buffered
            + self.session.pending_output
            + queued
        )

    # -- the receive seam ------------------------------------------------------

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Bytes from the peer: hand them to the session, act, answer."""
        self._receive(data)
        self.flush()

    def _receive(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing:
            return
        session = self.session
        control = session.control_received
        try:
            events = session.receive_data(data)
            spent = session.control_received - control
            for event in events:
                if type(event) is BatchDropped:
                    spent += 1
                self._handle(event)
            if spent:
                wait = self._budget.charge(spent, time.monotonic())
                if wait > 0:
                    self._turns.hold(wait)
        except ProtocolError as error:
            self.refuse(error)
            return
        except LogError as error:
            log.error("stream storage failed for %s: %s", self.peer, error)
            self.refuse(ProtocolError(str(error), code=ErrorCode.STORAGE_UNAVAILABLE))

    def flush(self) -> None:
        """Write whatever the session has queued, in one write."""
        if self.transport is None or self._closing:
            return
        out = self.session.data_to_send()
        if out:
            self.transport.write(out)
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
        if self._idle is not None:
            self._idle.cancel()
        transport = self.transport
        if self._tls_pending:
            transport.abort()  # nothing can be said before TLS is up
            self.connection_lost(None)  # the TLS layer may never report it
            return
        if data:
            transport.write(data)
        transport.close()
        asyncio.get_running_loop().call_later(CLOSE_GRACE_S, transport.abort)

    def _handshake_expired(self) -> None:
        if self._tls_pending and not self._closing:
            log.warning("refused %s: TLS handshake failed: not finished in time", self.peer)
            self.close_with(b"")
        elif not self.session.opened and not self._closing:
            self.refuse(ProtocolError("no Hello in time", code=ErrorCode.TIMEOUT))

    def _arm_idle(self, delay: float) -> None:
        self._idle = asyncio.get_running_loop().call_later(delay, self._idle_check)

    def _idle_check(self) -> None:
        if self._closing:
            return
        timeout = self.gateway.config.idle_timeout_ms / 1000
        silent = asyncio.get_running_loop().time() - self.last_received
        if silent >= timeout:
            self.refuse(
                ProtocolError(f"nothing received for {silent:.1f} s", code=ErrorCode.TIMEOUT)
            )
        else:
            self._arm_idle(timeout - silent)

    def _bind_refusal(self, name: str) -> ProtocolError | None:
        """Why the peer may not bind stream ``name``, or None if it may."""
        rights = self.rights
        assert rights is not None
        if not rights.can_write(name):
            return ProtocolError(
                f"token {rights.name!r} may not write stream {name!r}", code=ErrorCode.FORBIDDEN
            )
        gw = self.gateway
        if name in gw.streams:
            return None
        quota = rights.max_streams
        if quota is None:
            quota = gw.config.streams_per_token
        if gw.tokens is not None and gw.created_by.get(rights.name, 0) >= quota:
            return ProtocolError(
                f"token {rights.name!r} created its maximum of {quota} streams",
                code=ErrorCode.RESOURCE_EXHAUSTED,
            )
        if len(gw.streams) >= gw.config.max_streams:
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
        log.warning("refused stream %r to %s: %s", name, self.peer, error)
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
            case BatchReceived() if event.handle not in self.writers:
                # A refused stream's channel has no buffer, so this cannot
                # happen; if it did, the batch is let go, never stored.
                self.session.process(event.handle, reissue=False)
            case BatchReceived():
                writer = self.writers[event.handle]
                stream = gw.streams[event.stream]
                stream.append(
                    writer,
                    event.first_sequence,
                    event.record_count,
                    event.records,
                    now=time.monotonic(),
                    timestamp_us=time.time_ns() // 1000,
                )
                gw.mark_dirty(stream)
            case StreamBound(handle=handle, stream=name) if (
                refusal := self._bind_refusal(name)
            ) is not None:
                self.refuse_stream(handle, name, refusal)
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
                )
                self.writers[handle] = writer
                stream.add_writer(writer)
                # Tell the producer where its sequence numbers resume.
                stream.announce_resume(writer)
                stream.rebalance(time.monotonic())
            case HelloReceived(hello=hello):
                if self._handshake is not None:
                    self._handshake.cancel()
                if hello.producer_id >= 1 << 63:
                    # Spark reads producer ids as a signed long.
                    raise ProtocolError(
                        f"producer id {hello.producer_id} must be below 2**63",
                        code=ErrorCode.BAD_HELLO,
                    )
                self.rights = gw.authenticate(hello.token)
                self.producer_id = hello.producer_id
                self.session.send_global(
                    m.Welcome(
                        server_name=gw.name,
                        max_message_size=gw.config.max_message_size,
                        idle_timeout_ms=gw.config.idle_timeout_ms,
                    )
                )
                self.session.grant(m.STREAM_CHANNEL, gw.config.bind_budget)
                if gw.config.idle_timeout_ms > 0:
                    self._arm_idle(gw.config.idle_timeout_ms / 1000)
            case Absolved(handle=handle) if handle is not None and handle in self.writers:
                # The absolved space is free now: share it with who pleaded for it.
                self._rebalance_handle(handle)
            case HandleDeleted(handle=handle, ours=False):
                # The binding's bytes are bind-channel space again.
                self.session.issue(m.STREAM_CHANNEL)
                self.refused.pop(handle, None)
                if handle in self.writers:
                    writer = self.writers.pop(handle)
                    stream = gw.streams[writer.stream]
                    stream.remove_writer(writer)
                    stream.rebalance(time.monotonic())
            case MessageReceived(message=m.Release(stream=name, position=position)):
                assert self.rights is not None
                if not self.rights.can_administer():
                    raise ProtocolError(
                        f"token {self.rights.name!r} may not release stream positions",
                        code=ErrorCode.FORBIDDEN,
                    )
                gw.release(name, position)
            case MessageReceived(message=m.Goodbye()):
                self.close_with(self.session.data_to_send())
            case _:
                pass

    def _rebalance_handle(self, handle: int) -> None:
        self.gateway.streams[self.writers[handle].stream].rebalance(time.monotonic())


class Gateway:
    """The headgate gateway. ``await start()``, serve, ``await stop()``."""

    def __init__(self, config: GatewayConfig, *, name: str = "headgate") -> None:
        self.config = config.validate()
        self.name = name
        self.streams: dict[str, Stream] = {}
        self.connections: dict[int, GatewayConnection] = {}
        self._ids = itertools.count(1)
        self._servers: list[asyncio.Server] = []
        self._dirty: set[Stream] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="headgate-fsync")
        self._stopping = False
        self.address: tuple[str, int] = config.listen
        #: The listener's TLS context, or None for plain TCP.
        self.ssl_context = server_context(self.config)
        #: New streams created by the peers of each token, by token name.
        self.created_by: dict[str, int] = {}
        #: Accepted tokens, or None when every peer may do anything.
        self.tokens: TokenTable | None = (
            None if self.config.auth_file is None else load_tokens(self.config.auth_file)
        )

    # -- lifecycle ---------------------------------------------------------------

    async def start(self) -> None:
        """Open the data directory and start listening."""
        data = Path(self.config.data_dir)
        (data / "streams").mkdir(parents=True, exist_ok=True)
        # Streams on disk are opened now, so their dedup state is ready and a
        # broken log is reported at start, not at the first producer.
        for entry in sorted((data / "streams").iterdir()):
            if entry.is_dir() and m.is_valid_name(entry.name):
                self.stream(entry.name)
        loop = asyncio.get_running_loop()
        host, port = self.config.listen
        tls = self.ssl_context is not None
        server = await loop.create_server(
            lambda: GatewayConnection(self, next(self._ids), tls=tls),
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
        log.info("listening on %s:%d, data in %s", self.address[0], self.address[1], data)

    def attach(self, conn: GatewayConnection) -> bool:
        """Count a new connection in; False if that is one too many."""
        if len(self.connections) >= self.config.max_connections:
            return False
        self.connections[conn.conn_id] = conn
        return True

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
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._commit(list(self.streams.values()))
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
        for stream in self.streams.values():
            stream.close()
        self._executor.shutdown(wait=True)
        if self.config.unix_socket is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.unix_socket)

    # -- streams -------------------------------------------------------------------

    def stream(self, name: str) -> Stream:
        """The stream called ``name``, opened (or created) on first use."""
        stream = self.streams.get(name)
        if stream is None:
            stream = Stream.open(
                name,
                Path(self.config.data_dir),
                capacity=self.config.stream_capacity_for(name),
                term_length=self.config.term_length,
                max_message_size=self.config.max_message_size,
            )
            self.streams[name] = stream
        return stream

    def mark_dirty(self, stream: Stream) -> None:
        self._dirty.add(stream)

    def release(self, name: str, position: int) -> None:
        """Spark is done with ``name`` before ``position``: reclaim and re-share."""
        stream = self.streams.get(name)
        if stream is None:
            raise ProtocolError(f"no stream called {name!r}", code=ErrorCode.UNEXPECTED_FRAME)
        stream.release(position)
        # The next group commit stores the release and deletes the terms it
        # frees, even if nothing is appended to this stream meanwhile.
        self.mark_dirty(stream)
        stream.rebalance(time.monotonic())
        stream.flush_writers()

    def detach(self, conn: GatewayConnection) -> None:
        """A connection ended: its writers' unused credit goes back to the pool."""
        self.connections.pop(conn.conn_id, None)
        for writer in conn.writers.values():
            stream = self.streams[writer.stream]
            stream.remove_writer(writer)
            stream.rebalance(time.monotonic())
            stream.flush_writers()

    def statistics(self) -> list[StreamStatistics]:
        return [s.statistics() for s in self.streams.values()]

    # -- background work -------------------------------------------------------------

    async def _commit(self, streams: list[Stream]) -> None:
        if not streams:
            return
        loop = asyncio.get_running_loop()

        def sync_all() -> None:
            for stream in streams:
                stream.log.sync()

        await loop.run_in_executor(self._executor, sync_all)
        for stream in streams:
            stream.on_durable()
            stream.rebalance(time.monotonic())
            stream.flush_writers()

    async def _group_commit(self) -> None:
        interval = self.config.group_commit_interval_ms / 1000
        while True:
            await asyncio.sleep(interval)
            dirty, self._dirty = list(self._dirty), set()
            try:
                await self._commit(dirty)
            except LogError as exc:
                # Nothing is acknowledged that is not durable; producers keep
                # their batches and the next commit tries again.
                log.error("group commit failed: %s", exc)
                self._dirty.update(dirty)

    async def _rebalance_loop(self) -> None:
        while True:
            await asyncio.sleep(REBALANCE_INTERVAL_S)
            now = time.monotonic()
            for stream in self.streams.values():
                if stream.writers:
                    stream.rebalance(now)
                    stream.flush_writers()
