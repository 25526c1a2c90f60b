"""``headgate run``: the demo finishes with its summary, and Ctrl-C prints what it has so far."""

from __future__ import annotations

import _thread
import io
import random
import threading
import time
from pathlib import Path

from pyspark.sql import SparkSession
from rich.console import Console

from headgate.cli.demo import GENERATORS, demo_gateway_config, run_demo

#: The producer's own bound in the demo, and the largest batch it seals.
_BUFFER = 512 * 1024


def _console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=80, force_terminal=False), out


def _smallest_record(stream: str) -> int:
    make = GENERATORS[stream]
    return min(len(make(random.Random(seed), n)) for seed in range(3) for n in range(1000))


def test_the_demo_writes_every_acknowledged_record_and_stops_its_load_when_it_says(
    spark: SparkSession, tmp_path: Path
) -> None:
    console, out = _console()
    result = run_demo(tmp_path / "demo", 3.0, console, spark=spark)
    text = out.getvalue()
    assert result.failure is None, text
    assert result.completed and not result.interrupted
    for s in result.summaries:
        assert s.acked > 0, s
        assert s.sent == s.acked, s
        assert s.written + s.dead_letters == s.acked, s
        # What is acknowledged after "load stopped" is only what the producer
        # still held then: its buffer, one batch on the wire, the open batch.
        limit = _BUFFER + 2 * demo_gateway_config(tmp_path).max_message_size
        assert s.acked_after_load * _smallest_record(s.stream) <= limit, s
    accounting = next(s for s in result.summaries if s.stream == "accounting")
    assert accounting.dead_letters > 0  # the malformed records went to the dead letters
    assert "load stopped after" in text and "caught up in" in text
    assert "summary" in text and "Traceback" not in text
    # The session is the caller's: still usable.
    assert spark.range(3).count() == 3


def test_ctrl_c_during_the_load_prints_the_summary_so_far(
    spark: SparkSession, tmp_path: Path
) -> None:
    console, out = _console()
    interrupted_at: list[float] = []

    def press_ctrl_c_once_loading() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and "Spark is ready" not in out.getvalue():
            time.sleep(0.2)
        time.sleep(1.5)
        interrupted_at.append(time.monotonic())
        _thread.interrupt_main()  # what Ctrl-C does: KeyboardInterrupt in the main thread

    presser = threading.Thread(target=press_ctrl_c_once_loading, daemon=True)
    presser.start()
    result = run_demo(tmp_path / "demo", 60.0, console, spark=spark)
    presser.join(5)
    text = out.getvalue()
    assert interrupted_at, "the load never started"
    assert result.interrupted and not result.completed and result.failure is None, text
    # It stopped soon after Ctrl-C, not after the 60 s of load it was asked for.
    assert time.monotonic() - interrupted_at[0] < 30
    assert "summary so far" in text and "Traceback" not in text
    assert sum(s.acked for s in result.summaries) > 0
    for s in result.summaries:
        assert s.written + s.dead_letters <= s.acked, s
    assert spark.range(3).count() == 3
