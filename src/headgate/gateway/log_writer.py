"""The log writer: batches from the receive rings into the logs, then group commit.

Received batches wait in one :class:`~headgate.gateway.ring.MessageQueue`,
in the order they arrived, as headers pointing into their connection's
receive ring. The first one into an empty queue schedules
:meth:`LogWriter.write_messages` with ``call_soon``; it appends every queued
batch (each through its connection's ``write_batch``, which knows the
stream's policy), marks it handled and repays its ring loan, and charges
the appends' time to each batch's cause (``turns``).

Durability is a group commit (:meth:`LogWriter.group_commit`): in the
``interval`` mode a task wakes every ``group_commit_interval_ms``, in the
``eager`` mode as soon as something waits; it fsyncs every log with new
appends (and the producer ids table first) in a worker thread, repays the
batches' durability loans and sends the cumulative acks that the new
durable positions allow. What a commit means for credit is the gateway's
(:class:`CommitHost`). The commit trace (:mod:`headgate.gateway.commit_trace`,
off unless ``HEADGATE_COMMIT_TRACE`` is set) is fed from here.

This is its own room so that the path every batch takes, and the one task
that makes batches durable, can be read without the connection's or the
gateway's other work.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from headgate.config import GatewayConfig
from headgate.gateway import commit_trace
from headgate.gateway.accounts import DurabilityLoans
from headgate.gateway.connection import GatewayConnection
from headgate.gateway.identity import ProducerOwners
from headgate.gateway.ring import HANDLED, MessageQueue
from headgate.gateway.statistics import StreamCounters
from headgate.gateway.streams import Stream
from headgate.gateway.turns import Passes, SharedWork
from headgate.log import LogError
from headgate.protocol.errors import ErrorCode, ProtocolError

log = logging.getLogger("headgate.gateway")


class CommitHost(Protocol):
    """What the log writer asks of the gateway that owns it."""

    #: Read when a commit task starts (its interval and mode).
    config: GatewayConfig
    #: The producer ids table, made durable before the logs it covers.
    owners: ProducerOwners
    #: Where the appends' time is charged, to each batch's cause.
    passes: Passes

    def counters(self, name: str) -> StreamCounters:
        """The stream's counters (its fsync histogram)."""
        ...

    def save_consumers(self, stream: Stream) -> None:
        """Store the stream's consumer positions, now that its log is durable."""
        ...

    def after_commit(self, stream: Stream, failed: bool) -> None:
        """The stream's commit is done (or ``failed``): move its credit, send what it allows."""
        ...


class LogWriter:
    """The gateway's one writer of batches into logs, and its group commit.

    The gateway owns it and binds its :meth:`write_messages` and
    :meth:`mark_dirty` on itself once (they are called per batch).
    """

    def __init__(self, host: CommitHost) -> None:
        self._host = host
        config = host.config
        #: Batches received and not yet written to their log, oldest first.
        self.queue = MessageQueue(self._signal_writer)
        #: Loans of batches appended and not yet durable.
        self.durability = DurabilityLoans()
        #: The log writer's pass (write_messages) under way: a run of durability loans.
        self.write_pass = 0
        self._dirty: set[Stream] = set()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="headgate-fsync")
        # Set while an eager group commit waits for something to commit.
        self._commit_wanted: asyncio.Future[float] | None = None
        #: Per group commit, where its time went (off unless HEADGATE_COMMIT_TRACE is set).
        self._trace = commit_trace.from_environment(
            0.0 if config.group_commit_mode == "eager" else config.group_commit_interval_ms / 1000,
            config.term_length,
        )

    @property
    def trace(self) -> commit_trace.CommitTrace | None:
        """The commit trace, or None (off)."""
        return self._trace

    def close(self) -> None:
        """After the last commit: end the fsync thread and the trace."""
        self._executor.shutdown(wait=True)
        if self._trace is not None:
            self._trace.close()

    def mark_dirty(self, stream: Stream) -> None:
        """``stream`` has appends (or a release) that the next group commit makes durable."""
        self._dirty.add(stream)
        wanted = self._commit_wanted
        if wanted is not None:
            # An eager group commit waits for this (group_commit_mode).
            self._commit_wanted = None
            if not wanted.done():  # (cancelled at stop)
                wanted.set_result(time.monotonic())

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
                    conn.write_batch(
                        message.event, now, timestamp_us, message.arrived, self.write_pass
                    )
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
            self._host.passes.spent(conn.share.turn, now - since)
        return now

    async def commit(self) -> None:
        """Write what is queued, make every log durable now and send the acks."""
        self.write_messages()
        dirty, self._dirty = list(self._dirty), set()
        await self.commit_streams(dirty)

    async def commit_streams(self, streams: list[Stream], due: float | None = None) -> bool:
        """Sync ``streams``, then send the acks it allows; False if a stream's sync failed."""
        if not streams:
            return True
        loop = asyncio.get_running_loop()
        trace = self._trace
        woke = time.monotonic()
        # When the fsync thread began and ended (for the trace).
        thread_times = [0.0, 0.0]
        owners = self._host.owners

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
                fsync = self._host.counters(stream.name).fsync
                assert fsync is not None
                fsync.observe(seconds)
        for stream in streams:
            # The stream's writers' causes pay for its Acks and credit (turns.SharedWork).
            writers = [
                t
                for w in stream.writers
                if w.account is not None and (t := w.account.turn_of()) is not None
            ]
            with SharedWork(self._host.passes, writers):
                if stream in failed:
                    # Nothing is acknowledged that is not durable; the stream is
                    # held (logged once) and the next commit tries again.
                    stream.sync_failed(failed[stream])
                    self._dirty.add(stream)
                else:
                    stream.on_durable()
                    self.durability.settle(stream.name, stream.log.durable_position)
                    self._host.save_consumers(stream)  # one that failed is retried
                self._host.after_commit(stream, stream in failed)
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

    async def group_commit(self) -> None:
        """Commit what was appended, every interval or eagerly, until cancelled."""
        config = self._host.config
        interval = config.group_commit_interval_ms / 1000
        eager = config.group_commit_mode == "eager"
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
                ok = await self.commit_streams(dirty, due)
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
