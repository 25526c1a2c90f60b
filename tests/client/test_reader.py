"""The reader library against a real gateway on 127.0.0.1: fetch, list, tail.

Producers write with the producer library; the reader reads back through the
gateway and every record is checked against what the log itself holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from headgate.client import Producer, ReleaseClient
from headgate.client.reader import MissedBatches, Reader, ReaderError, SyncReader, TailBatch
from headgate.config import GatewayConfig
from headgate.gateway import Gateway
from headgate.log import LogReader
from headgate.protocol import messages as m
from headgate.protocol.records import decode_records

pytestmark = pytest.mark.timeout(60)

KiB = 1024


@contextlib.asynccontextmanager
async def gateway(data_dir: Path, **settings: Any) -> AsyncIterator[Gateway]:
    base: dict[str, Any] = dict(
        term_length=64 * KiB, max_message_size=16 * KiB, group_commit_interval_ms=1.0
    )
    base.update(settings)
    gw = Gateway(GatewayConfig(listen=("127.0.0.1", 0), data_dir=data_dir, **base))
    await gw.start()
    try:
        yield gw
    finally:
        await gw.stop()


def address(gw: Gateway) -> str:
    return f"{gw.address[0]}:{gw.address[1]}"


async def produce(gw: Gateway, stream: str, count: int, *, producer_id: int = 7) -> None:
    async with Producer(address(gw), producer_id=producer_id, max_batch_bytes=1024) as producer:
        for i in range(count):
            await producer.send(stream, b"value-%06d" % i, key=b"k%d" % (i % 3))
        await producer.flush()


def values(batches: list[TailBatch]) -> list[bytes]:
    out: list[bytes] = []
    for batch in batches:
        out += decode_records(batch.records).to_lists()[0]
    return out


async def test_fetch_returns_every_frame_with_its_header_exactly(tmp_path: Path) -> None:
    async with gateway(tmp_path / "d") as gw:
        await produce(gw, "orders", 3000)
        async with Reader(address(gw)) as reader:
            batches, next_position = await reader.fetch_all("orders", 0)
        with LogReader.open(tmp_path / "d" / "streams" / "orders") as log:
            frames = log.read(0)
            assert len(frames) > 10

            def fields(f: Any) -> tuple[int, ...]:
                names = "position end_position producer_id first_sequence record_count"
                return tuple(getattr(f, n) for n in [*names.split(), "timestamp_us"])

            assert [fields(b.to_frame()) for b in batches] == [fields(f) for f in frames]
            assert [b.records for b in batches] == [bytes(f.payload) for f in frames]
            assert next_position == frames[-1].end_position
        assert values(batches) == [b"value-%06d" % i for i in range(3000)]
        assert all(b.header.producer_id == 7 for b in batches)


async def test_fetch_stops_at_max_bytes_and_resumes_where_it_said(tmp_path: Path) -> None:
    async with gateway(tmp_path / "d") as gw:
        await produce(gw, "s", 2000)
        async with Reader(address(gw)) as reader:
            (info,) = await reader.list_streams()
            got: list[TailBatch] = []
            position, rounds = 0, 0
            while position < info.durable_position and rounds < 1000:
                batches, position = await reader.fetch_all(
                    "s", position, info.durable_position, max_bytes=4 * KiB
                )
                assert batches, "a fetch with a limit still returns one batch"
                assert batches[-1].end_position - batches[0].position <= 4 * KiB or (
                    len(batches) == 1
                )
                got += batches
                rounds += 1
            assert rounds > 3
            assert position == info.durable_position
            assert values(got) == [b"value-%06d" % i for i in range(2000)]


async def test_list_streams_reports_positions_and_term_length(tmp_path: Path) -> None:
    async with gateway(tmp_path / "d") as gw:
        await produce(gw, "b", 10)
        await produce(gw, "a", 10, producer_id=8)
        async with Reader(address(gw)) as reader:
            infos = await reader.list_streams()
        assert [i.stream for i in infos] == ["a", "b"]
        for info in infos:
            log = gw.streams[info.stream].log
            assert info.start_position == log.release_position == 0
            assert info.durable_position == log.durable_position > 0
            assert info.tail_position == log.tail_position
            assert info.term_length == 64 * KiB


async def test_describe_streams_says_when_a_release_last_moved_each_stream(
    tmp_path: Path,
) -> None:
    async with gateway(tmp_path / "d") as gw:
        await produce(gw, "a", 300)
        await produce(gw, "b", 10, producer_id=8)
        async with Reader(address(gw)) as reader:
            listed = await reader.list_streams()
            described = await reader.describe_streams()
        # The same positions as ListStreams, and no release since the gateway started.
        assert [d.info for d in described] == listed
        assert [d.released_at_us for d in described] == [0, 0]
        with LogReader.open(tmp_path / "d" / "streams" / "a") as log:
            first, second = (f.end_position for f in log.read(0)[:2])

        def release_over_the_wire(position: int) -> None:
            with ReleaseClient(address(gw)) as client:
                client.release("a", position)
                assert client.flush(10)

        before = time.time_ns() // 1000
        await asyncio.to_thread(release_over_the_wire, first)
        after = time.time_ns() // 1000
        await gw.consumers_saved()  # the log frees once the position is stored
        async with Reader(address(gw)) as reader:
            a, b = await reader.describe_streams()
        assert a.info.start_position == first
        assert before <= a.released_at_us <= after
        assert b.released_at_us == 0  # its consumer never released it
        # A Release that moves nothing (the same position, or behind it) is not news.
        await asyncio.sleep(0.01)
        gw.release("a", first)
        gw.release("a", 0)
        async with Reader(address(gw)) as reader:
            assert (await reader.describe_streams())[0].released_at_us == a.released_at_us
        gw.release("a", second)
        await gw.consumers_saved()
        async with Reader(address(gw)) as reader:
            moved = (await reader.describe_streams())[0]
        assert moved.info.start_position == second
        assert moved.released_at_us > a.released_at_us


async def test_a_slow_fetcher_holds_the_gateway_to_its_guarantees(tmp_path: Path) -> None:
    """The gateway sends no more than the reader's buffer until it takes batches."""
    async with gateway(tmp_path / "d") as gw:
        await produce(gw, "s", 5000)
        buffer = 8 * KiB
        async with Reader(address(gw), buffer_bytes=buffer) as reader:
            batches = reader.fetch("s", 0)
            first = await anext(batches)
            await asyncio.sleep(0.3)  # the reader takes nothing meanwhile
            (conn,) = [c for c in gw.connections.values() if c.readers._jobs]
            job = conn.readers._jobs[0]
            assert job.cursor < job.end, "the fetch must wait for guarantees, not finish"
            waiting = reader._fetch_channels["s"].items
            assert 0 < sum(size for _, size in waiting) <= buffer
            rest = [b async for b in batches]
        assert values([first, *rest]) == [b"value-%06d" % i for i in range(5000)]


