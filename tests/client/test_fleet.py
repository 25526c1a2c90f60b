"""A fleet of real gateways on 127.0.0.1: partitioned streams, routing, a gateway killed.

Each gateway is a ``headgate serve --cluster cluster.toml --name gwN`` child
process, so that one can be SIGKILLed under load and started again on its
data directory. Every record is read back from the partition logs on disk
(the log reader) once the gateways have stopped.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from headgate.cli import main
from headgate.client import Producer, StreamRefused
from headgate.client.fleet import FleetProducer, PartitionUnavailable
from headgate.client.reader import Reader, ReaderRefused
from headgate.cluster import ClusterError, load_cluster, partition_of
from headgate.protocol.errors import ErrorCode
from tests.helpers import free_port, read_log, values_in_order
from tests.serving import HEADGATE, stop

GATEWAYS = ("gw1", "gw2", "gw3")


def write_cluster(path: Path, ports: dict[str, int], *, swap: bool = False) -> Path:
    """Three gateways; ``orders`` (6 partitions, gwN holds N-1 and N+2) and ``events`` (6)."""
    held = {"gw1": "[0, 3]", "gw2": "[1, 4]", "gw3": "[2, 5]"}
    if swap:  # a wrong copy of the file: gw1 and gw2 swapped
        held["gw1"], held["gw2"] = held["gw2"], held["gw1"]
    lines = []
    for name, port in ports.items():
        lines += [f"[gateways.{name}]", f'address = "127.0.0.1:{port}"']
    lines += [
        "[streams.orders]",
        "partitions = 6",
        "assignment = { " + ", ".join(f"{g} = {h}" for g, h in held.items()) + " }",
        "[streams.events]",
        "partitions = 6",
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


class Fleet:
    """Three ``headgate serve`` processes of one cluster file, each on its own data directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ports = {name: free_port() for name in GATEWAYS}
        self.cluster = write_cluster(root / "cluster.toml", self.ports)
        self.procs: dict[str, subprocess.Popen[str]] = {}

    def data(self, name: str) -> Path:
        return self.root / name

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def start(self, name: str, *extra: str) -> None:
        proc = subprocess.Popen(
            [
                *HEADGATE,
                "serve",
                "--listen",
                self.address(name),
                "--data-dir",
                str(self.data(name)),
                "--cluster",
                str(self.cluster),
                "--name",
                name,
                "--stream-capacity",
                "8MiB",
                "--term-length",
                "2MiB",
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("listening on "):
            stop(proc)
            raise AssertionError(f"gateway {name} did not start: {line!r}")
        self.procs[name] = proc

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.kill()
        proc.wait(10)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            stop(proc)
        self.procs.clear()

    def partition_values(self, stream: str, producer_id: int) -> dict[int, list[bytes]]:
        """Per partition, the producer's values in its log, checking its sequences
        run on without gap or repeat (exactly once per partition)."""
        cluster = load_cluster(self.cluster)
        out: dict[int, list[bytes]] = {}
        for partition in cluster.stream(stream).partitions:
            directory = self.data(partition.gateway) / "streams" / partition.name
            if not directory.exists():
                out[partition.index] = []
                continue
            frames = read_log(self.data(partition.gateway), partition.name)
            out[partition.index] = values_in_order(frames, producer_id)
        return out


@pytest.fixture
def fleet(tmp_path: Path) -> Any:
    fleet = Fleet(tmp_path)
    try:
        yield fleet
    finally:
        fleet.stop_all()


def run(coroutine: Any, timeout: float = 60.0) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(timeout):
            await coroutine

    asyncio.run(bounded())


def test_three_gateways_hold_every_acknowledged_record_once_in_key_order(fleet: Fleet) -> None:
    for name in GATEWAYS:
        fleet.start(name)
    keyed_sent: list[bytes] = []
    keyless_sent: list[bytes] = []
    ids: dict[str, int] = {}

    async def scenario() -> None:
        # One producer from the cluster file, one bootstrapped from a single address.
        by_file = Producer(cluster=fleet.cluster, max_batch_bytes=4096, linger_ms=1)
        by_address = Producer([fleet.address("gw2")], max_batch_bytes=4096, linger_ms=1)
        assert isinstance(by_file, FleetProducer) and isinstance(by_address, FleetProducer)
        async with by_file, by_address:
            assert by_address.cluster.streams == by_file.cluster.streams
            for i in range(3000):
                key = b"k%d" % (i % 40)
                value = key + b":%05d" % i
                await by_file.send("orders", value, key=key)
                keyed_sent.append(value)
                plain = b"n:%d" % i
                await by_address.send("events", plain)
                keyless_sent.append(plain)
            await by_file.flush()
            await by_address.flush()
            stats = by_file.statistics()
            assert all(g.up for g in stats.gateways.values())
            assert sorted(stats.partitions) == [f"orders.p{k}" for k in range(6)]
            assert sum(p.records_acked for p in stats.partitions.values()) == 3000
            assert all(p.guarantees is not None for p in stats.partitions.values())
            ids["file"], ids["address"] = by_file.producer_id, by_address.producer_id

    run(scenario())
    # headgate tail --cluster merges the partitions and says which one each record is from.
    tailed = subprocess.run(
        [
            *HEADGATE,
            *("tail", "orders", "--cluster", str(fleet.cluster), "--from", "earliest"),
            *("--count", "3000", "--format", "json"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert tailed.returncode == 0, tailed.stderr
    rows = [json.loads(line) for line in tailed.stdout.splitlines()]
    assert sorted(r["value"].encode() for r in rows) == sorted(keyed_sent)
    assert {r["stream"] for r in rows} == {f"orders.p{k}" for k in range(6)}
    assert all(r["stream"] == f"orders.p{partition_of(r['key'].encode(), 6)}" for r in rows)
    fleet.stop_all()
    check_keyed_sequences(fleet.partition_values("orders", ids["file"]), keyed_sent)
    events = fleet.partition_values("events", ids["address"])
    landed = [v for values in events.values() for v in values]
    assert sorted(landed) == sorted(keyless_sent)
    # Sticky round robin: batches of keyless records went to most partitions.
    assert sum(len(values) > 0 for values in events.values()) >= 4, {
        k: len(v) for k, v in events.items()
    }


def test_a_killed_gateway_moves_keyless_traffic_and_holds_keyed_until_it_returns(
    fleet: Fleet,
) -> None:
    for name in GATEWAYS:
        fleet.start(name)
    keyed_sent: list[bytes] = []
    keyless_sent: list[bytes] = []
    while_down: list[bytes] = []
    ids: dict[str, int] = {}

    async def scenario() -> None:
        producer = FleetProducer(
            cluster=fleet.cluster, max_batch_bytes=2048, linger_ms=1, partition_timeout=60
        )
        async with producer:
            ids["id"] = producer.producer_id
            gateways = producer._producers

            async def load(count: int, tag: bytes) -> None:
                for i in range(count):
                    key = b"k%d" % (i % 30)
                    value = key + b":%s%05d" % (tag, i)
                    await producer.send("orders", value, key=key)
                    keyed_sent.append(value)
                    plain = b"n:%s%05d" % (tag, i)
                    # What the producer routes by: gw2's session is not open.
                    down = "gw2" in gateways and not gateways["gw2"].connected
                    await producer.send("events", plain)
                    keyless_sent.append(plain)
                    if down:
                        while_down.append(plain)
                    if i % 50 == 0:
                        await asyncio.sleep(0.001)

            await load(1500, b"a")
            # SIGKILL gw2 while records are in flight to it.
            sender = asyncio.ensure_future(load(1500, b"b"))
            await asyncio.sleep(0.05)
            fleet.kill("gw2")  # typically ~50 keyed records in flight to it, unacknowledged
            await sender
            assert not producer.statistics().gateways["gw2"].up
            await load(1500, b"c")  # all of it while gw2 is down
            assert len(while_down) >= 1500
            fleet.start("gw2")
            await load(1500, b"d")
            async with asyncio.timeout(30):
                await producer.flush()
            assert producer.statistics().gateways["gw2"].up

    run(scenario(), timeout=120)
    fleet.stop_all()
    # Keyed: nothing lost, nothing twice, each key in order, across the kill.
    check_keyed_sequences(fleet.partition_values("orders", ids["id"]), keyed_sent)
    events = fleet.partition_values("events", ids["id"])
    landed = [v for values in events.values() for v in values]
    assert sorted(landed) == sorted(keyless_sent)
    assert len(landed) == len(set(landed))
    # Keyless records sent while gw2 was down went to gw1 and gw3 only.
    cluster = load_cluster(fleet.cluster)
    on_gw2 = {
        v
        for p in cluster.stream("events").partitions
        if p.gateway == "gw2"
        for v in events[p.index]
    }
    assert not on_gw2 & set(while_down)


def check_keyed_sequences(values: dict[int, list[bytes]], sent: list[bytes]) -> None:
    """Every sent ``key:[TAG]nnnnn`` record once, in its key's partition, and per key
    in send order (the tag orders the phases, the number the records of a phase)."""
    seen: list[bytes] = []
    per_key: dict[bytes, list[bytes]] = defaultdict(list)
    for index, partition_values in values.items():
        for value in partition_values:
            key, number = value.split(b":")
            assert partition_of(key, len(values)) == index, (value, index)
            per_key[key].append(number)
            seen.append(value)
    assert len(seen) == len(set(seen))
    assert sorted(seen) == sorted(sent)
    for key, numbers in per_key.items():
        assert numbers == sorted(numbers), key


def test_a_partition_sent_to_the_wrong_gateway_is_refused_with_the_holder(fleet: Fleet) -> None:
    for name in GATEWAYS:
        fleet.start(name)

    async def scenario() -> None:
        # A plain producer that binds a partition on a gateway that does not hold it.
        async with Producer(fleet.address("gw1"), reconnect_timeout=5) as plain:
            await plain.send("orders.p1", b"x")
            await plain.send("orders", b"x")
            await plain.send("orders.p0", b"fine")
            with pytest.raises(StreamRefused) as caught:
                await plain.flush("orders.p1")
            assert caught.value.code is ErrorCode.WRONG_GATEWAY
            holder = f"held by gateway gw2 (127.0.0.1:{fleet.ports['gw2']})"
            assert holder in str(caught.value)
            assert "\n" not in str(caught.value)
            with pytest.raises(StreamRefused) as caught:
                await plain.flush("orders")
            assert caught.value.code is ErrorCode.PARTITIONED_STREAM
            await plain.flush("orders.p0")
        # A reader of it on the wrong gateway.
        async with Reader(fleet.address("gw1")) as reader:
            with pytest.raises(ReaderRefused) as refused:
                await reader.fetch_all("orders.p1", 0)
            assert refused.value.code is ErrorCode.WRONG_GATEWAY
        # A fleet producer with a wrong copy of the cluster file.
        wrong = write_cluster(fleet.root / "wrong.toml", fleet.ports, swap=True)
        async with FleetProducer(cluster=wrong) as producer:
            key = next(b"k%d" % i for i in range(100) if _partition(b"k%d" % i) == 0)
            await producer.send("orders", b"v", key=key)
            with pytest.raises(StreamRefused, match=r"orders\.p0 is held by gateway gw1"):
                await producer.flush()
            await producer.abort()

    run(scenario())


def _partition(key: bytes) -> int:
    return partition_of(key, 6)


def test_an_unreachable_gateway_holds_back_only_its_partitions(fleet: Fleet) -> None:
    fleet.start("gw1")
    fleet.start("gw2")  # gw3 never starts

    async def scenario() -> None:
        producer = FleetProducer(cluster=fleet.cluster, partition_timeout=1.0, linger_ms=1)
        async with producer:
            for i in range(200):
                await producer.send("events", b"n:%d" % i)
            on_gw3 = next(b"k%d" % i for i in range(100) if _partition(b"k%d" % i) in (2, 5))
            elsewhere = next(b"k%d" % i for i in range(100) if _partition(b"k%d" % i) == 0)
            await producer.send("orders", b"early", key=on_gw3)  # buffered, within the timeout
            await asyncio.sleep(1.2)
            await producer.send("orders", b"ok", key=elsewhere)
            with pytest.raises(PartitionUnavailable) as caught:
                await producer.send("orders", b"late", key=on_gw3)
            text = str(caught.value)
            assert f"gateway gw3 (127.0.0.1:{fleet.ports['gw3']}) has been down" in text
            assert "\n" not in text
            with pytest.raises(PartitionUnavailable, match="gateway gw3"):
                await producer.flush()
            stats = producer.statistics()
            assert not stats.gateways["gw3"].up and stats.gateways["gw1"].up
            assert stats.gateways["gw3"].down_for is not None
            await producer.abort()

    run(scenario())
    # The operator's view: gw3 down with its reason, the others' partitions with their fill.
    result = CliRunner().invoke(main, ["cluster", "status", str(fleet.cluster), "--timeout", "2"])
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    assert any(line.startswith("gw1 ") and line.endswith(" up") for line in lines)
    assert any(line.startswith("gw3 ") and "DOWN: cannot connect" in line for line in lines)
    rows = {line.split()[0]: line.split() for line in lines if ".p" in line.split(" ")[0]}
    assert sorted(rows) == sorted(
        [f"events.p{k}" for k in range(6)] + [f"orders.p{k}" for k in range(6)]
    )
    assert rows["events.p2"][1:3] == ["gw3", "?"]
    # Each consumer's lag in bytes and in records: every record sent to
    # "events" is in the lag of a partition on gw1 or gw2 (none on gw3 is up).
    lags = [
        int(found.group(1).replace(",", ""))
        for line in lines
        if line.startswith("events.p")
        for found in [re.search(r"default \(.*, ([\d,]+) records\)", line)]
        if found is not None
    ]
    assert sum(lags) == 200, lines


def test_bootstrap_errors_are_one_line(tmp_path: Path) -> None:
    async def nobody() -> None:
        with pytest.raises(ClusterError) as caught:
            await FleetProducer([f"127.0.0.1:{free_port()}"], connect_timeout=2).connect()
        assert "no gateway told the cluster: cannot connect to gateway" in str(caught.value)
        assert "\n" not in str(caught.value)

    run(nobody())
    # A gateway without a cluster file says so.
    proc = subprocess.Popen(
        [*HEADGATE, "serve", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "solo")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().split()[-1]

        async def solo() -> None:
            with pytest.raises(ClusterError, match="runs without a cluster file"):
                await FleetProducer([address]).connect()

        run(solo())
    finally:
        stop(proc)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--name", "gw1"], "cluster and cluster_name go together"),
        (["--cluster", "{bad}", "--name", "gw1"], "partition 1 is held by both gw1 and gw2"),
        (["--cluster", "{good}", "--name", "gw9"], "no gateway named 'gw9'"),
        (["--cluster", "{missing}", "--name", "gw1"], "does not exist"),
    ],
)
def test_serve_with_a_bad_cluster_says_why_in_one_line(
    tmp_path: Path, args: list[str], expected: str
) -> None:
    good = write_cluster(tmp_path / "good.toml", {g: 7000 + i for i, g in enumerate(GATEWAYS)})
    bad = tmp_path / "bad.toml"
    bad.write_text(
        good.read_text().replace("gw1 = [0, 3]", "gw1 = [0, 1, 3]"),
        encoding="utf-8",
    )
    paths = {"good": good, "bad": bad, "missing": tmp_path / "missing.toml"}
    args = [a.format(**paths) for a in args]
    result = CliRunner().invoke(
        main, ["serve", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "d"), *args]
    )
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("headgate serve: "), result.output
    assert expected in lines[0]


def test_a_fleet_producer_is_what_producer_makes_for_a_cluster_or_a_list(tmp_path: Path) -> None:
    cluster = write_cluster(tmp_path / "c.toml", {g: 7000 + i for i, g in enumerate(GATEWAYS)})
    assert isinstance(Producer(cluster=cluster), FleetProducer)
    assert isinstance(Producer(["127.0.0.1:7000"]), FleetProducer)
    assert isinstance(Producer(address=["127.0.0.1:7000"]), FleetProducer)
    assert type(Producer("127.0.0.1:7000")) is Producer
    with pytest.raises(TypeError, match="needs the gateway's address"):
        Producer()
    with pytest.raises(ValueError, match="either the bootstrap addresses or the cluster"):
        Producer(["127.0.0.1:7000"], cluster=cluster)
    with pytest.raises(TypeError, match="partition_timeout bounds"):
        FleetProducer(cluster=cluster, reconnect_timeout=5)  # type: ignore[call-arg]


def test_a_gateways_tls_settings_in_the_cluster_file_apply_to_it_alone() -> None:
    from headgate.client import ClientSecurity
    from headgate.client.fleet import gateway_security
    from headgate.cluster import ClusterGateway

    base = ClientSecurity(token=b"t", ca_file="mine.pem")
    plain = ClusterGateway(name="gw1", address="h:1")
    assert gateway_security(base, plain) is base
    tls = ClusterGateway(
        name="gw2", address="h:2", tls=True, tls_ca_file="fleet.pem", tls_server_name="gw2.x"
    )
    secured = gateway_security(base, tls)
    assert secured.token == b"t" and secured.uses_tls
    assert (secured.ca_file, secured.server_name) == ("fleet.pem", "gw2.x")


def test_a_built_tls_context_serves_the_gateways_whose_entry_names_no_files() -> None:
    import ssl

    from headgate.client import ClientSecurity
    from headgate.client.fleet import gateway_security
    from headgate.cluster import ClusterGateway

    context = ssl.create_default_context()
    base = ClientSecurity(token=b"t", tls_context=context)
    named = ClusterGateway(name="gw1", address="h:1", tls=True, tls_server_name="gw1.x")
    kept = gateway_security(base, named)
    assert kept.ssl_context() is context and kept.server_name == "gw1.x"
    with_files = ClusterGateway(name="gw2", address="h:2", tls=True, tls_ca_file="fleet.pem")
    replaced = gateway_security(base, with_files)
    assert replaced.tls_context is None and replaced.ca_file == "fleet.pem"
    assert replaced.token == b"t"


def test_batches_sealed_before_each_gateways_welcome_fit_its_smaller_frames(
    fleet: Fleet,
) -> None:
    """Issue 19: a fleet producer connects in the background, so its first batches are
    sealed at max_batch_bytes (256 KiB here) before each gateway's Welcome says 16 KiB."""
    config = fleet.root / "small-frames.toml"
    config.write_text('[gateway]\nmax_message_size = "16KiB"\n', encoding="utf-8")
    for name in GATEWAYS:
        fleet.start(name, "--config", str(config))
    sent: list[bytes] = []
    ids: dict[str, int] = {}

    async def scenario() -> None:
        producer = Producer(cluster=fleet.cluster, linger_ms=200)
        assert isinstance(producer, FleetProducer)
        async with producer:
            for i in range(4000):  # about 60 KiB per partition, in its first batch
                key = b"k%d" % (i % 30)
                value = key + b":%05d" % i + b"." * 40
                await producer.send("orders", value, key=key)
                sent.append(value)
            await producer.flush()
            stats = producer.statistics()
            assert sum(p.records_acked for p in stats.partitions.values()) == 4000
            assert all(g.up for g in stats.gateways.values())
            ids["id"] = producer.producer_id

    run(scenario())
    fleet.stop_all()
    check_keyed_sequences(fleet.partition_values("orders", ids["id"]), sent)
