"""The gateway: an asyncio server that turns frames into log appends and credit.

Each connection is a :class:`GatewayConnection` driving one sans-IO
:class:`~headgate.protocol.session.Session`. The receive path is one small
seam, :meth:`GatewayConnection.feed`: bytes in, session events handled, bytes
out. A later change replaces what calls it (a preallocated ring buffer read
with ``BufferedProtocol``) without touching what it does.

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
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from headgate.config import GatewayConfig
from headgate.costs import batch_cost
from headgate.gateway.readers import ReaderConnection, TailHub
from headgate.gateway.streams import Stream, StreamStatistics, Writer
from headgate.log import LogError
from headgate.protocol import messages as m
from headgate.protocol.errors import ErrorCode, ProtocolError
from headgate.protocol.session import (
    Absolved,
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

#: Bytes of stream-name bindings one connection may hold (bind-channel credit).
BIND_BUDGET = 64 * 1024
#: How long a peer has to send Hello.
HANDSHAKE_TIMEOUT_S = 10.0
#: How often idle writers are re-checked and credit re-shared.
REBALANCE_INTERVAL_S = 0.1


class GatewayConnection(asyncio.Protocol):
    """One peer: a producer, a pipeline reporting releases, or a reader."""

    def __init__(self, gateway: Gateway, conn_id: int) -> None:
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
        # Fetches and subscriptions, if the peer is a reader (readers.py).
        self.readers = ReaderConnection(
            self.session,
            gateway.streams,
            gateway.tails,
            flush=self.flush,
            backlog=self._write_backlog,
            later=lambda f: asyncio.get_running_loop().call_soon(f),
            fail=lambda error: self.refuse(error),
        )

    # -- asyncio.Protocol -----------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer or "unix")
        loop = asyncio.get_running_loop()
        self._handshake = loop.call_later(HANDSHAKE_TIMEOUT_S, self._handshake_expired)

    def data_received(self, data: bytes) -> None:
        self.feed(data)

    def pause_writing(self) -> None:
        # The peer does not read what we send: stop reading what it sends,
        # so that nothing it makes us produce can pile up here.
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self._closing:
            self.transport.resume_reading()
            self.readers.resume()

    def _write_backlog(self) -> int:
        return 0 if self.transport is None else self.transport.get_write_buffer_size()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._handshake is not None:
            self._handshake.cancel()
        self.readers.close()
        self.gateway.detach(self)

    # -- the receive seam ------------------------------------------------------

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Bytes from the peer: hand them to the session, act, answer."""
        if self._closing:
            return
        try:
            events = self.session.receive_data(data)
            for event in events:
                self._handle(event)
        except ProtocolError as error:
            self.refuse(error)
            return
        except LogError as error:
            log.error("stream storage failed for %s: %s", self.peer, error)
            self.refuse(ProtocolError(str(error), code=ErrorCode.STORAGE_UNAVAILABLE))
            return
        self.flush()

    def flush(self) -> None:
        """Write whatever the session has queued, in one write."""
        if self.transport is None or self._closing:
            return
        out = self.session.data_to_send()
        if out:
            self.transport.write(out)

    def refuse(self, error: ProtocolError) -> None:
        """Tell the peer what it did wrong, once, log it once, and close."""
        log.warning("closing %s: %s", self.peer, error)
        self.close_with(self.session.fail(error))

    def close_with(self, data: bytes) -> None:
        if self.transport is None or self._closing:
            return
        self._closing = True
        if data:
            self.transport.write(data)
        self.transport.close()

    def _handshake_expired(self) -> None:
        if not self.session.opened:
            self.refuse(ProtocolError("no Hello in time", code=ErrorCode.TIMEOUT))
            self.flush()

    # -- events ------------------------------------------------------------------

    def _handle(self, event: Event) -> None:
        gw = self.gateway
        match event:
            case BatchReceived():
                writer = self.writers[event.handle]
                stream = gw.streams[event.stream]
                timestamp_us = time.time_ns() // 1000
                appended = stream.append(
                    writer,
                    event.first_sequence,
                    event.record_count,
                    event.records,
                    now=time.monotonic(),
                    timestamp_us=timestamp_us,
                )
                gw.mark_dirty(stream)
                if appended:
                    gw.tails.on_append(
                        stream, self.producer_id, event.first_sequence, event.records, timestamp_us
                    )
            case StreamBound(handle=handle, stream=name):
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
                self.producer_id = hello.producer_id
                self.session.send_global(
                    m.Welcome(
                        server_name=gw.name,
                        max_message_size=gw.config.max_message_size,
                        idle_timeout_ms=0,
                    )
                )
                self.session.grant(m.STREAM_CHANNEL, BIND_BUDGET)
            case Absolved(handle=handle) if handle is not None and handle in self.writers:
                # The absolved space is free now: share it with who pleaded for it.
                self._rebalance_handle(handle)
            case HandleDeleted(handle=handle, ours=False):
                if handle in self.writers:
                    writer = self.writers.pop(handle)
                    stream = gw.streams[writer.stream]
                    stream.remove_writer(writer)
                    stream.rebalance(time.monotonic())
            case MessageReceived(message=m.Fetch() | m.Subscribe() | m.ListStreams() as request):
                self.readers.on_request(request)
            case GuaranteesReceived(channel=channel):
                self.readers.on_guarantees(channel)
            case MessageReceived(message=m.Release(stream=name, position=position)):
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
        self.tails = TailHub()
        self.connections: dict[int, GatewayConnection] = {}
        self._ids = itertools.count(1)
        self._servers: list[asyncio.Server] = []
        self._dirty: set[Stream] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="headgate-fsync")
        self._stopping = False
        self.address: tuple[str, int] = config.listen

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
        server = await loop.create_server(lambda: self._accept(), host, port, reuse_address=True)
        self._servers.append(server)
        sockname = server.sockets[0].getsockname()
        self.address = (sockname[0], sockname[1])
        if self.config.unix_socket is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.unix_socket)
            self._servers.append(
                await loop.create_unix_server(lambda: self._accept(), str(self.config.unix_socket))
            )
        self._tasks.append(asyncio.create_task(self._group_commit()))
        self._tasks.append(asyncio.create_task(self._rebalance_loop()))
        log.info("listening on %s:%d, data in %s", self.address[0], self.address[1], data)

    def _accept(self) -> GatewayConnection:
        conn = GatewayConnection(self, next(self._ids))
        self.connections[conn.conn_id] = conn
        if len(self.connections) > self.config.max_connections:
            asyncio.get_running_loop().call_soon(
                conn.refuse,
                ProtocolError("too many connections", code=ErrorCode.RESOURCE_EXHAUSTED),
            )
        return conn

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
