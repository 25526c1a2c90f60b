"""``headgate top``: the gateway's metrics endpoint as a live terminal table.

It reads exactly what Prometheus reads (``/metrics``, parsed with
prometheus-client's own parser), so the two views always agree. Rates (records
per second) are the difference between two scrapes, and so are the ack
latency percentiles: p50 and p99 of the batches acknowledged between them,
from the histogram ``headgate_ack_latency_seconds``. Every percentile (the
fsync p99 too, over the gateway's life) is interpolated within its bucket, as
Prometheus's ``histogram_quantile`` does (:mod:`headgate.latency`).
"""

from __future__ import annotations

import json
import math
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field

import click
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from headgate.cli.options import table_or_json
from headgate.config import DEFAULT_METRICS_PORT, ConfigError, parse_address
from headgate.latency import bucket_increase, bucket_quantile

__all__ = [
    "MetricsUnavailable",
    "Snapshot",
    "as_json",
    "fetch",
    "parse",
    "render",
    "render_to_fit",
    "top",
]

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
    #: stream -> ``[(le, cumulative count)]`` of the ack latency histogram.
    ack_buckets: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    gateway: dict[str, float] = field(default_factory=dict)
    #: stream -> consumer -> its samples (``consumer_lag_bytes``, ...).
    consumers: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)


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
                if "stream" in labels and "consumer" in labels:
                    by_stream = snap.consumers.setdefault(labels["stream"], {})
                    by_stream.setdefault(labels["consumer"], {})[name] = sample.value
                elif "stream" in labels:
                    stream = labels["stream"]
                    if name == "stream_fsync_seconds_bucket":
                        le = float(labels["le"])
                        snap.fsync_buckets.setdefault(stream, []).append((le, sample.value))
                    elif name == "ack_latency_seconds_bucket":
                        le = float(labels["le"])
                        snap.ack_buckets.setdefault(stream, []).append((le, sample.value))
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
    for buckets in (*snap.fsync_buckets.values(), *snap.ack_buckets.values()):
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


def _size(value: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value:.0f} B"


def _ms(seconds: float | None, buckets: list[tuple[float, float]] | None = None) -> str:
    """Milliseconds; for a quantile beyond the largest bucket, "> " that bucket's bound."""
    if seconds is None:
        return "-"
    if math.isinf(seconds):
        finite = [le for le, _ in buckets or () if math.isfinite(le)]
        if not finite:
            return "> 2 s"
        top = max(finite)
        return f"> {top:g} s" if top >= 1 else f"> {top * 1000:g} ms"
    return f"{seconds * 1000:.1f} ms"


def ack_quantiles(
    snap: Snapshot, previous: Snapshot | None, stream: str
) -> tuple[float | None, float | None]:
    """p50 and p99 of the ack latency of ``stream``'s batches acked since ``previous``.

    Since the gateway started without ``previous`` (or if it restarted
    since); None where no batch was acked in the interval.
    """
    before = None if previous is None else previous.ack_buckets.get(stream)
    interval = bucket_increase(snap.ack_buckets.get(stream, []), before)
    return bucket_quantile(interval, 0.5), bucket_quantile(interval, 0.99)


def _rate(snap: Snapshot, previous: Snapshot | None, stream: str) -> float | None:
    """Records per second appended to ``stream`` between two scrapes, or None."""
    if previous is None or stream not in previous.streams or snap.at <= previous.at:
        return None
    now = snap.streams[stream].get("stream_appended_records_total", 0.0)
    before = previous.streams[stream].get("stream_appended_records_total", 0.0)
    return (now - before) / (snap.at - previous.at)


def _fsync_mean(row: dict[str, float]) -> float | None:
    count = row.get("stream_fsync_seconds_count", 0.0)
    return row.get("stream_fsync_seconds_sum", 0.0) / count if count else None


#: A column: its header, and the width a name in it is cut to (None: a number,
#: right-aligned and never cut).
_Column = tuple[str, int | None]
#: Name columns that are not cut, in the wide view.
_WHOLE = 1_000


def _table(title: str, columns: list[_Column]) -> Table:
    """A table without borders, whose names are cut to their column's width."""
    table = Table(
        title=title,
        title_justify="left",
        title_style="bold",
        box=None,
        padding=(0, 1),
        pad_edge=False,
        header_style="bold underline",
    )
    for header, width in columns:
        table.add_column(
            header,
            justify="right" if width is None else "left",
            no_wrap=True,
            overflow="ellipsis",
            max_width=None if width == _WHOLE else width,
        )
    return table


