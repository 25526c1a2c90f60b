"""The headgate source reading through a gateway, as a cluster does.

A real gateway runs in this process (in a background event loop) on
127.0.0.1 and real producers fill three streams. Spark reads them with option
``gateway``: in the shared local session (batch and ``availableNow``), and in
a child process with the ``local-cluster`` master, whose executors are
separate JVMs and Python workers. Every record must come back exactly once.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from pyspark.sql import SparkSession

from headgate.cli.demo import BackgroundLoop
from headgate.client import Producer
from headgate.config import GatewayConfig
from headgate.gateway import Gateway
from headgate.spark.pipeline import Pipeline, error_text, pipeline_config_from_dict

STREAMS = ("alpha", "beta", "gamma")
RECORDS = 3000  # per stream
CHILD = Path(__file__).with_name("_cluster_child.py")


class RunningGateway:
    def __init__(self, data_dir: Path) -> None:
        self.loop = BackgroundLoop("test-gateway")
        self.gateway = Gateway(
            GatewayConfig(
                listen=("127.0.0.1", 0),
                data_dir=data_dir,
                term_length=64 * 1024,
                max_message_size=16 * 1024,
                stream_capacity=8 * 1024 * 1024,
                group_commit_interval_ms=1.0,
            )
        )
        self.loop.run(self.gateway.start(), 30)
        host, port = self.gateway.address
        self.address = f"{host}:{port}"

    def produce(self, stream: str, values: list[bytes], producer_id: int) -> None:
        async def send() -> None:
            async with Producer(
                self.address, producer_id=producer_id, max_batch_bytes=2048
            ) as producer:
                for value in values:
                    await producer.send(stream, value)
                await producer.flush()

        self.loop.run(send(), 60)

    def stop(self) -> None:
        self.loop.run(self.gateway.stop(), 30)
        self.loop.stop()


def expected_values(stream: str, count: int = RECORDS, offset: int = 0) -> list[bytes]:
    return [f"{stream}-{i:06d}".encode() for i in range(offset, offset + count)]


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[RunningGateway]:
    running = RunningGateway(tmp_path / "data")
    try:
        for index, stream in enumerate(STREAMS):
            running.produce(stream, expected_values(stream), producer_id=100 + index)
        yield running
    finally:
        running.stop()


def check_exactly_once(rows: list[Any], streams: tuple[str, ...] = STREAMS) -> None:
    """Each stream's rows are its values, each exactly once, in sequence order."""
    for stream in streams:
        mine = sorted((r[3], r[4]) for r in rows if r[0] == stream)
        assert [v for _, v in mine] == expected_values(stream), stream
        assert [s for s, _ in mine] == list(range(RECORDS))
        assert {r[2] for r in rows if r[0] == stream} == {100 + STREAMS.index(stream)}
    assert len(rows) == RECORDS * len(streams)


def test_batch_read_through_a_gateway_matches_the_local_read(
    spark: SparkSession, gateway: RunningGateway, tmp_path: Path
) -> None:
    columns = ("stream", "position", "producer", "sequence", "value", "ingest_time", "key")
    remote = (
        spark.read.format("headgate")
        .option("gateway", gateway.address)
        .option("bytesPerPartition", 16 * 1024)
        .load()
    )
    assert remote.rdd.getNumPartitions() > 3
    rows = [tuple(r) for r in remote.select(*columns).collect()]
    check_exactly_once(rows)
    local = spark.read.format("headgate").option("path", str(tmp_path / "data")).load()
    assert sorted(rows) == sorted(tuple(r) for r in local.select(*columns).collect())


