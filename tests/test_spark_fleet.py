"""The driver's view of a fleet (headgate.spark.fleet), against real gateways, without Spark."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from headgate.client.fleet import FleetProducer
from headgate.client.reader import Reader
from headgate.cluster import load_cluster
from headgate.protocol.records import decode_records
from headgate.spark.decode import SourceError
from headgate.spark.fleet import FleetLogs, FleetReleases, by_gateway
from headgate.spark.planning import plan_slices
from headgate.spark.remote import LIST_FRESH_S
from tests.client.test_fleet import GATEWAYS, Fleet, run


@pytest.fixture
def fleet(tmp_path: Path) -> object:
    fleet = Fleet(tmp_path)
    try:
        yield fleet
    finally:
        fleet.stop_all()


def test_every_partition_is_read_through_its_gateway_and_a_down_one_waits(fleet: Fleet) -> None:
    for name in GATEWAYS:
        fleet.start(name)
    sent = [b"k%d:%04d" % (i % 40, i) for i in range(600)]  # 40 keys reach all 6

    async def produce() -> None:
        async with FleetProducer(cluster=fleet.cluster, linger_ms=1) as producer:
            for value in sent:
                await producer.send("orders", value, key=value.split(b":")[0])

    run(produce())
    cluster = load_cluster(fleet.cluster)
    logs = FleetLogs(cluster, ["orders"])
    try:
        names = logs.discover()
        assert names == [f"orders.p{k}" for k in range(6)]
        ranges = {name: (logs.earliest(name), logs.latest(name)) for name in names}
        planned = plan_slices(logs, ranges, 1 << 20)
        split = by_gateway(logs, planned)
        for address, slices in split:
            assert {logs.address(s.stream) for s in slices} == {address}
        read = [
            value
            for name in names
            for frame in logs.frames(name, *ranges[name])
            for value in decode_records(frame.payload).to_lists()[0]
        ]
        assert sorted(read) == sorted(sent)
        # gw2 down: its partitions wait at what the query read, the others go on.
        fleet.kill("gw2")
        assert logs.discover() == ["orders.p0", "orders.p2", "orders.p3", "orders.p5"]
        assert "gw2" in logs.down
        assert logs.latest("orders.p1", read_up_to=ranges["orders.p1"][1]) == ranges["orders.p1"][1]
        assert logs.latest("orders.p0", read_up_to=0) == ranges["orders.p0"][1]
        time.sleep(2 * LIST_FRESH_S)  # past the reuse of gw2's last listing
        with pytest.raises(SourceError, match="cannot connect to gateway"):
            logs.earliest("orders.p4")
        fleet.start("gw2")
        assert logs.discover() == names and not logs.down
    finally:
        logs.close()

    # Releases go to each partition's gateway.
    releases = FleetReleases(cluster)
    try:
        for name in names:
            releases.release(name, ranges[name][1])
        assert releases.flush(10)
    finally:
        releases.close()

    async def released() -> None:
        for gateway in GATEWAYS:
            async with Reader(fleet.address(gateway)) as reader:
                for info in await reader.list_streams():
                    assert info.start_position == ranges[info.stream][1], info

    run(released())
    with pytest.raises(SourceError, match="not a partition"):
        FleetReleases(cluster).release("clicks", 0)
