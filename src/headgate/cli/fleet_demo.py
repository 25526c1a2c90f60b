"""``headgate run --gateways N``: the demo on a fleet of N local gateways.

The same three streams as :mod:`headgate.cli.demo`, each a partitioned stream of
a cluster file the command writes (``<data_dir>/cluster.toml``): N gateways
on 127.0.0.1, each in this process on its own event loop and data directory
(``<data_dir>/gw1`` ...), ports picked free at start. One
:class:`~headgate.client.FleetProducer` sends every record with a key (a
tick's symbol, an accounting event's or an audit event's user), so one key's
records land in one partition, in order. The pipeline runs one Spark query
per stream over the cluster (option ``cluster``): each reads every partition
through its gateway and releases it there, and its Parquet rows carry the
``partition`` column. The summary adds a table per gateway and partition:
records and bytes acknowledged, and rows written.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import socket
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from headgate.cli.demo import (
    GENERATORS,
    PIPELINE,
    STREAMS,
    BackgroundLoop,
    DemoFailed,
    _Demo,
    demo_gateway_config,
)
from headgate.cluster import Cluster, Partition, load_cluster
from headgate.config import StreamSettings
from headgate.gateway import Gateway, GatewayStreamStatistics
from headgate.log.lock import DirectoryInUse

if TYPE_CHECKING:
    from collections.abc import Callable

    from headgate.client.fleet import PartitionStatistics

__all__ = ["FleetDemo", "PartitionSummary", "record_key"]

#: The field of each stream's JSON records that is its key.
KEY_FIELDS = {"ticks": "symbol", "accounting": "user", "audit": "user"}
#: Partitions per gateway of each stream: the slow audit stream has fewer, so
#: that its backlog (what credit lets in) stays about the one-gateway demo's.
PARTITIONS_PER_GATEWAY = {"ticks": 2, "accounting": 2, "audit": 1}
#: Terms of 128 KiB and frames of at most 16 KiB, so that a partition of audit
#: may hold as little as 256 KiB and still give credit beyond the room the log
#: keeps for term rotations (a frame per term, and two).
TERM_LENGTH = 128 * 1024
MAX_MESSAGE_SIZE = 16 * 1024
AUDIT_PARTITION_CAPACITY = 256 * 1024
#: The other partitions' capacity: a stream of 6 holds about the one-gateway demo's 16 MiB.
PARTITION_CAPACITY = 4 * 1024 * 1024
#: The producer's bound per partition (the one-gateway demo's 512 KiB is per stream).
MAX_BUFFERED_PER_PARTITION = 128 * 1024


def record_key(stream: str, value: bytes) -> bytes | None:
    """The key of a demo record: its :data:`KEY_FIELDS` field; None for a malformed one."""
    try:
        document = json.loads(value)
    except ValueError:
        return None
    field = document.get(KEY_FIELDS[stream]) if isinstance(document, dict) else None
    return None if field is None else str(field).encode()


async def _keyed_load(producer: Any, stream: str, stop: asyncio.Event) -> None:
    rng = random.Random(stream)
    make = GENERATORS[stream]
    n = 0
    while not stop.is_set():
        value = make(rng, n)
        # A malformed record has no key: it goes to a sticky partition.
        await producer.send(stream, value, key=record_key(stream, value))
        n += 1
        if n % 200 == 0:
            await asyncio.sleep(0)


def _free_ports(count: int) -> list[int]:
    """``count`` TCP ports on 127.0.0.1 that nothing listens on (as of now)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            s = stack.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            ports.append(int(s.getsockname()[1]))
        return ports


def write_demo_cluster(path: Path, ports: dict[str, int]) -> Cluster:
    """The demo's cluster file: the gateways at ``ports``, the streams round robin over them."""
    lines = ["# Written by headgate run --gateways; rewritten (new ports) by every run."]
    for name, port in ports.items():
        lines += [f"[gateways.{name}]", f'address = "127.0.0.1:{port}"']
    for stream in STREAMS:
        partitions = PARTITIONS_PER_GATEWAY[stream] * len(ports)
        lines += [f"[streams.{stream}]", f"partitions = {partitions}"]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return load_cluster(path)


@dataclass(frozen=True, slots=True)
class PartitionSummary:
    """One partition at the end of the demo."""

    gateway: str
    stream: str
    #: The partition's log (``ticks.p3``).
    partition: str
    #: Records and record bytes the gateway acknowledged durable.
    acked: int
    acked_bytes: int
    #: Parquet rows and dead letters written from it (None: not counted).
    written: int | None