async def test_fetch_of_a_bad_range_or_stream_is_a_clear_error(tmp_path: Path) -> None:
    async with gateway(tmp_path / "d") as gw:
        await produce(gw, "s", 10)
        cases = [
            ("nope", 0, "no stream called 'nope'"),
            ("s", 10**9, r"cannot read \[1000000000, "),
            ("s", 8, "cannot fetch from position 8"),
        ]
        for stream, start, why in cases:
            async with Reader(address(gw)) as reader:
                with pytest.raises(ReaderError, match=f"gateway {address(gw)} refused: .*{why}"):
                    await reader.fetch_all(stream, start)


async def test_connecting_to_nothing_names_the_address(tmp_path: Path) -> None:
    async with gateway(tmp_path / "d") as gw:
        where = address(gw)
    with pytest.raises(ReaderError, match=f"cannot connect to gateway {where}"):
        await Reader(where, connect_timeout=2).connect()
    with pytest.raises(ReaderError, match="port"):
        Reader("127.0.0.1:notaport")


def test_sync_reader_fetches_without_an_event_loop(tmp_path: Path) -> None:
    from headgate.cli.demo import BackgroundLoop

    loop = BackgroundLoop("gw")
    gw = Gateway(
        GatewayConfig(
            listen=("127.0.0.1", 0),
            data_dir=tmp_path / "d",
            term_length=64 * KiB,
            max_message_size=16 * KiB,
            group_commit_interval_ms=1.0,
        )
    )
    loop.run(gw.start(), 30)
    try:
        loop.run(produce(gw, "s", 500), 30)
        with SyncReader(address(gw)) as reader:
            (info,) = reader.list_streams()
            got = list(reader.fetch("s", 0, info.durable_position))
            assert values(got) == [b"value-%06d" % i for i in range(500)]
            # Stopping half-way leaves the reader usable.
            iterator = reader.fetch("s", 0)
            assert next(iterator).position == 0
            iterator.close()
            assert len(list(reader.fetch("s", 0))) == len(got)
    finally:
        loop.run(gw.stop(), 30)
        loop.stop()


