"""``headgate top``: the gateway's metrics endpoint as a live terminal table.

It reads exactly what Prometheus reads (``/metrics``, parsed with
prometheus-client's own parser), so the two views always agree. Rates (records
per second) are the difference between two scrapes.
"""

from __future__ import annotations

import math
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Group
from rich.table import Table

__all__ = ["MetricsUnavailable", "Snapshot", "fetch", "parse", "render"]

#: The most of a response that is read; a metrics page is far smaller.
MAX_RESPONSE_BYTES = 16 << 20


class MetricsUnavailable(Exception):
    """The endpoint cannot be reached, or what it answers is not headgate's metrics."""


@dataclass
class Snapshot:
    """One scrape: per-stream and per-connection samples, by metric name."""

    #: When it was taken (``time.monotonic()``).
    at: float
    streams: dict[str, dict[str, float]] = field(default_factory=dict)
    #: Keyed by connection id; values include the labels ``peer`` and ``producer``.
    connections: dict[str, dict[str, float | str]] = field(default_factory=dict)
    #: stream -> ``[(le, cumulative count)]`` of the fsync histogram.
    fsync_buckets: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    gateway: dict[str, float] = field(default_factory=dict)


def parse(text: str, at: float = 0.0) -> Snapshot:
    """Read a Prometheus text exposition into a :class:`Snapshot`.

    Raises:
        MetricsUnavailable: the text is not Prometheus metrics, or has none of
            headgate's.
    """
    snap = Snapshot(at=at)
    seen = False
    try:
        for family in text_string_to_metric_families(text):
            if not family.name.startswith("headgate_"):
                continue
            seen = True
            for sample in family.samples:
                name = sample.name.removeprefix("headgate_")
                labels = sample.labels
                if "stream" in labels:
                    stream = labels["stream"]
                    if name == "stream_fsync_seconds_bucket":
                        le = float(labels["le"])
                        snap.fsync_buckets.setdefault(stream, []).append((le, sample.value))
                    else:
                        snap.streams.setdefault(stream, {})[name] = sample.value
                elif "connection" in labels:
                    row = snap.connections.setdefault(labels["connection"], {})
                    row["peer"] = labels.get("peer", "?")
                    row["producer"] = labels.get("producer", "?")
                    row[name] = sample.value
                else:
                    snap.gateway[name] = sample.value
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise MetricsUnavailable(f"the answer is not Prometheus metrics ({exc})") from None
    if not seen:
        raise MetricsUnavailable("the answer holds no headgate metrics")
    for buckets in snap.fsync_buckets.values():
        buckets.sort()
    return snap


def fetch(address: tuple[str, int], *, timeout: float = 5.0) -> Snapshot:
    """Scrape ``http://host:port/metrics``.

    Raises:
        MetricsUnavailable: with a message that says what went wrong.
    """
    host, port = address
    url = f"http://{host}:{port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            body = response.read(MAX_RESPONSE_BYTES + 1)
    except urllib.error.HTTPError as exc:
        raise MetricsUnavailable(f"{url} answered HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise MetricsUnavailable(f"cannot reach {url}: {reason}") from None
    if len(body) > MAX_RESPONSE_BYTES:
        raise MetricsUnavailable(f"{url} answered more than {MAX_RESPONSE_BYTES} bytes")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise MetricsUnavailable(f"{url} answered something that is not text") from None
    return parse(text, at=time.monotonic())


def _quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The upper bound of the bucket holding quantile ``q``; None without data."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    for le, count in buckets:
        if count >= rank:
            return le
    return buckets[-1][0]


def _size(value: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value:.0f} B"


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if math.isinf(seconds):
        return "> 2 s"
    return f"{seconds * 1000:.1f}"


def render(snap: Snapshot, previous: Snapshot | None = None) -> Group:
    """Two tables: streams, then connections (with rates against ``previous``)."""
    streams = Table(title="streams", title_justify="left")
    for column in (
        "stream",
        "fill",
        "capacity",
        "tail",
        "durable",
        "released",
        "guarantees",
        "writers",
        "records",
        "rec/s",
        "drops",
        "fsync mean ms",
        "fsync p99 ms",
    ):
        streams.add_column(column, justify="left" if column == "stream" else "right")
    for name in sorted(snap.streams):
        row = snap.streams[name]
        records = row.get("stream_appended_records_total", 0.0)
        rate = "-"
        if previous is not None and name in previous.streams and snap.at > previous.at:
            before = previous.streams[name].get("stream_appended_records_total", 0.0)
            rate = f"{(records - before) / (snap.at - previous.at):,.0f}"
        count = row.get("stream_fsync_seconds_count", 0.0)
        mean = row.get("stream_fsync_seconds_sum", 0.0) / count if count else None
        streams.add_row(
            name,
            f"{100 * row.get('stream_fill_ratio', 0.0):.1f}%",
            _size(row.get("stream_capacity_bytes", 0.0)),
            f"{row.get('stream_tail_position', 0.0):,.0f}",
            f"{row.get('stream_durable_position', 0.0):,.0f}",
            f"{row.get('stream_release_position', 0.0):,.0f}",
            _size(row.get("stream_guarantees_outstanding_bytes", 0.0)),
            f"{row.get('stream_writers', 0.0):.0f}",
            f"{records:,.0f}",
            rate,
            f"{row.get('stream_dropped_batches_total', 0.0):,.0f}",
            _ms(mean),
            _ms(_quantile(snap.fsync_buckets.get(name, []), 0.99)),
        )
    connections = Table(title="connections", title_justify="left")
    for column in (
        "id",
        "peer",
        "producer",
        "debt",
        "threshold",
        "peak",
        "reads",
        "pauses",
        "ring",
    ):
        connections.add_column(column, justify="left" if column in ("peer", "reads") else "right")
    for conn_id in sorted(snap.connections, key=lambda c: int(c) if c.isdigit() else 0):
        c = snap.connections[conn_id]

        def num(key: str, c: dict[str, float | str] = c) -> float:
            value = c.get(key, 0.0)
            return value if isinstance(value, float) else 0.0

        connections.add_row(
            conn_id,
            str(c["peer"]),
            str(c["producer"]),
            f"{num('connection_debt'):,.0f}",
            f"{num('connection_debt_threshold'):,.0f}",
            f"{num('connection_peak_debt'):,.0f}",
            "[red]paused[/red]" if num("connection_reads_paused") else "reading",
            f"{num('connection_read_pauses_total'):,.0f}",
            f"{_size(num('connection_ring_in_use_bytes'))} / {_size(num('connection_ring_bytes'))}",
        )
    queued = snap.gateway.get("writer_queue_messages", 0.0)
    waiting = snap.gateway.get("durability_loans", 0.0)
    summary = Table.grid(padding=(0, 2))
    summary.add_row(
        f"connections: {snap.gateway.get('connections', 0.0):.0f}",
        f"batches waiting for the writer: {queued:.0f}",
        f"batches waiting for the disk: {waiting:.0f}",
    )
    return Group(summary, streams, connections)