def render(snap: Snapshot, previous: Snapshot | None = None, *, wide: bool = False) -> Group:
    """A summary line and four tables: streams, their latency, consumers, then connections.

    Rates and ack latency are over the interval since ``previous``. Without
    ``wide`` the view fits 80 columns: a stream name or a peer that does not
    fit is cut short, never a number.
    """
    stream_columns: list[_Column] = [
        ("stream", _WHOLE if wide else 14),
        ("fill", None),
        ("capacity", None),
        ("guarantees", None),
        ("writers", None),
        ("rec/s", None),
        ("drops", None),
    ]
    if wide:
        stream_columns[5:5] = [("tail", None), ("durable", None), ("released", None)]
        stream_columns.insert(-1, ("records", None))
    streams = _table("streams", stream_columns)
    # Latency has a table of its own: beside the streams table's columns it
    # would not fit 80 of them.
    latency_columns: list[_Column] = [
        ("stream", _WHOLE if wide else 14),
        ("ack p50", None),
        ("ack p99", None),
        ("fsync p99", None),
    ]
    if wide:
        latency_columns.append(("fsync mean", None))
    latency = _table("latency (ack: arrival to durable ack)", latency_columns)
    for name in sorted(snap.streams):
        row = snap.streams[name]
        rate = _rate(snap, previous, name)
        cells = [
            name,
            f"{100 * row.get('stream_fill_ratio', 0.0):.1f}%",
            _size(row.get("stream_capacity_bytes", 0.0)),
            _size(row.get("stream_guarantees_outstanding_bytes", 0.0)),
            f"{row.get('stream_writers', 0.0):.0f}",
            "-" if rate is None else f"{rate:,.0f}",
            f"{row.get('stream_dropped_batches_total', 0.0):,.0f}",
        ]
        if wide:
            cells[5:5] = [
                f"{row.get(key, 0.0):,.0f}"
                for key in (
                    "stream_tail_position",
                    "stream_durable_position",
                    "stream_release_position",
                )
            ]
            cells.insert(-1, f"{row.get('stream_appended_records_total', 0.0):,.0f}")
        streams.add_row(*cells)
        p50, p99 = ack_quantiles(snap, previous, name)
        acks = snap.ack_buckets.get(name)
        fsyncs = snap.fsync_buckets.get(name, [])
        cells = [name, _ms(p50, acks), _ms(p99, acks), _ms(bucket_quantile(fsyncs, 0.99), fsyncs)]
        if wide:
            cells.append(_ms(_fsync_mean(row)))
        latency.add_row(*cells)
    connection_columns: list[_Column] = [
        ("id", None),
        ("peer", _WHOLE if wide else 20),
        ("producer", None),
        ("debt/threshold", None),
        ("reads", _WHOLE),
        ("ring", None),
    ]
    if wide:
        connection_columns[4:4] = [("peak debt", None)]
        connection_columns[-1:-1] = [("pauses", None)]
        connection_columns.append(("ring size", None))
    connections = _table("connections", connection_columns)
    for conn_id in sorted(snap.connections, key=lambda c: int(c) if c.isdigit() else 0):
        c = snap.connections[conn_id]

        def num(key: str, c: dict[str, float | str] = c) -> float:
            value = c.get(key, 0.0)
            return value if isinstance(value, float) else 0.0

        cells = [
            conn_id,
            str(c["peer"]),
            str(c["producer"]),
            f"{num('connection_debt'):,.0f}/{num('connection_debt_threshold'):,.0f}",
            "[red]paused[/red]" if num("connection_reads_paused") else "reading",
            _size(num("connection_ring_in_use_bytes")),
        ]
        if wide:
            cells[4:4] = [f"{num('connection_peak_debt'):,.0f}"]
            cells[-1:-1] = [f"{num('connection_read_pauses_total'):,.0f}"]
            cells.append(_size(num("connection_ring_bytes")))
        connections.add_row(*cells)
    # Names are cut shorter here than in the other tables: three lags,
    # blocking and the state must fit beside them in 80 columns, uncut.
    consumers = _table(
        "consumers",
        [
            ("stream", _WHOLE if wide else 12),
            ("consumer", _WHOLE if wide else 12),
            ("lag", None),
            ("lag rec", None),
            ("lag s", None),
            ("blocking", None),
            ("state", None),
        ],
    )
    for stream_name in sorted(snap.consumers):
        for consumer_name, row in sorted(snap.consumers[stream_name].items()):
            lag_s = row.get("consumer_lag_seconds")
            # Absent where the gateway cannot count them (a position freed
            # before it was counted, or a gateway older than the gauge).
            lag_records = row.get("consumer_lag_records")
            detached = row.get("consumer_detached_total", 0.0) and not row.get(
                "consumer_blocking", 0.0
            )
            state = (
                "[red]idle[/red]"
                if row.get("consumer_idle", 0.0)
                else "detached"
                if detached
                else "ok"
            )
            consumers.add_row(
                stream_name,
                consumer_name,
                _size(row.get("consumer_lag_bytes", 0.0)),
                "?" if lag_records is None else f"{lag_records:,.0f}",
                "-" if lag_s is None else f"{lag_s:,.1f}",
                "yes" if row.get("consumer_blocking", 0.0) else "no",
                state,
            )
    queued = snap.gateway.get("writer_queue_messages", 0.0)
    waiting = snap.gateway.get("durability_loans", 0.0)
    summary = Text(
        f"connections {snap.gateway.get('connections', 0.0):.0f}; batches waiting "
        f"for the writer {queued:.0f}, for the disk {waiting:.0f}"
    )
    return Group(summary, streams, latency, consumers, connections)


