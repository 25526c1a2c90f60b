"""The driver's side of reading a fleet: every partition on every gateway, as one set of logs.

What ``option("cluster", "cluster.toml")`` of the source reads with:
:class:`FleetLogs` is the planner's ``Logs`` interface over the
partitions of the selected partitioned streams, each read through its own
gateway (:class:`~headgate.spark.remote.GatewayLogs`); offsets are keyed by
the partition logs' names (``orders.p0``, ``orders.p1``, ...), so they come
in a fixed key order. A gateway that does not answer holds back only its
partitions: they are left out of discovery, and a partition the query has
read keeps the position it has read to. :func:`by_gateway` splits planned
slices so that each Spark partition reads from one gateway, and
:class:`FleetReleases` sends each partition's release to its gateway.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from headgate.cluster import Cluster, Partition
from headgate.spark.decode import SourceError, StreamSlice
from headgate.spark.planning import StreamSelection
from headgate.spark.remote import GatewayLogs

if TYPE_CHECKING:
    from headgate.client.control import ReleaseClient
    from headgate.client.security import ClientSecurity
    from headgate.config import ConsumerSettings

__all__ = ["FleetLogs", "FleetReleases", "by_gateway", "security_for"]

log = logging.getLogger("headgate.spark")


def security_for(cluster: Cluster, gateway: str, security: ClientSecurity | None) -> ClientSecurity:
    """The query's token with the cluster file's TLS settings of ``gateway``."""
    from headgate.client.fleet import gateway_security
    from headgate.client.security import ClientSecurity

    return gateway_security(security or ClientSecurity(), cluster.gateways[gateway])


class FleetLogs:
    """Every partition of ``streams`` (partitioned stream names) on the fleet's gateways."""

    def __init__(
        self, cluster: Cluster, streams: Sequence[str], security: ClientSecurity | None = None
    ) -> None:
        self.cluster = cluster
        self._partitions: dict[str, Partition] = {
            p.name: p for name in streams for p in cluster.stream(name).partitions
        }
        held: dict[str, list[str]] = {}
        for p in self._partitions.values():
            held.setdefault(p.gateway, []).append(p.name)
        self._gateways = {
            gateway: GatewayLogs(
                cluster.gateways[gateway].address,
                StreamSelection(names=tuple(names)),
                security_for(cluster, gateway, security),
            )
            for gateway, names in held.items()
        }
        #: Why each gateway that did not answer at the last discovery is down.
        self.down: dict[str, str] = {}

    def partition(self, stream: str) -> Partition:
        """The partition whose log is ``stream``; SourceError if the query does not read it."""
        found = self._partitions.get(stream)
        if found is None:
            raise SourceError(f"{stream!r} is not a partition of the streams this query reads")
        return found

    def address(self, stream: str) -> str:
        """``host:port`` of the gateway that holds partition log ``stream``."""
        return self.cluster.gateways[self.partition(stream).gateway].address

    def _logs(self, stream: str) -> GatewayLogs:
        return self._gateways[self.partition(stream).gateway]

    def discover(self) -> list[str]:
        """The partitions that exist now on the gateways that answer, sorted."""
        found: list[str] = []
        for gateway, logs in self._gateways.items():
            try:
                found += logs.discover()
            except SourceError as error:
                if gateway not in self.down:
                    log.warning("gateway %s is down, its partitions wait: %s", gateway, error)
                self.down[gateway] = str(error)
                continue
            self.down.pop(gateway, None)
        return sorted(found)

    def names(self) -> list[str]:
        """Every partition the query reads, sorted: for messages."""
        return sorted(self._partitions)

    def where(self) -> str:
        return f"the fleet of gateways {', '.join(self._gateways)}"

    def earliest(self, stream: str) -> int:
        return self._logs(stream).earliest(stream)

    def count_records(
        self, stream: str, positions: tuple[int, ...]
    ) -> tuple[int, tuple[int | None, ...]]:
        """The record counts of the gateway that holds ``stream`` (CountRecords)."""
        return self._logs(stream).count_records(stream, positions)

    def latest(self, stream: str, *, read_up_to: int | None = None) -> int:
        """The durable end of ``stream``; while its gateway is down, where the query
        has read it to (the partition waits, the others go on)."""
        try:
            return self._logs(stream).latest(stream, read_up_to=read_up_to)
        except SourceError as error:
            if read_up_to is None:
                raise
            gateway = self.partition(stream).gateway
            if gateway not in self.down:
                log.warning("partition %s waits for gateway %s: %s", stream, gateway, error)
            self.down[gateway] = str(error)
            return read_up_to

    def term_length(self, stream: str) -> int:
        return self._logs(stream).term_length(stream)

    def check_retained(self, stream: str, start: int, end: int) -> None:
        self._logs(stream).check_retained(stream, start, end)

    def frames(self, stream: str, start: int, end: int) -> Iterator[Any]:
        return self._logs(stream).frames(stream, start, end)

    def close(self) -> None:
        for logs in self._gateways.values():
            logs.close()


def by_gateway(
    logs: FleetLogs, planned: Sequence[Sequence[StreamSlice]]
) -> list[tuple[str, tuple[StreamSlice, ...]]]:
    """Each planned partition split so that one Spark partition reads one gateway:
    ``(address, slices)`` in plan order."""
    out: list[tuple[str, tuple[StreamSlice, ...]]] = []
    for slices in planned:
        grouped: dict[str, list[StreamSlice]] = {}
        for piece in slices:
            grouped.setdefault(logs.address(piece.stream), []).append(piece)
        out += [(address, tuple(pieces)) for address, pieces in grouped.items()]
    return out


class FleetReleases:
    """Releases of partition logs, each to the gateway that holds it (one client per gateway)."""

    def __init__(
        self,
        cluster: Cluster,
        security: ClientSecurity | None = None,
        *,
        consumer: str | None = None,
        declare: ConsumerSettings | None = None,
    ) -> None:
        self.cluster = cluster
        self._security = security
        self._consumer = consumer
        #: How each gateway's client declares the consumer before its first Release.
        self._declare = declare
        self._clients: dict[str, ReleaseClient] = {}

    def release(self, stream: str, position: int) -> None:
        """Release partition log ``stream`` up to ``position`` on its gateway."""
        from headgate.client.control import ReleaseClient

        found = self.cluster.locate(stream)
        if not isinstance(found, Partition):
            raise SourceError(f"{stream!r} is not a partition of the cluster")
        client = self._clients.get(found.gateway)
        if client is None:
            options: dict[str, Any] = {}
            if self._consumer is not None:
                options["consumer"] = self._consumer
            if self._declare is not None:
                options["declare"] = self._declare
            client = self._clients[found.gateway] = ReleaseClient(
                self.cluster.gateways[found.gateway].address,
                security=security_for(self.cluster, found.gateway, self._security),
                **options,
            )
        client.release(stream, position)

    def flush(self, timeout: float) -> bool:
        """Wait until every release sent so far reached its gateway (False: not in time)."""
        return all([client.flush(timeout) for client in self._clients.values()])

    def applied(self) -> dict[str, int]:
        """Per partition log, the newest position its gateway confirmed having applied."""
        applied: dict[str, int] = {}
        for client in self._clients.values():
            applied.update(client.statistics().applied)
        return applied

    def close(self, timeout: float = 5.0) -> bool:
        """Flush (up to ``timeout``) and close every client; True if nothing was left unsent."""
        return all([client.close(timeout) for client in self._clients.values()])
