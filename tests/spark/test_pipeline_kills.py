"""``headgate pipeline`` SIGKILLed mid-batch again and again, under load, loses and repeats nothing.

A real gateway in this process, a producer writing two streams the whole
time (one parsed as JSON with some bad records, one raw), and the pipeline
as a subprocess of its own (its own Spark driver). The pipeline is killed
three times while its batches run (the whole process group: the
driver's JVM and Python workers too) and started again each time; the last run
is stopped with SIGTERM once everything sent has been acknowledged. Then
every record is in Parquet or in the dead letters exactly once, by its id,
and no run of the pipeline failed or restarted a query: every restart worked
the first time. What the killed drivers left in Spark's scratch space is
gone after the next start.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from headgate.cli.demo import BackgroundLoop
from headgate.client import SyncProducer
from headgate.config import GatewayConfig
from headgate.gateway import Gateway
from headgate.spark.pipeline import committed_positions

KILLS = 3


def record(stream: str, n: int) -> bytes:
    if stream == "beta":
        return b"beta-%d" % n
    if n % 97 == 13:
        return b"alpha-%d is not json" % n  # a dead letter
    return json.dumps({"id": n, "pad": "x" * 40}).encode()


def alpha_id(raw: bytes) -> int:
    return int(raw.split(b"-")[1].split(b" ")[0])


def parquet_files(path: Path) -> int:
    return sum(1 for _ in path.rglob("batch-*.parquet")) if path.is_dir() else 0


def column(path: Path, name: str) -> list[Any]:
    if not path.is_dir() or not parquet_files(path):
        return []
    values: list[Any] = pq.read_table(path).column(name).to_pylist()
    return values


class Load:
    """Sends numbered records to both streams until stopped; counts what it handed over."""

    def __init__(self, address: str) -> None:
        self.producer = SyncProducer(address, producer_id=77, connect_timeout=10)
        self.sent = 0
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.stop.is_set() and self.sent < 80_000:
                first = self.sent
                for stream in ("alpha", "beta"):
                    self.producer.send_many(
                        stream, [record(stream, n) for n in range(first, first + 200)]
                    )
                self.sent += 200
                time.sleep(0.08)  # 2,500 records/s a stream while the gateway takes them
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)

    def finish(self) -> int:
        self.stop.set()
        self.thread.join(60)
        assert not self.thread.is_alive() and not self.errors, self.errors
        self.producer.flush(120)
        self.producer.close()
        return self.sent


def start_pipeline(config: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "headgate.cli", "pipeline", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            # Its own process group: the kill takes Spark's JVM and Python
            # workers with it, as a machine's or container's end would, and
            # none of them gets to clean up.
            start_new_session=True,
        )


def wait_for_new_batches(
    process: subprocess.Popen[bytes], outputs: list[Path], before: int, log: Path
) -> None:
    """Wait (bounded) until this run wrote at least two more batch files."""
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()
        if sum(parquet_files(p) for p in outputs) >= before + 2:
            return
        time.sleep(0.1)
    raise AssertionError("the pipeline wrote nothing after its restart:\n" + log.read_text())


def test_a_pipeline_killed_mid_batch_again_and_again_restarts_and_counts_exactly_once(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    loop = BackgroundLoop("kill-test-gateway")
    gateway = Gateway(
        GatewayConfig(
            listen=("127.0.0.1", 0),
            data_dir=data,
            term_length=256 * 1024,
            max_message_size=64 * 1024,
            stream_capacity=2 * 1024 * 1024,
        )
    )
    loop.run(gateway.start(), 30)
    host, port = gateway.address
    address = f"{host}:{port}"
    config = tmp_path / "pipeline.toml"
    config.write_text(
        f'data_dir = "{data}"\ngateway = "{address}"\n'
        "[streams.alpha]\nformat = 'json'\nschema = 'id BIGINT, pad STRING'\n"
        "trigger_seconds = 0.2\nmax_records_per_trigger = 3000\n"
        "[streams.beta]\nformat = 'raw'\ntrigger_seconds = 0.2\nmax_records_per_trigger = 3000\n"
    )
    alpha_out, beta_out = data / "parquet" / "alpha", data / "parquet" / "beta"
    dead = data / "parquet" / "_dead_letters" / "alpha"
    scratch = data / "checkpoints" / "_spark-local"
    outputs = [alpha_out, beta_out, dead]
    logs = [tmp_path / f"run-{i}.log" for i in range(KILLS + 1)]
    rng = random.Random(15)
    load = Load(address)
    try:
        left_by_kills: set[str] = set()
        for run in range(KILLS):
            before = sum(parquet_files(p) for p in outputs)
            process = start_pipeline(config, logs[run])
            try:
                wait_for_new_batches(process, outputs, before, logs[run])
                time.sleep(rng.uniform(0.0, 0.4))  # somewhere inside a batch
            finally:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(30)
            left_by_kills |= {p.name for p in scratch.iterdir()} if scratch.is_dir() else set()
        assert left_by_kills, "a killed driver leaves its scratch behind; the test expected some"
        # The last run: everything sent is acknowledged while it runs, then it stops cleanly.
        before = sum(parquet_files(p) for p in outputs)
        process = start_pipeline(config, logs[KILLS])
        try:
            wait_for_new_batches(process, outputs, before, logs[KILLS])
            assert not left_by_kills & {p.name for p in scratch.iterdir()}, "not cleaned at start"
            sent = load.finish()
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if len(column(beta_out, "value")) >= sent:
                    break
                time.sleep(0.3)
            time.sleep(1.0)  # alpha's last batch
        finally:
            process.send_signal(signal.SIGTERM)
            status = process.wait(120)
        released = {s.name: s.release_position for s in loop.run(statistics(gateway), 10)}
    finally:
        load.stop.set()
        loop.run(gateway.stop(), 30)
        loop.stop()
    outputs_text = [log.read_text() for log in logs]
    assert status == 0, outputs_text[-1]
    for text in outputs_text:
        # A query that failed would have been restarted with a warning, or ended the run.
        assert "warning: the query" not in text and "headgate pipeline:" not in text, text
    beta = Counter(column(beta_out, "value"))
    alpha = Counter(column(alpha_out, "id")) + Counter(alpha_id(r) for r in column(dead, "raw"))
    assert beta == Counter(b"beta-%d" % n for n in range(sent)), "beta lost or repeated records"
    assert alpha == Counter(range(sent)), "alpha lost or repeated records"
    assert sum(1 for n in range(sent) if n % 97 == 13) == len(column(dead, "raw"))
    # What a restart releases before Spark starts is read from Spark's own
    # checkpoint files: after a clean stop, exactly what the gateway has.
    for stream in ("alpha", "beta"):
        committed = committed_positions(data / "checkpoints" / stream)
        assert committed == {stream: released[stream]}, (committed, released)


async def statistics(gateway: Gateway) -> list[Any]:
    return list(gateway.statistics())
