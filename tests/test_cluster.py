"""The cluster file: its rules, partition names, the key hash, and hostile files."""

from __future__ import annotations

import contextlib
import string
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from headgate.cluster import (
    MAX_PARTITIONS,
    ClusterError,
    Partition,
    PartitionedStream,
    cluster_from_metadata,
    cluster_from_tables,
    load_cluster,
    partition_name,
    partition_of,
)
from headgate.protocol import messages as m
from headgate.protocol.errors import ErrorCode

GOOD = """
[gateways.gw1]
address = "127.0.0.1:7001"
[gateways.gw2]
address = "127.0.0.1:7002"
tls_ca_file = "ca.pem"
[gateways.gw3]
address = "127.0.0.1:7003"

[streams.orders]
partitions = 6
assignment = { gw1 = [0, 3], gw2 = [1, 4], gw3 = [2, 5] }

[streams.events]
partitions = 4
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_a_cluster_file_names_gateways_and_who_holds_each_partition(tmp_path: Path) -> None:
    cluster = load_cluster(write(tmp_path, GOOD))
    assert list(cluster.gateways) == ["gw1", "gw2", "gw3"]
    assert cluster.gateways["gw2"].tls and cluster.gateways["gw2"].tls_ca_file == "ca.pem"
    assert not cluster.gateways["gw1"].tls
    orders = cluster.stream("orders")
    assert orders.holders == ("gw1", "gw2", "gw3", "gw1", "gw2", "gw3")
    assert orders.partitions[4] == Partition("orders", 4, "gw2")
    assert orders.partitions[4].name == "orders.p4"
    # Left out, the assignment is round robin over the gateways by name.
    assert cluster.stream("events").holders == ("gw1", "gw2", "gw3", "gw1")
    assert [p.name for p in cluster.held_by("gw3")] == ["events.p2", "orders.p2", "orders.p5"]


def test_a_gateway_serves_only_what_it_holds(tmp_path: Path) -> None:
    cluster = load_cluster(write(tmp_path, GOOD))
    assert cluster.refusal("orders.p0", "gw1") is None
    assert cluster.refusal("clicks", "gw1") is None  # an ordinary stream
    assert cluster.refusal("orders.x", "gw1") is None  # not a partition name
    code, text = cluster.refusal("orders.p1", "gw1") or (None, "")
    assert code is ErrorCode.WRONG_GATEWAY
    assert text == "partition orders.p1 is held by gateway gw2 (127.0.0.1:7002), not by gw1"
    for reserved in ("orders", "orders.p6", "orders.p99", "orders.p01", "orders.p" + "9" * 200):
        code, text = cluster.refusal(reserved, "gw1") or (None, "")
        assert code is ErrorCode.PARTITIONED_STREAM, reserved
        assert "orders.p0 to orders.p5" in text
    # Only the partitioned stream's names are reserved.
    assert cluster.locate("orders.q1") is None and cluster.locate("orders2.p1") is None


# The documented key hash: BLAKE2b with an 8-byte digest, big-endian, modulo the
# partition count. README.md lists the same vectors; a change here moves keys.
VECTORS = [
    (b"", "e4a6a0577479b2b4", [0, 0, 0, 0]),
    (b"a", "40f89e395b66422f", [0, 2, 5, 11]),
    (b"user-42", "6fa0ca4d7be6efa6", [0, 0, 0, 6]),
    (b"orders/2026-11-25", "ec469b0ffd9de1a6", [0, 2, 2, 2]),
    (bytes(range(8)), "df1d951c82837e75", [0, 0, 3, 9]),
]


@pytest.mark.parametrize(("key", "digest", "partitions"), VECTORS)
def test_the_key_hash_is_pinned(key: bytes, digest: str, partitions: list[int]) -> None:
    assert [partition_of(key, n) for n in (1, 3, 6, 12)] == partitions
    assert partition_of(key, 1 << 64) == int(digest, 16)


def test_the_key_hash_vectors_are_the_documented_ones() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    for key, digest, partitions in VECTORS:
        assert f"`{key!r}` | `{digest}` | {partitions[2]} |" in readme


def test_keys_spread_over_partitions() -> None:
    stream = PartitionedStream("orders", ("gw1", "gw2", "gw3") * 2)
    counts = [0] * 6
    for i in range(6000):
        counts[stream.partition_for_key(f"customer-{i}".encode()).index] += 1
    assert min(counts) > 800, counts


BAD = [
    ("", "no gateways"),
    ('[gateways.gw1]\naddress = "h:1"\n[other]\n', "unknown section(s) other"),
    ("[gateways.gw1]\n", "gateways.gw1: no address"),
    ('[gateways.gw1]\naddress = "h:99999"\n', "port must be a number"),
    ('[gateways.gw1]\naddress = "h:0"\n', "port 0"),
    ('[gateways.gw1]\naddress = "unix:/tmp/s"\n', "reached by TCP"),
    ("[gateways.gw1]\naddress = 7\n", "expected non-empty text"),
    ('[gateways.gw1]\naddress = "h:1"\nport = 2\n', "unknown key(s) port"),
    ('[gateways.gw1]\naddress = "h:1"\ntls = "yes"\n', "tls: expected true or false"),
    ('[gateways.gw1]\naddress = "h:1"\ntls_key_file = "k"\n', "tls_key_file needs tls_cert_file"),
    ('[gateways."g w"]\naddress = "h:1"\n', "is not a gateway name"),
    ('[gateways.a]\naddress = "h:1"\n[gateways.b]\naddress = "h:1"\n', "same address h:1"),
    ('[gateways.a]\naddress = "h:1"\n[streams.s]\n', "partitions: expected a whole number"),
    ('[gateways.a]\naddress = "h:1"\n[streams.s]\npartitions = 0\n', "from 1 to 1024"),
    (f'[gateways.a]\naddress = "h:1"\n[streams.s]\npartitions = {MAX_PARTITIONS + 1}\n', "1024"),
    ('[gateways.a]\naddress = "h:1"\n[streams.s]\npartitions = true\n', "whole number"),
    (
        '[gateways.a]\naddress = "h:1"\n[streams.s]\npartitions = 2\nassignment = {b = [0, 1]}\n',
        "unknown gateway 'b'",
    ),
    (
        '[gateways.a]\naddress = "h:1"\n[gateways.b]\naddress = "h:2"\n'
        "[streams.s]\npartitions = 2\nassignment = {a = [0, 1], b = [1]}\n",
        "partition 1 is held by both a and b",
    ),
    (
        '[gateways.a]\naddress = "h:1"\n[streams.s]\npartitions = 2\n'
        "assignment = {a = [0, 0, 1]}\n",
        "partition 0 is held twice by a",
    ),
    (
        '[gateways.a]\naddress = "h:1"\n[streams.s]\npartitions = 3\nassignment = {a = [0]}\n',
        "partitions 1, 2 are held by no gateway",
    ),
    (
        '[gateways.a]\naddress = "h:1"\n[streams.s]\npartitions = 2\nassignment = {a = [0, 2]}\n',
        "2 is not a partition number (0 to 1)",
    ),
    (
        '[gateways.a]\naddress = "h:1"\n[streams.s]\npartitions = 2\nassignment = [0, 1]\n',
        "expected a table of gateway = [partitions]",
    ),
    (
        '[gateways.a]\naddress = "h:1"\n[streams.s]\npartitions = 2\n'
        '[streams."s.p1"]\npartitions = 1\n',
        "is a partition name of stream 's'",
    ),
    (
        f'[gateways.a]\naddress = "h:1"\n[streams.{"s" * 253}]\npartitions = 10\n',
        "too long for its partitions' logs",
    ),
    ("[gateways.a\n", "not valid TOML"),
]


@pytest.mark.parametrize(("text", "expected"), BAD, ids=[e for _, e in BAD])
def test_a_cluster_file_with_an_error_gets_one_clear_line(
    tmp_path: Path, text: str, expected: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ClusterError) as caught:
        load_cluster(path)
    message = str(caught.value)
    assert expected in message
    assert str(path) in message
    assert "\n" not in message.strip()


def test_a_missing_cluster_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match="does not exist"):
        load_cluster(tmp_path / "nope.toml")
    with pytest.raises(ClusterError, match="is a directory"):
        load_cluster(tmp_path)


def test_metadata_round_trips_the_assignment(tmp_path: Path) -> None:
    cluster = load_cluster(write(tmp_path, GOOD))
    answer = cluster.metadata(5, "gw2")
    decoded = m.decode_global(m.encode_message(answer))
    assert decoded == answer
    assert isinstance(decoded, m.ClusterMetadata)
    again = cluster_from_metadata(decoded, where="gateway gw2")
    assert again.streams == cluster.streams
    # TLS settings are local files: not on the wire.
    assert [g.address for g in again.gateways.values()] == [
        g.address for g in cluster.gateways.values()
    ]


def test_a_gateway_without_a_cluster_or_a_doubled_name_is_refused() -> None:
    empty = m.ClusterMetadata(request_id=1, gateway="headgate", gateways=(), streams=())
    with pytest.raises(ClusterError, match="runs without a cluster file"):
        cluster_from_metadata(empty, where="gateway h:1")
    doubled = m.ClusterMetadata(
        request_id=1,
        gateway="a",
        gateways=(m.MetadataGateway(name="a", address="h:1"),) * 2,
        streams=(),
    )
    with pytest.raises(ClusterError, match="names gateway a twice"):
        cluster_from_metadata(doubled, where="gateway h:1")


_toml_text = st.text(alphabet=string.printable, max_size=300)
_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 2000) | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)


@given(
    st.dictionaries(
        st.sampled_from(["gateways", "streams", "x"]),
        st.dictionaries(st.sampled_from(["gw1", "gw2", "s", "", "a b"]), _values, max_size=3),
        max_size=3,
    )
)
def test_hostile_tables_get_a_cluster_error_or_a_valid_cluster(raw: dict[str, object]) -> None:
    """Whatever the tables hold, the loader returns a cluster whose every partition
    has a known gateway, or raises ClusterError: never another exception."""
    try:
        cluster = cluster_from_tables(raw, where="f")
    except ClusterError as exc:
        assert "\n" not in str(exc)
        return
    for stream in cluster.streams.values():
        assert all(h in cluster.gateways for h in stream.holders)
        assert m.is_valid_name(partition_name(stream.name, len(stream.holders) - 1))


@given(_toml_text)
def test_hostile_files_get_a_cluster_error_or_a_valid_cluster(text: str) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "c.toml"
        path.write_text(text, encoding="utf-8")
        with contextlib.suppress(ClusterError):
            load_cluster(path)