@dataclass
class _StreamTotals:
    """A stream's figures summed over its partitions (what the demo's dashboard reads)."""

    records_sent: int = 0
    records_acked: int = 0
    buffered_bytes: int = 0


def _summed(stream: str, parts: list[GatewayStreamStatistics]) -> GatewayStreamStatistics:
    """One stream's partitions as one: each figure summed (release reaches durable on
    the sum only when it does on every partition)."""

    def total(field: str) -> int:
        return sum(int(getattr(p, field)) for p in parts)

    return GatewayStreamStatistics(
        name=stream,
        capacity=total("capacity"),
        free_capacity=total("free_capacity"),
        tail_position=total("tail_position"),
        durable_position=total("durable_position"),
        release_position=total("release_position"),
        writers=total("writers"),
        guarantees_outstanding=total("guarantees_outstanding"),
        appended_batches=total("appended_batches"),
        appended_records=total("appended_records"),
        duplicate_batches=total("duplicate_batches"),
        storage_problem=next((p.storage_problem for p in parts if p.storage_problem), None),
        held_batches=total("held_batches"),
        reserve=total("reserve"),
    )


class FleetDemo(_Demo):
    """The demo's phases over ``count`` gateways (see the module docstring)."""

    def __init__(self, data_dir: Path, console: Console, spark: Any | None, count: int) -> None:
        super().__init__(data_dir, console, spark)
        self.count = count
        self.cluster_path = data_dir / "cluster.toml"
        self.cluster: Cluster | None = None
        self.gateways: dict[str, tuple[BackgroundLoop, Gateway]] = {}
        self.carried_by = f"{count} gateways"
        self._last_partitions: dict[str, PartitionStatistics] = {}

    # -- phases -------------------------------------------------------------------

    def start_gateway(self) -> None:
        names = [f"gw{i + 1}" for i in range(self.count)]
        self.data_dir.mkdir(parents=True, exist_ok=True)
        ports = dict(zip(names, _free_ports(self.count), strict=True))
        cluster = self.cluster = write_demo_cluster(self.cluster_path, ports)
        for name in names:
            audit = {
                p.name: StreamSettings(capacity=AUDIT_PARTITION_CAPACITY)
                for p in cluster.held_by(name)
                if p.stream == "audit"
            }
            config = replace(
                demo_gateway_config(self.data_dir / name),
                listen=("127.0.0.1", ports[name]),
                term_length=TERM_LENGTH,
                max_message_size=MAX_MESSAGE_SIZE,
                stream_capacity=PARTITION_CAPACITY,
                cluster=self.cluster_path,
                cluster_name=name,
                streams=audit,
            ).validate()
            thread = BackgroundLoop(f"headgate-gateway-{name}")
            try:
                gateway = Gateway(config)
                thread.run(gateway.start(), 30)
            except DirectoryInUse:
                thread.stop()
                raise  # the command says who holds it, in its own words
            except Exception as exc:
                thread.stop()
                raise DemoFailed(f"gateway {name} did not start: {exc}") from None
            self.gateways[name] = (thread, gateway)
            self.console.print(f"gateway {name} listening on 127.0.0.1:{ports[name]}")
        self.console.print(
            f"cluster file {self.cluster_path}: "
            + ", ".join(f"{s} {len(cluster.stream(s).holders)} partitions" for s in STREAMS)
        )

    def start_spark(self) -> None:
        # The pipeline declares each stream's consumer on every partition before
        # the producer has created any: each gateway refuses that (the consumer
        # is declared with the first release instead) and logs a warning per
        # partition, which in the demo is only noise on the terminal.
        gateway_log = logging.getLogger("headgate.gateway")
        level = gateway_log.level
        gateway_log.setLevel(logging.ERROR)
        try:
            super().start_spark()
        finally:
            gateway_log.setLevel(level)

    def pipeline_settings(self) -> dict[str, Any]:
        """The pipeline reads and releases every partition through its gateway."""
        return {
            "cluster": str(self.cluster_path),
            "data_dir": str(self.data_dir),
            "missing_streams": "wait",
            "streams": PIPELINE,
        }

    def release_callback(self) -> Callable[[str, int], None] | None:
        return None  # the pipeline's own: each partition's release to its gateway

    def new_producer(self) -> Any:
        from headgate.client import FleetProducer

        return FleetProducer(
            cluster=self.cluster,
            client_name="headgate-demo",
            max_buffered_bytes=MAX_BUFFERED_PER_PARTITION,
        )

    def load(self, stream: str, stop: asyncio.Event) -> Any:
        return _keyed_load(self.producer, stream, stop)

    def teardown(self) -> None:
        super().teardown()  # the load, the producer, the pipeline
        for thread, gateway in self.gateways.values():
            with contextlib.suppress(Exception):
                thread.run(gateway.stop(), 60)
            thread.stop()

    # -- what it knows --------------------------------------------------------------

    def producer_partitions(self) -> dict[str, PartitionStatistics]:
        """The producer's per-partition statistics, taken on its own loop."""
        producer, thread = self.producer, self.prod_thread
        if producer is None or thread is None:
            return self._last_partitions

        async def snapshot() -> dict[str, PartitionStatistics]:
            return dict(producer.statistics().partitions)

        coro = snapshot()
        try:
            partitions: dict[str, PartitionStatistics] = thread.run(coro, 10)
        except RuntimeError:  # its loop is already closed: the last figures stand
            coro.close()
            return self._last_partitions
        self._last_partitions = partitions
        return partitions

    def producer_streams(self) -> dict[str, Any]:
        totals: dict[str, _StreamTotals] = {}
        for p in self.producer_partitions().values():
            t = totals.setdefault(p.stream, _StreamTotals())
            t.records_sent += p.records_sent
            t.records_acked += p.records_acked
            t.buffered_bytes += p.buffered_bytes
        return totals

    def gateway_stats(self) -> dict[str, GatewayStreamStatistics]:
        """Per stream, its partitions on every gateway, summed."""
        assert self.cluster is not None
        by_stream: dict[str, list[GatewayStreamStatistics]] = {}
        for thread, gateway in self.gateways.values():

            async def snapshot(g: Gateway = gateway) -> list[GatewayStreamStatistics]:
                return g.statistics()

            for stats in thread.run(snapshot(), 10):
                found = self.cluster.locate(stats.name)
                if isinstance(found, Partition):
                    by_stream.setdefault(found.stream, []).append(stats)
        return {s: _summed(s, parts) for s, parts in by_stream.items()}

    def partition_summaries(self, spark: Any | None) -> list[PartitionSummary]:
        """Each partition's acknowledged records and bytes, and (with ``spark``) rows written."""
        written = _written_by_partition(spark, self.pipeline) if spark is not None else None
        rows = [
            PartitionSummary(
                gateway=p.gateway,
                stream=p.stream,
                partition=name,
                acked=p.records_acked,
                acked_bytes=p.bytes_acked,
                written=None if written is None else written.get(name, 0),
            )
            for name, p in self.producer_partitions().items()
        ]
        return sorted(rows, key=lambda r: (r.gateway, r.stream, int(r.partition.split(".p")[-1])))


