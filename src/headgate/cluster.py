"""The cluster file: a fleet of gateways, and the partitioned streams spread over them.

One machine's disk caps a stream. A *partitioned* stream is a set of
ordinary stream logs, one per partition, each on the gateway that the cluster
file assigns it to: a static assignment, as Kafka's without a controller.
Every gateway, producer and Spark source reads the same file (or asks any
gateway for it: the ``Metadata`` request). Example ``cluster.toml``::

    [gateways.gw1]
    address = "10.0.0.1:7878"
    [gateways.gw2]
    address = "10.0.0.2:7878"
    tls = true                      # how a client reaches this gateway
    tls_ca_file = "fleet-ca.pem"    # (the keys of the pipeline TOML)
    tls_server_name = "gw2.example"

    [streams.orders]
    partitions = 4
    # Which gateway holds which partitions; every partition exactly once.
    # Left out: partition i goes to the i-th gateway by name, round robin.
    assignment = { gw1 = [0, 2], gw2 = [1, 3] }

This module is pure (no I/O but reading the file, no asyncio): the rules of
the file, how a partition's log is named, and which partition a key goes to.
Every rule has its home here; the gateway, the producer and the Spark source
ask this module.

**Partition names.** Partition ``k`` of stream ``orders`` is the stream log
``orders.p<k>`` (``orders.p0``, ``orders.p1``, ...; no leading zeros) on its
gateway. Within a cluster, a partitioned stream owns its name and every name
``<name>.p<digits>``: a gateway refuses to serve them otherwise than as the
cluster says (``PARTITIONED_STREAM``, ``WRONG_GATEWAY``), so an unpartitioned
stream cannot share a partition's log, and the file is refused if one
partitioned stream's name is another's partition name.

**The key hash** (stable across versions, machines and languages): a key's
partition is the BLAKE2b digest of the key bytes with an 8-byte digest size
(RFC 7693; no key, salt or personalisation: Python's
``hashlib.blake2b(key, digest_size=8)``), read as an unsigned big-endian
64-bit integer, modulo the partition count. README.md lists test vectors,
which ``tests/test_cluster.py`` pins. Adding partitions moves keys (as in
Kafka): records of a key written before and after lie in different
partitions, so per-key order holds only within one partition count.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headgate.config import ConfigError, format_address, parse_address
from headgate.protocol import messages as m
from headgate.protocol.errors import ErrorCode
from headgate.protocol.messages import MAX_NAME_BYTES, is_valid_name
from headgate.tomlfile import expect_table, read_toml, refuse_unknown

__all__ = [
    "MAX_GATEWAYS",
    "MAX_PARTITIONED_STREAMS",
    "MAX_PARTITIONS",
    "Cluster",
    "ClusterError",
    "ClusterGateway",
    "Partition",
    "PartitionedStream",
    "cluster_from_metadata",
    "cluster_from_tables",
    "load_cluster",
    "partition_name",
    "partition_of",
]

#: Most gateways a cluster file names (what a Metadata answer can carry).
MAX_GATEWAYS = m.MAX_METADATA_GATEWAYS
#: Most partitions of one stream.
MAX_PARTITIONS = m.MAX_METADATA_PARTITIONS
#: Most partitioned streams a cluster file names.
MAX_PARTITIONED_STREAMS = 256

#: Between a partitioned stream's name and a partition's number, in the partition's log name.
PARTITION_INFIX = ".p"
_PARTITION_NAME = re.compile(r"(.+)\.p([0-9]+)")

_GATEWAY_KEYS = frozenset(
    {"address", "tls", "tls_ca_file", "tls_cert_file", "tls_key_file", "tls_server_name"}
)
_STREAM_KEYS = frozenset({"partitions", "assignment"})


class ClusterError(ConfigError):
    """A cluster file (or a gateway's Metadata answer) that cannot be used; one line says why."""


def partition_of(key: bytes, partitions: int) -> int:
    """The partition of ``key`` among ``partitions``: the documented, stable key hash."""
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "big") % partitions


def partition_name(stream: str, index: int) -> str:
    """The name of partition ``index``'s log: ``orders.p3``."""
    return f"{stream}{PARTITION_INFIX}{index}"


