"""Named consumers per stream, against a real gateway on 127.0.0.1 and real files.

A consumer is played as Spark plays it: read the durable log by position,
keep what was read, and Release the position (``Gateway.release`` in
process, a ``ReleaseClient`` or a Reader over the wire). The slowest
*blocking* consumer decides what the log frees, and so the producers'
credit; a non-blocking one decides nothing, and gets what it asked for
when it falls behind; an idle blocking one is held to or detached; and
every consumer's position survives a SIGKILL of ``headgate serve``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from headgate.client import Producer
from headgate.client.control import ReleaseClient
from headgate.client.reader import Reader, ReaderRefused
from headgate.client.security import ClientSecurity
from headgate.config import (
    ConfigError,
    ConsumerSettings,
    GatewayConfig,
    StreamSettings,
    load_gateway_config,
)
from headgate.gateway import Gateway
from headgate.gateway.consumers import ConsumerBook, consumers_file
from headgate.gateway.metrics import GatewayCollector
from headgate.protocol import messages as m
from headgate.protocol.errors import ErrorCode, ProtocolError
from tests.gateway._tokens import Token, write_tokens
from tests.helpers import (
    BLOCKING,
    SMALL,
    Consumer,
    RawPeer,
    consumers,
    gateway,
    positions,
    record_lists,
    records,
    run,
    values_in_order,
)
from tests.serving import serve, stop

pytestmark = pytest.mark.timeout(90)

KiB = 1024
CAPACITY = 256 * KiB


def stored(data_dir: Path, stream: str) -> dict[str, dict[str, Any]]:
    raw = json.loads(consumers_file(data_dir, stream).read_text())
    return {c["name"]: c for c in raw["consumers"]}


# --- blocking consumers: the slowest throttles -----------------------------------------


def test_two_blocking_consumers_the_slow_one_throttles_and_the_log_is_freed_to_the_minimum(
    tmp_path: Path,
) -> None:
    settings = StreamSettings(capacity=CAPACITY, consumers=consumers(fast=BLOCKING, slow=BLOCKING))

    async def scenario() -> None:
        async with (
            gateway(tmp_path, **SMALL, streams={"A": settings}) as gw,
            Producer(gw.address, linger_ms=1, max_batch_bytes=4 * KiB) as p,
        ):
            values = records("v" * 100, 8000)  # about 900 KB: 3.5 logs' worth

            async def sender() -> None:
                for value in values:
                    await p.send("A", value)
                await p.flush("A")

            task = asyncio.create_task(sender())
            fast = Consumer(gw, tmp_path, "A", "fast")
            slow = Consumer(gw, tmp_path, "A", "slow")
            for _ in range(120):  # 1.2 s: only the fast one reads
                fast.poll()
                await asyncio.sleep(0.01)
            stream = gw.streams["A"]
            # The slow one holds the log: nothing freed, the producer waits.
            assert not task.done()
            assert fast.position > 0
            assert positions(gw, "A") == {"fast": fast.position, "slow": 0}
            assert stream.log.release_position == 0
            assert stream.log.tail_position <= CAPACITY
            ages = {
                c.name: c.lag_seconds for c in stream.statistics(time.time_ns() // 1000).consumers
            }
            assert ages["slow"] is not None and ages["slow"] >= 1.0
            assert ages["fast"] is not None and ages["fast"] < ages["slow"]
            # Credit follows the minimum exactly: what the writers may still
            # send fits what the slow consumer left free.
            assert stream.outstanding() <= stream.log.free_capacity
            # The slow one commits a little: the log is freed to it, not further.
            slow.poll(max_bytes=8 * KiB)
            assert 0 < slow.position < fast.position
            # The log frees once the positions are stored (off the loop).
            assert stream.log.release_position == 0
            await gw.consumers_saved()
            assert stream.log.release_position == slow.position
            # Both keep reading: the producer finishes, both outputs are whole.
            while not task.done():
                fast.poll()
                slow.poll()
                await gw.consumers_saved()
                assert stream.log.release_position == min(fast.position, slow.position)
                await asyncio.sleep(0.01)
            await task
            await asyncio.sleep(0.05)
            fast.poll()
            slow.poll()
            assert values_in_order(fast.frames, p.producer_id) == values
            assert values_in_order(slow.frames, p.producer_id) == values
            fast.close()
            slow.close()

    run(scenario(), timeout=40)


# --- non-blocking consumers --------------------------------------------------------


@pytest.mark.parametrize("on_data_loss", ["fail", "skip"])
def test_a_stalled_non_blocking_consumer_does_not_slow_producers_and_gets_its_outcome(
    tmp_path: Path, on_data_loss: str
) -> None:
    settings = StreamSettings(
        capacity=CAPACITY,
        consumers=consumers(
            main=BLOCKING, live=ConsumerSettings(blocking=False, on_data_loss=on_data_loss)
        ),
    )

    async def scenario() -> None:
        async with (
            gateway(tmp_path, **SMALL, streams={"A": settings}) as gw,
            Producer(gw.address, linger_ms=1, max_batch_bytes=4 * KiB) as p,
        ):
            values = records("v" * 100, 8000)

            async def sender() -> None:
                for value in values:
                    await p.send("A", value)
                await p.flush("A")

            task = asyncio.create_task(sender())
            main = Consumer(gw, tmp_path, "A", "main")
            await main.run_until(task)  # "live" never reads nor releases
            await task
            await gw.consumers_saved()
            stream = gw.streams["A"]
            oldest = stream.log.release_position
            assert oldest > CAPACITY  # the log freed what "live" had not read
            assert positions(gw, "A")["live"] == 0
            main.close()
            # More than "main" has read: what the log holds now.
            extra = records("w", 50)
            for value in extra:
                await p.send("A", value)
            await p.flush("A")
            assert stream.log.release_position == oldest

            async with Reader(gw.address) as reader:
                if on_data_loss == "fail":
                    with pytest.raises(ReaderRefused) as refused:
                        await reader.fetch_all("A", 0, consumer="live")
                    assert refused.value.code == ErrorCode.DATA_LOST
                    assert f"read from 0, but the log holds from {oldest}" in str(refused.value)
                else:
                    batches, end = await reader.fetch_all("A", 0, consumer="live")
                    assert reader.last_skipped_bytes == oldest
                    assert reader.last_skipped_records == len(values)  # every one freed
                    assert batches[0].header.position == oldest
                    assert end == stream.log.durable_position
                    got = [v for b in batches for v in record_lists(memoryview(b.records))[0]]
                    assert got == extra
                    # Reading on from where it is now skips nothing more.
                    await reader.fetch_all("A", end, consumer="live")
                    assert reader.last_skipped_bytes == 0
                    assert reader.last_skipped_records == 0
                    stats = {c.name: c for c in stream.statistics().consumers}
                    assert stats["live"].skipped_bytes == oldest
                    assert stats["live"].skipped_records == len(values)
                    assert not stats["live"].blocking
                    text = metrics_text(gw)
                    assert (
                        f'headgate_consumer_skipped_bytes_total{{consumer="live",stream="A"}} '
                        f"{float(oldest)}" in text
                    )
                    # A fetch without a consumer keeps the old rule (no skipping).
                    with pytest.raises(ReaderRefused):
                        await reader.fetch_all("A", 0)

    run(scenario(), timeout=40)


def metrics_text(gw: Gateway) -> str:
    from prometheus_client import generate_latest
    from prometheus_client.registry import CollectorRegistry

    registry = CollectorRegistry()
    registry.register(GatewayCollector(gw.snapshot))
    return generate_latest(registry).decode()


def test_a_non_blocking_consumer_keeps_the_rate_of_the_producers(tmp_path: Path) -> None:
    """The same load, with and without a stalled non-blocking consumer: no slower with it."""

    async def timed(data_dir: Path, named: dict[str, ConsumerSettings]) -> float:
        settings = StreamSettings(capacity=CAPACITY, consumers=tuple(named.items()))
        async with (
            gateway(data_dir, **SMALL, streams={"A": settings}) as gw,
            Producer(gw.address, linger_ms=1, max_batch_bytes=4 * KiB) as p,
        ):
            loop = asyncio.get_running_loop()
            started = loop.time()

            async def sender() -> None:
                for value in records("v" * 100, 6000):
                    await p.send("A", value)
                await p.flush("A")

            task = asyncio.create_task(sender())
            main = Consumer(gw, data_dir, "A", "main")
            await main.run_until(task)
            await task
            main.close()
            return loop.time() - started

    async def scenario() -> None:
        alone = await timed(tmp_path / "alone", {"main": BLOCKING})
        stalled = ConsumerSettings(blocking=False)
        beside = await timed(tmp_path / "beside", {"main": BLOCKING, "stalled": stalled})
        # A consumer that held producers back would stop them for good here.
        assert beside < max(3 * alone, alone + 1.0), (alone, beside)

    run(scenario(), timeout=60)


# --- refused releases ----------------------------------------------------------------


@pytest.mark.parametrize("case", ["unknown consumer", "beyond the tail", "inside a frame"])
def test_a_refused_release_is_a_clear_error_and_moves_no_consumer(
    tmp_path: Path, case: str
) -> None:
    settings = StreamSettings(consumers=consumers(a=BLOCKING, b=BLOCKING))

    async def scenario() -> None:
        async with gateway(tmp_path, **SMALL, streams={"s": settings}) as gw:
            async with Producer(gw.address, linger_ms=1) as p:
                for value in records("x", 200):
                    await p.send("s", value)
                await p.flush("s")
            log = gw.streams["s"].log
            first = log.read(0, log.durable_position)[0]
            gw.release("s", first.end_position, "a")
            await gw.consumers_saved()
            before = positions(gw, "s")
            on_disk = stored(tmp_path, "s")
            consumer, position, code = {
                "unknown consumer": ("nobody", first.end_position, ErrorCode.UNKNOWN_CONSUMER),
                "beyond the tail": ("b", log.tail_position + 4096, ErrorCode.UNEXPECTED_FRAME),
                "inside a frame": ("b", first.position + 8, ErrorCode.UNEXPECTED_FRAME),
            }[case]
            peer = RawPeer(producer_id=9)
            await peer.connect(gw.address)
            peer.session.send_global(m.Release(stream="s", position=position, consumer=consumer))
            await peer.send()
            for _ in range(100):
                if peer.closed or peer.errors():
                    break
                await peer.pump(0.02)
            (error,) = peer.errors()
            assert error.code == code
            assert "stream s" in error.text and repr(consumer) in error.text
            if case == "unknown consumer":
                assert "it has: a, b" in error.text
            assert positions(gw, "s") == before
            assert stored(tmp_path, "s") == on_disk
            assert log.release_position == 0  # b holds it

    run(scenario(), timeout=20)


def test_releases_and_declares_need_admin_or_a_matching_consume_pattern(tmp_path: Path) -> None:
    tokens = write_tokens(
        tmp_path / "tokens.toml",
        Token("ingest", "w" * 32, write=("*",)),
        Token("archiver", "c" * 32, read=("*",), consume=("s/archive",)),
        Token("ops", "o" * 32, admin=True),
    )
    settings = StreamSettings(consumers=consumers(archive=BLOCKING, other=BLOCKING))

    async def scenario() -> None:
        async with gateway(
            tmp_path / "data", **SMALL, auth_file=tokens, streams={"s": settings}
        ) as gw:
            security = ClientSecurity(token=b"w" * 32)
            async with Producer(gw.address, linger_ms=1, security=security) as p:
                for value in records("x", 50):
                    await p.send("s", value)
                await p.flush("s")
            end = gw.streams["s"].log.durable_position
            for secret, consumer in [(b"c" * 32, "other"), (b"w" * 32, "archive")]:
                async with Reader(gw.address, security=ClientSecurity(token=secret)) as reader:
                    await reader.release("s", end, consumer)
                    with pytest.raises(ReaderRefused) as refused:
                        await reader.list_streams()
                    assert refused.value.code == ErrorCode.FORBIDDEN
                    assert f"may not release consumer {consumer!r} of stream 's'" in str(
                        refused.value
                    )
            assert positions(gw, "s") == {"archive": 0, "other": 0}
            # The pattern's consumer: its Release and its DeclareConsumer pass.
            async with Reader(gw.address, security=ClientSecurity(token=b"c" * 32)) as reader:
                await reader.release("s", end, "archive")
                assert await reader.declare_consumer("s", "archive") == end
                with pytest.raises(ReaderRefused) as refused:
                    await reader.declare_consumer("s", "backfill")
                assert refused.value.code == ErrorCode.FORBIDDEN
            assert positions(gw, "s") == {"archive": end, "other": 0}
            # Admin declares any consumer at run time; it starts at the oldest held
            # position and is stored at once.
            async with Reader(gw.address, security=ClientSecurity(token=b"o" * 32)) as reader:
                assert await reader.declare_consumer("s", "backfill", blocking=False) == 0
                with pytest.raises(ReaderRefused) as refused:
                    await reader.declare_consumer("s", "backfill", blocking=True)
                assert "exists with blocking=false" in str(refused.value)
            assert stored(tmp_path / "data", "s")["backfill"]["blocking"] is False

    run(scenario(), timeout=20)


# --- idle consumers ----------------------------------------------------------------


def test_an_idle_blocking_consumer_is_detached_and_the_stream_flows_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = StreamSettings(
        capacity=CAPACITY,
        consumers=consumers(main=BLOCKING, abandoned=BLOCKING),
        idle_release_seconds=0.5,
        idle_policy="detach",
    )

    async def scenario() -> None:
        async with (
            gateway(tmp_path, **SMALL, streams={"A": settings}) as gw,
            Producer(gw.address, linger_ms=1, max_batch_bytes=4 * KiB) as p,
        ):
            values = records("v" * 100, 8000)

            async def sender() -> None:
                for value in values:
                    await p.send("A", value)
                await p.flush("A")

            task = asyncio.create_task(sender())
            main = Consumer(gw, tmp_path, "A", "main")
            await main.run_until(task)  # would never end if "abandoned" kept blocking
            await task
            main.close()
            assert values_in_order(main.frames, p.producer_id) == values
            stats = {c.name: c for c in gw.streams["A"].statistics().consumers}
            assert not stats["abandoned"].blocking and stats["abandoned"].detached
            assert stats["abandoned"].detached_total == 1
            assert stats["main"].blocking
            assert stored(tmp_path, "A")["abandoned"]["detached"] is True
            text = metrics_text(gw)
            assert 'headgate_consumer_detached_total{consumer="abandoned",stream="A"} 1.0' in text
            assert 'headgate_consumer_blocking{consumer="abandoned",stream="A"} 0.0' in text
            assert 'headgate_consumer_lag_bytes{consumer="main",stream="A"} 0.0' in text
            assert 'headgate_consumer_lag_seconds{consumer="main",stream="A"} 0.0' in text
            assert stats["abandoned"].lag_seconds is None  # statistics() without a clock

    with caplog.at_level(logging.WARNING, logger="headgate.gateway"):
        run(scenario(), timeout=40)
    detached = [r for r in caplog.records if "abandoned" in r.getMessage()]
    assert len(detached) == 1 and "detached" in detached[0].getMessage()


def test_the_idle_rule_holds_warns_once_per_spell_and_is_a_function_of_time(
    tmp_path: Path,
) -> None:
    """``hold``: producers keep waiting; the consumer is reported once, until it moves."""
    book = ConsumerBook.load(
        "s",
        tmp_path / "s.consumers.json",
        release_position=0,
        tail_position=4096,
        declared={"a": BLOCKING, "b": BLOCKING},
    )
    a, b = book.consumers["a"], book.consumers["b"]
    assert book.idle(100.0, 5.0, "hold", durable=4096) == []  # starts the clocks
    assert book.idle(104.9, 5.0, "hold", durable=4096) == []
    (action,) = [x for x in book.idle(105.0, 5.0, "hold", durable=4096) if x.consumer is a]
    assert action.policy == "hold" and action.idle_for == 5.0
    assert a.idle and a.blocking and book.floor() == 0
    assert [x.consumer for x in book.idle(200.0, 5.0, "hold", durable=4096)] == []  # once
    book.commit(a, 4096, now=201.0)  # caught up: no longer idle, never idle while caught up
    assert not a.idle
    assert [x.consumer for x in book.idle(300.0, 5.0, "hold", durable=4096)] == []
    assert b.idle  # b never moved: still reported as holding producers


# --- crashes, restarts and old data directories ---------------------------------------


def test_a_sigkilled_gateway_keeps_every_consumers_position(tmp_path: Path) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text(
        "[gateway]\nterm_length = 65536\nmax_message_size = 16384\n"
        "[streams.s.consumers.archive]\n"
        '[streams.s.consumers.live]\nblocking = false\non_data_loss = "skip"\n'
    )
    data = tmp_path / "data"
    proc, address = serve(data, "--config", str(config))
    try:

        async def produce() -> None:
            async with Producer(address, linger_ms=1, max_batch_bytes=1024) as p:
                for value in records("k" * 50, 2000):
                    await p.send("s", value)
                await p.flush("s")

        run(produce(), timeout=30)

        async def read_positions() -> list[int]:
            async with Reader(address) as reader:
                batches, _ = await reader.fetch_all("s", 0)
            return [b.header.end_position for b in batches]

        ends: list[int] = []

        async def fetch() -> None:
            ends.extend(await read_positions())

        run(fetch(), timeout=30)
        archive_at, live_at = ends[len(ends) // 3], ends[2 * len(ends) // 3]
        for consumer, position in [("live", live_at), ("archive", archive_at)]:
            with ReleaseClient(address, consumer=consumer) as client:
                client.release("s", position)
                assert client.flush(10)
        # Killed as soon as the log is freed to archive's position: the save
        # that allowed it (holding live's position too) is on disk by then.
        run(freed_to(address, "s", archive_at), timeout=10)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        stop(proc)

    async def reopened() -> None:
        cfg = load_gateway_config(config, listen=("127.0.0.1", 0), data_dir=data)
        gw = Gateway(cfg)
        await gw.start()
        try:
            stream = gw.stream("s")
            assert positions(gw, "s") == {"archive": archive_at, "live": live_at}
            assert stream.log.release_position <= archive_at
            # Releasing on frees to the blocking consumer, not the other.
            gw.release("s", ends[-1], "live")
            assert stream.log.release_position == archive_at
        finally:
            await gw.stop()

    run(reopened(), timeout=30)


def test_releases_in_quick_succession_then_a_sigkill_keep_every_position_that_freed_space(
    tmp_path: Path,
) -> None:
    """Releases are stored off the loop and coalesced: a kill loses none that freed the log."""
    config = tmp_path / "gateway.toml"
    config.write_text(
        "[gateway]\nterm_length = 65536\nmax_message_size = 16384\n[streams.s.consumers.archive]\n"
    )
    data = tmp_path / "data"
    proc, address = serve(data, "--config", str(config))
    ends: list[int] = []
    freed_seen: list[int] = [0]
    try:

        async def produce() -> None:
            async with Producer(address, linger_ms=1, max_batch_bytes=512) as p:
                for value in records("q" * 50, 3000):
                    await p.send("s", value)
                await p.flush("s")
            async with Reader(address) as reader:
                batches, _ = await reader.fetch_all("s", 0)
            ends.extend(b.header.end_position for b in batches)

        run(produce(), timeout=30)
        assert len(ends) >= 200

        async def release_then_kill() -> None:
            async with Reader(address) as releaser, Reader(address) as watcher:
                done = asyncio.Event()

                async def watch() -> None:
                    while not done.is_set():
                        (info,) = [i for i in await watcher.list_streams() if i.stream == "s"]
                        freed_seen[0] = max(freed_seen[0], info.start_position)
                        await asyncio.sleep(0.001)

                watching = asyncio.create_task(watch())
                for i, end in enumerate(ends[:200]):
                    await releaser.release("s", end, "archive")
                    if i % 10 == 9:
                        await asyncio.sleep(0.002)
                await releaser.list_streams()  # every Release above is applied
                done.set()
                await watching
                proc.send_signal(signal.SIGKILL)

        run(release_then_kill(), timeout=30)
        proc.wait(10)
    finally:
        stop(proc)
    assert freed_seen[0] > 0, "the log was freed before the kill"

    async def reopened() -> None:
        cfg = load_gateway_config(config, listen=("127.0.0.1", 0), data_dir=data)
        gw = Gateway(cfg)
        await gw.start()
        try:
            stream = gw.stream("s")
            at = positions(gw, "s")["archive"]
            # Every position that freed space before the kill is stored, and
            # the consumer never stands behind what the log holds.
            assert at in ends[:200]
            assert at >= freed_seen[0]
            assert at >= stream.log.release_position
        finally:
            await gw.stop()

    run(reopened(), timeout=30)


def test_releases_coalesce_into_few_writes_and_a_slow_fsync_does_not_hold_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each fsync takes 50 ms: Releases still answer at once and share a handful of writes."""
    import os

    from headgate.gateway import consumers as consumers_module
    from headgate.gateway.dedup import write_json_durably as real_write

    real_fsync = os.fsync
    writes: list[int] = []
    fsyncs: list[float] = []

    on_loop: list[int] = []

    def counted_write(path: Path, body: Any) -> None:
        position = max(c["position"] for c in body["consumers"])
        writes.append(position)
        if threading.current_thread() is threading.main_thread():
            on_loop.append(position)
        real_write(path, body)

    def slow_fsync(fd: int) -> None:
        fsyncs.append(time.monotonic())
        time.sleep(0.05)
        real_fsync(fd)

    settings = StreamSettings(consumers=consumers(a=BLOCKING, holder=BLOCKING))

    async def scenario() -> None:
        async with gateway(tmp_path, **SMALL, streams={"s": settings}) as gw:
            async with Producer(gw.address, linger_ms=1, max_batch_bytes=512) as p:
                for value in records("x" * 30, 2000):
                    await p.send("s", value)
                await p.flush("s")
            log = gw.streams["s"].log
            ends = [f.end_position for f in log.read(0, log.durable_position)]
            assert len(ends) >= 60
            async with Reader(gw.address) as reader:
                await reader.list_streams()
                monkeypatch.setattr(consumers_module, "write_json_durably", counted_write)
                monkeypatch.setattr(os, "fsync", slow_fsync)
                slowest = 0.0
                for end in ends[:60]:
                    await reader.release("s", end, "a")
                    started = time.monotonic()
                    await reader.list_streams()  # answered after the Release
                    slowest = max(slowest, time.monotonic() - started)
                await gw.consumers_saved()
                monkeypatch.setattr(os, "fsync", real_fsync)
            assert fsyncs, "the slow fsync was in the path"
            # A write (two fsyncs: file and directory) takes 100 ms; on the
            # loop it would hold every answer behind it that long.
            assert slowest < 0.04, slowest
            assert on_loop == []  # not even the housekeeping pass writes them there
            # 60 Releases in well under a second: a few coalesced writes,
            # the last one holding the last position.
            assert 1 <= len(writes) <= 12, writes
            assert writes[-1] == ends[59]
            assert positions(gw, "s") == {"a": ends[59], "holder": 0}
            assert stored(tmp_path, "s")["a"]["position"] == ends[59]

    run(scenario(), timeout=30)


