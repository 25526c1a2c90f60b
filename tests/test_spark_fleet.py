"""The driver's view of a fleet (headgate.spark.fleet), against real gateways, without Spark."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from headgate.client.fleet import FleetProducer
from headgate.client.reader import Reader
from headgate.cluster import load_cluster, partition_of
from headgate.protocol.records import decode_records
from headgate.spark.decode import SourceError, StreamSlice, arrow_schema
from headgate.spark.fleet import FleetLogs, FleetReleases, by_gateway
from headgate.spark.planning import plan_slices
from headgate.spark.remote import LIST_FRESH_S, read_remote_slice
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
        # The gateway frees the log once it has stored the consumer's new position,
        # after confirming the release: a moment later.
        for gateway in GATEWAYS:
            async with Reader(fleet.address(gateway)) as reader:
                for _ in range(100):
                    infos = await reader.list_streams()
                    if all(i.start_position == ranges[i.stream][1] for i in infos):
                        break
                    await asyncio.sleep(0.05)
                for info in infos:
                    assert info.start_position == ranges[info.stream][1], info

    run(released())
    with pytest.raises(SourceError, match="not a partition"):
        FleetReleases(cluster).release("clicks", 0)


def test_a_slice_read_outlives_its_gateway_restarting_and_gives_up_after_its_deadline(
    fleet: Fleet,
) -> None:
    """An executor's read (what a Spark task runs) of a partition on gw2, with gw2
    down at its start, killed in the middle, and down for good."""
    for name in GATEWAYS:
        fleet.start(name)
    sent = [b"k%d:%05d" % (i % 40, i) for i in range(3000)]

    async def produce() -> None:
        async with FleetProducer(
            cluster=fleet.cluster, linger_ms=1, max_batch_bytes=1024
        ) as producer:
            for value in sent:
                await producer.send("orders", value, key=value.split(b":")[0])

    run(produce())
    logs = FleetLogs(load_cluster(fleet.cluster), ["orders"])
    try:
        piece = StreamSlice("orders.p1", logs.earliest("orders.p1"), logs.latest("orders.p1"))
    finally:
        logs.close()
    expected = [v for v in sent if partition_of(v.split(b":")[0], 6) == 1]
    where = fleet.address("gw2")

    def values(batches: list[object]) -> list[bytes]:
        return [v for b in batches for v in b.column("value").to_pylist()]  # type: ignore[attr-defined]

    def restart_later() -> threading.Timer:
        timer = threading.Timer(1.0, fleet.start, args=("gw2",))
        timer.start()
        return timer

    # Down when the read starts, back a second later: the read waits for it.
    fleet.kill("gw2")
    timer = restart_later()
    began = time.monotonic()
    rows = list(read_remote_slice(where, piece, arrow_schema(), page_bytes=1024))
    timer.join()
    assert time.monotonic() - began >= 0.9
    assert values(rows) == expected
    # Killed after the first page: the read goes on from the first page not yielded.
    pages = read_remote_slice(where, piece, arrow_schema(), page_bytes=1024)
    first = [next(pages)]
    fleet.kill("gw2")
    timer = restart_later()
    rest = list(pages)
    timer.join()
    assert values(first + rest) == expected
    # Down for good: one line, after the deadline.
    fleet.kill("gw2")
    began = time.monotonic()
    with pytest.raises(SourceError, match=r"tried again for 1 s") as caught:
        list(read_remote_slice(where, piece, arrow_schema(), retry_for=1.0))
    assert 0.9 <= time.monotonic() - began < 10
    assert "\n" not in str(caught.value) and f"from gateway {where}" in str(caught.value)
