"""``headgate top``'s ack latency: p50 and p99 per stream between two scrapes, in 80 columns."""

from __future__ import annotations

import json
import math

import pytest

from headgate.cli.top import Snapshot, ack_quantiles, as_json, parse
from tests.helpers import busy_gateway, shown

INF = math.inf


def with_acks() -> tuple[Snapshot, Snapshot]:
    """The busy gateway, whose ``ticks`` acked 500 batches between the two scrapes:
    50 within 1 ms, 400 in (1, 5 ms], 50 in (5, 10 ms]."""
    snap, previous = busy_gateway()
    snap.ack_buckets["ticks"] = [
        (0.001, 100.0),
        (0.005, 900.0),
        (0.01, 1000.0),
        (1.0, 1000.0),
        (INF, 1000.0),
    ]
    previous.ack_buckets["ticks"] = [
        (0.001, 50.0),
        (0.005, 450.0),
        (0.01, 500.0),
        (1.0, 500.0),
        (INF, 500.0),
    ]
    # Its other stream acked one batch, slower than the largest bucket.
    snap.ack_buckets["a-stream-name-longer-than-the-column"] = [(1.0, 0.0), (INF, 1.0)]
    return snap, previous


def test_the_percentiles_are_of_the_interval_between_the_scrapes() -> None:
    snap, previous = with_acks()
    p50, p99 = ack_quantiles(snap, previous, "ticks")
    assert p50 == pytest.approx(0.003)  # rank 250: halfway through (1, 5 ms]
    assert p99 == pytest.approx(0.0095)  # rank 495: 45 of the 50 in (5, 10 ms]
    # Without an earlier scrape: everything since the gateway started.
    p50, p99 = ack_quantiles(snap, None, "ticks")
    assert p50 == pytest.approx(0.001 + 0.004 * 400 / 800)
    assert ack_quantiles(snap, previous, "no-such-stream") == (None, None)
    quiet = Snapshot(at=3.0, ack_buckets={"ticks": list(snap.ack_buckets["ticks"])})
    assert ack_quantiles(quiet, snap, "ticks") == (None, None)  # nothing acked since


def test_top_shows_ack_p50_and_p99_per_stream_within_80_columns() -> None:
    snap, previous = with_acks()
    lines = shown(80, snap, previous)
    assert max(len(line) for line in lines) <= 80
    (row,) = [line for line in lines if line.startswith("ticks") and "ms" in line]
    assert row.split()[1:5] == ["3.0", "ms", "9.5", "ms"]
    (slow,) = [line for line in lines if line.startswith("a-stream-name…") and "> " in line]
    assert "> 1 s" in slow
    assert "ack p50" in "\n".join(lines) and "ack p99" in "\n".join(lines)
    wide = "\n".join(shown(200, snap, previous))
    assert "9.5 ms" in wide and "fsync mean" in wide


def test_json_has_the_ack_percentiles_and_null_beyond_the_largest_bucket() -> None:
    snap, previous = with_acks()
    back = json.loads(json.dumps(as_json(snap, previous), allow_nan=False))
    ticks = back["streams"]["ticks"]
    assert ticks["ack_latency_p50_seconds"] == pytest.approx(0.003)
    assert ticks["ack_latency_p99_seconds"] == pytest.approx(0.0095)
    slow = back["streams"]["a-stream-name-longer-than-the-column"]
    assert slow["ack_latency_p99_seconds"] is None


def test_parse_reads_the_ack_latency_histogram() -> None:
    text = (
        "# TYPE headgate_ack_latency_seconds histogram\n"
        'headgate_ack_latency_seconds_bucket{le="0.001",stream="s"} 2.0\n'
        'headgate_ack_latency_seconds_bucket{le="0.01",stream="s"} 3.0\n'
        'headgate_ack_latency_seconds_bucket{le="+Inf",stream="s"} 4.0\n'
        'headgate_ack_latency_seconds_count{stream="s"} 4.0\n'
        'headgate_ack_latency_seconds_sum{stream="s"} 2.5\n'
    )
    snap = parse(text)
    assert snap.ack_buckets["s"] == [(0.001, 2.0), (0.01, 3.0), (INF, 4.0)]
    assert snap.streams["s"]["ack_latency_seconds_count"] == 4.0
    assert "ack_latency_seconds_bucket" not in snap.streams["s"]
