"""Latency percentiles: the one home of how headgate turns durations into p50 and p99.

Two sources, one rule each:

- :class:`LatencyWindow` keeps the latest durations themselves (the
  producer's send-to-durable-ack times) and answers exact nearest-rank
  percentiles over a recent window.
- :func:`bucket_quantile` reads a Prometheus histogram (the gateway's
  ``headgate_ack_latency_seconds``, as ``headgate top`` scrapes it) and
  interpolates within the bucket that holds the quantile, as Prometheus's
  ``histogram_quantile`` does; :func:`bucket_increase` turns two scrapes into
  the histogram of the interval between them.

Pure functions of their arguments: time is an argument, nothing here reads a
clock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "WINDOW_HORIZON_S",
    "WINDOW_SIZE",
    "LatencySummary",
    "LatencyWindow",
    "bucket_increase",
    "bucket_quantile",
    "nearest_rank",
]

#: How many of the latest durations a :class:`LatencyWindow` keeps.
WINDOW_SIZE = 1024
#: How old a duration may be (seconds) and still count: a stream that went
#: quiet shows no latency rather than that of a minute ago.
WINDOW_HORIZON_S = 60.0


def nearest_rank(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0 < q <= 1) of ``ordered`` (sorted, not empty), by nearest rank.

    The smallest value that at least ``q`` of the values are at or below: an
    observed value, never an interpolation, so a p99 is a latency some batch
    really had.
    """
    if not ordered:
        raise ValueError("no values")
    if not 0 < q <= 1:
        raise ValueError(f"quantile {q} is not in (0, 1]")
    rank = math.ceil(q * len(ordered) - 1e-9)  # 1-based; tolerate q*n's rounding
    return ordered[max(rank, 1) - 1]


@dataclass(frozen=True, slots=True)
class LatencySummary:
    """Percentiles of the durations in a window, in seconds."""

    #: How many durations the percentiles are over.
    count: int
    p50: float
    p99: float
    max: float


class LatencyWindow:
    """The latest durations, up to ``size`` of them and none older than ``horizon_s``.

    :meth:`observe` is the hot-path half (an append to a bounded deque, per
    batch); :meth:`summary` sorts at most ``size`` values and is meant for
    ``statistics()``, which people and monitoring call now and then.

    Args:
        size: how many of the latest durations to keep.
        horizon_s: durations observed longer ago than this (seconds, on the
            caller's clock) are left out of the summary.
    """

    __slots__ = ("_entries", "horizon_s")

    def __init__(self, size: int = WINDOW_SIZE, horizon_s: float = WINDOW_HORIZON_S) -> None:
        if size < 1:
            raise ValueError("a window holds at least one duration")
        self._entries: deque[tuple[float, float]] = deque(maxlen=size)
        self.horizon_s = horizon_s

    def observe(self, seconds: float, now: float) -> None:
        """A duration of ``seconds`` that ended at ``now``."""
        self._entries.append((now, seconds))

    def summary(self, now: float) -> LatencySummary | None:
        """p50, p99 and max of the durations within the horizon at ``now``; None if none."""
        since = now - self.horizon_s
        ordered = sorted(seconds for at, seconds in self._entries if at >= since)
        if not ordered:
            return None
        return LatencySummary(
            count=len(ordered),
            p50=nearest_rank(ordered, 0.5),
            p99=nearest_rank(ordered, 0.99),
            max=ordered[-1],
        )


#: A Prometheus histogram as scraped: ``(le, cumulative count)`` pairs sorted by
#: ``le``, the last one ``+Inf`` (then its count is the histogram's count).
Buckets = Sequence[tuple[float, float]]


def bucket_increase(now: Buckets, before: Buckets | None) -> list[tuple[float, float]]:
    """The histogram of what was observed between two scrapes (``before`` then ``now``).

    Without ``before``, or when a bucket went down (the gateway restarted and
    its counts began again), everything in ``now``.
    """
    if not before:
        return list(now)
    earlier = dict(before)
    out = []
    for le, count in now:
        previous = earlier.get(le, 0.0)
        if count < previous:
            return list(now)
        out.append((le, count - previous))
    return out


def bucket_quantile(buckets: Buckets, q: float) -> float | None:
    """The ``q`` quantile of a histogram, interpolated linearly within its bucket.

    As Prometheus's ``histogram_quantile``: the first bucket starts at 0,
    and a quantile inside a bucket is placed as if its observations were
    spread evenly across it. A quantile that falls in the ``+Inf`` bucket is
    ``math.inf`` (only "more than the largest bound" is known). None without
    observations.
    """
    if not buckets:
        return None
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for le, count in buckets:
        if count >= rank and count > below:
            if math.isinf(le):
                return math.inf
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return math.inf
