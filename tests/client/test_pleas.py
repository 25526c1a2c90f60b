"""The producer library answers every Plead at once, so it never meets the Plead deadline."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

import pytest

from headgate.client import Producer
from headgate.config import GatewayConfig
from headgate.gateway import Gateway
from headgate.gateway.streams import Stream, Writer
from tests.helpers import Releaser

pytestmark = pytest.mark.timeout(60)

RECORDS = 8_000


async def write(producer: Producer, tag: bytes, pause_at: int | None = None) -> None:
    for i in range(RECORDS):
        await producer.send("shared", tag + b"%06d" % i + b"x" * 90)
        if i == pause_at:
            await producer.flush()
            await asyncio.sleep(1.3)  # idle: its share moves to the other writer
    await producer.flush()


async def test_producers_sharing_a_stream_absolve_before_the_plead_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pleas: list[int] = []
    plead = Stream.plead

    def counted(writer: Writer, target: int, now: float) -> None:
        if writer.pleaded != target:
            pleas.append(target)
        plead(writer, target, now)

    monkeypatch.setattr(Stream, "plead", staticmethod(counted))
    # The gateway and both producers share this process: a full collection of
    # a heap that earlier tests grew, mid-test, would stall them all past the
    # 250 ms deadline (seen in a full suite run, never in this file alone).
    gc.collect()
    gw = Gateway(
        GatewayConfig(
            listen=("127.0.0.1", 0),
            data_dir=tmp_path / "data",
            stream_capacity=2 << 20,
            term_length=256 * 1024,
            max_message_size=64 * 1024,
            group_commit_interval_ms=1.0,
            plead_deadline_ms=250,
        )
    )
    await gw.start()
    try:
        address = f"127.0.0.1:{gw.address[1]}"
        async with (
            Producer(address, producer_id=1, max_batch_bytes=16 * 1024) as first,
            Producer(address, producer_id=2, max_batch_bytes=16 * 1024) as second,
        ):
            await first.send("shared", b"first")
            await first.flush()
            # A consumer that keeps up: each writer earns credit by using it,
            # and when one goes idle its share moves to the other (a Plead).
            releaser = Releaser(gw, tmp_path / "data", "shared")
            both = asyncio.ensure_future(
                asyncio.gather(
                    write(first, b"a", pause_at=RECORDS // 2), write(second, b"b", pause_at=100)
                )
            )
            await releaser.run_until(both)
            await both
            releaser.close()
            assert first.statistics().reconnects == 0, first.statistics().last_error
            assert second.statistics().reconnects == 0, second.statistics().last_error
            assert first.statistics().failure is None and second.statistics().failure is None
    finally:
        await gw.stop()
    assert pleas, "the writers were never pleaded: the test proves nothing"
    values = [v for f in releaser.frames for v in f.values]
    assert len(values) == 2 * RECORDS + 1 == len(set(values))
