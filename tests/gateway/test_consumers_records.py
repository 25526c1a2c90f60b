"""Consumers' lag in records, and a skip consumer's skipped records, exact across kills and frees.

A consumer's lag in records is what the gateway's record index counts
between its committed position and the durable end (see
:mod:`headgate.log.record_index`). The truth here is the frames themselves,
read back before anything is freed: every number the gateway gives must be
their sum, after the log freed terms behind a non-blocking consumer and
after a SIGKILL of ``headgate serve``.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from headgate.client import Producer
from headgate.client.control import ReleaseClient
from headgate.client.reader import Reader, ReaderRefused
from headgate.config import ConsumerSettings, StreamSettings
from headgate.log.record_index import read_marks, record_index_file
from headgate.protocol.errors import ErrorCode
from tests.gateway.test_consumers import freed_to, metrics_text
from tests.helpers import BLOCKING, SMALL, consumers, gateway, record_lists, records, run
from tests.serving import serve, stop

pytestmark = pytest.mark.timeout(120)

T = TypeVar("T")


def ask(coroutine: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
    """Run ``coroutine`` on a fresh event loop, bounded by ``timeout``; its result."""

    async def bounded() -> T:
        async with asyncio.timeout(timeout):
            return await coroutine

    return asyncio.run(bounded())


KiB = 1024


async def frames_of(address: str | tuple[str, int], stream: str) -> list[tuple[int, int]]:
    """``(end_position, record_count)`` of every frame of ``stream``, read back."""
    async with Reader(address) as reader:
        batches, _ = await reader.fetch_all(stream, 0)
    return [(b.header.end_position, len(record_lists(memoryview(b.records))[0])) for b in batches]


async def lags(address: str, stream: str) -> dict[str, int | None]:
    """Each consumer's lag in records, once the stream is open (at most 5 s after a start)."""
    for _ in range(100):
        async with Reader(address) as reader:
            try:
                listed = await reader.list_consumers(stream)
            except ReaderRefused as refused:
                if refused.code != ErrorCode.RECOVERING:
                    raise
            else:
                return {c.consumer: c.lag_records for c in listed}
        await asyncio.sleep(0.05)
    raise AssertionError(f"stream {stream} still recovering after 5 s")