def test_a_sync_reader_reconnects_only_after_half_the_idle_timeout(tmp_path: Path) -> None:
    """Between calls nothing Pings; a call past half the idle timeout opens a new
    connection first (the gateway may have closed the old one as idle)."""
    from headgate.cli.demo import BackgroundLoop

    loop = BackgroundLoop("gw")
    gw = Gateway(
        GatewayConfig(listen=("127.0.0.1", 0), data_dir=tmp_path / "d", idle_timeout_ms=600)
    )
    loop.run(gw.start(), 30)
    try:
        with SyncReader(address(gw)) as reader:
            assert reader.list_streams() == []
            time.sleep(0.05)
            assert reader.list_streams() == []
            assert reader.reconnects == 0
            time.sleep(0.35)  # past half of 0.6 s, within it
            assert reader.list_streams() == []
            assert reader.reconnects == 1
    finally:
        loop.run(gw.stop(), 30)
        loop.stop()


# --- live tail -----------------------------------------------------------------------


async def take(
    sub: AsyncIterator[TailBatch | MissedBatches], n: int, timeout: float = 10
) -> list[Any]:
    out: list[Any] = []
    async with asyncio.timeout(timeout):
        while len(out) < n:
            out.append(await anext(sub))
    return out


async def wait_for(condition: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def subscription_of(gw: Gateway, stream: str) -> Any:
    (sub,) = gw.tails.subscriptions[stream]
    return sub


async def test_a_subscriber_receives_new_records(tmp_path: Path) -> None:
    async with gateway(tmp_path / "d") as gw:
        await produce(gw, "s", 100)  # history a subscription from now does not see
        async with Reader(address(gw)) as reader:
            sub = reader.subscribe("s")
            await wait_for(lambda: "s" in gw.tails.subscriptions)
            await produce(gw, "s", 50, producer_id=9)
            batches: list[Any] = []
            while sum(b.record_count for b in batches) < 50:
                batches += await take(sub, 1)
            assert all(isinstance(b, TailBatch) for b in batches)
            assert values(batches) == [b"value-%06d" % i for i in range(50)]
            assert all(b.header.producer_id == 9 for b in batches)


async def test_tail_from_earliest_and_from_a_position(tmp_path: Path) -> None:
    async with gateway(tmp_path / "d") as gw:
        await produce(gw, "s", 300)
        async with Reader(address(gw)) as reader:
            stored, _ = await reader.fetch_all("s", 0)
            everything = await take(reader.subscribe("s", m.StartAt.EARLIEST), len(stored))
            assert values(everything) == values(stored)
            half = len(stored) // 2
            later = await take(reader.subscribe("s", stored[half].position), len(stored) - half)
            assert [b.position for b in later] == [b.position for b in stored[half:]]
            sampled = reader.subscribe("s", m.StartAt.EARLIEST, sample_every=3)
            got = await take(sampled, len(stored[::3]))
            assert [b.position for b in got] == [b.position for b in stored[::3]]


def has_guarantees(gw: Gateway, stream: str) -> bool:
    """Whether the subscriber's guarantees reached the gateway."""
    if stream not in gw.tails.subscriptions:
        return False
    tail = subscription_of(gw, stream)
    if tail.handle is None:
        return False
    session = tail.owner._session
    return bool(session.outbound(m.data_channel(tail.handle)).guarantees > 0)


async def timed_produce(gw: Gateway, count: int, producer_id: int) -> float:
    started = time.monotonic()
    await produce(gw, "s", count, producer_id=producer_id)
    return time.monotonic() - started


async def test_a_stalled_subscriber_gets_missed_counts_and_never_slows_the_producer(
    tmp_path: Path,
) -> None:
    async with gateway(tmp_path / "d", stream_capacity=16 * 1024 * KiB) as gw:
        await produce(gw, "s", 1)  # the stream exists
        without_tail = await timed_produce(gw, 10000, 10)
        async with Reader(address(gw), buffer_bytes=4 * KiB) as reader:
            sub = reader.subscribe("s")
            await wait_for(lambda: has_guarantees(gw, "s"))
            before = gw.streams["s"].appended_batches
            with_tail = await timed_produce(gw, 10000, 11)
            appended = gw.streams["s"].appended_batches - before
            tail = subscription_of(gw, "s")
            # The subscriber took nothing: the gateway skipped and counted.
            assert tail.delivered_total + tail.missed_total == appended
            assert 0 < tail.delivered_total < appended // 4
            delivered, missed = tail.delivered_total, tail.missed_total
            # It gets what it was sent, each batch after a MissedBatches with the count
            # skipped before it; reading again, it gets new batches.
            await produce(gw, "s", 10, producer_id=12)
            items: list[Any] = []
            while (
                not items
                or not isinstance(items[-1], TailBatch)
                or (items[-1].header.producer_id != 12)
            ):
                items += await take(sub, 1)
                assert len(items) < 3 * appended
            before_new = items[:-1]
            batches = [i for i in before_new if isinstance(i, TailBatch)]
            assert len(batches) == delivered
            assert sum(i.count for i in before_new if isinstance(i, MissedBatches)) == missed
            assert all(b.header.producer_id == 11 for b in batches)
        # Ingestion did not wait for the stalled subscriber (generous: shared CPU).
        assert with_tail < 2 * without_tail + 1.0


async def test_subscribing_to_an_unknown_stream_is_a_clear_error(tmp_path: Path) -> None:
    async with gateway(tmp_path / "d") as gw, Reader(address(gw)) as reader:
        with pytest.raises(ReaderError, match="no stream called 'ghost'"):
            await take(reader.subscribe("ghost"), 1)


async def test_history_released_under_a_catching_up_subscriber_is_reported_missed(
    tmp_path: Path,
) -> None:
    async with gateway(tmp_path / "d") as gw:
        await produce(gw, "s", 3000)
        async with Reader(address(gw), buffer_bytes=4 * KiB) as reader:
            sub = reader.subscribe("s", m.StartAt.EARLIEST)
            await wait_for(lambda: has_guarantees(gw, "s") or bool(reader._by_handle))
            await asyncio.sleep(0.2)  # it got what its buffer holds, and took nothing
            tail = subscription_of(gw, "s")
            assert not tail.live and tail.delivered_total > 0
            sent = tail.delivered_total
            log = gw.streams["s"].log
            await wait_for(lambda: log.durable_position == log.tail_position)
            gw.release("s", log.durable_position)  # Spark is done with all of it
            await gw.consumers_saved()  # the log frees what is saved
            await produce(gw, "s", 5, producer_id=21)
            items: list[Any] = []
            while not (
                items and isinstance(items[-1], TailBatch) and items[-1].header.producer_id == 21
            ):
                items += await take(sub, 1)
                assert len(items) < sent + 10
            assert [type(i) for i in items[:sent]] == [TailBatch] * sent
            assert items[sent] == MissedBatches(1)  # some batches, count unknown
            assert values(items[sent + 1 :]) == [b"value-%06d" % i for i in range(5)]


async def test_a_gateway_stopping_ends_a_subscription_with_a_clear_error(tmp_path: Path) -> None:
    gw = Gateway(
        GatewayConfig(
            listen=("127.0.0.1", 0),
            data_dir=tmp_path / "d",
            term_length=64 * KiB,
            max_message_size=16 * KiB,
        )
    )
    await gw.start()
    try:
        await produce(gw, "s", 1)
        reader = Reader(address(gw))
        await reader.connect()
        sub = reader.subscribe("s")
        await wait_for(lambda: "s" in gw.tails.subscriptions)
    finally:
        await gw.stop()
    with pytest.raises(ReaderError, match="closed the connection: gateway stopping"):
        await take(sub, 1)
    await reader.close()
