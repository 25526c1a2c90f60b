"""A query of ``headgate pipeline`` that fails is started again from its checkpoint, a bounded
number of times, with a one-line warning; past the bound the command exits as before.

The failure is real: the stream's output directory is a file, so writing the
first batch fails in Spark. Once the file is gone the restarted query writes
every record, exactly once.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from headgate.client import SyncProducer
from headgate.spark.restarts import RestartPolicy
from tests.spark.test_pipeline_command import Served, parquet_values, wait_for_rows


@pytest.fixture
def sock() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="hg-", dir="/tmp"))
    try:
        yield directory / "gw.sock"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def run_in_thread(
    config: Path, policy: RestartPolicy, lines: list[str], stop: threading.Event
) -> tuple[threading.Thread, list[int]]:
    from headgate.spark.command import run_pipeline
    from headgate.spark.pipeline import load_pipeline_config

    status: list[int] = []

    def run() -> None:
        status.append(
            run_pipeline(
                load_pipeline_config(config),
                available_now=False,
                echo=lines.append,
                status_seconds=60.0,
                stop=stop,
                restarts=policy,
            )
        )

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, status


def wait_for_line(lines: list[str], start: str, thread: threading.Thread) -> str:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = [line for line in lines if line.startswith(start)]
        if found:
            return found[0]
        if not thread.is_alive():
            break
        time.sleep(0.1)
    raise AssertionError(f"no line starting {start!r}: {lines}")


def setup(tmp_path: Path, sock: Path) -> tuple[Served, Path, Path]:
    data = tmp_path / "data"
    served = Served(data, sock)
    config = tmp_path / "pipeline.toml"
    config.write_text(
        f'data_dir = "{data}"\ngateway = "{served.tcp}"\n'
        "[streams.live]\nformat = 'raw'\ntrigger_seconds = 0.2\n"
    )
    output = data / "parquet" / "live"
    output.parent.mkdir(parents=True)
    output.write_text("in the way")  # writing the batch fails until this is gone
    return served, config, output


def test_a_failed_query_restarts_from_its_checkpoint_with_a_warning(
    spark: Any, tmp_path: Path, sock: Path
) -> None:
    served, config, output = setup(tmp_path, sock)
    lines: list[str] = []
    stop = threading.Event()
    try:
        with SyncProducer(served.tcp, producer_id=3, connect_timeout=10) as producer:
            producer.send_many("live", [b"r%d" % i for i in range(100)])
            producer.flush(30)
        policy = RestartPolicy(max_restarts=3, window=600.0, backoff=(2.0,))
        runner, status = run_in_thread(config, policy, lines, stop)
        warning = wait_for_line(lines, "warning: the query of stream live failed", runner)
        output.unlink()
        values = wait_for_rows(output, 100, runner)
        stop.set()
        runner.join(120)
    finally:
        stop.set()
        served.stop()
    assert "restarting it from its checkpoint in 2 s (1 of 3 restarts within 600 s)" in warning
    assert "\n" not in warning
    assert status == [0], lines
    assert (
        sorted(values) == sorted(parquet_values(output)) == sorted(b"r%d" % i for i in range(100))
    )


def test_a_query_that_keeps_failing_ends_the_pipeline_past_the_bound(
    spark: Any, tmp_path: Path, sock: Path
) -> None:
    served, config, _ = setup(tmp_path, sock)
    lines: list[str] = []
    stop = threading.Event()
    try:
        with SyncProducer(served.tcp, producer_id=4, connect_timeout=10) as producer:
            producer.send_many("live", [b"r%d" % i for i in range(10)])
            producer.flush(30)
        policy = RestartPolicy(max_restarts=1, window=600.0, backoff=(0.5,))
        runner, status = run_in_thread(config, policy, lines, stop)
        runner.join(180)
    finally:
        stop.set()
        served.stop()
    assert not runner.is_alive() and status == [1], lines
    assert sum(line.startswith("warning: the query of stream live failed") for line in lines) == 1
    final = [line for line in lines if line.startswith("headgate pipeline: the query of stream")]
    assert final and "1 restarts within 600 s did not help" in final[0], lines
