"""Consumers: the requests that name them, and the state files they write off the loop.

A pipeline releases what it has stored (Release); an admin declares,
resets or deletes a named consumer; a client lists a stream's consumers or
counts its records. :class:`ConsumerService` answers all of them for the
gateway, beside the per-stream book of positions
(:mod:`headgate.gateway.consumers`) that it moves.

It is a room of its own because what a release sets off is its own
machinery: the consumers file and the producer-state snapshot that freeing
the log needs are written in one thread of their own (never on the event
loop, never two at once), many releases cost one write, and credit and
space go no further than what is on disk covers. Releases and declarations
of streams not recovered yet (or not created yet) wait here until they are.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

from headgate.config import ConsumerSettings, GatewayConfig
from headgate.gateway.consumers import PendingSave, consumers_file, declare_before_the_stream
from headgate.gateway.dedup import DedupSnapshot
from headgate.gateway.recovery import StreamRecovery
from headgate.gateway.streams import Stream
from headgate.protocol import messages as m
from headgate.protocol.errors import ErrorCode, ProtocolError

log = logging.getLogger("headgate.gateway")


class ConsumerHost(Protocol):
    """What the consumer requests need of the gateway."""

    #: Read at each request (a reload may replace it).
    config: GatewayConfig
    streams: dict[str, Stream]
    #: The streams found at start and not recovered yet.
    recovery: StreamRecovery

    def stream_slot_refusal(self, name: str) -> ProtocolError | None:
        """Why no stream called ``name`` may come into being (``max_streams``), or None."""
        ...

    def mark_dirty(self, stream: Stream) -> None:
        """The next group commit stores the stream's state (and deletes the terms it frees)."""
        ...

    def rebalance(self, stream: Stream, now: float) -> None:
        """Let the stream's policy move credit now."""
        ...


class ConsumerService:
    """The gateway's answers to consumer requests, and the writes of their state.

    The gateway owns it; ``host`` is the gateway.
    """

    def __init__(self, host: ConsumerHost) -> None:
        self._host = host
        # Consumers files are written beside the log's fsync, not behind it.
        self._consumer_executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="headgate-consumers"
        )
        self._consumer_saves: set[asyncio.Task[None]] = set()
        # Releases of streams still recovering: applied once they are.
        self._held_releases: dict[str, dict[str, int]] = {}
        #: Streams not created yet with a consumer declared (``declare_consumer``).
        self._declared_ahead: set[str] = set()

    def find_declared_ahead(self, data: Path, on_disk: list[str]) -> None:
        """At start: the streams with consumers declared and no log yet.

        They keep counting against ``max_streams`` after a restart.
        """
        logs, suffix = set(on_disk), ".consumers.json"
        self._declared_ahead = {
            entry.name.removesuffix(suffix)
            for entry in (data / "state").glob(f"*{suffix}")
            if entry.name.removesuffix(suffix) not in logs
        }

    @property
    def declared_ahead(self) -> frozenset[str]:
        """The streams not created yet with a consumer declared: each holds a stream slot."""
        return frozenset(self._declared_ahead)

    def stream_created(self, name: str) -> None:
        """Stream ``name`` has a log now: it no longer counts as declared ahead."""
        self._declared_ahead.discard(name)

    def close(self) -> None:
        """After the last save (:meth:`consumers_saved`): end the consumers' thread."""
        self._consumer_executor.shutdown(wait=True)

    def apply_held_releases(self, stream: Stream) -> None:
        """``stream`` was recovered: apply the Releases that came while it was recovering."""
        for consumer, position in self._held_releases.pop(stream.name, {}).items():
            try:
                self.release(stream.name, position, consumer)
            except ProtocolError as error:
                log.warning("a Release received while recovering was refused: %s", error)

    def release(self, name: str, position: int, consumer: str = m.DEFAULT_CONSUMER) -> bool:
        """Consumer ``consumer`` is done with ``name`` before ``position``: reclaim and re-share.

        Returns whether the consumer moved.
        """
        stream = self._host.streams.get(name)
        if stream is None and self._host.recovery.recovering(name):
            # Applied as soon as the stream is recovered (releases are
            # cumulative: only the highest position matters).
            self._host.recovery.want(name)
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
        self._host.mark_dirty(stream)
        self._host.rebalance(stream, time.monotonic())
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

    def snapshot_soon(self, stream: Stream) -> None:
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
        self._host.mark_dirty(stream)
        self._host.rebalance(stream, time.monotonic())
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
            elif any(s.snapshot_pending for s in self._host.streams.values()):
                await asyncio.sleep(self._host.config.group_commit_interval_ms / 1000)
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
            self._host.mark_dirty(stream)  # the next group commit tries again
            return
        # The next group commit deletes the terms this save freed.
        self._after_freeing(stream)
        self.save_consumers(stream)  # the Releases that came in meanwhile

    def _consumers_stream(self, name: str) -> Stream:
        """The stream a consumer request names; refused if there is none, or not yet."""
        stream = self._host.streams.get(name)
        if stream is not None:
            return stream
        if (recovering := self._host.recovery.refusal(name)) is not None:
            raise recovering
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
            name not in self._host.streams
            and not self._host.recovery.recovering(name)
            and self._host.recovery.failure(name) is None
        ):
            refusal = self._host.stream_slot_refusal(name)
            if refusal is not None:
                raise refusal
            answer = declare_before_the_stream(
                name,
                consumers_file(Path(self._host.config.data_dir), name),
                declare.consumer,
                settings,
                declared=self._host.config.consumers_for(name),
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
        self._host.mark_dirty(stream)
        self._host.rebalance(stream, now)
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
        stream = self._host.streams.get(name)
        return 0 if stream is None else stream.records_scanned

    def record_counts(
        self, name: str, positions: tuple[int, ...]
    ) -> tuple[int, tuple[int | None, ...]]:
        """The record index's epoch, and its count at each of ``positions`` (CountRecords)."""
        stream = self._consumers_stream(name)
        return stream.records.epoch, tuple(stream.count_known(p) for p in positions)

    def check_consumers(self, now: float) -> None:
        """The idle rule of every stream's blocking consumers at ``now`` (housekeeping)."""
        for stream in self._host.streams.values():
            if stream.expire_retained():
                self._host.mark_dirty(stream)  # the next commit stores it and deletes the terms
            idle_after, policy = self._host.config.idle_rule_for(stream.name)
            if any(a.policy == "detach" for a in stream.check_idle(now, idle_after, policy)):
                self._host.mark_dirty(stream)
                self._host.rebalance(stream, now)
                stream.flush_writers()