@dataclass(frozen=True, slots=True)
class ClusterGateway:
    """One gateway of the fleet, as clients reach it."""

    #: Its name in the file (what errors and statistics show).
    name: str
    #: ``host:port``, as clients connect to it.
    address: str
    #: Clients speak TLS to it (implied by any ``tls_*`` key).
    tls: bool = False
    #: PEM bundle its certificate must chain to (else the system's trust store).
    tls_ca_file: str | None = None
    #: The client certificate to show it (mutual TLS).
    tls_cert_file: str | None = None
    #: The key of ``tls_cert_file`` (None if inside it).
    tls_key_file: str | None = None
    #: The name its certificate must carry (default: the address's host).
    tls_server_name: str | None = None


@dataclass(frozen=True, slots=True)
class Partition:
    """One partition of a partitioned stream, and where it lives."""

    #: The partitioned stream's name.
    stream: str
    #: Its number, from 0.
    index: int
    #: The gateway that holds it.
    gateway: str

    @property
    def name(self) -> str:
        """The name of its stream log on its gateway (``orders.p3``)."""
        return partition_name(self.stream, self.index)


@dataclass(frozen=True, slots=True)
class PartitionedStream:
    """A stream spread over the fleet: one log per partition."""

    #: The stream's name (its partitions' logs are ``<name>.p<k>``).
    name: str
    #: The gateway holding each partition, by partition number.
    holders: tuple[str, ...]

    @property
    def partitions(self) -> tuple[Partition, ...]:
        """Every partition, by number."""
        return tuple(Partition(self.name, k, g) for k, g in enumerate(self.holders))

    def partition_for_key(self, key: bytes) -> Partition:
        """Where records with ``key`` go (see the module's "key hash")."""
        k = partition_of(key, len(self.holders))
        return Partition(self.name, k, self.holders[k])


@dataclass(frozen=True, slots=True)
class Cluster:
    """A validated cluster file: gateways by name, partitioned streams by name."""

    #: Every gateway, sorted by name.
    gateways: Mapping[str, ClusterGateway]
    #: Every partitioned stream, sorted by name.
    streams: Mapping[str, PartitionedStream]

    def stream(self, name: str) -> PartitionedStream:
        """The partitioned stream ``name``; ClusterError names the ones there are."""
        found = self.streams.get(name)
        if found is None:
            known = ", ".join(self.streams) or "none"
            raise ClusterError(f"the cluster has no partitioned stream {name!r} (it has: {known})")
        return found

    def locate(self, name: str) -> Partition | PartitionedStream | None:
        """What a stream log name is in this cluster: a partition, a partitioned
        stream's own name, or None (an ordinary stream, no business of the cluster).

        A ``<stream>.p<digits>`` name that is no partition's (a number beyond
        the stream's partitions, or with a leading zero) is the stream's
        (reserved, held by nobody): it is returned as the stream.
        """
        stream = self.streams.get(name)
        if stream is not None:
            return stream
        match = _PARTITION_NAME.fullmatch(name)
        if match is None:
            return None
        stream = self.streams.get(match[1])
        if stream is None:
            return None
        digits = match[2]
        if (digits.startswith("0") and digits != "0") or int(digits) >= len(stream.holders):
            return stream
        k = int(digits)
        return Partition(stream.name, k, stream.holders[k])

    def refusal(self, name: str, gateway: str) -> tuple[ErrorCode, str] | None:
        """Why gateway ``gateway`` must not serve stream log ``name``, or None if it may.

        The one rule of what a gateway holds: a partition only on its
        assigned gateway, a partitioned stream's own name nowhere.
        """
        found = self.locate(name)
        if found is None:
            return None
        if isinstance(found, PartitionedStream):
            last = len(found.holders) - 1
            return (
                ErrorCode.PARTITIONED_STREAM,
                f"{name!r} is not a stream log here: {found.name!r} is partitioned, "
                f"its partitions are {partition_name(found.name, 0)} to "
                f"{partition_name(found.name, last)}",
            )
        if found.gateway == gateway:
            return None
        holder = self.gateways[found.gateway]
        return (
            ErrorCode.WRONG_GATEWAY,
            f"partition {name} is held by gateway {holder.name} ({holder.address}), "
            f"not by {gateway}",
        )

    def held_by(self, gateway: str) -> tuple[Partition, ...]:
        """The partitions gateway ``gateway`` holds, by stream and number."""
        return tuple(p for s in self.streams.values() for p in s.partitions if p.gateway == gateway)

    def metadata(self, request_id: int, gateway: str) -> m.ClusterMetadata:
        """The answer gateway ``gateway`` gives a Metadata request (no TLS settings:
        they name files on each client's machine)."""
        names = list(self.gateways)
        index = {name: i for i, name in enumerate(names)}
        return m.ClusterMetadata(
            request_id=request_id,
            gateway=gateway,
            gateways=tuple(
                m.MetadataGateway(name=g.name, address=g.address) for g in self.gateways.values()
            ),
            streams=tuple(
                m.MetadataStream(stream=s.name, holders=tuple(index[h] for h in s.holders))
                for s in self.streams.values()
            ),
        )


