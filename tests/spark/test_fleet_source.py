"""One Spark query over a fleet: ``option("cluster", ...)`` against three real gateways.

Three ``headgate serve --cluster`` processes on 127.0.0.1 (the fleet of
tests/client/test_fleet.py) hold the 6 partitions of ``orders``; a
FleetProducer sends keyed records. The query, in the shared local session,
reads every partition through its gateway: every acknowledged record comes
back exactly once, and each key's records in the order they were sent. A
SIGKILLed gateway holds back only its partitions; after its restart the
query catches up, exactly once.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from pyspark.sql import SparkSession
from rich.console import Console

from headgate.cli import main
from headgate.cli.demo import SYMBOLS, run_demo
from headgate.client.fleet import FleetProducer
from headgate.client.reader import Reader
from headgate.cluster import load_cluster, partition_name, partition_of
from headgate.config import ConfigError
from headgate.spark.pipeline import (
    META_COLUMNS,
    Pipeline,
    pipeline_config_from_dict,
    query_definition,
)
from headgate.spark.source import FLEET_SCHEMA, SCHEMA, HeadgateDataSource, SourceOptions
from tests.client.test_fleet import GATEWAYS, Fleet, run, write_cluster
from tests.spark.test_gateway_source import local_cluster_environment

pytestmark = pytest.mark.timeout(240)

PARTITIONS = 6


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    fleet = Fleet(tmp_path)
    try:
        for name in GATEWAYS:
            fleet.start(name)
        yield fleet
    finally:
        fleet.stop_all()


def produce(fleet: Fleet, values: list[bytes]) -> None:
    """Send ``values`` keyed by what precedes their ``:``; returns once all are acknowledged."""

    async def send() -> None:
        async with FleetProducer(
            cluster=fleet.cluster, linger_ms=1, max_batch_bytes=1024
        ) as producer:
            for value in values:
                await producer.send("orders", value, key=value.split(b":")[0])

    run(send())


def keyed(keys: list[int], per_key: int, first: int = 0) -> list[bytes]:
    return [b"k%02d:%05d" % (k, i) for i in range(first, first + per_key) for k in keys]


def partition_of_key(key: int) -> int:
    return partition_of(b"k%02d" % key, PARTITIONS)


def fleet_query(
    spark: SparkSession,
    fleet: Fleet,
    tmp_path: Path,
    name: str,
    trigger: dict[str, Any],
    **options: Any,
) -> Any:
    return (
        spark.readStream.format("headgate")
        .option("cluster", str(fleet.cluster))
        .option("streams", "orders")
        .options(**options)
        .load()
        .writeStream.format("memory")
        .queryName(name)
        .option("checkpointLocation", str(tmp_path / f"checkpoint-{name}"))
        .trigger(**trigger)
        .start()
    )


def check_read(spark: SparkSession, name: str, sent: list[bytes]) -> None:
    """Every sent value once, each in its key's partition, each key's values in send order."""
    rows = spark.sql(
        f"SELECT stream, partition, position, index, value FROM {name} "
        "ORDER BY stream, position, index"
    ).collect()
    values = [bytes(r.value) for r in rows]
    assert len(values) == len(sent) and sorted(values) == sorted(sent)
    per_key: dict[bytes, list[bytes]] = defaultdict(list)
    for row in rows:
        key = bytes(row.value).split(b":")[0]
        assert row.partition == partition_of(key, PARTITIONS)
        assert row.stream == partition_name("orders", row.partition)
        per_key[key].append(bytes(row.value))
    for key, got in per_key.items():
        assert got == [v for v in sent if v.split(b":")[0] == key], key


def test_a_killed_gateway_holds_back_only_its_partitions_and_catches_up(
    spark: SparkSession, fleet: Fleet, tmp_path: Path
) -> None:
    cluster = load_cluster(fleet.cluster).stream("orders")
    down = {p.index for p in cluster.partitions if p.gateway == "gw2"}
    keys = list(range(24))
    elsewhere = [k for k in keys if partition_of_key(k) not in down]
    assert down and len(elsewhere) < len(keys)
    first = keyed(keys, 20)
    produce(fleet, first)
    name = "fleet_kill"
    query = fleet_query(spark, fleet, tmp_path, name, {"processingTime": "0.2 seconds"})
    try:
        query.processAllAvailable()
        assert spark.table(name).count() == len(first)
        fleet.kill("gw2")
        # Only the partitions of the gateways that are up get more records.
        more = keyed(elsewhere, 20, first=20)
        produce(fleet, more)
        deadline = time.monotonic() + 60
        while spark.table(name).count() < len(first) + len(more):
            assert query.isActive and time.monotonic() < deadline, query.exception()
            time.sleep(0.1)
        fleet.start("gw2")
        last = keyed(keys, 20, first=40)
        produce(fleet, last)
        total = len(first) + len(more) + len(last)
        while spark.table(name).count() < total:
            assert query.isActive and time.monotonic() < deadline, query.exception()
            time.sleep(0.1)
        query.processAllAvailable()
    finally:
        query.stop()
    check_read(spark, name, first + more + last)


def test_one_query_reads_every_partition_of_three_gateways_once_in_key_order(
    spark: SparkSession, fleet: Fleet, tmp_path: Path
) -> None:
    """Through the pipeline (``cluster = ...``), which also releases each partition."""
    sent = keyed(list(range(24)), 50)  # 24 keys reach all 6 partitions
    assert {partition_of_key(k) for k in range(24)} == set(range(PARTITIONS))
    produce(fleet, sent)
    config = pipeline_config_from_dict(
        {
            "cluster": str(fleet.cluster),
            "data_dir": str(tmp_path / "pipeline"),
            "streams": {
                "orders": {"format": "raw", "consumer": "archive", "max_records_per_trigger": 800}
            },
        }
    )
    pipeline = Pipeline(spark, config)
    try:
        pipeline.start(available_now=True)
        pipeline.await_done(120)
        releases = pipeline._gateway_releases
        assert releases is not None and releases.close(10)
        applied = releases.applied()
        progress = [p for p in pipeline.queries["orders"].recentProgress if p.numInputRows > 0]
    finally:
        pipeline.stop()
    assert len(progress) == 2, "admission control must split the backlog"
    # An offset is a position per partition log, in a fixed (sorted) key order.
    end = json.loads(progress[-1].sources[0].endOffset)
    assert list(end) == [f"orders.p{k}" for k in range(PARTITIONS)]
    table = pq.read_table(tmp_path / "pipeline" / "parquet" / "orders")
    assert table.column_names[:3] == ["stream", "partition", "position"]
    assert str(table.schema.field("partition").type) == "int32"
    rows = table.to_pylist()
    assert sorted(r["value"] for r in rows) == sorted(sent)
    assert all(r["partition"] == partition_of(r["value"].split(b":")[0], 6) for r in rows)
    rows.sort(key=lambda r: (r["stream"], r["position"], r["index"]))
    for key in {v.split(b":")[0] for v in sent}:
        got = [r["value"] for r in rows if r["value"].split(b":")[0] == key]
        assert got == [v for v in sent if v.split(b":")[0] == key]

    # Each partition's gateway applied its release, as consumer archive, at its end.
    positions: dict[str, tuple[int, int, dict[str, int]]] = {}

    async def released() -> None:
        for gateway in GATEWAYS:
            async with Reader(fleet.address(gateway)) as reader:
                for info in await reader.list_streams():
                    consumers = await reader.list_consumers(info.stream)
                    positions[info.stream] = (
                        applied[info.stream],
                        info.durable_position,
                        {c.consumer: c.position for c in consumers},
                    )

    run(released())
    assert sorted(positions) == [f"orders.p{k}" for k in range(PARTITIONS)]
    for done, end, consumers in positions.values():
        assert done == end > 0 and consumers.get("archive") == end, positions


def test_cluster_mistakes_are_one_line_before_any_query(tmp_path: Path) -> None:
    """The source's ``cluster`` option and the pipeline's ``cluster`` key, without Spark."""
    ports = {name: 7000 + i for i, name in enumerate(GATEWAYS)}
    cluster = str(write_cluster(tmp_path / "cluster.toml", ports))
    options = SourceOptions.parse({"cluster": cluster, "streams": "orders"})
    assert options.fleet_streams == ("orders",)
    assert options.selection.names == tuple(f"orders.p{k}" for k in range(PARTITIONS))
    assert SourceOptions.parse({"cluster": cluster}).fleet_streams == ("events", "orders")
    assert SourceOptions.parse({"cluster": cluster, "streamPattern": "ev.*"}).fleet_streams == (
        "events",
    )
    (tmp_path / "broken.toml").write_text("[gateways.gw1]\n", encoding="utf-8")
    for raw, fragment in [
        ({"cluster": cluster, "gateway": "h:1"}, "exactly one of option 'path'"),
        ({"cluster": cluster, "streams": "ordres"}, "has no partitioned stream 'ordres'"),
        ({"cluster": str(tmp_path / "nosuch.toml")}, "option 'cluster': cluster file"),
        ({"cluster": str(tmp_path / "broken.toml")}, "option 'cluster': "),
    ]:
        with pytest.raises(ValueError, match=re.escape(fragment)) as refused:
            SourceOptions.parse(raw)
        assert "\n" not in str(refused.value)
    good: dict[str, Any] = {"cluster": cluster, "streams": {"orders": {}}}
    assert pipeline_config_from_dict(good).cluster == Path(cluster)
    bad: list[tuple[dict[str, Any], str]] = [
        ({**good, "gateway": "h:1"}, "leave out gateway"),
        ({**good, "streams": {"ordres": {}}}, "has no partitioned stream 'ordres'"),
        ({**good, "cluster": str(tmp_path / "broken.toml")}, "pipeline: cluster: "),
    ]
    for raw, fragment in bad:
        with pytest.raises(ConfigError, match=re.escape(fragment)) as refused:
            pipeline_config_from_dict(raw)
        assert "\n" not in str(refused.value)


def test_only_a_fleet_query_has_the_partition_column(tmp_path: Path) -> None:
    """The path and gateway sources keep their schema (and their checkpoints open)."""
    ports = {name: 7000 + i for i, name in enumerate(GATEWAYS)}
    cluster = str(write_cluster(tmp_path / "cluster.toml", ports))
    fleet_source = HeadgateDataSource({"cluster": cluster, "streams": "orders"})
    assert fleet_source.schema() == FLEET_SCHEMA
    assert FLEET_SCHEMA.fieldNames()[:3] == ["stream", "partition", "position"]
    assert FLEET_SCHEMA.fieldNames() == ["stream", "partition", *SCHEMA.fieldNames()[1:]]
    for single in ({"gateway": "127.0.0.1:1", "streams": "s"}, {"path": str(tmp_path)}):
        assert HeadgateDataSource(single).schema() == SCHEMA
    with pytest.raises(ValueError, match="the schema is fixed"):
        fleet_source.streamReader(SCHEMA)
    # The pipeline's checkpoint definitions: the fleet's rows carry the partition.
    by_cluster = pipeline_config_from_dict(
        {"cluster": cluster, "data_dir": str(tmp_path / "p"), "streams": {"orders": {}}}
    )
    by_gateway = pipeline_config_from_dict(
        {"gateway": "127.0.0.1:1", "data_dir": str(tmp_path / "q"), "streams": {"orders": {}}}
    )
    assert query_definition(by_gateway, "orders")["columns"] == list(META_COLUMNS)
    assert query_definition(by_cluster, "orders")["columns"] == [
        "stream",
        "partition",
        *META_COLUMNS[1:],
    ]


def test_the_demo_on_three_gateways_writes_every_acknowledged_record_with_its_partition(
    spark: SparkSession, tmp_path: Path
) -> None:
    """``headgate run --gateways 3``, with a short load, in the shared session."""
    out = io.StringIO()
    console = Console(file=out, width=100, force_terminal=False)
    result = run_demo(tmp_path / "demo", 3.0, console, spark=spark, gateways=3)
    text = out.getvalue()
    assert result.failure is None and result.completed and not result.interrupted, text
    for s in result.summaries:
        assert s.acked > 0 and s.sent == s.acked, s
        assert s.written + s.dead_letters == s.acked, s
    # Per gateway and partition: every partition of every stream, on its gateway, each
    # partition's acknowledged records written (rows or dead letters) from it alone.
    cluster = load_cluster(tmp_path / "demo" / "cluster.toml")
    ticks_holders = cluster.stream("ticks").holders
    # The 5 symbols are the ticks' only keys: their partitions, and no other.
    expected = {
        (ticks_holders[k], f"ticks.p{k}")
        for k in {partition_of(s.encode(), len(ticks_holders)) for s in SYMBOLS}
    }
    expected |= {
        (p.gateway, p.name) for s in ("accounting", "audit") for p in cluster.stream(s).partitions
    }
    assert {(p.gateway, p.partition) for p in result.partitions} == expected
    assert {p.gateway for p in result.partitions} == set(GATEWAYS)
    for p in result.partitions:
        assert p.acked > 0 and p.acked_bytes > p.acked and p.written == p.acked, p
    for s in result.summaries:
        assert sum(p.acked for p in result.partitions if p.stream == s.stream) == s.acked
    assert "per gateway and partition" in text and "Traceback" not in text
    # Keyed: each symbol's ticks are in its key's partition, which the rows name.
    ticks = pq.read_table(tmp_path / "demo" / "parquet" / "ticks").to_pylist()
    partitions = len(cluster.stream("ticks").holders)
    assert ticks and all(
        r["partition"] == partition_of(str(r["symbol"]).encode(), partitions)
        and r["stream"] == f"ticks.p{r['partition']}"
        for r in ticks
    )
    assert spark.range(3).count() == 3  # the session is the caller's: still usable


def test_run_takes_gateways_from_1_to_9() -> None:
    shown = CliRunner().invoke(main, ["run", "--help"])
    assert shown.exit_code == 0 and "--gateways" in shown.output
    refused = CliRunner().invoke(main, ["run", "--gateways", "0"])
    assert refused.exit_code == 2 and "--gateways" in refused.output


FLEET_CHILD = Path(__file__).with_name("_fleet_cluster_child.py")


@pytest.mark.timeout(300)
def test_local_cluster_executors_read_keyed_and_keyless_records_of_three_gateways_once(
    fleet: Fleet, tmp_path: Path
) -> None:
    """Executors in their own JVMs and Pythons read the fleet: nothing lost or twice,
    keyed records in their key's partition in send order, keyless ones spread."""
    keyed_values = keyed(list(range(12)), 40)
    keyless_values = [b"free:%05d" % i + b"." * 200 for i in range(600)]

    async def send() -> None:
        async with FleetProducer(
            cluster=fleet.cluster, linger_ms=1, max_batch_bytes=1024
        ) as producer:
            for index, value in enumerate(keyed_values):
                await producer.send("orders", value, key=value.split(b":")[0])
                await producer.send("orders", keyless_values[index])
            await producer.send_many("orders", keyless_values[len(keyed_values) :])

    run(send())
    output = tmp_path / "fleet.json"
    child = subprocess.run(
        [sys.executable, str(FLEET_CHILD), str(fleet.cluster), str(output)],
        env=local_cluster_environment(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert child.returncode == 0, child.stderr[-4000:]
    result = json.loads(output.read_text())
    assert len(result["executor_pids"]) == 2
    assert result["driver_pid"] not in result["executor_pids"]
    assert os.getpid() not in result["executor_pids"]
    rows = sorted(
        (stream, partition, position, index, bytes.fromhex(value))
        for stream, partition, position, index, value in result["rows"]
    )
    values = [r[4] for r in rows]
    assert len(values) == len(keyed_values) + len(keyless_values)
    assert sorted(values) == sorted(keyed_values + keyless_values)
    for stream, partition, *_ in rows:
        assert stream == partition_name("orders", partition)
    for key in {v.split(b":")[0] for v in keyed_values}:
        mine = [r for r in rows if r[4].split(b":")[0] == key]
        assert {r[1] for r in mine} == {partition_of(key, PARTITIONS)}
        assert [r[4] for r in mine] == [v for v in keyed_values if v.split(b":")[0] == key]
    # Sticky batches of keyless records move among the partitions.
    assert len({r[1] for r in rows if r[4].startswith(b"free:")}) >= 3
