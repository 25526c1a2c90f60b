"""The fleet producer's bulk and non-waiting sends, its sync wrapper, and a send
waiting for room on a gateway that dies, against three real gateways on 127.0.0.1
(the ``headgate serve`` processes of tests/client/test_fleet.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from headgate.client import BufferFull, SyncProducer
from headgate.client.fleet import FleetProducer, FleetStatistics, PartitionUnavailable
from headgate.cluster import load_cluster, partition_of
from tests.client.test_fleet import GATEWAYS, Fleet, check_keyed_sequences, run


@pytest.fixture
def fleet(tmp_path: Path) -> Any:
    fleet = Fleet(tmp_path)
    try:
        for name in GATEWAYS:
            fleet.start(name)
        yield fleet
    finally:
        fleet.stop_all()


class Numbered:
    """Keyed values ``k<n>:<counter>``: per key, the counter orders the send order."""

    def __init__(self) -> None:
        self.counter = 0
        self.sent: list[bytes] = []

    def next(self, key_count: int = 40) -> tuple[bytes, bytes]:
        key = b"k%d" % (self.counter % key_count)
        value = key + b":%07d" % self.counter
        self.counter += 1
        return value, key


def test_send_many_and_send_nowait_keep_each_key_in_order_over_three_gateways(
    fleet: Fleet,
) -> None:
    keyed = Numbered()
    keyless_sent: list[bytes] = []
    ids: dict[str, int] = {}

    async def scenario() -> None:
        producer = FleetProducer(cluster=fleet.cluster, max_batch_bytes=2048, linger_ms=1)
        async with producer:
            ids["id"] = producer.producer_id
            deliveries = []
            for _ in range(8):  # lists
                pairs = [keyed.next() for _ in range(300)]
                values, keys = [v for v, _ in pairs], [k for _, k in pairs]
                deliveries.append(await producer.send_many("orders", values, keys))
                keyed.sent += values
            for _ in range(4):  # Arrow, keys as the RecordBatch's column
                pairs = [keyed.next() for _ in range(300)]
                batch = pa.record_batch(
                    {
                        "value": pa.array([v for v, _ in pairs], pa.binary()),
                        "key": pa.array([k for _, k in pairs], pa.binary()),
                    }
                )
                deliveries.append(await producer.send_many("orders", batch))
                keyed.sent += [v for v, _ in pairs]
            for _ in range(600):  # one at a time, never waiting, between bulk calls
                value, key = keyed.next()
                for _attempt in range(2000):
                    try:
                        producer.send_nowait("orders", value, key)
                        break
                    except BufferFull:
                        await asyncio.sleep(0.005)
                else:
                    raise AssertionError("the buffer never had room")
                keyed.sent.append(value)
            # Keyless: a list with some null keys, an Arrow array without keys, send_nowait.
            plain = [b"n:a%05d" % i for i in range(1500)]
            mixed = await producer.send_many(
                "events", plain, [None if i % 3 else b"x%d" % i for i in range(1500)]
            )
            keyless_sent.extend(plain)
            arrow = pa.array([b"n:b%05d" % i for i in range(1500)], pa.binary())
            spread = await producer.send_many("events", arrow)
            keyless_sent.extend(arrow.to_pylist())
            for i in range(300):
                producer.send_nowait("events", b"n:c%05d" % i)
                keyless_sent.append(b"n:c%05d" % i)
                if i % 50 == 0:
                    await asyncio.sleep(0)
            results = [await d for d in deliveries]
            assert [r.record_count for r in results] == [300] * 12
            for result in results:
                assert sum(b.record_count for b in result.batches) == 300
                assert {b.stream for b in result.batches} <= {f"orders.p{k}" for k in range(6)}
            spread_result = await spread
            assert sum(b.record_count for b in spread_result.batches) == 1500
            # 1500 records of 8 bytes are about 6 batches of 2048: more than one partition
            # (which ones depends on their credit).
            assert len({b.stream for b in spread_result.batches}) >= 2, spread_result
            assert (await mixed).record_count == 1500
            await producer.flush()
            stats = producer.statistics()
            acked = sum(p.records_acked for n, p in stats.partitions.items() if "orders" in n)
            assert acked == len(keyed.sent)

    run(scenario(), timeout=90)
    fleet.stop_all()
    check_keyed_sequences(fleet.partition_values("orders", ids["id"]), keyed.sent)
    events = fleet.partition_values("events", ids["id"])
    landed = [v for values in events.values() for v in values]
    assert sorted(landed) == sorted(keyless_sent)
    assert sum(len(values) > 0 for values in events.values()) >= 4
    # The keyed records of the mixed call are in their keys' partitions.
    for index, values in events.items():
        for value in values:
            number = int(value[3:])
            if value.startswith(b"n:a") and number % 3 == 0:
                assert partition_of(b"x%d" % number, 6) == index, value


def test_the_sync_producer_writes_to_a_fleet_from_a_cluster_file_or_an_address(
    fleet: Fleet,
) -> None:
    keyed = Numbered()
    keyless_sent: list[bytes] = []
    with SyncProducer(cluster=fleet.cluster, linger_ms=1, max_batch_bytes=4096) as producer:
        for i in range(3000):
            value, key = keyed.next()
            producer.send("orders", value, key=key)
            keyed.sent.append(value)
            producer.send("events", b"s:%05d" % i)
            keyless_sent.append(b"s:%05d" % i)
        pairs = [keyed.next() for _ in range(500)]
        many = producer.send_many("orders", [v for v, _ in pairs], [k for _, k in pairs])
        keyed.sent += [v for v, _ in pairs]
        producer.flush(timeout=30)
        result = many.result(timeout=5)
        assert result.record_count == 500
        assert sum(b.record_count for b in result.batches) == 500
        stats = producer.statistics()
        assert isinstance(stats, FleetStatistics)
        assert all(g.up for g in stats.gateways.values())
        orders = [p for n, p in stats.partitions.items() if n.startswith("orders.")]
        assert sum(p.records_acked for p in orders) == len(keyed.sent)
        file_id = producer.producer_id
    assert producer.statistics().producer_id == file_id  # the last snapshot, once closed
    with SyncProducer([fleet.address("gw3")], linger_ms=1) as bootstrapped:
        for i in range(1000):
            bootstrapped.send("events", b"b:%05d" % i)
        bootstrapped.flush(timeout=30)
        address_id = bootstrapped.producer_id
    with pytest.raises(TypeError, match="partition_timeout bounds"):
        SyncProducer(cluster=fleet.cluster, reconnect_timeout=5)  # type: ignore[call-overload]
    fleet.stop_all()
    check_keyed_sequences(fleet.partition_values("orders", file_id), keyed.sent)
    events = fleet.partition_values("events", file_id)
    assert sorted(v for values in events.values() for v in values) == sorted(keyless_sent)
    assert sum(len(values) > 0 for values in events.values()) >= 4
    events = fleet.partition_values("events", address_id)
    assert sorted(v for values in events.values() for v in values) == sorted(
        b"b:%05d" % i for i in range(1000)
    )


def test_a_send_waiting_for_room_on_a_gateway_that_dies_raises_after_partition_timeout(
    fleet: Fleet,
) -> None:
    """Without the fleet's watch on waiting sends, this send waits until gw2 returns."""
    cluster = load_cluster(fleet.cluster)
    on_gw2 = next(
        b"k%d" % i
        for i in range(100)
        if cluster.stream("orders").partition_for_key(b"k%d" % i).gateway == "gw2"
    )
    on_gw1 = next(
        b"k%d" % i
        for i in range(100)
        if cluster.stream("orders").partition_for_key(b"k%d" % i).gateway == "gw1"
    )
    taken: list[bytes] = []
    refused: list[bytes] = []
    ids: dict[str, int] = {}

    async def scenario() -> None:
        producer = FleetProducer(
            cluster=fleet.cluster,
            partition_timeout=1.0,
            max_buffered_bytes=4096,
            max_batch_bytes=1024,
            linger_ms=1,
        )
        async with producer:
            ids["id"] = producer.producer_id
            await producer.send("orders", b"%s:0000000" % on_gw2, key=on_gw2)
            await producer.flush()
            taken.append(b"%s:0000000" % on_gw2)
            os.kill(fleet.procs["gw2"].pid, signal.SIGSTOP)  # no acks from here on
            waiting = None
            for i in range(1, 200):
                value = b"%s:%07d" % (on_gw2, i) + b"." * 100
                send = asyncio.ensure_future(producer.send("orders", value, key=on_gw2))
                await asyncio.sleep(0.05)
                if not send.done():
                    waiting, waiting_value = send, value
                    break
                send.result()
                taken.append(value)
            assert waiting is not None, "the partition's buffer never filled"
            # A bulk call waits behind it.
            many_values = [b"%s:%07d" % (on_gw2, 500 + i) for i in range(5)]
            many = asyncio.ensure_future(producer.send_many("orders", many_values, [on_gw2] * 5))
            await asyncio.sleep(0.05)
            assert not many.done()
            fleet.kill("gw2")
            killed = time.monotonic()
            with pytest.raises(PartitionUnavailable, match=r"gateway gw2 .* has been down"):
                await asyncio.wait_for(waiting, 10)
            elapsed = time.monotonic() - killed
            assert 0.8 < elapsed < 5, elapsed
            with pytest.raises(PartitionUnavailable):
                await asyncio.wait_for(many, 5)
            refused.append(waiting_value)
            refused.extend(many_values)
            # Meanwhile the other gateways take records.
            await producer.send("orders", b"%s:0000001" % on_gw1, key=on_gw1)
            taken.append(b"%s:0000001" % on_gw1)
            # What was taken before is delivered once gw2 is back.
            fleet.start("gw2")
            async with asyncio.timeout(30):
                # A flush before the producer is back on gw2 is refused (gw2 was down
                # past partition_timeout): wait for the reconnection first.
                while not producer.statistics().gateways["gw2"].up:
                    await asyncio.sleep(0.05)
                await producer.flush()

    run(scenario(), timeout=90)
    fleet.stop_all()
    values = fleet.partition_values("orders", ids["id"])
    landed = [v for partition_values in values.values() for v in partition_values]
    assert sorted(landed) == sorted(taken)
    assert not set(refused) & set(landed)
