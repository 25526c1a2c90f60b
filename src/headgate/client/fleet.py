"""Producing to a partitioned stream spread over a fleet of gateways.

A :class:`FleetProducer` knows the fleet's assignment (a cluster file, or any
gateway's answer to ``Metadata``) and keeps one :class:`Producer` per gateway
it writes to. Each of those is the ordinary single-gateway producer: its own
connection, credit, reconnects and resends under the same producer id and
sequences, so exactly-once holds per partition as it holds per stream.

Routing (the rule's one home is :mod:`headgate.cluster`):

* a record with a key goes to the partition of its key's stable hash, so
  every record of a key lands in one partition, in send order;
* a record without a key goes to a *sticky* partition, as Kafka's sticky
  partitioner does: one partition per batch (``max_batch_bytes`` of records),
  then the next one round robin, among the partitions whose gateway is up and
  has credit. A slow or dead gateway does not slow keyless traffic down.

When a gateway is down, records for its partitions stay buffered by its
producer (up to ``max_buffered_bytes`` per partition) and are sent once it is
back. After ``partition_timeout`` seconds down (counted from when this
producer first found it down, or from the start for a gateway never reached),
a keyed send to one of its partitions raises :class:`PartitionUnavailable`,
and so does :meth:`FleetProducer.flush`; what was taken before stays
buffered and is still delivered if the gateway returns.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from headgate.client.address import GatewayAddress
from headgate.client.errors import ProducerError
from headgate.client.producer import Producer, ProducerOptions
from headgate.client.reader import Reader, ReaderError
from headgate.client.security import ClientSecurity
from headgate.cluster import (
    Cluster,
    ClusterError,
    ClusterGateway,
    Partition,
    PartitionedStream,
    cluster_from_metadata,
    load_cluster,
)
from headgate.protocol import messages as m

__all__ = [
    "FleetProducer",
    "FleetStatistics",
    "GatewayState",
    "PartitionStatistics",
    "PartitionUnavailable",
    "fetch_cluster",
    "gateway_security",
]

# How often a waiting send or flush looks at the gateways again.
_POLL_S = 0.02


class PartitionUnavailable(ProducerError):
    """A partition's gateway stayed down beyond ``partition_timeout``; one line says which."""


@dataclass(frozen=True, slots=True)
class GatewayState:
    """One gateway of the fleet, as this producer sees it."""

    #: Its name in the cluster.
    name: str
    #: ``host:port``.
    address: str
    #: Whether a session with it is open now (False: never used yet, or down).
    up: bool
    #: Seconds since this producer found it down (None while up or unused).
    down_for: float | None
    #: Sessions lost after being open.
    reconnects: int
    #: The last connection problem, or None.
    last_error: str | None


@dataclass(frozen=True, slots=True)
class PartitionStatistics:
    """One partition this producer wrote to."""

    #: The partitioned stream.
    stream: str
    #: The partition's number.
    partition: int
    #: The gateway that holds it.
    gateway: str
    #: Our guarantees (credit) on its channel; None while not bound.
    guarantees: int | None
    #: Records-block bytes held for it and not acknowledged yet.
    buffered_bytes: int
    #: Records sent at least once.
    records_sent: int
    #: Records the gateway acknowledged durable.
    records_acked: int
    #: Why its gateway refused it, or None.
    refused: str | None


@dataclass(frozen=True, slots=True)
class FleetStatistics:
    """A snapshot of a fleet producer: each gateway's state, each partition's credit."""

    #: The producer id every gateway deduplicates by.
    producer_id: int
    #: Every gateway of the cluster, by name.
    gateways: Mapping[str, GatewayState]
    #: Every partition written to, by log name (``orders.p3``).
    partitions: Mapping[str, PartitionStatistics]


class _MetadataReader(Reader):
    """A Reader that also asks Metadata (no edit of the Reader for one request)."""

    def __init__(self, address: str | tuple[str, int] | GatewayAddress, **options: Any) -> None:
        super().__init__(address, **options)
        self._answers: dict[int, asyncio.Future[m.ClusterMetadata]] = {}
        self._request_ids = itertools.count(1)

    async def metadata(self) -> m.ClusterMetadata:
        self._check()
        request_id = next(self._request_ids)
        future: asyncio.Future[m.ClusterMetadata] = asyncio.get_running_loop().create_future()
        self._answers[request_id] = future
        self._session.send_global(m.Metadata(request_id=request_id))
        self._write()
        return await future

    def _on_message(self, message: m.GlobalMessage) -> None:
        if isinstance(message, m.ClusterMetadata):
            future = self._answers.pop(message.request_id, None)
            if future is not None and not future.done():
                future.set_result(message)
            return
        super()._on_message(message)

    def _fail(self, error: ReaderError) -> None:
        super()._fail(error)
        for future in self._answers.values():
            if not future.done():
                future.set_exception(error)
        self._answers.clear()