def cluster_from_metadata(answer: m.ClusterMetadata, *, where: str) -> Cluster:
    """The cluster a gateway's Metadata answer describes, checked as a file is.

    A gateway without a cluster file answers with no gateways: ClusterError.
    """
    if not answer.gateways:
        raise ClusterError(f"{where} runs without a cluster file (serve --cluster)")
    gateways: dict[str, Any] = {}
    for g in answer.gateways:
        if g.name in gateways:
            raise ClusterError(f"{where}: its cluster names gateway {g.name} twice")
        gateways[g.name] = {"address": g.address}
    streams: dict[str, Any] = {}
    for s in answer.streams:
        if s.stream in streams:
            raise ClusterError(f"{where}: its cluster names stream {s.stream} twice")
        assignment: dict[str, list[int]] = {}
        for k, holder in enumerate(s.holders):
            assignment.setdefault(answer.gateways[holder].name, []).append(k)
        streams[s.stream] = {"partitions": len(s.holders), "assignment": assignment}
    return cluster_from_tables({"gateways": gateways, "streams": streams}, where=where)


def load_cluster(path: str | Path) -> Cluster:
    """Read and check a cluster file; ClusterError says, in one line, what is wrong."""
    path = Path(path)
    raw = read_toml(path, "cluster", ClusterError)
    return cluster_from_tables(raw, where=str(path))


def cluster_from_tables(raw: Mapping[str, Any], *, where: str) -> Cluster:
    """A :class:`Cluster` from the file's tables (also what a Metadata answer is turned into)."""
    refuse_unknown(raw, ("gateways", "streams"), where, ClusterError, noun="section")
    gateways_raw = raw.get("gateways")
    if not isinstance(gateways_raw, dict) or not gateways_raw:
        raise ClusterError(f"{where}: no gateways: add a [gateways.NAME] table with an address")
    if len(gateways_raw) > MAX_GATEWAYS:
        raise ClusterError(f"{where}: {len(gateways_raw)} gateways; at most {MAX_GATEWAYS}")
    gateways: dict[str, ClusterGateway] = {}
    addresses: dict[str, str] = {}
    for name in sorted(gateways_raw):
        gateway = _gateway(name, gateways_raw[name], f"{where}: gateways.{name}")
        other = addresses.get(gateway.address)
        if other is not None:
            raise ClusterError(
                f"{where}: gateways {other} and {name} have the same address {gateway.address}"
            )
        addresses[gateway.address] = name
        gateways[name] = gateway
    streams_raw = expect_table(
        raw.get("streams", {}), f"{where}: [streams]", ClusterError, "a table of tables"
    )
    if len(streams_raw) > MAX_PARTITIONED_STREAMS:
        raise ClusterError(
            f"{where}: {len(streams_raw)} partitioned streams; at most {MAX_PARTITIONED_STREAMS}"
        )
    streams: dict[str, PartitionedStream] = {}
    for name in sorted(streams_raw):
        streams[name] = _stream(name, streams_raw[name], list(gateways), f"{where}: streams.{name}")
    for name in streams:
        match = _PARTITION_NAME.fullmatch(name)
        if match is not None and match[1] in streams:
            raise ClusterError(
                f"{where}: streams.{name}: the name is a partition name of stream {match[1]!r}; "
                "choose another"
            )
    return Cluster(gateways=gateways, streams=streams)


