"""``max_buffered_bytes`` bounds a producer's memory, whatever sealed its batches.

A stream whose consumer never releases stops acknowledging once its log is
full. From then on every record a producer takes for it stays in the
producer's memory, so the producer must stop taking them: ``send`` waits,
``send_nowait`` raises :class:`BufferFull`, and the synchronous producer's
``send`` blocks. The sends here are paced (a burst, then a pause longer than
the linger time), so that the linger timer, not a full batch, seals every
batch: the case that once grew without bound.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from headgate.client import BufferFull, Producer, ProducerError, SyncProducer
from headgate.config import StreamSettings
from tests.helpers import SMALL, KiB, Releaser, gateway, records, run, values_in_order

BOUND = 512 * KiB
#: The largest batch the gateway of these tests takes (SMALL's max_message_size).
ONE_BATCH = 16 * KiB
BURST = 200
#: Bursts of 200 records of about 50 bytes: under one batch each, so only the
#: linger timer seals them. 150 of them are about 1.6 MB, three times what
#: the stalled stream's log and the bound hold together.
BURSTS = 150
PAUSE = 0.01
#: A stalled stream: 256 KiB of log, and nobody releases it.
STALLED = {"A": StreamSettings(capacity=256 * KiB)}


def test_paced_sends_to_a_stalled_stream_wait_at_max_buffered_bytes(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with (
            gateway(tmp_path, **SMALL, streams=STALLED) as gw,
            Producer(gw.address, max_buffered_bytes=BOUND, linger_ms=2) as p,
        ):
            values = records("p" * 40, BURST * BURSTS)
            taken = 0

            async def sender() -> None:
                nonlocal taken
                for start in range(0, len(values), BURST):
                    for value in values[start : start + BURST]:
                        await p.send("A", value)
                        taken += 1
                    await asyncio.sleep(PAUSE)

            task = asyncio.create_task(sender())
            peak = 0
            # Watch until the sender has taken nothing for 0.5 s: it waits.
            last_taken, still_since = -1, time.monotonic()
            give_up = time.monotonic() + 8.0
            while not task.done() and time.monotonic() < give_up:
                stream = p.statistics().streams.get("A")
                if stream is not None:
                    peak = max(peak, stream.buffered_bytes)
                if taken != last_taken:
                    last_taken, still_since = taken, time.monotonic()
                elif time.monotonic() - still_since > 0.5:
                    break
                await asyncio.sleep(0.005)
            assert peak <= BOUND + ONE_BATCH, f"{peak} bytes buffered with a bound of {BOUND}"
            assert not task.done(), "every send went through to a stalled stream"
            assert 0 < taken < len(values)
            stream = p.statistics().streams["A"]
            assert BOUND - ONE_BATCH <= stream.buffered_bytes <= BOUND + ONE_BATCH

            with pytest.raises(BufferFull, match="'A'") as full:
                p.send_nowait("A", b"one more")
            assert full.value.stream == "A" and full.value.limit == BOUND
            # A bulk call waits too; another stream is not held up.
            many = asyncio.create_task(p.send_many("A", [b"m-%d" % i for i in range(10)]))
            p.send_nowait("B", b"b-0")
            await p.send("B", b"b-1")
            await p.flush("B")
            assert p.statistics().streams["B"].records_acked == 2
            assert not many.done()
            assert p.statistics().streams["A"].buffered_bytes <= BOUND + ONE_BATCH

            # Spark catches up: everything arrives, exactly once, in order.
            releaser = Releaser(gw, tmp_path, "A")

            async def rest() -> None:
                await task
                await many
                await p.flush("A")

            done = asyncio.ensure_future(rest())
            await releaser.run_until(done)
            await done
            releaser.close()
            stored = values_in_order(releaser.frames, p.producer_id)
            assert [v for v in stored if not v.startswith(b"m-")] == values
            assert sorted(v for v in stored if v.startswith(b"m-")) == sorted(
                b"m-%d" % i for i in range(10)
            )
            assert (await (await many)).record_count == 10

    run(scenario(), timeout=60)


def test_send_nowait_takes_records_while_there_is_room(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with gateway(tmp_path, **SMALL) as gw:
            p = Producer(gw.address, max_buffered_bytes=BOUND)
            # Not connected yet: the records wait for the session, within the bound.
            for i in range(100):
                p.send_nowait("s", b"v-%d" % i)
            p.send_nowait("s", b"keyed", key=b"k")
            await p.flush()
            assert p.statistics().streams["s"].records_acked == 101
            with pytest.raises(ValueError, match="does not fit"):
                p.send_nowait("s", b"x" * (64 * KiB))
            with pytest.raises(TypeError):
                p.send_nowait("s", "not bytes")  # type: ignore[arg-type]
            await p.close()

    run(scenario())


def test_sync_producer_blocks_at_max_buffered_bytes(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with gateway(tmp_path, **SMALL, streams=STALLED) as gw:
            p = await asyncio.to_thread(
                SyncProducer,
                gw.address,
                max_buffered_bytes=BOUND,
                linger_ms=2,
                handoff_records=BURST,
                max_pending_records=2 * BURST,
                connect_timeout=10,
            )
            values = records("s" * 40, BURST * BURSTS)
            taken = 0

            def sender() -> None:
                nonlocal taken
                for start in range(0, len(values), BURST):
                    for value in values[start : start + BURST]:
                        p.send("A", value)
                        taken += 1
                    time.sleep(PAUSE)

            task = asyncio.ensure_future(asyncio.to_thread(sender))
            peak = 0
            last_taken, still_since = -1, time.monotonic()
            give_up = time.monotonic() + 8.0
            while not task.done() and time.monotonic() < give_up:
                stats = await asyncio.to_thread(p.statistics)
                stream = stats.streams.get("A")
                if stream is not None:
                    peak = max(peak, stream.buffered_bytes)
                if taken != last_taken:
                    last_taken, still_since = taken, time.monotonic()
                elif time.monotonic() - still_since > 0.5:
                    break
                await asyncio.sleep(0.005)
            assert peak <= BOUND + ONE_BATCH, f"{peak} bytes buffered with a bound of {BOUND}"
            assert not task.done(), "every send went through to a stalled stream"
            # Beyond the bound only the handoff queue holds records, and it is bounded too.
            assert taken < len(values)

            releaser = Releaser(gw, tmp_path, "A")

            async def rest() -> None:
                await task
                await asyncio.to_thread(p.flush, 30)

            done = asyncio.ensure_future(rest())
            await releaser.run_until(done)
            await done
            releaser.close()
            producer_id = p.producer_id
            await asyncio.to_thread(p.close, 10)
            assert values_in_order(releaser.frames, producer_id) == values

    run(scenario(), timeout=60)


LARGER = b"." * 200


async def fill(p: Producer, stream: str) -> int:
    """send_nowait until the stream stays full for 0.3 s; the records taken.

    Its records are 98 bytes: a larger one certainly waits after it.
    """
    taken = 0
    full_since: float | None = None
    give_up = time.monotonic() + 8.0
    while time.monotonic() < give_up:
        try:
            p.send_nowait(stream, b"f-%06d" % taken + b"." * 90)
            taken += 1
            full_since = None
            if taken % 100 == 0:
                await asyncio.sleep(0)
        except BufferFull:
            full_since = full_since or time.monotonic()
            if time.monotonic() - full_since > 0.3:
                return taken
            await asyncio.sleep(0.01)
    raise AssertionError("the stream never filled up")


def test_a_cancelled_waiting_send_gives_its_turn_to_the_next(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with (
            gateway(tmp_path, **SMALL, streams=STALLED) as gw,
            Producer(gw.address, max_buffered_bytes=64 * KiB, linger_ms=2) as p,
        ):
            taken = await fill(p, "A")
            first = asyncio.create_task(p.send("A", b"first" + LARGER))
            second = asyncio.create_task(p.send("A", b"second" + LARGER))
            await asyncio.sleep(0.1)
            assert not first.done() and not second.done()
            first.cancel()
            releaser = Releaser(gw, tmp_path, "A")

            async def rest() -> None:
                await second
                await p.flush("A")

            done = asyncio.ensure_future(rest())
            await releaser.run_until(done)
            await done
            releaser.close()
            assert first.cancelled()
            stored = values_in_order(releaser.frames, p.producer_id)
            assert len(stored) == taken + 1 and stored[-1] == b"second" + LARGER

    run(scenario(), timeout=30)


def test_sends_waiting_for_room_raise_when_the_producer_is_aborted(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with gateway(tmp_path, **SMALL, streams=STALLED) as gw:
            p = Producer(gw.address, max_buffered_bytes=64 * KiB, linger_ms=2)
            await p.connect()
            await fill(p, "A")
            waiting = asyncio.create_task(p.send("A", b"late" + LARGER))
            bulk = asyncio.create_task(p.send_many("A", [b"bulk" + LARGER] * 10))
            await asyncio.sleep(0.1)
            assert not waiting.done() and not bulk.done()
            await p.abort()
            for task in (waiting, bulk):
                with pytest.raises(ProducerError, match="closed"):
                    await task

    run(scenario(), timeout=30)