async def fetch_cluster(
    addresses: Sequence[str | tuple[str, int]],
    *,
    security: ClientSecurity | None = None,
    timeout: float = 10.0,
) -> Cluster:
    """The cluster the first answering gateway of ``addresses`` runs under (Kafka's
    bootstrap servers). ClusterError, one line, says why each one failed."""
    if not addresses:
        raise ClusterError("no gateway address to ask for the cluster")
    problems = []
    for address in addresses:
        reader = _MetadataReader(address, security=security, connect_timeout=timeout)
        try:
            async with asyncio.timeout(timeout):
                await reader.connect()
                answer = await reader.metadata()
            return cluster_from_metadata(answer, where=f"gateway {reader.address}")
        except (ReaderError, TimeoutError, ClusterError) as exc:
            problems.append(str(exc) or f"gateway {address}: no answer within {timeout:g} s")
        finally:
            await reader.close()
    raise ClusterError("no gateway told the cluster: " + "; ".join(problems))


def gateway_security(base: ClientSecurity, gateway: ClusterGateway) -> ClientSecurity:
    """The client's token with the cluster file's TLS settings of ``gateway``.

    The cluster file's CA or certificate files for ``gateway`` replace the
    client's own TLS settings, a ``tls_context`` included; without them the
    client's settings verify that gateway.
    """
    if not gateway.tls:
        return base
    files_given = gateway.tls_ca_file is not None or gateway.tls_cert_file is not None
    return replace(
        base,
        tls=True,
        tls_context=None if files_given else base.tls_context,
        ca_file=gateway.tls_ca_file or base.ca_file,
        cert_file=gateway.tls_cert_file or base.cert_file,
        key_file=gateway.tls_key_file if gateway.tls_cert_file else base.key_file,
        server_name=gateway.tls_server_name or base.server_name,
    )


