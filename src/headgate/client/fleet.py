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
and so do :meth:`FleetProducer.flush` and a :class:`FleetDelivery` waiting
for it; what was taken before stays buffered and is still delivered if the
gateway returns. A send already waiting for room on a partition whose
gateway then goes down raises it too, once the gateway has been down that
long, having taken nothing: a watch task looks at the gateways every
``_WATCH_S`` and fails such waits (with the gateway down, nothing else would
end them before it returns).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
from collections.abc import Awaitable, Generator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

from headgate.client.address import GatewayAddress
from headgate.client.batches import send_many_columns
from headgate.client.errors import ProducerError
from headgate.client.producer import BatchResult, Delivery, Policy, Producer
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
    partition_of,
)
from headgate.protocol import messages as m

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = [
    "FleetBatchResult",
    "FleetDelivery",
    "FleetOptions",
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
# How often the watch task looks for sends waiting for room on a gateway
# down beyond partition_timeout.
_WATCH_S = 0.1


class FleetOptions(TypedDict, total=False):
    """The :class:`Producer` options a fleet producer hands to each gateway's producer.

    The :class:`~headgate.client.producer.ProducerOptions` less the fleet
    producer's own arguments (``producer_id``, ``security``, ``spool``),
    ``cluster`` and ``reconnect_timeout`` (each gateway's producer
    reconnects for ever; ``partition_timeout`` bounds the wait).
    """

    producer_secret: bytes | None
    policy: Policy
    linger_ms: float
    max_batch_bytes: int
    max_buffered_bytes: int
    client_name: str
    spool_max_bytes: int


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
    #: Bytes of records the gateway acknowledged durable.
    bytes_acked: int = 0
    #: Records written to the spool (with ``spool``).
    records_spooled: int = 0


@dataclass(frozen=True, slots=True)
class FleetStatistics:
    """A snapshot of a fleet producer: each gateway's state, each partition's credit."""

    #: The producer id every gateway deduplicates by.
    producer_id: int
    #: Every gateway of the cluster, by name.
    gateways: Mapping[str, GatewayState]
    #: Every partition written to, by log name (``orders.p3``).
    partitions: Mapping[str, PartitionStatistics]


@dataclass(frozen=True, slots=True)
class FleetBatchResult:
    """Records of one :meth:`FleetProducer.send_many` call, durable on their partitions."""

    #: The partitioned stream.
    stream: str
    #: How many records, on all partitions.
    record_count: int
    #: Per part of the call, in the order they were queued: what landed on one
    #: partition (its ``stream`` is the partition's log name, ``orders.p3``).
    batches: tuple[BatchResult, ...]


class FleetDelivery:
    """The pending durability of one :meth:`FleetProducer.send_many` call.

    Await it for a :class:`FleetBatchResult`. It raises what a part's
    :class:`Delivery` raises, or :class:`PartitionUnavailable` once a gateway
    holding a part has been down beyond ``partition_timeout`` (the part stays
    buffered for the gateway's return).
    """

    __slots__ = ("_fleet", "_parts", "record_count", "stream")

    def __init__(
        self, fleet: FleetProducer, stream: str, parts: list[tuple[str, Delivery]], count: int
    ) -> None:
        #: The partitioned stream.
        self.stream = stream
        #: How many records the call took.
        self.record_count = count
        self._fleet = fleet
        self._parts = parts

    def done(self) -> bool:
        """Whether every part is durable or lost."""
        return all(delivery.done() for _, delivery in self._parts)

    def result(self) -> FleetBatchResult:
        """The result; raises a part's failure, or ``asyncio.InvalidStateError`` if pending."""
        batches = tuple(delivery.result() for _, delivery in self._parts)
        return FleetBatchResult(self.stream, self.record_count, batches)

    def __await__(self) -> Generator[Any, None, FleetBatchResult]:
        return self._settle().__await__()

    async def _settle(self) -> FleetBatchResult:
        by_gateway: dict[str, list[Delivery]] = {}
        for gateway, delivery in self._parts:
            by_gateway.setdefault(gateway, []).append(delivery)
        await self._fleet._bounded({g: _all(d) for g, d in by_gateway.items()})
        return self.result()

    def __repr__(self) -> str:
        return f"<FleetDelivery {self.stream!r} {self.record_count} records in {len(self._parts)}>"


async def _all(deliveries: list[Delivery]) -> None:
    for delivery in deliveries:
        await delivery


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
        **options: Unpack[FleetOptions],
    ) -> None:
        if (bootstrap is None) == (cluster is None):
            raise ValueError("give either the bootstrap addresses or the cluster file")
        if "reconnect_timeout" in options:
            raise TypeError(
                "a fleet producer reconnects to each gateway for ever; "
                "partition_timeout bounds how long records wait"
            )
        unknown = sorted(set(options) - set(FleetOptions.__optional_keys__))
        if unknown:
            # Found now, not when the first gateway's producer is made.
            raise TypeError(f"FleetProducer() got an unexpected keyword argument {unknown[0]!r}")
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
        self._linger_ms = float(options.get("linger_ms", 5.0))
        self._producers: dict[str, Producer] = {}
        self._watch: asyncio.Task[None] | None = None
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

    @property
    def linger_ms(self) -> float:
        """How long an open batch waits for more records before it is sealed."""
        return self._linger_ms

    @property
    def producer_secret(self) -> None:
        """None: each gateway ties the producer id to a secret of its own, kept by
        that gateway's producer (a fleet resumes from its spools, not from one secret)."""
        return None

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

    async def reach(self, stream: str, timeout: float) -> FleetStatistics:
        """Connect to every gateway of partitioned stream ``stream`` and wait, up to
        ``timeout`` seconds, until all of them are up; the statistics then, whose
        ``gateways`` say which are not (for a command that reports them at start).

        Raises:
            ClusterError: the cluster has no partitioned stream ``stream``.
        """
        await self.connect()
        holders = dict.fromkeys(self._open_stream(stream).holders)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not all(self._is_up(g) for g in holders) and loop.time() < deadline:
            await asyncio.sleep(_POLL_S)
        return self.statistics()

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
            self._stop_watch()
            for producer in self._producers.values():
                await producer.abort()  # nothing left to do for one that closed

    async def abort(self) -> None:
        """Close every gateway's producer at once; unacknowledged records are lost."""
        self._closed = True
        self._stop_watch()
        for producer in self._producers.values():
            await producer.abort()

    def _stop_watch(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None

    # -- sending ----------------------------------------------------------------------

    async def send(self, stream: str, value: bytes, key: bytes | None = None) -> None:
        """Append one record to partitioned stream ``stream``.

        Waits as :meth:`Producer.send` does while the partition's buffer is
        full, and no longer than ``partition_timeout`` past its gateway's
        going down.

        Raises:
            PartitionUnavailable: the record's partition (with a key), or every
                partition (without), is on gateways down beyond ``partition_timeout``;
                the record was not taken.
            ClusterError: the cluster has no partitioned stream ``stream``.
            StreamRefused, ProducerError: as :meth:`Producer.send`.
        """
        partitioned = self._open_stream(stream)
        if key is None:
            partition = await self._sticky_partition(partitioned, len(value))
        else:
            partition = partitioned.partition_for_key(key)
            self._check_reachable(partition)
        await self._producers[partition.gateway].send(partition.name, value, key)

    def send_nowait(self, stream: str, value: bytes, key: bytes | None = None) -> None:
        """Append one record if its partition's buffer has room; never waits.

        As :meth:`Producer.send_nowait`: it takes the record as :meth:`send`
        does, or raises :class:`BufferFull` where :meth:`send` would wait. A
        keyless record goes to the sticky partition; while no gateway is up
        yet it is chosen round robin all the same, and the record waits there
        for the session. Call it from the event loop's thread.

        Raises:
            BufferFull: the partition's buffer is full; nothing was taken.
            PartitionUnavailable: as :meth:`send`, without waiting.
            ClusterError, StreamRefused, ProducerError, ValueError, TypeError:
                as :meth:`Producer.send_nowait`.
        """
        partitioned = self._open_stream(stream)
        if key is None:
            partition = self._choose_sticky(partitioned, len(value))
            if partition is None:
                self._check_some_reachable(partitioned)
                partition = self._choose_sticky(partitioned, len(value), any_state=True)
                assert partition is not None
        else:
            partition = partitioned.partition_for_key(key)
            self._check_reachable(partition)
        self._producers[partition.gateway].send_nowait(partition.name, value, key)

    def _append_nowait(self, stream: str, value: bytes) -> bool:
        """send()'s fast path for a keyless record on the sticky partition; False to use send().

        For the sync wrapper's drainer (see :meth:`Producer._append_nowait`).
        """
        sticky = self._sticky.get(stream)
        if sticky is None or self._closed:
            return False
        current, taken = sticky
        if taken >= self._max_batch_bytes:
            return False
        producer = self._producers[current.gateway]
        if not producer.connected or not producer._append_nowait(current.name, value):
            return False
        self._sticky[stream] = (current, taken + len(value))
        return True

    async def send_many(
        self,
        stream: str,
        values: Sequence[bytes] | pa.Array | pa.ChunkedArray | pa.RecordBatch | pa.Table,
        keys: Sequence[bytes | None] | pa.Array | pa.ChunkedArray | None = None,
    ) -> FleetDelivery:
        """Send many records at once; await the returned :class:`FleetDelivery` for durability.

        Takes what :meth:`Producer.send_many` takes. Keyed records go to
        their keys' partitions and keyless ones (no ``keys``, or a null key)
        to sticky partitions, one per ``max_batch_bytes`` of records, as
        :meth:`send` would send them one by one; each partition's records go
        in one :meth:`Producer.send_many` call, in the call's order, so that
        per key the order is the order in ``values``.

        Raises:
            PartitionUnavailable: a partition of the call is on a gateway down
                beyond ``partition_timeout``. Checked before anything is taken;
                if its gateway goes down that long while the call waits for
                room, the parts queued before stay queued.
            ClusterError, StreamRefused, ProducerError, ValueError, TypeError:
                as :meth:`Producer.send_many`.
        """
        partitioned = self._open_stream(stream)
        values, keys = send_many_columns(values, keys)
        groups = await self._route_many(partitioned, values, keys)
        for partition in groups:
            self._check_reachable(partition)
        parts: list[tuple[str, Delivery]] = []
        for partition, indices in groups.items():
            part_values, part_keys = _take(values, keys, indices)
            delivery = await self._producers[partition.gateway].send_many(
                partition.name, part_values, part_keys
            )
            parts.append((partition.gateway, delivery))
        return FleetDelivery(self, stream, parts, len(values))

    async def flush(self) -> None:
        """Wait until every record sent so far is durable on its partition's gateway.

        Raises:
            PartitionUnavailable: a gateway holding records stayed down beyond
                ``partition_timeout`` (its records stay buffered for its return).
        """
        await self._bounded({name: p.flush() for name, p in self._producers.items()})

    async def _bounded(self, work: Mapping[str, Awaitable[Any]]) -> None:
        """Await each gateway's ``work``; PartitionUnavailable once a gateway whose
        work is not done has been down beyond ``partition_timeout``."""
        tasks = {name: asyncio.ensure_future(w) for name, w in work.items()}
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

    async def _watch_gateways(self) -> None:
        """Fail the sends waiting for room on gateways down beyond ``partition_timeout``.

        Only acknowledgements make room, and a gateway that is down sends
        none: without this such a send would wait for its return. The waiter
        failed is the one :meth:`Producer._wait_room` awaits, so the send
        raises before taking its records, and the sends behind it move up.
        """
        while True:
            await asyncio.sleep(_WATCH_S)
            for name, producer in self._producers.items():
                if self._is_up(name) or self._remaining(name) > 0:
                    continue
                for s in list(producer._streams.values()):
                    for _, waiter in list(s.space_waiters):
                        if not waiter.done():
                            waiter.set_exception(self._unavailable(name, s.name))

    # -- routing ---------------------------------------------------------------------

    def _open_stream(self, name: str) -> PartitionedStream:
        if self._closed:
            raise ProducerError("the fleet producer is closed")
        return self._stream(name)

    def _check_reachable(self, partition: Partition) -> None:
        """PartitionUnavailable if ``partition``'s gateway has been down beyond the timeout."""
        gateway = partition.gateway
        if not self._is_up(gateway) and self._remaining(gateway) <= 0:
            raise self._unavailable(gateway, partition.name)

    def _check_some_reachable(self, stream: PartitionedStream) -> None:
        """PartitionUnavailable if every gateway of ``stream`` has been down beyond the timeout."""
        if all(self._remaining(g) <= 0 for g in dict.fromkeys(stream.holders)):
            raise self._unavailable(None, stream.name)

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
            producer = self._producers[gateway] = Producer(
                entry.address,
                producer_id=self.producer_id,
                reconnect_timeout=None,
                security=gateway_security(self._security, entry),
                spool=None if self._spool is None else self._spool / gateway,
                **self._options,
            )
            # Connecting starts now, in the background; a gateway never
            # reached counts as down from here.
            producer._start()
            loop = asyncio.get_running_loop()
            self._down_since[gateway] = loop.time()
            if self._watch is None:
                self._watch = loop.create_task(self._watch_gateways(), name="headgate-fleet-watch")
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

    def _choose_sticky(
        self, stream: PartitionedStream, size: int, *, any_state: bool = False
    ) -> Partition | None:
        """The partition of a keyless record of ``size`` bytes, without waiting.

        The current sticky one while it is up and its batch is not full; else
        the next one round robin that has credit or, failing that, that is
        up. None when no gateway of the stream is up, unless ``any_state``:
        then the next one round robin all the same.
        """
        sticky = self._sticky.get(stream.name)
        if sticky is not None:
            current, taken = sticky
            if taken < self._max_batch_bytes and self._is_up(current.gateway):
                self._sticky[stream.name] = (current, taken + size)
                return current
        partitions = self._partitions[stream.name]
        start = 0 if sticky is None else sticky[0].index + 1
        order = [partitions[(start + i) % len(partitions)] for i in range(len(partitions))]
        chosen = next((p for p in order if self._has_credit(p)), None)
        if chosen is None:
            chosen = next((p for p in order if self._is_up(p.gateway)), None)
        if chosen is None and any_state:
            chosen = order[0]
        if chosen is not None:
            self._sticky[stream.name] = (chosen, size)
        return chosen

    async def _sticky_partition(self, stream: PartitionedStream, size: int) -> Partition:
        """:meth:`_choose_sticky`, waiting while no gateway of the stream is up."""
        while True:
            chosen = self._choose_sticky(stream, size)
            if chosen is not None:
                return chosen
            self._check_some_reachable(stream)
            await asyncio.sleep(_POLL_S)

    async def _route_many(
        self, stream: PartitionedStream, values: Any, keys: Any
    ) -> dict[Partition, list[int]]:
        """The records of a send_many call, by partition, each list in the call's order."""
        count = len(values)
        partitions = stream.partitions
        routed: dict[Partition, list[int]] = {}
        keyless: list[int] = []
        if keys is None:
            keyless = list(range(count))
        else:
            key_list = keys if isinstance(keys, list | tuple) else keys.to_pylist()
            if len(key_list) != count:
                raise ValueError(f"{len(key_list)} keys for {count} values")
            # Keys repeat; each distinct one is hashed once per call.
            known: dict[bytes, Partition] = {}
            for i, key in enumerate(key_list):
                if key is None:
                    keyless.append(i)
                    continue
                partition = known.get(key)
                if partition is None:
                    partition = known[key] = partitions[partition_of(key, len(partitions))]
                routed.setdefault(partition, []).append(i)
        if keyless:
            sizes = _sizes(values)
            start = 0
            while start < len(keyless):
                # One sticky choice per batch of records, as for send().
                end, taken = start, 0
                while end < len(keyless) and (end == start or taken < self._max_batch_bytes):
                    taken += sizes[keyless[end]]
                    end += 1
                partition = await self._sticky_partition(stream, taken)
                routed.setdefault(partition, []).extend(keyless[start:end])
                start = end
            for indices in routed.values():
                indices.sort()  # keyed and keyless records of a partition in the call's order
        return routed

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
                    bytes_acked=s.bytes_acked,
                    records_spooled=s.records_spooled,
                )
        return FleetStatistics(
            producer_id=self.producer_id,
            gateways=gateways,
            partitions=dict(sorted(partitions.items())),
        )


def _sizes(values: Any) -> list[int]:
    """Each value's length in bytes (what the sticky batches are measured in)."""
    if isinstance(values, list | tuple):
        return [len(v) for v in values]
    import pyarrow as pa
    import pyarrow.compute as pc

    if not pa.types.is_binary(values.type) and not pa.types.is_large_binary(values.type):
        values = values.cast(pa.binary())
    lengths: list[int] = pc.fill_null(pc.binary_length(values), 0).to_pylist()
    return lengths


def _take(values: Any, keys: Any, indices: list[int]) -> tuple[Any, Any]:
    """The records at ``indices`` (the whole call when they are all of it, in order)."""
    if len(indices) == len(values):
        return values, keys
    if isinstance(values, list | tuple):
        return [values[i] for i in indices], None if keys is None else [keys[i] for i in indices]
    import pyarrow as pa

    taken = pa.array(indices, type=pa.int64())
    return values.take(taken), None if keys is None else keys.take(taken)
