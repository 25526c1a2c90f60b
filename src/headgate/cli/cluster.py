"""``headgate cluster status``: each gateway of a fleet, and each partition on it.

It asks every gateway of the cluster file at once (DescribeStreams and
ListConsumers, the ``read`` right), so a fleet with a gateway down still
shows the others: a gateway that does not answer within the timeout is
down, with the reason, and its partitions are shown as unknown.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from headgate.client.reader import Reader, ReaderError
from headgate.client.security import ClientSecurity
from headgate.cluster import Cluster, ClusterGateway, Partition

__all__ = ["GatewayRow", "PartitionRow", "cluster_status"]


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
