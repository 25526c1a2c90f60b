"""What the gateway counts for people and monitoring, beside each stream's own.

Everything here is plain counting on the event loop: nothing is exported per
append. The metrics endpoint (:mod:`headgate.gateway.metrics`) reads these
records at scrape time.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from headgate.gateway.accounts import AccountStatistics
from headgate.gateway.ring import RingStatistics
from headgate.gateway.streams import GatewayStreamStatistics

__all__ = [
    "ACK_LATENCY_BUCKETS",
    "FSYNC_BUCKETS",
    "ConnectionStatistics",
    "GatewaySnapshot",
    "LatencyHistogram",
    "StreamCounters",
    "StreamSnapshot",
]

#: Upper bounds, in seconds, of the fsync latency histogram's buckets.
FSYNC_BUCKETS: tuple[float, ...] = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
)


#: Upper bounds, in seconds, of the ack latency histogram's buckets: from a
#: batch's arrival to its durable Ack, 0.1 ms (a batch that catches a group
#: commit at once) to 1 s (a stalled disk); finest around the 5 to 20 ms
#: that the group-commit interval and an fsync add up to.
ACK_LATENCY_BUCKETS: tuple[float, ...] = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
)


class LatencyHistogram:
    """A cumulative-ready histogram of durations, as Prometheus exposes them."""

    __slots__ = ("bounds", "count", "counts", "total")

    def __init__(self, bounds: tuple[float, ...] = FSYNC_BUCKETS) -> None:
        self.bounds = bounds
        #: Observations per bucket (the last one is above every bound).
        self.counts = [0] * (len(bounds) + 1)
        self.count = 0
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.count += 1
        self.total += seconds

    def observe_since(self, starts: list[float], now: float) -> None:
        """One observation per start time: ``now - start`` (a batch of acks at once)."""
        bounds = self.bounds
        counts = self.counts
        total = 0.0
        for start in starts:
            seconds = now - start
            counts[bisect.bisect_left(bounds, seconds)] += 1
            total += seconds
        self.count += len(starts)
        self.total += total

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, count of observations <= le)`` for each bound, then ``+Inf``."""
        out = []
        running = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            running += count
            out.append((repr(bound), running))
        out.append(("+Inf", self.count))
        return out


@dataclass(eq=False, slots=True)
class StreamCounters:
    """Per-stream figures the gateway keeps beside :class:`GatewayStreamStatistics`."""

    #: Batches dropped because they did not fit (optimistic producers).
    dropped_batches: int = 0
    #: Group commits that synced this stream, and how long each fsync took.
    fsync: LatencyHistogram | None = None
    #: Batches acknowledged, and how long each took from its arrival to its
    #: Ack being written (see :data:`ACK_LATENCY_BUCKETS`).
    ack_latency: LatencyHistogram | None = None

    def __post_init__(self) -> None:
        if self.fsync is None:
            self.fsync = LatencyHistogram()
        if self.ack_latency is None:
            self.ack_latency = LatencyHistogram(ACK_LATENCY_BUCKETS)


@dataclass(frozen=True, slots=True)
class ConnectionStatistics:
    """A snapshot of one connection, for metrics and ``headgate top``."""

    #: The gateway's number for the connection.
    conn_id: int
    #: The peer's address.
    peer: str
    #: The producer id from its Hello (0 before it).
    producer_id: int
    #: Its account: debt, threshold and history.
    account: AccountStatistics
    #: Whether its socket is not being read now, and why.
    paused: bool
    pause_reasons: tuple[str, ...]
    #: How many times reading was paused.
    pauses: int
    #: Its receive ring.
    ring: RingStatistics


@dataclass(frozen=True, slots=True)
class StreamSnapshot:
    """One stream's statistics and histograms, as a scrape exposes them."""

    stats: GatewayStreamStatistics
    dropped_batches: int
    #: ``(le, cumulative count)`` pairs ending with ``+Inf``.
    fsync_buckets: list[tuple[str, int]]
    fsync_sum: float
    #: The same for the ack latency histogram.
    ack_buckets: list[tuple[str, int]]
    ack_sum: float


@dataclass(frozen=True, slots=True)
class GatewaySnapshot:
    """Everything a scrape exposes, taken at one instant on the event loop.

    The gateway takes it (``Gateway.snapshot``); the metrics module only
    reads it, so that neither imports the other.
    """

    streams: list[StreamSnapshot]
    connections: list[ConnectionStatistics]
    queued_messages: int
    durability_loans: int
    #: Streams found on disk at start and not recovered yet.
    streams_recovering: int = 0