def test_a_read_through_a_gateway_starts_exactly_at_a_record_address(
    spark: SparkSession, gateway: RunningGateway
) -> None:
    def read(**extra: str) -> list[tuple[int, int, bytes]]:
        reader = spark.read.format("headgate").option("gateway", gateway.address)
        for key, value in {"streams": "alpha", **extra}.items():
            reader = reader.option(key, value)
        rows = reader.load().select("position", "index", "value").collect()
        return sorted((r.position, r["index"], bytes(r.value)) for r in rows)

    everything = read()
    assert [v for _, _, v in everything] == expected_values("alpha")
    # A record in the middle of a batch of several: its address is in the output.
    at = next(i for i, (_, index, _) in enumerate(everything) if index == 2 and i > RECORDS // 2)
    position, index, _ = everything[at]
    assert read(startingOffsets=json.dumps({"alpha": f"{position}:{index}"})) == everything[at:]
    with pytest.raises(Exception, match=rf"record address {position}:999 is past the end of"):
        read(startingOffsets=json.dumps({"alpha": f"{position}:999"}))


def test_streaming_available_now_through_a_gateway_with_admission_control(
    spark: SparkSession, gateway: RunningGateway, tmp_path: Path
) -> None:
    name = "via_gateway"
    query = (
        spark.readStream.format("headgate")
        .option("gateway", gateway.address)
        .option("streamPattern", "alpha|gamma")
        .option("maxRecordsPerTrigger", 1000)
        .load()
        .writeStream.format("memory")
        .queryName(name)
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    assert query.awaitTermination(120)
    batches = [p for p in query.recentProgress if p.numInputRows > 0]
    assert len(batches) >= 6, "admission control must split the backlog"
    assert all(p.numInputRows <= 1000 + 200 for p in batches)
    rows = [
        tuple(r)
        for r in spark.sql(
            f"SELECT stream, position, producer, sequence, value FROM {name}"
        ).collect()
    ]
    check_exactly_once(rows, ("alpha", "gamma"))


@pytest.mark.parametrize("where", ["gateway", "path"])
def test_a_stream_that_does_not_exist_fails_at_start_naming_the_streams_that_do(
    spark: SparkSession, gateway: RunningGateway, tmp_path: Path, where: str
) -> None:
    place = gateway.address if where == "gateway" else str(tmp_path / "data")
    query = (
        spark.readStream.format("headgate")
        .option(where, place)
        .option("streams", "alpha,nosuch,betta")
        .load()
        .writeStream.format("memory")
        .queryName(f"missing_via_{where}")
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    with pytest.raises(Exception) as failed:
        query.awaitTermination(120)
    line = error_text(failed.value)
    held = f"gateway {place}" if where == "gateway" else f"data directory {place}"
    assert line.startswith(
        f"headgate: streams 'nosuch', 'betta' do not exist ({held} has alpha, beta, gamma). "
    ), line
    assert "missingStreams to 'wait'" in line
    assert not spark.table(f"missing_via_{where}").count()
    with pytest.raises(Exception, match=r"stream 'nosuch' does not exist \("):
        spark.read.format("headgate").option(where, place).option(
            "streams", "nosuch"
        ).load().collect()


@pytest.mark.parametrize("where", ["gateway", "path"])
def test_missing_streams_wait_reads_a_stream_that_its_producer_creates_later(
    spark: SparkSession, gateway: RunningGateway, tmp_path: Path, where: str
) -> None:
    name = f"waited_via_{where}"
    place = gateway.address if where == "gateway" else str(tmp_path / "data")
    query = (
        spark.readStream.format("headgate")
        .option(where, place)
        .option("streams", "late")
        .option("missingStreams", "wait")
        .load()
        .writeStream.format("memory")
        .queryName(name)
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(processingTime="0.2 seconds")
        .start()
    )
    try:
        deadline = time.monotonic() + 120
        while not query.recentProgress:  # it runs, with nothing to read
            assert query.isActive and time.monotonic() < deadline, query.exception()
            time.sleep(0.1)
        gateway.produce("late", expected_values("late", 500), producer_id=200)
        while spark.table(name).count() < 500:
            assert query.isActive and time.monotonic() < deadline, query.exception()
            time.sleep(0.1)
        query.processAllAvailable()
        values = [bytes(r.value) for r in spark.sql(f"SELECT value FROM {name}").collect()]
    finally:
        query.stop()
    assert sorted(values) == expected_values("late", 500)


def test_a_gateway_that_is_down_is_a_clear_error_naming_it(spark: SparkSession) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    where = f"127.0.0.1:{port}"
    with pytest.raises(Exception, match=f"cannot read through gateway {where}"):
        spark.read.format("headgate").option("gateway", where).load().collect()
    with pytest.raises(Exception, match="option 'gateway' must be host:port"):
        spark.read.format("headgate").option("gateway", "127.0.0.1:99999").load()


def test_the_pipeline_reads_through_the_gateway_and_releases_to_it(
    spark: SparkSession, gateway: RunningGateway, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    pipeline = Pipeline(
        spark,
        pipeline_config_from_dict(
            {
                "data_dir": str(tmp_path / "nowhere"),  # never read: the gateway serves
                "gateway": gateway.address,
                "read_through_gateway": True,
                "output_dir": str(out),
                "checkpoint_dir": str(tmp_path / "checkpoints"),
                "streams": {"beta": {"max_records_per_trigger": 1000}},
            }
        ),
    )
    try:
        pipeline.start(available_now=True)
        pipeline.await_done(120)
    finally:
        pipeline.stop()
    values = pq.read_table(out / "beta").to_pydict()["value"]
    assert sorted(values) == expected_values("beta")
    log = gateway.gateway.streams["beta"].log
    deadline = time.monotonic() + 10
    while log.release_position < log.durable_position and time.monotonic() < deadline:
        time.sleep(0.05)
    assert log.release_position == log.durable_position == pipeline.committed["beta"]
    assert not (tmp_path / "nowhere").exists()


def local_cluster_environment() -> dict[str, str]:
    """What a pip-installed PySpark needs to start a ``local-cluster`` master.

    Measured with PySpark 4.3 here: the master's workers launch executors
    with ``$SPARK_HOME/bin/spark-class``, and PySpark finds SPARK_HOME by
    itself (its own package directory, which holds ``bin/`` and ``jars/``)
    and passes it to the JVM; Spark 4's scripts no longer need
    SPARK_SCALA_VERSION. It is set here anyway, so that a SPARK_HOME of some
    other Spark in the environment cannot be picked up. What is needed is
    PYSPARK_PYTHON: the executors' Python workers otherwise run whatever
    ``python3`` is on the PATH, which does not have headgate.
    """
    import pyspark

    env = dict(os.environ)
    env["SPARK_HOME"] = os.path.dirname(pyspark.__file__)
    env["PYSPARK_PYTHON"] = sys.executable
    env["PYSPARK_DRIVER_PYTHON"] = sys.executable
    return env


@pytest.mark.timeout(300)
def test_local_cluster_executors_read_through_the_gateway(
    gateway: RunningGateway, tmp_path: Path
) -> None:
    output = tmp_path / "cluster.json"
    child = subprocess.run(
        [sys.executable, str(CHILD), gateway.address, str(output)],
        env=local_cluster_environment(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert child.returncode == 0, child.stderr[-4000:]
    result = json.loads(output.read_text())
    # Two executors, each a process of its own, apart from the driver.
    assert len(result["executor_pids"]) == 2
    assert result["driver_pid"] not in result["executor_pids"]
    assert os.getpid() not in result["executor_pids"]
    assert result["partitions"] > 2
    rows = [(s, p, prod, seq, bytes.fromhex(v)) for s, p, prod, seq, v in result["rows"]]
    check_exactly_once(rows)
