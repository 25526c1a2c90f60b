"""The gateway: an asyncio server that turns frames into log appends and credit.

:class:`Gateway` wires the rooms together and owns what they share: it
listens (TCP, a Unix socket, TLS through
:class:`~headgate.gateway.connection.TlsDoor`), hands each peer to a
:class:`~headgate.gateway.connection.GatewayConnection` (the connection
adapter, with the receive path), opens and recovers the streams, owns each
stream's flow-control policy, and answers what the connections ask of the
streams.

Who gets in is :class:`~headgate.gateway.admission.Admission`'s to decide
(connection slots and those kept for writers, TLS handshakes, tokens and
their shares of the work budget); the log writer and the group commit are
:class:`~headgate.gateway.log_writer.LogWriter`'s, which the gateway owns;
what a reload may change is :mod:`headgate.gateway.reload`'s; consumer
requests and the state files they write are
:class:`~headgate.gateway.consumer_service.ConsumerService`'s.

The gateway's 0.1 s housekeeping loop checks the connections' deadlines
(idle, frame, handshake) and the Plead deadline (:meth:`Gateway.check_deadlines`),
and re-shares credit. Binds, frees and Absolves only mark their stream; it
is re-shared once per pass of the event loop (:meth:`Gateway.rebalance_soon`).

Durability is the log writer's group commit; what a commit means for
credit (re-share it, send what it allows) is the gateway's
(:meth:`Gateway.after_commit`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from headgate.config import (
    ConfigError,
    GatewayConfig,
    format_address,
)
from headgate.gateway.admission import Admission
from headgate.gateway.auth import TokenTable
from headgate.gateway.budget import (
    LogLimiter,
)
from headgate.gateway.connection import (
    PLEAD_READ_GRACE_S,
    READ_SECONDS,
    RING_INITIAL,
    RING_MIN_READ,
    GatewayConnection,
    TlsDoor,
    ring_limit,
)
from headgate.gateway.consumer_service import ConsumerService
from headgate.gateway.fleet import FleetMembership, metadata_without_cluster
from headgate.gateway.identity import ProducerOwners
from headgate.gateway.log_writer import LogWriter
from headgate.gateway.policies import Flow, FlowStatistics, make_flow
from headgate.gateway.readers import TailHub
from headgate.gateway.recovery import StreamRecovery
from headgate.gateway.reload import reconfigure
from headgate.gateway.statistics import (
    ConnectionStatistics,
    GatewaySnapshot,
    StreamCounters,
    StreamSnapshot,
)
from headgate.gateway.streams import GatewayStreamStatistics, Stream, Writer
from headgate.gateway.tls import server_context
from headgate.gateway.turns import Passes
from headgate.log import LogError
from headgate.log.lock import DirectoryLock
from headgate.protocol import messages as m
from headgate.protocol.errors import ErrorCode, ProtocolError
from headgate.protocol.records import load_accelerator

if TYPE_CHECKING:
    from headgate.gateway.metrics import MetricsServer

log = logging.getLogger("headgate.gateway")

# What tests, benchmarks and the package import from here, though some now
# live in the rooms this module wires together (connection.py).
__all__ = [
    "DATA_LOCK_FILE_NAME",
    "GIL_SWITCH_INTERVAL_S",
    "READ_SECONDS",
    "RING_INITIAL",
    "RING_MIN_READ",
    "AddressInUse",
    "Gateway",
    "GatewayConnection",
    "ring_limit",
]

#: The file in the data directory whose lock says which gateway writes it.
DATA_LOCK_FILE_NAME = "gateway.lock"
#: How often idle writers are re-checked and credit re-shared.
REBALANCE_INTERVAL_S = 0.1
#: Streams recovered at once after a start, each in its own thread: a
#: stream's recovery waits mostly on fsyncs, an unlink and the reservation of
#: its next term, which overlap across streams. Not more: while recovery
#: reads frame headers (Python), each thread takes the interpreter lock from
#: the event loop (with 4, a loop round trip took up to 100 ms; with 1 or 2,
#: about 30 ms).
RECOVERY_THREADS = 2
#: How soon a thread waiting for the interpreter lock (the group commit's
#: fsyncs, the term preparer) gets it from a busy event loop (Python's
#: default: 5 ms). Set for the process when the gateway starts listening.
GIL_SWITCH_INTERVAL_S = 0.0005


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
        self.connection_ids: Iterator[int] = itertools.count(1)
        self._servers: list[asyncio.Server] = []
        # Streams whose credit is re-shared at the end of this loop pass.
        self._to_rebalance: dict[Stream, None] = {}
        self._rebalance_scheduled = False
        self._tasks: list[asyncio.Task[None]] = []
        #: Appends the received batches and makes them durable (log_writer.py).
        self.log_writer = LogWriter(self)
        # Bound once here: the connections call them per batch.
        self.write_messages: Callable[[], None] = self.log_writer.write_messages
        self.mark_dirty: Callable[[Stream], None] = self.log_writer.mark_dirty
        #: Per group commit, where its time went (off unless HEADGATE_COMMIT_TRACE is set).
        self._trace = self.log_writer.trace
        #: Consumer requests and the state files they write (consumer_service.py).
        self.consumer_service = ConsumerService(self)
        # What the connections, the log writer and the tests ask the gateway.
        consumers = self.consumer_service
        self.release = consumers.release
        self.save_consumers = consumers.save_consumers
        self.consumers_saved = consumers.consumers_saved
        self.declare_consumer = consumers.declare_consumer
        self.change_consumer = consumers.change_consumer
        self.consumer_infos = consumers.consumer_infos
        self.records_scanned = consumers.records_scanned
        self.record_counts = consumers.record_counts
        self.check_consumers = consumers.check_consumers
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
        self._stopping = False
        #: The lock on the data directory, from start() to stop().
        self._data_lock: DirectoryLock | None = None
        self.address: tuple[str, int] = config.listen
        #: Batches received and not yet written to their log, oldest first.
        self.queue = self.log_writer.queue
        #: Loans of batches appended and not yet durable.
        self.durability = self.log_writer.durability
        self._counters: dict[str, StreamCounters] = {}
        self._metrics: MetricsServer | None = None
        #: Where the Prometheus endpoint listens, once started (None: off).
        self.metrics_address: tuple[str, int] | None = None
        #: The listener's TLS context, or None for plain TCP.
        self.ssl_context = server_context(self.config)
        #: New streams created by the peers of each token, by token name.
        self.created_by: dict[str, int] = {}
        #: Owners of producer ids; :meth:`start` reads the table on disk.
        self.owners = ProducerOwners(
            Path(self.config.data_dir) / "state" / "producers.log",
            {},
            limit=self.config.max_producer_ids,
        )
        #: The connection over which each producer id's owner writes now
        #: (GatewayConnection._fence_older_connection).
        self.producer_connections: dict[int, GatewayConnection] = {}
        #: The passes of the event loop in which connections take turns,
        #: one turn per cause (token or address) and pass (``turns``).
        self.passes = Passes()
        #: Refusals are logged at a bounded rate: a flood of them costs no flood of lines.
        self.refusals = LogLimiter(log)
        #: Who may come in: connection slots, TLS handshakes, tokens and their
        #: work budgets (admission.py).
        self.admission: Admission[GatewayConnection] = Admission(lambda: self.config)
        #: Every connection that holds a slot, by id (the admission's table).
        self.connections = self.admission.connections
        #: The work budgets, shared per token (the admission's).
        self.shares = self.admission.shares
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
        self.consumer_service.find_declared_ahead(data, on_disk)
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
                else (lambda: GatewayConnection(self, next(self.connection_ids))),
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
                    lambda: GatewayConnection(self, next(self.connection_ids)),
                    str(self.config.unix_socket),
                )
            )
        self._tasks.append(asyncio.create_task(self.log_writer.group_commit()))
        self._tasks.append(asyncio.create_task(self._rebalance_loop()))
        if self._trace is not None:
            self._tasks.append(asyncio.create_task(self._trace.watch_loop()))
        log.info("listening on %s:%d, data in %s", self.address[0], self.address[1], data)

    @property
    def tokens(self) -> TokenTable | None:
        """Accepted tokens, or None when every peer may do anything (the admission's)."""
        return self.admission.tokens

    @tokens.setter
    def tokens(self, tokens: TokenTable | None) -> None:
        self.admission.tokens = tokens

    @property
    def tls_pending(self) -> int:
        """TLS handshakes in progress."""
        return self.admission.tls_pending

    @property
    def writer_connections(self) -> int:
        """Connections that have bound a stream to write (they hold writer slots)."""
        return self.admission.writer_connections

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
        await self.log_writer.commit_streams(list(self.streams.values()))
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
        self.consumer_service.close()
        for stream in self.streams.values():
            stream.close()
        self.log_writer.close()
        if self.config.unix_socket is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.unix_socket)
        if self._data_lock is not None:
            self._data_lock.release()

    # -- streams -------------------------------------------------------------------

    def stream(self, name: str) -> Stream:
        """The stream called ``name``, opened (or created) on first use.

        Raises:
            ProtocolError: ``RECOVERING``, the stream is on disk and not
                recovered yet (:meth:`StreamRecovery.refusal`).
            LogError: the stream could not be recovered.
        """
        stream = self.streams.get(name)
        if stream is None:
            if (recovering := self.recovery.refusal(name)) is not None:
                raise recovering
            if self.recovery.failure(name) is not None:
                raise LogError(f"stream {name} could not be recovered")
            stream = self._open_stream(name)
            self._install(stream)
            self.consumer_service.stream_created(name)
        return stream

    def stream_slot_refusal(self, name: str) -> ProtocolError | None:
        """Why no stream called ``name`` may come into being, or None if it may.

        The one rule of ``max_streams``, asked by a bind and by a
        DeclareConsumer alike: a slot is held by every stream that exists, is
        still recovering, or has consumers declared ahead of it. A name that
        holds a slot already keeps it; a new one needs a free slot.
        """
        declared_ahead = self.consumer_service.declared_ahead
        if name in self.streams or self.recovery.recovering(name) or name in declared_ahead:
            return None
        limit = self.config.max_streams
        if len(self.streams) + self.recovery.count + len(declared_ahead) < limit:
            return None
        return ProtocolError(
            f"stream {name!r} cannot be created: the gateway holds its maximum of {limit} "
            "streams (those still recovering and those with consumers declared ahead included)",
            code=ErrorCode.RESOURCE_EXHAUSTED,
        )

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
        stream.snapshot_soon = partial(self.consumer_service.snapshot_soon, stream)
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
                self.consumer_service.apply_held_releases(self.streams[name])

    def _serve_held_requests(self) -> None:
        """A stream was recovered (or failed): serve reader requests that waited for it."""
        for conn in list(self.connections.values()):
            try:
                conn.readers.recovered()
            except ProtocolError as error:
                conn.refuse(error)

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
        """Apply a reloaded configuration to the running gateway (see ``reload.py``)."""
        reconfigure(self, config)

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

    def counters(self, name: str) -> StreamCounters:
        """The gateway's own counters for stream ``name``."""
        counters = self._counters.get(name)
        if counters is None:
            counters = self._counters[name] = StreamCounters()
        return counters

    def detach(self, conn: GatewayConnection) -> None:
        """A connection ended: its slot and its writers' unused credit go back."""
        self.admission.detach(conn)
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
        await self.log_writer.commit()

    def after_commit(self, stream: Stream, failed: bool) -> None:
        """A group commit made ``stream`` durable (or ``failed`` to): move its credit, send."""
        now = time.monotonic()
        # A rebalance visits every writer of the stream: under the
        # credit policy, not after each of hundreds of commits a second
        # (binds, frees, Absolves, releases and use rebalance it, and
        # the housekeeping loop every REBALANCE_INTERVAL_S).
        if (
            self.flow(stream).durability_moves_credit
            or failed
            or now - stream.rebalanced_at >= REBALANCE_INTERVAL_S
        ):
            self.rebalance(stream, now)
        stream.flush_writers()

    # -- background work -------------------------------------------------------------

    async def _rebalance_loop(self) -> None:
        while True:
            await asyncio.sleep(REBALANCE_INTERVAL_S)
            now = time.monotonic()
            self.admission.forget_idle(now)
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
