"""``headgate top``: 80 columns with its numbers whole, every column where there is room,
and JSON for scripts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from rich.console import Console

from headgate.cli.top import as_json, render, render_to_fit
from tests.helpers import busy_gateway, shown

from .serving import serve_with_metrics

HEADGATE = [sys.executable, "-m", "headgate.cli"]


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
        # Nothing released: the stream's default consumer lags by all 300 records.
        rows = [line.split() for line in table.stdout.splitlines()]
        consumer = next(row for row in rows if row[:2] == ["scripted", "default"])
        assert consumer[4] == "300", consumer
    finally:
        proc.terminate()
        proc.wait(20)


def test_each_consumers_lag_in_records_shows_beside_its_bytes_or_a_question_mark() -> None:
    # Issue 18: top showed a consumer's lag in bytes and seconds, not in records.
    snap, previous = busy_gateway()
    snap.consumers["a-stream-name-longer-than-the-column"] = {
        "a-consumer-name-longer-than-its-column": {
            "consumer_lag_bytes": 3.0 * 2**20,
            "consumer_lag_records": 12_345_678.0,
            "consumer_lag_seconds": 12_345.6,
            "consumer_blocking": 0.0,
            "consumer_detached_total": 1.0,
        },
        # No consumer_lag_records sample: the gateway cannot count them.
        "live": {
            "consumer_lag_bytes": 512.0,
            "consumer_lag_seconds": 0.5,
            "consumer_blocking": 1.0,
        },
    }
    for width in (80, 200):
        lines = shown(width, snap, previous)
        assert max(len(line) for line in lines) <= width
        header = next(line for line in lines if "lag rec" in line)
        assert header.split() == [
            "stream",
            "consumer",
            "lag",
            "lag",
            "rec",
            "lag",
            "s",
            "blocking",
            "state",
        ]
        counted = next(line for line in lines if "a-consumer-" in line)
        assert counted.split()[2:] == [
            "3.0",
            "MiB",
            "12,345,678",
            "12,345.6",
            "no",
            "detached",
        ]
        uncounted = next(line for line in lines if " live " in line)
        assert uncounted.split()[2:] == ["512", "B", "?", "0.5", "yes", "ok"]