def test_lag_in_records_is_exact_after_freed_terms_and_a_sigkill_and_so_is_the_skip(
    tmp_path: Path,
) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text(
        "[gateway]\nterm_length = 65536\nmax_message_size = 16384\n"
        "[streams.s.consumers.archive]\n"
        '[streams.s.consumers.live]\nblocking = false\non_data_loss = "skip"\n'
    )
    data = tmp_path / "data"
    proc, address = serve(data, "--config", str(config))
    try:

        async def produce(count: int) -> None:
            async with Producer(address, linger_ms=1, max_batch_bytes=700) as p:
                for i, value in enumerate(records("k" * 40, count)):
                    await p.send("s", value)
                    if i % 97 == 0:
                        await p.flush("s")  # batches of uneven record counts
                await p.flush("s")

        run(produce(6000), timeout=60)
        frames = ask(frames_of(address, "s"), timeout=30)
        assert frames[-1][0] > 4 * 65536  # several terms, so that frees delete some
        assert len({n for _, n in frames}) > 3

        def after(position: int) -> int:
            return sum(n for end, n in frames if end > position)

        live_at = frames[len(frames) // 5][0]
        archive_at = frames[4 * len(frames) // 5][0]
        for consumer, position in [("live", live_at), ("archive", archive_at)]:
            with ReleaseClient(address, consumer=consumer) as client:
                client.release("s", position)
                assert client.flush(10)
        # The blocking consumer frees the log past "live": its records there
        # are gone from the log, and still counted.
        run(freed_to(address, "s", archive_at), timeout=10)
        expected = {"archive": after(archive_at), "live": after(live_at)}
        assert expected["live"] > expected["archive"] > 0
        assert ask(lags(address, "s")) == expected
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        stop(proc)

    stored = read_marks(record_index_file(data, "s"))
    assert stored is not None and len(stored.marks) > 0
    proc, address = serve(data, "--config", str(config))
    try:
        assert ask(lags(address, "s")) == expected

        async def skip() -> tuple[int, int | None, int]:
            async with Reader(address) as reader:
                batches, _ = await reader.fetch_all("s", live_at, consumer="live")
                assert reader.last_skipped_bytes is not None
                return (
                    reader.last_skipped_bytes,
                    reader.last_skipped_records,
                    batches[0].header.position,
                )

        skipped_bytes, skipped_records, first = ask(skip())
        assert first == archive_at and skipped_bytes == archive_at - live_at
        # Exactly the records the log freed after "live"'s position, though
        # the gateway that freed them was killed.
        assert skipped_records == after(live_at) - after(archive_at)
    finally:
        stop(proc)


def test_the_lag_in_records_metric_follows_each_release(tmp_path: Path) -> None:
    settings = StreamSettings(
        consumers=consumers(
            main=BLOCKING, tail=ConsumerSettings(blocking=False, on_data_loss="skip")
        ),
    )

    async def scenario() -> None:
        async with (
            gateway(tmp_path, **SMALL, streams={"A": settings}) as gw,
            Producer(gw.address, linger_ms=1, max_batch_bytes=2 * KiB) as p,
        ):
            for value in records("m" * 30, 500):
                await p.send("A", value)
            await p.flush("A")
            frames = await frames_of(gw.address, "A")
            middle = frames[len(frames) // 2][0]
            left = sum(n for end, n in frames if end > middle)
            gw.release("A", middle, "main")
            await gw.consumers_saved()
            text = metrics_text(gw)
            assert (
                f'headgate_consumer_lag_records{{consumer="main",stream="A"}} {float(left)}' in text
            )
            assert 'headgate_consumer_lag_records{consumer="tail",stream="A"} 500.0' in text
            gw.release("A", frames[-1][0], "main")
            await asyncio.sleep(0)
            stats = {c.name: c for c in gw.streams["A"].statistics().consumers}
            assert stats["main"].lag_records == 0 and stats["tail"].lag_records == 500

    run(scenario(), timeout=40)


def test_a_local_spark_read_reports_its_exact_lag_and_skipped_records(tmp_path: Path) -> None:
    """The source's ``_consumer`` progress, planned over the gateway's own data directory.

    Two skips: from an end this query planned (counted while held), and,
    as a restarted driver resumes its checkpoint, from the consumer's
    committed position (the gateway stored its count).
    """
    pytest.importorskip("pyspark")
    from headgate.spark.planning import offset_position
    from headgate.spark.source import HeadgateStreamReader, SourceOptions

    settings = StreamSettings(
        consumers=consumers(
            main=BLOCKING, live=ConsumerSettings(blocking=False, on_data_loss="skip")
        ),
    )

    def source(**extra: str) -> HeadgateStreamReader:
        options = {"path": str(tmp_path), "consumer": "live", "failOnDataLoss": "false"}
        return HeadgateStreamReader(SourceOptions.parse({**options, **extra}))

    async def scenario() -> None:
        async with (
            gateway(tmp_path, **SMALL, streams={"A": settings}) as gw,
            Producer(gw.address, linger_ms=1, max_batch_bytes=700) as p,
        ):
            for i, value in enumerate(records("q" * 40, 3000)):
                await p.send("A", value)
                if i % 89 == 0:
                    await p.flush("A")
            await p.flush("A")
            frames = await frames_of(gw.address, "A")

            def after(position: int) -> int:
                return sum(n for end, n in frames if end > position)

            live_at = frames[len(frames) // 5][0]
            gw.release("A", live_at, "live")
            await gw.consumers_saved()

            first = source(maxRecordsPerTrigger="400")
            try:
                planned = first.latestOffset({"A": live_at}, first.getDefaultReadLimit())
                planned_at = offset_position(planned["A"])
                figures = first.reportLatestOffset()["_consumer"]
                assert figures["lag_records"] == {"A": after(planned_at)}
                assert figures["skipped_records"] == {"A": 0}
                # The blocking consumer frees all of it, more comes in.
                end = frames[-1][0]
                gw.release("A", end, "main")
                await gw.consumers_saved()
                assert gw.streams["A"].log.release_position == end
                for value in records("r", 100):
                    await p.send("A", value)
                await p.flush("A")
                first.latestOffset(planned, first.getDefaultReadLimit())
                figures = first.reportLatestOffset()["_consumer"]
                assert figures["skipped_bytes"] == {"A": end - planned_at}
                assert figures["skipped_records"] == {"A": after(planned_at)}
                assert figures["lag_records"] == {"A": 0}
            finally:
                first.stop()
            restarted = source()
            try:
                restarted.latestOffset({"A": live_at}, restarted.getDefaultReadLimit())
                figures = restarted.reportLatestOffset()["_consumer"]
                assert figures["skipped_bytes"] == {"A": end - live_at}
                assert figures["skipped_records"] == {"A": after(live_at)}
            finally:
                restarted.stop()

    run(scenario(), timeout=40)


def test_count_records_answers_the_index_and_a_spark_read_through_the_gateway_uses_it(
    tmp_path: Path,
) -> None:
    """CountRecords over the wire, and the source's progress planned through ``gateway``."""
    pytest.importorskip("pyspark")
    from headgate.spark.planning import offset_position
    from headgate.spark.source import HeadgateStreamReader, SourceOptions

    config = tmp_path / "gateway.toml"
    config.write_text(
        "[gateway]\nterm_length = 65536\nmax_message_size = 16384\n"
        "[streams.s.consumers.main]\n"
        '[streams.s.consumers.live]\nblocking = false\non_data_loss = "skip"\n'
    )
    proc, address = serve(tmp_path / "data", "--config", str(config))
    try:

        async def produce(values: list[bytes]) -> None:
            async with Producer(address, linger_ms=1, max_batch_bytes=600) as p:
                for i, value in enumerate(values):
                    await p.send("s", value)
                    if i % 83 == 0:
                        await p.flush("s")
                await p.flush("s")

        run(produce(records("c" * 40, 3000)), timeout=60)
        frames = ask(frames_of(address, "s"), timeout=30)

        def after(position: int) -> int:
            return sum(n for end, n in frames if end > position)

        total = after(0)
        ends = [end for end, _ in frames]

        async def count(positions: list[int]) -> tuple[int, tuple[int | None, ...]]:
            async with Reader(address) as reader:
                return await reader.count_records("s", positions)

        picked = [0, *ends[:: len(ends) // 20], ends[-1]]
        epoch, counts = ask(count(picked))
        assert epoch > 0
        assert counts == tuple(total - after(p) for p in picked)
        assert ask(count([ends[3] + 8]))[1] == (None,)  # inside a frame: not countable

        live_at = ends[len(ends) // 4]
        with ReleaseClient(address, consumer="live") as client:
            client.release("s", live_at)
            assert client.flush(10)

        def source(**extra: str) -> HeadgateStreamReader:
            options = {"gateway": address, "consumer": "live", "failOnDataLoss": "false"}
            return HeadgateStreamReader(SourceOptions.parse({**options, **extra}))

        first = source(maxRecordsPerTrigger="300")
        try:
            planned = first.latestOffset({"s": live_at}, first.getDefaultReadLimit())
            planned_at = offset_position(planned["s"])
            figures = first.reportLatestOffset()["_consumer"]
            assert figures["lag_records"] == {"s": after(planned_at)}
            with ReleaseClient(address, consumer="main") as client:
                client.release("s", ends[-1])
                assert client.flush(10)
            run(freed_to(address, "s", ends[-1]), timeout=10)
            # Freed: only the counts kept (the consumer's) reach live_at now.
            assert ask(count([live_at]))[1] == (total - after(live_at),)
            run(produce(records("d", 40)), timeout=30)
            first.latestOffset(planned, first.getDefaultReadLimit())
            figures = first.reportLatestOffset()["_consumer"]
            assert figures["skipped_records"] == {"s": after(planned_at)}
        finally:
            first.stop()
        restarted = source()
        try:
            restarted.latestOffset({"s": live_at}, restarted.getDefaultReadLimit())
            figures = restarted.reportLatestOffset()["_consumer"]
            assert figures["skipped_bytes"] == {"s": ends[-1] - live_at}
            assert figures["skipped_records"] == {"s": after(live_at)}
            assert figures["lag_records"] == {"s": 0}
        finally:
            restarted.stop()
    finally:
        stop(proc)