def _written_by_partition(spark: Any, pipeline: Any) -> dict[str, int]:
    """Parquet rows plus dead letters per partition log, from the pipeline's outputs."""
    counts: dict[str, int] = {}
    config = pipeline.config
    for spec in config.streams:
        for path in (config.output(spec.name), config.dead_letters(spec.name)):
            if not path.is_dir() or not any(path.rglob("*.parquet")):
                continue
            frame = spark.read.parquet(str(path)).groupBy("stream").count()
            for row in frame.collect():
                counts[row["stream"]] = counts.get(row["stream"], 0) + int(row["count"])
    return counts


def print_partitions(console: Console, partitions: list[PartitionSummary]) -> None:
    """The table per gateway and partition."""
    table = Table(title="per gateway and partition")
    for column in ("gateway", "partition", "acked", "bytes", "written"):
        table.add_column(column, justify="left" if column in ("gateway", "partition") else "right")
    for p in partitions:
        table.add_row(
            p.gateway,
            p.partition,
            f"{p.acked:,}",
            f"{p.acked_bytes:,}",
            "-" if p.written is None else f"{p.written:,}",
        )
    console.print(table)
    per_gateway: dict[str, int] = {}
    for p in partitions:
        per_gateway[p.gateway] = per_gateway.get(p.gateway, 0) + p.acked
    console.print(
        "records acknowledged per gateway: "
        + ", ".join(f"{g} {n:,}" for g, n in sorted(per_gateway.items()))
        + " (each key's records in one partition, in order)"
    )
