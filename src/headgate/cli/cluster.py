"""``headgate cluster status``: each gateway of a fleet, and each partition on it.

It asks every gateway of the cluster file at once (DescribeStreams and
ListConsumers, the ``read`` right), so a fleet with a gateway down still
shows the others: a gateway that does not answer within the timeout is
down, with the reason, and its partitions are shown as unknown.
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click

from headgate.cli.options import client_security, security_options, table_or_json
from headgate.cli.text import bytes_text, count_text
from headgate.client.reader import Reader, ReaderError
from headgate.client.security import ClientSecurity
from headgate.cluster import (
    Cluster,
    ClusterError,
    ClusterGateway,
    Partition,
    load_cluster,
    partition_name,
)

__all__ = ["GatewayRow", "PartitionRow", "cluster", "cluster_status"]


@dataclass(frozen=True, slots=True)
class GatewayRow:
    """One gateway: up or down."""

    name: str
    address: str
    up: bool
    #: Why it is down (None while up).
    error: str | None


@dataclass(frozen=True, slots=True)
class PartitionRow:
    """One partition, as its gateway describes it (None: its gateway is down)."""

    stream: str
    partition: int
    gateway: str
    #: Log bytes held (durable minus start); None when unknown.
    retained_bytes: int | None
    #: The durable end position; None when unknown or not created yet.
    durable_position: int | None
    #: Per consumer, its lag in bytes.
    consumers: dict[str, int]
    #: Per consumer, its lag in records (None: the gateway cannot count it).
    consumer_lag_records: dict[str, int | None] = field(default_factory=dict)


async def _ask(
    gateway: ClusterGateway, partitions: list[Partition], security: ClientSecurity, timeout: float
) -> tuple[GatewayRow, list[PartitionRow]]:
    from headgate.client.fleet import gateway_security

    reader = Reader(
        gateway.address,
        security=gateway_security(security, gateway),
        connect_timeout=timeout,
        client_name="headgate-cluster-status",
    )
    try:
        async with asyncio.timeout(timeout):
            await reader.connect()
            described = {d.info.stream: d.info for d in await reader.describe_streams()}
            rows = []
            for p in partitions:
                info = described.get(p.name)
                listed = [] if info is None else await reader.list_consumers(p.name)
                consumers = {c.consumer: c.lag_bytes for c in listed}
                lag_records = {c.consumer: c.lag_records for c in listed}
                rows.append(
                    PartitionRow(
                        p.stream,
                        p.index,
                        p.gateway,
                        None if info is None else info.durable_position - info.start_position,
                        None if info is None else info.durable_position,
                        consumers,
                        lag_records,
                    )
                )
        return GatewayRow(gateway.name, gateway.address, True, None), rows
    except (ReaderError, TimeoutError, OSError) as exc:
        error = str(exc) or f"no answer within {timeout:g} s"
        rows = [PartitionRow(p.stream, p.index, p.gateway, None, None, {}) for p in partitions]
        return GatewayRow(gateway.name, gateway.address, False, error), rows
    finally:
        await reader.close()


async def cluster_status(
    cluster: Cluster, security: ClientSecurity | None = None, timeout: float = 5.0
) -> tuple[list[GatewayRow], list[PartitionRow]]:
    """Every gateway's state and every partition's fill and consumers, asked in parallel."""
    security = security or ClientSecurity()
    answers = await asyncio.gather(
        *(
            _ask(g, list(cluster.held_by(g.name)), security, timeout)
            for g in cluster.gateways.values()
        )
    )
    gateways = [row for row, _ in answers]
    partitions = sorted(
        (p for _, rows in answers for p in rows), key=lambda p: (p.stream, p.partition)
    )
    return gateways, partitions


@click.group()
def cluster() -> None:
    """A fleet of gateways (a cluster file): its state."""


@cluster.command(name="status")
@click.argument("cluster_file", type=click.Path(path_type=Path))
@click.option("--timeout", type=float, default=5.0, show_default=True, help="Seconds per gateway.")
@table_or_json("table, or one JSON object per gateway and per partition.")
@security_options
def status(cluster_file: Path, timeout: float, fmt: str, **options: Any) -> None:
    """Each gateway of CLUSTER_FILE up or down, and per partition its fill and consumers' lag.

    Exits 1 when a gateway is down (after showing the others).
    """
    security = client_security(options)
    try:
        loaded = load_cluster(cluster_file)
    except ClusterError as exc:
        click.echo(f"headgate cluster status: {exc}", err=True)
        sys.exit(2)
    gateways, partitions = asyncio.run(cluster_status(loaded, security, timeout))
    if fmt == "json":
        for gateway_row in gateways:
            click.echo(json.dumps({"kind": "gateway", **asdict(gateway_row)}))
        for partition_row in partitions:
            click.echo(json.dumps({"kind": "partition", **asdict(partition_row)}))
    else:
        for g in gateways:
            state = "up" if g.up else f"DOWN: {g.error}"
            click.echo(f"{g.name:<12} {g.address:<24} {state}")
        click.echo("")
        click.echo(f"{'partition':<24} {'gateway':<12} {'retained':>12}  consumers (lag)")
        for p in partitions:
            name = partition_name(p.stream, p.partition)
            fill = "?" if p.retained_bytes is None else bytes_text(p.retained_bytes)
            counts = p.consumer_lag_records
            lags = ", ".join(
                f"{c} ({bytes_text(lag)}, {count_text(counts.get(c))} records)"
                for c, lag in sorted(p.consumers.items())
            )
            click.echo(f"{name:<24} {p.gateway:<12} {fill:>12}  {lags}".rstrip())
    if not all(g.up for g in gateways):
        sys.exit(1)
