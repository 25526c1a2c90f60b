"""``headgate top``: 80 columns with its numbers whole, every column where there is room,
and JSON for scripts."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from headgate.top import Snapshot, as_json, render, render_to_fit

from .serving import serve_with_metrics

HEADGATE = [sys.executable, "-m", "headgate.cli"]


def busy_gateway() -> tuple[Snapshot, Snapshot]:
    """Two scrapes a second apart, with wide numbers and a name too long for 80 columns."""
    row = {
        "stream_fill_ratio": 0.773,
        "stream_capacity_bytes": 64.0 * 2**20,
        "stream_tail_position": 123_456_789_012.0,
        "stream_durable_position": 123_456_789_012.0,
        "stream_release_position": 123_456_000_000.0,
        "stream_guarantees_outstanding_bytes": 3.0 * 2**20,
        "stream_writers": 3.0,
        "stream_appended_records_total": 12_345_678.0,
        "stream_dropped_batches_total": 12.0,
        "stream_fsync_seconds_sum": 1.0,
        "stream_fsync_seconds_count": 1000.0,
    }
    snap = Snapshot(at=2.0, gateway={"connections": 1.0})
    snap.streams["ticks"] = row
    snap.streams["a-stream-name-longer-than-the-column"] = dict(row)
    snap.fsync_buckets["ticks"] = [(0.001, 500.0), (0.0025, 990.0), (float("inf"), 1000.0)]
    snap.fsync_buckets["a-stream-name-longer-than-the-column"] = [(float("inf"), 10.0)]
    snap.connections["12"] = {
        "peer": "[2001:db8:1234:5678::1]:54321",
        "producer": "6851760619763790384",
        "connection_debt": 1234.0,
        "connection_debt_threshold": 4096.0,
        "connection_peak_debt": 4000.0,
        "connection_reads_paused": 1.0,
        "connection_read_pauses_total": 3.0,
        "connection_ring_in_use_bytes": 65536.0,
        "connection_ring_bytes": 1048576.0,
    }
    previous = Snapshot(at=1.0, streams={"ticks": {"stream_appended_records_total": 12_000_000.0}})
    return snap, previous


def shown(width: int, snap: Snapshot, previous: Snapshot) -> list[str]:
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(render_to_fit(console, snap, previous))
    return console.export_text().splitlines()


def test_top_fits_80_columns_and_cuts_only_names() -> None:
    snap, previous = busy_gateway()
    lines = shown(80, snap, previous)
    assert max(len(line) for line in lines) <= 80
    text = "\n".join(lines)
    # Issue 14: the numbers were cut to "12…" at 80 columns.
    for whole in ("77.3%", "64.0 MiB", "3.0 MiB", "345,678", "2.5 ms", "6851760619763790384"):
        assert whole in text, whole
    assert "1,234/4,096" in text and "paused" in text
    assert "a-stream-name…" in text and "[2001:db8:1234:5678…" in text
    assert "released" not in text, "positions only where there is room"


def test_a_wide_terminal_gets_every_column_uncut() -> None:
    snap, previous = busy_gateway()
    text = "\n".join(shown(200, snap, previous))
    assert "…" not in text
    for whole in ("123,456,000,000", "12,345,678", "1.0 ms", "[2001:db8:1234:5678::1]:54321"):
        assert whole in text, whole
    narrow = render(snap, previous)
    assert narrow is not render_to_fit(Console(width=200), snap, previous)


def test_json_has_every_metric_a_rate_and_no_infinity() -> None:
    snap, previous = busy_gateway()
    document = as_json(snap, previous)
    text = json.dumps(document, allow_nan=False)  # strict JSON
    back = json.loads(text)
    ticks = back["streams"]["ticks"]
    assert ticks["records_per_second"] == 345_678
    assert ticks["fsync_p99_seconds"] == 0.0025
    assert ticks["stream_appended_records_total"] == 12_345_678
    long_name = back["streams"]["a-stream-name-longer-than-the-column"]
    assert long_name["fsync_p99_seconds"] is None  # beyond the largest bucket
    assert long_name["records_per_second"] is None  # no earlier scrape
    assert back["connections"]["12"]["producer"] == "6851760619763790384"
    assert back["gateway"] == {"connections": 1}
    assert as_json(snap)["streams"]["ticks"]["records_per_second"] is None  # type: ignore[index]


def test_top_once_format_json_reads_a_running_gateway(tmp_path: Path) -> None:
    proc, address, metrics = serve_with_metrics(tmp_path / "data")
    try:
        source = tmp_path / "in.txt"
        source.write_text("".join(f"line {i}\n" for i in range(300)))
        sent = subprocess.run(
            [*HEADGATE, "send", "scripted", str(source), "--gateway", address],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert sent.returncode == 0, sent.stderr
        done = subprocess.run(
            [*HEADGATE, "top", "--once", "--format", "json", "--metrics", metrics],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.count("\n") == 1
        snapshot = json.loads(done.stdout)
        assert snapshot["streams"]["scripted"]["stream_appended_records_total"] == 300
        table = subprocess.run(
            [*HEADGATE, "top", "--once", "--metrics", metrics],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "COLUMNS": "80"},
        )
        assert table.returncode == 0, table.stderr
        assert "scripted" in table.stdout
        assert max(len(line) for line in table.stdout.splitlines()) <= 80
    finally:
        proc.terminate()
        proc.wait(20)
