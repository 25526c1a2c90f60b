"""The gateway's statistics as Prometheus metrics, read at scrape time.

Nothing is counted for Prometheus on the hot path: a custom collector takes a
snapshot of the gateway's own statistics (each stream's, each connection's
account, pauses and ring) when a scrape arrives. The HTTP server is
prometheus-client's, in a daemon thread; the snapshot itself is taken on the
gateway's event loop (``call_soon_threadsafe``), so it is consistent and
never races the loop.

Metrics, all prefixed ``headgate_`` (labels in brackets)::

    stream_capacity_bytes, stream_free_bytes, stream_fill_ratio      [stream]
    stream_tail_position, stream_durable_position,
    stream_release_position                                            [stream]
    stream_guarantees_outstanding_bytes, stream_writers                [stream]
    stream_appended_batches_total, stream_appended_records_total,
    stream_duplicate_batches_total, stream_dropped_batches_total       [stream]
    stream_fsync_seconds (histogram, one observation per group commit) [stream]
    ack_latency_seconds (histogram, one observation per acked batch)   [stream]
    consumer_position, consumer_lag_bytes, consumer_lag_seconds, consumer_lag_records
    (absent where not countable), consumer_blocking (0/1),
    consumer_idle (0/1: idle, producers held), consumer_detached_total,
    consumer_skipped_bytes_total, consumer_skipped_records_total      [stream, consumer]
    connection_debt, connection_debt_threshold, connection_peak_debt   [connection, peer, producer]
    connection_reads_paused (0/1), connection_read_pauses_total        [connection, peer, producer]
    connection_ring_bytes, connection_ring_in_use_bytes                [connection, peer, producer]
    connections, writer_queue_messages, durability_loans
    build_info (always 1)                                              [version, python]
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import platform
import threading
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector, CollectorRegistry

from headgate import __version__
from headgate.gateway.statistics import GatewaySnapshot

__all__ = ["GatewayCollector", "MetricsServer"]

#: How long a scrape waits for the event loop to take the snapshot.
SNAPSHOT_TIMEOUT_S = 5.0


def build_info() -> GaugeMetricFamily:
    """``headgate_build_info``: 1, labelled with what runs, as Prometheus exporters do.

    A dashboard joins on it to show which gateways run which version, and an
    alert can fire on a fleet that runs two.
    """
    family = GaugeMetricFamily(
        "headgate_build_info",
        "The headgate version and Python version of this gateway (always 1).",
        labels=["version", "python"],
    )
    family.add_metric([__version__, platform.python_version()], 1)
    return family


class GatewayCollector(Collector):
    """A prometheus-client collector over a snapshot function."""

    def __init__(self, take: Callable[[], GatewaySnapshot]) -> None:
        self._take = take

    def collect(self) -> Iterable[Any]:
        snap = self._take()
        s = ["stream"]

        def gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"headgate_{name}", doc, labels=labels)

        def counter(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
            return CounterMetricFamily(f"headgate_{name}", doc, labels=labels)

        capacity = gauge("stream_capacity_bytes", "Log capacity of the stream.", s)
        free = gauge("stream_free_bytes", "Log space free for new appends.", s)
        fill = gauge("stream_fill_ratio", "Share of the log capacity in use (0 to 1).", s)
        tail = gauge("stream_tail_position", "Log position after the last append.", s)
        durable = gauge("stream_durable_position", "Log position durable on disk.", s)
        release = gauge("stream_release_position", "Log position released by Spark.", s)
        guarantees = gauge(
            "stream_guarantees_outstanding_bytes", "Guarantees held by the stream's writers.", s
        )
        writers = gauge("stream_writers", "Connections writing the stream.", s)
        batches = counter("stream_appended_batches", "Batches appended to the log.", s)
        records = counter("stream_appended_records", "Records appended to the log.", s)
        duplicates = counter("stream_duplicate_batches", "Resent batches already stored.", s)
        drops = counter("stream_dropped_batches", "Batches dropped for lack of space.", s)
        fsync = HistogramMetricFamily(
            "headgate_stream_fsync_seconds", "fsync of the stream's log per group commit.", labels=s
        )
        ack = HistogramMetricFamily(
            "headgate_ack_latency_seconds",
            "From a batch's arrival (the latest socket read before its frame was parsed, "
            "no earlier than its first byte) to its durable Ack being written.",
            labels=s,
        )
        for entry in snap.streams:
            st = entry.stats
            name = [st.name]
            capacity.add_metric(name, st.capacity)
            free.add_metric(name, st.free_capacity)
            fill.add_metric(name, (st.capacity - st.free_capacity) / st.capacity)
            tail.add_metric(name, st.tail_position)
            durable.add_metric(name, st.durable_position)
            release.add_metric(name, st.release_position)
            guarantees.add_metric(name, st.guarantees_outstanding)
            writers.add_metric(name, st.writers)
            batches.add_metric(name, st.appended_batches)
            records.add_metric(name, st.appended_records)
            duplicates.add_metric(name, st.duplicate_batches)
            drops.add_metric(name, entry.dropped_batches)
            fsync.add_metric(name, buckets=entry.fsync_buckets, sum_value=entry.fsync_sum)
            ack.add_metric(name, buckets=entry.ack_buckets, sum_value=entry.ack_sum)
        yield from (capacity, free, fill, tail, durable, release, guarantees, writers)
        yield from (batches, records, duplicates, drops, fsync, ack)

        k = ["stream", "consumer"]
        position = gauge("consumer_position", "The consumer's committed log position.", k)
        lag = gauge("consumer_lag_bytes", "Durable log bytes after the consumer's position.", k)
        lag_seconds = gauge(
            "consumer_lag_seconds", "Age of the oldest durable record not committed.", k
        )
        lag_records = gauge(
            "consumer_lag_records", "Durable records after the consumer's position.", k
        )
        blocking = gauge("consumer_blocking", "1 if the consumer holds producers back.", k)
        idle = gauge(
            "consumer_idle",
            "1 while a blocking consumer idles past idle_release_seconds (policy hold).",
            k,
        )
        detached = counter(
            "consumer_detached", "Times the idle rule made the consumer non-blocking.", k
        )
        skipped = counter(
            "consumer_skipped_bytes", "Log bytes freed before the consumer read them.", k
        )
        skipped_records = counter(
            "consumer_skipped_records",
            "Records freed before the consumer read them (where counted).",
            k,
        )
        for entry in snap.streams:
            for consumer in entry.stats.consumers:
                labels = [entry.stats.name, consumer.name]
                position.add_metric(labels, consumer.position)
                lag.add_metric(labels, consumer.lag_bytes)
                if consumer.lag_seconds is not None:
                    lag_seconds.add_metric(labels, consumer.lag_seconds)
                if consumer.lag_records is not None:
                    lag_records.add_metric(labels, consumer.lag_records)
                blocking.add_metric(labels, 1 if consumer.blocking else 0)
                idle.add_metric(labels, 1 if consumer.idle else 0)
                detached.add_metric(labels, consumer.detached_total)
                skipped.add_metric(labels, consumer.skipped_bytes)
                skipped_records.add_metric(labels, consumer.skipped_records)
        yield from (position, lag, lag_seconds, blocking, idle, detached, skipped)
        yield from (skipped_records, lag_records)

        c = ["connection", "peer", "producer"]
        debt = gauge("connection_debt", "Units of work in flight charged to the connection.", c)
        threshold = gauge("connection_debt_threshold", "Debt above which reads pause.", c)
        peak = gauge("connection_peak_debt", "Highest debt seen.", c)
        paused = gauge("connection_reads_paused", "1 while the socket is not read.", c)
        pauses = counter("connection_read_pauses", "Times reading was paused.", c)
        ring = gauge("connection_ring_bytes", "Size of the receive ring.", c)
        in_use = gauge("connection_ring_in_use_bytes", "Receive ring bytes in use.", c)
        for conn in snap.connections:
            labels = [str(conn.conn_id), conn.peer, str(conn.producer_id)]
            debt.add_metric(labels, conn.account.debt)
            threshold.add_metric(labels, conn.account.threshold)
            peak.add_metric(labels, conn.account.peak_debt)
            paused.add_metric(labels, 1 if conn.paused else 0)
            pauses.add_metric(labels, conn.pauses)
            ring.add_metric(labels, conn.ring.size)
            in_use.add_metric(labels, conn.ring.in_use)
        yield from (debt, threshold, peak, paused, pauses, ring, in_use)

        yield GaugeMetricFamily(
            "headgate_connections", "Open connections.", value=len(snap.connections)
        )
        yield GaugeMetricFamily(
            "headgate_writer_queue_messages",
            "Batches received and waiting for the log writer.",
            value=snap.queued_messages,
        )
        yield GaugeMetricFamily(
            "headgate_durability_loans",
            "Batches appended and waiting for the disk.",
            value=snap.durability_loans,
        )
        yield GaugeMetricFamily(
            "headgate_streams_recovering",
            "Streams found on disk at start and not recovered yet (their binds get RECOVERING).",
            value=snap.streams_recovering,
        )
        yield build_info()


class MetricsServer:
    """Serves a gateway's metrics over HTTP (``/metrics``) until :meth:`close`.

    Args:
        take: takes the gateway's statistics (``Gateway.snapshot``); called
            on ``loop`` only.
        loop: the gateway's event loop, where snapshots are taken.
    """

    def __init__(
        self, take: Callable[[], GatewaySnapshot], loop: asyncio.AbstractEventLoop
    ) -> None:
        self._snapshot = take
        self._loop = loop
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(GatewayCollector(self._take))
        self._httpd: Any = None
        self._thread: threading.Thread | None = None
        self.address: tuple[str, int] | None = None

    def _take(self) -> GatewaySnapshot:
        if self._loop.is_closed():
            raise RuntimeError("the gateway's event loop is closed")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            return self._snapshot()
        done: concurrent.futures.Future[GatewaySnapshot] = concurrent.futures.Future()

        def take() -> None:
            try:
                done.set_result(self._snapshot())
            except BaseException as exc:
                done.set_exception(exc)

        self._loop.call_soon_threadsafe(take)
        return done.result(timeout=SNAPSHOT_TIMEOUT_S)

    def start(self, host: str, port: int) -> tuple[str, int]:
        """Listen on ``host:port`` (port 0 picks one); return the address bound."""
        self._httpd, self._thread = start_http_server(port, addr=host, registry=self.registry)
        bound = self._httpd.server_address
        self.address = (str(bound[0]), int(bound[1]))
        return self.address

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