class FleetProducer:
    """Sends records on partitioned streams to the gateways of a fleet.

    Args:
        bootstrap: gateway addresses to ask for the cluster (any one that
            answers will do), when ``cluster`` is not given.
        cluster: the cluster file (a path) or a loaded :class:`Cluster`.
        producer_id: the id every gateway deduplicates by (random if None).
        security: the token and TLS settings; a gateway's TLS settings in
            the cluster file override the TLS part for that gateway.
        partition_timeout: how long records for a down gateway's partitions
            may wait before sends and flushes raise :class:`PartitionUnavailable`.
        connect_timeout: the bound on asking a bootstrap gateway.
        spool: a directory; each gateway's producer spools in ``spool/<gateway>``.
        options: the other :class:`Producer` arguments (policy, linger_ms,
            max_batch_bytes, max_buffered_bytes, client_name), for every gateway.

    Use it as ``async with FleetProducer(cluster="cluster.toml") as p:``.
    """

    def __init__(
        self,
        bootstrap: Sequence[str | tuple[str, int]] | None = None,
        *,
        cluster: str | os.PathLike[str] | Cluster | None = None,
        producer_id: int | None = None,
        security: ClientSecurity | None = None,
        partition_timeout: float = 30.0,
        connect_timeout: float = 10.0,
        spool: str | os.PathLike[str] | None = None,
        **options: Any,
    ) -> None:
        if (bootstrap is None) == (cluster is None):
            raise ValueError("give either the bootstrap addresses or the cluster file")
        unknown = sorted(set(options) - set(ProducerOptions.__optional_keys__))
        if unknown:
            # Found now, not when the first gateway's producer is made.
            raise TypeError(f"FleetProducer() got an unexpected keyword argument {unknown[0]!r}")
        if "reconnect_timeout" in options:
            raise TypeError(
                "a fleet producer reconnects to each gateway for ever; "
                "partition_timeout bounds how long records wait"
            )
        if partition_timeout < 0:
            raise ValueError(f"partition_timeout must not be negative, got {partition_timeout}")
        self._bootstrap = list(bootstrap or [])
        self._cluster: Cluster | None = None
        if isinstance(cluster, Cluster):
            self._cluster = cluster
        elif cluster is not None:
            self._cluster = load_cluster(Path(cluster))
        if producer_id is None:
            producer_id = secrets.randbits(63)
        #: The producer id every gateway deduplicates by.
        self.producer_id = producer_id
        self._security = security or ClientSecurity()
        self._timeout = partition_timeout
        self._connect_timeout = connect_timeout
        self._spool = None if spool is None else Path(spool)
        self._options = options
        self._max_batch_bytes = int(options.get("max_batch_bytes", 256 * 1024))
        self._producers: dict[str, Producer] = {}
        self._down_since: dict[str, float] = {}
        # Per stream: the sticky partition of keyless records, and its bytes so far.
        self._sticky: dict[str, tuple[Partition, int]] = {}
        self._used: dict[str, PartitionedStream] = {}
        self._partitions: dict[str, tuple[Partition, ...]] = {}
        self._closed = False

    # -- lifecycle ------------------------------------------------------------------

    @property
    def cluster(self) -> Cluster:
        """The fleet's assignment (after :meth:`connect`, for a bootstrapped producer)."""
        if self._cluster is None:
            raise ProducerError("the fleet producer has not asked for the cluster yet (connect)")
        return self._cluster

    async def connect(self) -> None:
        """Learn the cluster from a bootstrap gateway, if no file was given; idempotent.

        Connections to the gateways open in the background, as streams need them.

        Raises:
            ClusterError: no bootstrap gateway answered, or its cluster is not usable.
        """
        if self._cluster is None:
            self._cluster = await fetch_cluster(
                self._bootstrap, security=self._security, timeout=self._connect_timeout
            )

    async def __aenter__(self) -> FleetProducer:
        await self.connect()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            await self.close()
        else:
            await self.abort()

    async def close(self) -> None:
        """Flush every partition, then close every gateway's producer (Goodbye).

        Raises what :meth:`flush` raises, after closing.
        """
        if self._closed:
            return
        try:
            await self.flush()
            for producer in self._producers.values():
                await producer.close()
        finally:
            self._closed = True
            for producer in self._producers.values():
                await producer.abort()  # nothing left to do for one that closed

    async def abort(self) -> None:
        """Close every gateway's producer at once; unacknowledged records are lost."""
        self._closed = True
        for producer in self._producers.values():
            await producer.abort()

    # -- sending ----------------------------------------------------------------------

    async def send(self, stream: str, value: bytes, key: bytes | None = None) -> None:
        """Append one record to partitioned stream ``stream``.

        Raises:
            PartitionUnavailable: the record's partition (with a key), or every
                partition (without), is on gateways down beyond ``partition_timeout``.
            ClusterError: the cluster has no partitioned stream ``stream``.
            StreamRefused, ProducerError: as :meth:`Producer.send`.
        """
        if self._closed:
            raise ProducerError("the fleet producer is closed")
        partitioned = self._stream(stream)
        if key is None:
            partition = await self._sticky_partition(partitioned, len(value))
        else:
            partition = partitioned.partition_for_key(key)
        producer = self._producers[partition.gateway]
        if self._is_up(partition.gateway):
            await producer.send(partition.name, value, key)
            return
        remaining = self._remaining(partition.gateway)
        if remaining <= 0:
            raise self._unavailable(partition.gateway, partition.name)
        try:
            async with asyncio.timeout(remaining):
                await producer.send(partition.name, value, key)
        except TimeoutError:
            raise self._unavailable(partition.gateway, partition.name) from None

    async def flush(self) -> None:
        """Wait until every record sent so far is durable on its partition's gateway.

        Raises:
            PartitionUnavailable: a gateway holding records stayed down beyond
                ``partition_timeout`` (its records stay buffered for its return).
        """
        tasks = {
            name: asyncio.ensure_future(producer.flush())
            for name, producer in self._producers.items()
        }
        try:
            while True:
                pending = [t for t in tasks.values() if not t.done()]
                if not pending:
                    break
                await asyncio.wait(pending, timeout=_POLL_S * 5)
                for name, task in tasks.items():
                    if not task.done() and not self._is_up(name) and self._remaining(name) <= 0:
                        raise self._unavailable(name, None)
            for task in tasks.values():
                task.result()
        finally:
            for task in tasks.values():
                if not task.done():
                    task.cancel()

    # -- routing ---------------------------------------------------------------------

    def _stream(self, name: str) -> PartitionedStream:
        found = self._used.get(name)
        if found is None:
            found = self._used[name] = self.cluster.stream(name)
            self._partitions[name] = found.partitions
            for gateway in dict.fromkeys(found.holders):
                self._producer(gateway)
        return found

    def _producer(self, gateway: str) -> Producer:
        producer = self._producers.get(gateway)
        if producer is None:
            entry = self.cluster.gateways[gateway]
            options = dict(self._options)
            if self._spool is not None:
                options["spool"] = self._spool / gateway
            producer = self._producers[gateway] = Producer(
                entry.address,
                producer_id=self.producer_id,
                reconnect_timeout=None,
                security=gateway_security(self._security, entry),
                **options,
            )
            # Connecting starts now, in the background; a gateway never
            # reached counts as down from here.
            producer._start()
            self._down_since[gateway] = asyncio.get_running_loop().time()
        return producer

    def _is_up(self, gateway: str) -> bool:
        """Whether ``gateway``'s session is open; notes when it was first found down."""
        if self._producers[gateway].connected:
            self._down_since.pop(gateway, None)
            return True
        self._down_since.setdefault(gateway, asyncio.get_running_loop().time())
        return False

    def _remaining(self, gateway: str) -> float:
        """Seconds left before ``gateway``'s records give up waiting."""
        since = self._down_since.get(gateway)
        if since is None:
            return self._timeout
        return self._timeout - (asyncio.get_running_loop().time() - since)

    def _has_credit(self, partition: Partition) -> bool:
        """Up, not refused, and nothing of it waiting for credit beyond one batch.

        Reads the gateway producer's per-stream state: the sticky choice is
        made once per batch, so this is cheap next to what it routes.
        """
        producer = self._producers[partition.gateway]
        if not self._is_up(partition.gateway):
            return False
        state = producer._streams.get(partition.name)
        if state is None:
            return True
        return state.failure is None and not state.space_waiters and len(state.queue) <= 1

    async def _sticky_partition(self, stream: PartitionedStream, size: int) -> Partition:
        """The partition of a keyless record: the current sticky one while it is up,
        has credit and its batch is not full; else the next one round robin that
        has credit (or, failing that, that is up)."""
        sticky = self._sticky.get(stream.name)
        if sticky is not None:
            current, taken = sticky
            if taken < self._max_batch_bytes and self._is_up(current.gateway):
                self._sticky[stream.name] = (current, taken + size)
                return current
        partitions = self._partitions[stream.name]
        start = 0 if sticky is None else sticky[0].index + 1
        order = [partitions[(start + i) % len(partitions)] for i in range(len(partitions))]
        while True:
            chosen = next((p for p in order if self._has_credit(p)), None)
            if chosen is None:
                chosen = next((p for p in order if self._is_up(p.gateway)), None)
            if chosen is not None:
                self._sticky[stream.name] = (chosen, size)
                return chosen
            if all(self._remaining(g) <= 0 for g in dict.fromkeys(stream.holders)):
                raise self._unavailable(None, stream.name)
            await asyncio.sleep(_POLL_S)

    def _unavailable(self, gateway: str | None, what: str | None) -> PartitionUnavailable:
        """The one-line error for records that waited too long for ``gateway``."""
        if gateway is None:
            down = [self.cluster.gateways[g] for g in dict.fromkeys(self._used[what or ""].holders)]
            parts = "; ".join(f"{g.name} ({g.address}): {self._why(g.name)}" for g in down)
            return PartitionUnavailable(
                f"no gateway of stream {what!r} is reachable after {self._timeout:g} s: {parts}"
            )
        entry = self.cluster.gateways[gateway]
        subject = f"partition {what}" if what else "records"
        return PartitionUnavailable(
            f"{subject} cannot be delivered: gateway {gateway} ({entry.address}) has been down "
            f"for more than {self._timeout:g} s ({self._why(gateway)}); its records stay "
            "buffered until it returns"
        )

    def _why(self, gateway: str) -> str:
        stats = self._producers[gateway].statistics()
        return stats.last_error or "not reached yet"

    # -- statistics ----------------------------------------------------------------------

    def statistics(self) -> FleetStatistics:
        """Each gateway's state and each partition's credit, now."""
        now = asyncio.get_running_loop().time()
        gateways: dict[str, GatewayState] = {}
        partitions: dict[str, PartitionStatistics] = {}
        for name, entry in self.cluster.gateways.items():
            producer = self._producers.get(name)
            if producer is None:
                gateways[name] = GatewayState(name, entry.address, False, None, 0, None)
                continue
            stats = producer.statistics()
            since = self._down_since.get(name)
            gateways[name] = GatewayState(
                name=name,
                address=entry.address,
                up=stats.connected,
                down_for=None if stats.connected or since is None else now - since,
                reconnects=stats.reconnects,
                last_error=stats.last_error,
            )
            for log_name, s in stats.streams.items():
                found = self.cluster.locate(log_name)
                if not isinstance(found, Partition):
                    continue
                partitions[log_name] = PartitionStatistics(
                    stream=found.stream,
                    partition=found.index,
                    gateway=name,
                    guarantees=s.guarantees,
                    buffered_bytes=s.buffered_bytes,
                    records_sent=s.records_sent,
                    records_acked=s.records_acked,
                    refused=s.refused,
                )
        return FleetStatistics(
            producer_id=self.producer_id,
            gateways=gateways,
            partitions=dict(sorted(partitions.items())),
        )