async def freed_to(address: str, stream: str, position: int) -> None:
    """Wait (polled, 5 s at most) until the gateway has freed ``stream``'s log to ``position``."""
    async with Reader(address) as reader:
        for _ in range(500):
            (info,) = [i for i in await reader.list_streams() if i.stream == stream]
            if info.start_position >= position:
                break
            await asyncio.sleep(0.01)
    assert info.start_position == position


def test_an_old_data_directory_opens_with_its_release_position_as_the_default_consumer(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        async with gateway(tmp_path, **SMALL) as gw:
            async with Producer(gw.address, linger_ms=1, max_batch_bytes=512) as p:
                for value in records("x", 300):
                    await p.send("s", value)
                await p.flush("s")
            log = gw.streams["s"].log
            middle = log.read(0, log.durable_position)[1].end_position
            async with Reader(gw.address) as reader:  # an old client: no consumer named
                await reader.release("s", middle)
                await reader.list_streams()  # answered after the Release was applied
            assert positions(gw, "s") == {"default": middle}
        # The directory as a gateway from before consumers left it.
        consumers_file(tmp_path, "s").unlink()
        async with gateway(tmp_path, **SMALL) as gw:
            stream = gw.stream("s")
            assert stream.log.release_position == middle
            assert positions(gw, "s") == {"default": middle}
            assert stored(tmp_path, "s")["default"]["position"] == middle
            assert stored(tmp_path, "s")["default"]["blocking"] is True

    run(scenario(), timeout=20)


def test_a_new_stream_declaring_consumers_has_no_default_one(tmp_path: Path) -> None:
    settings = StreamSettings(consumers=consumers(archive=BLOCKING))

    async def scenario() -> None:
        async with gateway(tmp_path, **SMALL, streams={"s": settings}) as gw:
            async with Producer(gw.address, linger_ms=1) as p:
                await p.send("s", b"v")
                await p.flush("s")
            assert positions(gw, "s") == {"archive": 0}
            peer = RawPeer(producer_id=9)
            await peer.connect(gw.address)
            peer.session.send_global(m.Release(stream="s", position=0))
            await peer.send()
            for _ in range(100):
                if peer.closed or peer.errors():
                    break
                await peer.pump(0.02)
            (error,) = peer.errors()
            assert error.code == ErrorCode.UNKNOWN_CONSUMER
            assert "no consumer called 'default'" in error.text

    run(scenario(), timeout=20)


# --- configuration -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        (
            '[streams.s.consumers.c]\non_data_loss = "drop"\n',
            "streams.s.consumers.c.on_data_loss: expected one of fail, skip, got 'drop'",
        ),
        (
            "[streams.s.consumers.c]\nblocking = 1\n",
            "streams.s.consumers.c.blocking: expected true or false, got 1",
        ),
        ("[streams.s.consumers.c]\nlag = 1\n", "streams.s.consumers.c: unknown key(s) lag"),
        ('[streams.s.consumers."a b"]\n', "'a b' is not a valid consumer name"),
        (
            '[streams.s]\nidle_policy = "kill"\n',
            "streams.s.idle_policy: expected one of hold, detach, got 'kill'",
        ),
        (
            "[streams.s]\nidle_release_seconds = 0\n",
            "streams.s.idle_release_seconds: expected a number of seconds above 0",
        ),
    ],
)
def test_bad_consumer_settings_name_the_file_and_key(
    tmp_path: Path, toml: str, message: str
) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as error:
        load_gateway_config(path)
    assert str(error.value).startswith(str(path))
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_a_consume_pattern_must_name_a_consumer(tmp_path: Path) -> None:
    from headgate.gateway.auth import load_tokens

    path = write_tokens(tmp_path / "tokens.toml", Token("t", "x" * 32, consume=("clicks",)))
    with pytest.raises(ConfigError, match='names no consumer; use "stream/consumer"'):
        load_tokens(path)


