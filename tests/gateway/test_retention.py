"""Retention after release, against a real gateway on 127.0.0.1 and real files.

A stream has two budgets: ``capacity`` of data its blocking consumers have
not committed (the producers' credit follows it), and ``retain_bytes`` of
released data kept readable for new consumers and replays. The log holds
both; retained bytes never take credit from the producers, and a restart
keeps what was retained.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest

from headgate.client import Producer
from headgate.client.reader import Reader
from headgate.config import ConfigError, GatewayConfig, Retention, StreamSettings
from headgate.gateway.consumers import free_position
from headgate.protocol import messages as m
from tests.helpers import (
    BLOCKING,
    Consumer,
    consumers,
    gateway,
    positions,
    record_lists,
    records,
    run,
)

pytestmark = pytest.mark.timeout(90)

KiB = 1024
#: Small frames keep the gateway's rotation reserve (a frame per term) small.
SETTINGS = {"term_length": 64 * KiB, "max_message_size": 4 * KiB}
CAPACITY = 256 * KiB
RETAIN = 128 * KiB


def retained(retain_seconds: float | None = None) -> StreamSettings:
    return StreamSettings(
        capacity=CAPACITY,
        retain_bytes=RETAIN,
        retain_seconds=retain_seconds,
        consumers=consumers(archive=BLOCKING),
    )


async def fetch_values(gw_address: tuple[str, int], start: int) -> list[bytes]:
    async with Reader(gw_address) as reader:
        batches, _ = await reader.fetch_all("s", start)
    return [v for b in batches for v in record_lists(memoryview(b.records))[0]]


async def produce(address: tuple[str, int], values: list[bytes], stream: str = "s") -> None:
    async with Producer(address, linger_ms=1, max_batch_bytes=1024) as p:
        for value in values:
            await p.send(stream, value)
        await p.flush(stream)


def test_released_data_stays_readable_inside_the_retention_and_a_reset_replays_it(
    tmp_path: Path,
) -> None:
    plain = StreamSettings(capacity=CAPACITY, consumers=consumers(archive=BLOCKING))
    streams = {"s": retained(), "plain": plain}

    async def scenario() -> None:
        async with gateway(tmp_path, **SETTINGS, streams=streams) as gw:
            original = records("r", 1500)
            await produce(gw.address, original)
            await produce(gw.address, original, "plain")
            for name in ("s", "plain"):
                archive = Consumer(gw, tmp_path, name, "archive")
                archive.poll()  # reads everything and releases it
                await gw.consumers_saved()  # the log frees once stored
                archive.close()
            stream, end = gw.streams["s"], gw.streams["s"].log.durable_position
            assert end < RETAIN
            # Without retention the release frees the log; with it, nothing is freed.
            assert gw.streams["plain"].log.release_position == gw.streams["plain"].consumed_position
            assert stream.consumed_position == end
            assert stream.log.release_position == 0
            assert stream.statistics().retained_bytes == end
            # Credit follows the consumed position: the retained bytes take none.
            assert stream.free_capacity == stream.capacity == CAPACITY
            assert await fetch_values(gw.address, 0) == original
            async with Reader(gw.address) as reader:
                assert await reader.reset_consumer("s", "archive", m.ResetTo.EARLIEST) == 0
                replay, _ = await reader.fetch_all("s", 0, consumer="archive")
                assert [
                    v for b in replay for v in record_lists(memoryview(b.records))[0]
                ] == original
                # A new consumer starts at the oldest retained position.
                assert await reader.declare_consumer("s", "late", blocking=False) == 0
            assert positions(gw, "s") == {"archive": 0, "late": 0}
            assert stream.consumed_position == end  # a reset takes no credit back

    run(scenario(), timeout=30)


def test_retained_bytes_never_reduce_the_producers_credit_and_stay_within_the_budget(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        async with gateway(tmp_path, **SETTINGS, streams={"s": retained()}) as gw:
            values = records("v" * 100, 6000)  # about 700 KB: several logs' worth
            sender = asyncio.create_task(produce(gw.address, values))
            archive = Consumer(gw, tmp_path, "s", "archive")
            stream = None
            deadline = time.monotonic() + 40
            while not sender.done() and time.monotonic() < deadline:
                archive.poll()
                stream = gw.streams.get("s")
                if stream is not None:
                    log = stream.log
                    assert log.tail_position - stream.consumed_position <= CAPACITY
                    assert stream.consumed_position - log.release_position <= RETAIN
                    assert log.tail_position - log.release_position <= CAPACITY + RETAIN
                await asyncio.sleep(0.005)
            await sender
            archive.poll()
            await gw.consumers_saved()  # the log frees once stored
            assert stream is not None
            end = stream.log.durable_position
            assert stream.consumed_position == end
            assert 0 < stream.statistics().retained_bytes <= RETAIN
            assert stream.log.release_position > 0, "retention beyond its budget was freed"
            assert stream.free_capacity == stream.capacity
            # With the retention full and nothing released, producers still get
            # (nearly) the whole capacity: about 160 KiB flows without a release,
            # where retention carved out of the capacity would leave less than 100.
            more = records("w" * 100, 1400)
            await asyncio.wait_for(produce(gw.address, more), 20)
            assert stream.log.durable_position - stream.consumed_position > CAPACITY - RETAIN
            assert stream.consumed_position == end
            archive.close()

    run(scenario(), timeout=60)


def test_a_restart_keeps_the_retained_data_and_the_consumed_position(tmp_path: Path) -> None:
    streams = {"s": retained()}
    original = records("r", 1500)

    async def first_life() -> int:
        async with gateway(tmp_path, **SETTINGS, streams=streams) as gw:
            await produce(gw.address, original)
            archive = Consumer(gw, tmp_path, "s", "archive")
            archive.poll()
            await gw.consumers_saved()  # the log frees once stored
            archive.close()
            return gw.streams["s"].log.durable_position

    ends: list[int] = []

    async def life_one() -> None:
        ends.append(await first_life())

    run(life_one(), timeout=30)

    async def second_life() -> None:
        async with gateway(tmp_path, **SETTINGS, streams=streams) as gw:
            stream = gw.stream("s")
            assert stream.log.release_position == 0
            assert stream.consumed_position == ends[0]
            assert stream.free_capacity == CAPACITY
            assert await fetch_values(gw.address, 0) == original

    run(second_life(), timeout=30)


def test_retained_data_older_than_retain_seconds_is_freed(tmp_path: Path) -> None:
    streams = {"s": retained(retain_seconds=1.5)}

    async def scenario() -> None:
        async with gateway(tmp_path, **SETTINGS, streams=streams) as gw:
            await produce(gw.address, records("r", 500))
            archive = Consumer(gw, tmp_path, "s", "archive")
            archive.poll()
            await gw.consumers_saved()  # the log frees once stored
            archive.close()
            stream = gw.streams["s"]
            assert stream.log.release_position == 0 < stream.consumed_position
            await asyncio.sleep(1.7)
            gw.check_consumers(time.monotonic())  # the housekeeping pass
            assert stream.log.release_position == stream.consumed_position

    run(scenario(), timeout=30)


def test_free_position_keeps_the_newest_frames_within_both_limits() -> None:
    # (position, end, timestamp_us): 10 frames of 100 bytes, one a second.
    frames = [(i * 100, (i + 1) * 100, i * 1_000_000) for i in range(10)]
    consumed = 1000
    assert free_position(consumed, Retention(), frames, 0) == consumed
    assert free_position(consumed, Retention(bytes=350), frames, 0) == 700
    assert free_position(consumed, Retention(bytes=5000), frames, 0) == 0
    # Older than 4.5 s at t = 9.5 s: the frames stamped 0..4 s go.
    assert free_position(consumed, Retention(bytes=5000, seconds=4.5), frames, 9_500_000) == 500
    assert free_position(consumed, Retention(bytes=5000, seconds=0.1), frames, 99_000_000) == 1000


def test_retain_seconds_needs_a_byte_budget() -> None:
    config = GatewayConfig(streams={"s": StreamSettings(retain_seconds=60.0)})
    with pytest.raises(ConfigError, match=r"streams.s.retain_seconds needs retain_bytes"):
        config.validate()
    assert GatewayConfig().retention_for("s") == Retention()


def test_a_reload_that_drops_the_retention_frees_the_retained_data(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with gateway(tmp_path, **SETTINGS, streams={"s": retained()}) as gw:
            await produce(gw.address, records("r", 500))
            archive = Consumer(gw, tmp_path, "s", "archive")
            archive.poll()
            await gw.consumers_saved()  # the log frees once stored
            archive.close()
            stream = gw.streams["s"]
            assert stream.log.capacity == CAPACITY + RETAIN
            assert stream.log.release_position == 0 < stream.consumed_position
            plain = dataclasses.replace(retained(), retain_bytes=None)
            gw.reconfigure(dataclasses.replace(gw.config, streams={"s": plain}))
            assert stream.retention == Retention()
            assert stream.log.release_position == stream.consumed_position
            assert stream.log.capacity == stream.capacity == CAPACITY

    run(scenario(), timeout=30)