def as_json(snap: Snapshot, previous: Snapshot | None = None) -> dict[str, object]:
    """The snapshot for scripts: every headgate metric, by its name without ``headgate_``.

    Per stream, also ``records_per_second`` (null without ``previous``),
    ``fsync_p99_seconds`` (null before the first fsync), and
    ``ack_latency_p50_seconds`` and ``ack_latency_p99_seconds`` of the
    batches acked since ``previous`` (since the start without it; null if
    none). JSON has no infinity: a value that is not finite (a quantile
    beyond the largest bucket) is null.
    """

    def finite(value: float | str | None) -> float | str | None:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        return value

    def plain(row: Mapping[str, float | str | None]) -> dict[str, float | str | None]:
        return {key: finite(value) for key, value in row.items()}

    streams: dict[str, object] = {}
    for name in sorted(snap.streams):
        row: dict[str, float | str | None] = dict(snap.streams[name])
        row["records_per_second"] = _rate(snap, previous, name)
        row["fsync_p99_seconds"] = bucket_quantile(snap.fsync_buckets.get(name, []), 0.99)
        row["ack_latency_p50_seconds"], row["ack_latency_p99_seconds"] = ack_quantiles(
            snap, previous, name
        )
        streams[name] = plain(row)
    return {
        "gateway": plain(snap.gateway),
        "streams": streams,
        "connections": {c: plain(snap.connections[c]) for c in sorted(snap.connections)},
        "consumers": {
            stream: {name: plain(row) for name, row in sorted(snap.consumers[stream].items())}
            for stream in sorted(snap.consumers)
        },
    }


def render_to_fit(console: Console, snap: Snapshot, previous: Snapshot | None = None) -> Group:
    """Every column where the terminal is wide enough for them, else the 80-column view."""
    wide = render(snap, previous, wide=True)
    unbounded = console.options.update(max_width=1 << 16)  # its natural width, not the screen's
    if Measurement.get(console, unbounded, wide).maximum <= console.width:
        return wide
    return render(snap, previous)


@click.command()
@click.option(
    "--metrics",
    "address",
    default=f"127.0.0.1:{DEFAULT_METRICS_PORT}",
    show_default=True,
    metavar="HOST:PORT",
    help="The gateway's metrics endpoint (headgate serve --metrics).",
)
@click.option("--interval", type=float, default=1.0, show_default=True, help="Seconds per refresh.")
@click.option("--once", is_flag=True, help="Print one snapshot and exit.")
@table_or_json("json: one JSON object per snapshot, one per line (every metric; for scripts).")
def top(address: str, interval: float, once: bool, fmt: str) -> None:
    """Watch a running gateway: streams and connections, live.

    Per stream: log fill, guarantees, writers, records/s, drops, the p50
    and p99 of its batches' arrival-to-durable-ack latency since the last
    refresh, fsync latency (and positions, where the terminal is wide
    enough). Per
    connection: debt against its threshold, and whether its reads are
    paused. Read from the gateway's Prometheus endpoint, which `headgate
    serve --metrics HOST:PORT` turns on.
    """
    if interval <= 0:
        raise click.UsageError("--interval must be positive")
    try:
        where = parse_address(address, what="--metrics", default_port=DEFAULT_METRICS_PORT)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    hint = "is the gateway running with --metrics {}:{}?".format(*where)
    console = Console()
    try:
        previous = fetch(where)
        if fmt == "json":
            click.echo(json.dumps(as_json(previous)))
            while not once:
                time.sleep(interval)
                snap = fetch(where)
                click.echo(json.dumps(as_json(snap, previous)))
                previous = snap
            return
        if once:
            console.print(render_to_fit(console, previous))
            return
        with Live(render_to_fit(console, previous), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                snap = fetch(where)
                live.update(render_to_fit(console, snap, previous), refresh=True)
                previous = snap
    except MetricsUnavailable as exc:
        click.echo(f"headgate top: {exc}; {hint}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        pass