def test_config_consumers_reach_the_stream(tmp_path: Path) -> None:
    cfg = GatewayConfig(
        streams={"s": StreamSettings(consumers=consumers(x=ConsumerSettings(blocking=False)))}
    )
    assert cfg.consumers_for("s") == {"x": ConsumerSettings(blocking=False)}
    assert cfg.idle_rule_for("s") == (300.0, "hold")


def test_with_no_blocking_consumer_nothing_holds_the_producers(tmp_path: Path) -> None:
    """Only a non-blocking consumer: three logs' worth goes through with nobody releasing."""
    settings = StreamSettings(
        capacity=CAPACITY, consumers=consumers(live=ConsumerSettings(blocking=False))
    )

    async def scenario() -> None:
        async with (
            gateway(tmp_path, **SMALL, streams={"A": settings}) as gw,
            Producer(gw.address, linger_ms=1, max_batch_bytes=4 * KiB) as p,
        ):
            for value in records("v" * 100, 7000):
                await p.send("A", value)
            await p.flush("A")
            log = gw.streams["A"].log
            assert log.tail_position > 3 * CAPACITY
            # Freed by nobody's Release, up to what was durable, as space ran short.
            assert log.release_position > 2 * CAPACITY
            assert log.tail_position - log.release_position <= CAPACITY
            assert positions(gw, "A") == {"live": 0}

    run(scenario(), timeout=30)