def _text(value: object, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ClusterError(f"{what}: expected non-empty text, got {value!r}")
    return value


def _gateway(name: str, value: object, where: str) -> ClusterGateway:
    if not is_valid_name(name):
        raise ClusterError(
            f"{where}: {name!r} is not a gateway name (letters, digits, '.', '_' and '-', "
            "starting with a letter or digit)"
        )
    table = expect_table(value, where, ClusterError, "a table with an address")
    refuse_unknown(table, _GATEWAY_KEYS, where, ClusterError)
    if "address" not in table:
        raise ClusterError(f'{where}: no address (address = "host:port")')
    text = _text(table["address"], f"{where}.address")
    if text.startswith("unix:"):
        raise ClusterError(f"{where}.address: a fleet's gateways are reached by TCP (host:port)")
    try:
        host, port = parse_address(text, what=f"{where}.address")
    except ConfigError as exc:
        raise ClusterError(str(exc)) from None
    if port == 0:
        raise ClusterError(f"{where}.address: port 0 is not an address clients can reach")
    tls = table.get("tls", False)
    if not isinstance(tls, bool):
        raise ClusterError(f"{where}.tls: expected true or false, got {tls!r}")
    files = {
        key: _text(table[key], f"{where}.{key}")
        for key in ("tls_ca_file", "tls_cert_file", "tls_key_file", "tls_server_name")
        if key in table
    }
    if "tls_key_file" in files and "tls_cert_file" not in files:
        raise ClusterError(f"{where}: tls_key_file needs tls_cert_file")
    return ClusterGateway(
        name=name,
        address=format_address(host, port),
        tls=tls or bool(files),
        **files,
    )


def _stream(name: str, value: object, gateways: list[str], where: str) -> PartitionedStream:
    if not is_valid_name(name):
        raise ClusterError(
            f"{where}: {name!r} is not a stream name (letters, digits, '.', '_' and '-', "
            "starting with a letter or digit)"
        )
    table = expect_table(value, where, ClusterError, "a table with partitions = N")
    refuse_unknown(table, _STREAM_KEYS, where, ClusterError)
    count = table.get("partitions")
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_PARTITIONS:
        raise ClusterError(
            f"{where}.partitions: expected a whole number from 1 to {MAX_PARTITIONS}, got {count!r}"
        )
    longest = partition_name(name, count - 1)
    if len(longest) > MAX_NAME_BYTES:
        raise ClusterError(
            f"{where}: the name is too long for its partitions' logs ({longest[:40]}... is "
            f"{len(longest)} characters; at most {MAX_NAME_BYTES})"
        )
    assignment = table.get("assignment")
    if assignment is None:
        return PartitionedStream(name, tuple(gateways[k % len(gateways)] for k in range(count)))
    if not isinstance(assignment, dict):
        raise ClusterError(
            f"{where}.assignment: expected a table of gateway = [partitions], got {assignment!r}"
        )
    holders: list[str | None] = [None] * count
    for gateway, held in assignment.items():
        if gateway not in gateways:
            raise ClusterError(
                f"{where}.assignment: unknown gateway {gateway!r} (the gateways are "
                f"{', '.join(gateways)})"
            )
        if not isinstance(held, list):
            raise ClusterError(
                f"{where}.assignment.{gateway}: expected a list of partition numbers, got {held!r}"
            )
        for k in held:
            if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < count:
                raise ClusterError(
                    f"{where}.assignment.{gateway}: {k!r} is not a partition number "
                    f"(0 to {count - 1})"
                )
            other = holders[k]
            if other is not None:
                both = (
                    "twice by " + gateway if other == gateway else f"by both {other} and {gateway}"
                )
                raise ClusterError(f"{where}: partition {k} is held {both}")
            holders[k] = gateway
    orphans = [k for k, h in enumerate(holders) if h is None]
    if orphans:
        shown = ", ".join(map(str, orphans[:10])) + (", ..." if len(orphans) > 10 else "")
        raise ClusterError(
            f"{where}: partition{'s' if len(orphans) > 1 else ''} {shown} "
            f"{'are' if len(orphans) > 1 else 'is'} held by no gateway (assignment)"
        )
    return PartitionedStream(name, tuple(h for h in holders if h is not None))