def test_a_reload_declares_new_consumers_of_open_streams(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with gateway(tmp_path, **SMALL) as gw:
            async with Producer(gw.address, linger_ms=1) as p:
                await p.send("s", b"v")
                await p.flush("s")
            assert positions(gw, "s") == {"default": 0}
            settings = StreamSettings(consumers=consumers(archive=BLOCKING))
            gw.reconfigure(dataclasses.replace(gw.config, streams={"s": settings}))
            assert positions(gw, "s") == {"default": 0, "archive": 0}
            assert set(stored(tmp_path, "s")) == {"default", "archive"}

    run(scenario(), timeout=20)


def test_a_consumer_taken_out_of_the_configuration_is_deleted_at_the_next_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    both = StreamSettings(consumers=consumers(archive=BLOCKING, old=BLOCKING))

    async def scenario() -> None:
        async with gateway(tmp_path, **SMALL, streams={"s": both}) as gw:
            async with Producer(gw.address, linger_ms=1) as p:
                await p.send("s", b"v")
                await p.flush("s")
            async with Reader(gw.address) as reader:
                await reader.declare_consumer("s", "adhoc")
            end = gw.streams["s"].log.durable_position
            gw.release("s", end, "archive")
            gw.release("s", end, "adhoc")
            assert gw.streams["s"].log.release_position == 0  # "old" holds it
        only = StreamSettings(consumers=consumers(archive=BLOCKING))
        with caplog.at_level(logging.WARNING, logger="headgate.gateway"):
            async with gateway(tmp_path, **SMALL, streams={"s": only}) as gw:
                stream = gw.stream("s")
                # Runtime consumers stay; the one the TOML made and dropped goes.
                assert positions(gw, "s") == {"archive": end, "adhoc": end}
                assert stream.log.release_position == end  # freed at open
        assert any(
            "old is no longer in the configuration" in r.getMessage() for r in caplog.records
        )

    run(scenario(), timeout=20)


def test_a_stream_has_at_most_max_consumers(tmp_path: Path) -> None:
    from headgate.gateway.consumers import MAX_CONSUMERS_PER_STREAM

    book = ConsumerBook.load(
        "s", tmp_path / "s.consumers.json", release_position=0, tail_position=0, declared={}
    )
    # The first blocking one takes the implicit "default"'s place.
    for i in range(MAX_CONSUMERS_PER_STREAM):
        book.declare(f"c{i}", BLOCKING, 0)
    assert len(book.consumers) == MAX_CONSUMERS_PER_STREAM
    with pytest.raises(ProtocolError) as refused:
        book.declare("one-more", BLOCKING, 0)
    assert refused.value.code == ErrorCode.RESOURCE_EXHAUSTED
    assert book.declare("c0", BLOCKING, 0).name == "c0"  # an existing one is still found


def test_a_consumer_reset_to_earliest_or_a_time_replays_the_original_records(
    tmp_path: Path,
) -> None:
    settings = StreamSettings(consumers=consumers(archive=BLOCKING, audit=BLOCKING))

    async def scenario() -> None:
        async with gateway(tmp_path, **SMALL, streams={"s": settings}) as gw:
            first, second = records("a", 100), records("b", 100)
            async with Producer(gw.address, linger_ms=1, max_batch_bytes=512) as p:
                for value in first:
                    await p.send("s", value)
                await p.flush("s")
                await asyncio.sleep(0.01)
                between = time.time_ns() // 1000
                await asyncio.sleep(0.01)
                for value in second:
                    await p.send("s", value)
                await p.flush("s")
            archive = Consumer(gw, tmp_path, "s", "archive")
            archive.poll()
            original = values_in_order(archive.frames, p.producer_id)
            assert original == first + second
            async with Reader(gw.address) as reader:
                assert await reader.reset_consumer("s", "archive", m.ResetTo.EARLIEST) == 0
                assert positions(gw, "s")["archive"] == 0
                replay, _ = await reader.fetch_all("s", 0, consumer="archive")
                replayed = [v for b in replay for v in record_lists(memoryview(b.records))[0]]
                assert replayed == original
                at = await reader.reset_consumer("s", "archive", m.ResetTime(between))
                tail, _ = await reader.fetch_all("s", at, consumer="archive")
                assert [v for b in tail for v in record_lists(memoryview(b.records))[0]] == second
                latest = await reader.reset_consumer("s", "archive", m.ResetTo.LATEST)
                assert latest == gw.streams["s"].log.durable_position
                # Deleting the consumer that held the log frees it to the other one.
                await reader.release("s", latest, "audit")
                await reader.list_consumers("s")  # the Release is applied before this answer
                await gw.consumers_saved()  # and frees the log once stored
                assert gw.streams["s"].log.release_position == latest
                await reader.reset_consumer("s", "archive", m.ResetTo.EARLIEST)
                assert gw.streams["s"].log.release_position == latest  # nothing to go back to
                assert positions(gw, "s")["archive"] == latest
                assert await reader.delete_consumer("s", "archive") == latest
                assert positions(gw, "s") == {"audit": latest}
                with pytest.raises(ReaderRefused) as refused:
                    await reader.reset_consumer("s", "audit", 8)
                assert refused.value.code == ErrorCode.UNEXPECTED_FRAME
            archive.close()

    run(scenario(), timeout=20)


def test_records_freed_after_each_anchor_are_counted_exactly_or_marked_unknown(
    tmp_path: Path,
) -> None:
    """A skip reports the records freed after where the consumer committed or last read."""
    live = ConsumerSettings(blocking=False, on_data_loss="skip")
    book = ConsumerBook.load(
        "s",
        tmp_path / "s.consumers.json",
        release_position=0,
        tail_position=10_000,
        declared={"main": BLOCKING, "live": live},
    )
    frames = [(p, 3) for p in range(0, 1000, 100)]  # ten frames of 3 records
    book.read("live", 300)  # its last Fetch ended at 300; it committed nothing
    book.freeing(0, 500, [f for f in frames if f[0] < 500])
    book.freeing(500, 1000, [f for f in frames if f[0] >= 500])
    assert book.read_from("live", 300, 1000) == (1000, 700, 21)
    # Committed at 0: all thirty, and each skip is counted once on the consumer.
    assert book.read_from("live", 0, 1000) == (1000, 1000, 30)
    # Not an anchor: the bytes are exact, the records unknown.
    assert book.read_from("live", 200, 1000) == (1000, 800, None)
    assert book.consumers["live"].skipped_records == 51
    # An anchor set behind the log (a Release of what was freed already): unknown.
    book.commit(book.consumers["live"], 600, now=0.0)
    book.freeing(1000, 1100, [(1000, 3)])
    assert book.read_from("live", 600, 1100) == (1100, 500, None)


def test_an_idle_consumer_under_hold_keeps_the_producers_waiting_warned_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = StreamSettings(
        capacity=CAPACITY,
        consumers=consumers(main=BLOCKING, stuck=BLOCKING),
        idle_release_seconds=0.3,
    )

    async def scenario() -> None:
        async with (
            gateway(tmp_path, **SMALL, streams={"A": settings}) as gw,
            Producer(gw.address, linger_ms=1, max_batch_bytes=4 * KiB) as p,
        ):

            async def sender() -> None:
                for value in records("v" * 100, 8000):
                    await p.send("A", value)
                await p.flush("A")

            task = asyncio.create_task(sender())
            main = Consumer(gw, tmp_path, "A", "main")
            for _ in range(150):  # 1.5 s, five times the idle time
                main.poll()
                await asyncio.sleep(0.01)
            assert not task.done()  # hold: the producers still wait for "stuck"
            stream = gw.streams["A"]
            assert stream.log.release_position == 0
            stats = {c.name: c for c in stream.statistics().consumers}
            assert stats["stuck"].blocking and stats["stuck"].idle
            assert not stats["main"].idle
            assert 'headgate_consumer_idle{consumer="stuck",stream="A"} 1.0' in metrics_text(gw)
            # It comes back: the stream flows, and it is no longer idle.
            stuck = Consumer(gw, tmp_path, "A", "stuck")
            while not task.done():
                main.poll()
                stuck.poll()
                await asyncio.sleep(0.01)
            await task
            assert not {c.name: c for c in stream.statistics().consumers}["stuck"].idle
            main.close()
            stuck.close()

    with caplog.at_level(logging.WARNING, logger="headgate.gateway"):
        run(scenario(), timeout=30)
    warned = [r for r in caplog.records if "consumer stuck" in r.getMessage()]
    assert len(warned) == 1 and "producers wait for it" in warned[0].getMessage()


def test_top_shows_each_consumer_apart_from_its_stream(tmp_path: Path) -> None:
    from rich.console import Console

    import headgate.cli.top as top

    settings = StreamSettings(
        consumers=consumers(archive=BLOCKING, live=ConsumerSettings(blocking=False))
    )

    async def scenario() -> None:
        async with gateway(tmp_path, **SMALL, streams={"s": settings}) as gw:
            async with Producer(gw.address, linger_ms=1) as p:
                for value in records("x", 100):
                    await p.send("s", value)
                await p.flush("s")
            snap = top.parse(metrics_text(gw))
            durable = gw.streams["s"].log.durable_position
            assert set(snap.consumers["s"]) == {"archive", "live"}
            assert snap.consumers["s"]["archive"]["consumer_lag_bytes"] == durable
            assert snap.consumers["s"]["live"]["consumer_blocking"] == 0.0
            # A consumer's samples are not mistaken for its stream's.
            assert not any(key.startswith("consumer_") for key in snap.streams["s"])
            console = Console(width=100, record=True)
            console.print(top.render(snap))
            shown = console.export_text()
            assert "consumers" in shown
            assert any(line.split()[:2] == ["s", "archive"] for line in shown.splitlines())
            assert top.as_json(snap)["consumers"] == {
                "s": {name: snap.consumers["s"][name] for name in ("archive", "live")}
            }

    run(scenario(), timeout=20)


def test_the_log_frees_only_what_the_stored_positions_allow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A consumers file that cannot be written (a full disk) holds the log where it was."""
    import errno

    from headgate.gateway import consumers as consumers_module
    from headgate.gateway.dedup import write_json_durably as real_write

    def full_disk(path: Path, body: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    async def scenario() -> None:
        async with gateway(tmp_path, **SMALL) as gw:
            async with Producer(gw.address, linger_ms=1, max_batch_bytes=512) as p:
                for value in records("x", 300):
                    await p.send("s", value)
                await p.flush("s")
            log = gw.streams["s"].log
            end = log.durable_position
            monkeypatch.setattr(consumers_module, "write_json_durably", full_disk)
            with caplog.at_level(logging.WARNING, logger="headgate.gateway"):
                gw.release("s", end)
                await asyncio.sleep(0.05)  # group commits try again, and fail again
            assert positions(gw, "s") == {"default": end}  # in memory
            assert log.release_position == 0  # but not stored: nothing freed
            assert stored(tmp_path, "s")["default"]["position"] == 0
            warned = [r for r in caplog.records if "not stored" in r.getMessage()]
            assert len(warned) == 1
            monkeypatch.setattr(consumers_module, "write_json_durably", real_write)
            gw.mark_dirty(gw.streams["s"])
            for _ in range(100):
                if log.release_position == end:
                    break
                await asyncio.sleep(0.01)
            assert log.release_position == end
            assert stored(tmp_path, "s")["default"]["position"] == end

    run(scenario(), timeout=20)


def test_a_release_client_can_declare_its_consumer_before_releasing(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with gateway(tmp_path, **SMALL) as gw:
            async with Producer(gw.address, linger_ms=1) as p:
                for value in records("x", 100):
                    await p.send("s", value)
                await p.flush("s")
            end = gw.streams["s"].log.durable_position
            address = f"{gw.address[0]}:{gw.address[1]}"

            def release() -> bool:
                with ReleaseClient(
                    address, consumer="archive", declare=ConsumerSettings()
                ) as client:
                    client.release("s", end)
                    return client.flush(10) and client.statistics().refusals == 0

            assert await asyncio.to_thread(release)
            await gw.consumers_saved()
            # The first blocking consumer declared at run time takes over the
            # implicit one (nobody declared it): it alone holds the log now.
            assert positions(gw, "s") == {"archive": end}
            assert gw.streams["s"].log.release_position == end
            assert stored(tmp_path, "s")["archive"]["origin"] == "runtime"

            # Without declare, an unknown consumer is refused (and logged).
            def refused() -> int:
                with ReleaseClient(address, consumer="other") as client:
                    client.release("s", end)
                    client.flush(10)
                    return client.statistics().refusals

            assert await asyncio.to_thread(refused) == 1
            assert "other" not in positions(gw, "s")

    run(scenario(), timeout=30)
