"""The gateway's reader side against hand-driven peers: guarantees and backlog bound it.

A reader here is a raw protocol session over a real socket, so a test can
misbehave exactly as it wants: grant huge guarantees and never read, never
grant any, or ask for what does not exist.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from headgate.client import Producer
from headgate.config import GatewayConfig
from headgate.gateway import Gateway
from headgate.gateway.readers import MAX_BACKLOG
from headgate.protocol import messages as m
from headgate.protocol.c64 import U64_MAX
from headgate.protocol.errors import ErrorCode
from headgate.protocol.session import StreamBound, TailReceived
from tests.helpers import RawPeer, config

pytestmark = pytest.mark.timeout(60)

GiB = 1 << 30


async def fill(gw: Gateway, stream: str, count: int, producer_id: int = 5) -> float:
    started = time.monotonic()
    async with Producer(
        f"127.0.0.1:{gw.address[1]}", producer_id=producer_id, max_batch_bytes=8 * 1024
    ) as producer:
        for i in range(count):
            await producer.send(stream, b"%08d" % i + b"x" * 120)
        await producer.flush()
    return time.monotonic() - started


def reader_conn(gw: Gateway) -> object:
    (conn,) = [c for c in gw.connections.values() if c.readers._jobs or c.readers.subscriptions]
    return conn


async def test_a_reader_that_grants_everything_and_reads_nothing_costs_a_bounded_backlog(
    tmp_path: Path,
) -> None:
    gw = Gateway(config(tmp_path, stream_capacity=32 * 1024 * 1024))
    await gw.start()
    try:
        await fill(gw, "big", 60_000)  # about 8 MiB of log
        peer = RawPeer(producer_id=0)
        await peer.connect(gw.address)
        peer.session.grant(m.STREAM_CHANNEL, 4096)
        peer.session.send_global(
            m.Fetch(request_id=1, stream="big", start_position=0, end_position=U64_MAX, max_bytes=0)
        )
        await peer.send()
        await peer.until(lambda: any(isinstance(e, StreamBound) for e in peer.events))
        peer.session.grant(m.data_channel(0), GiB)  # "send me everything"
        await peer.send()
        # ... and never read the socket again.
        await asyncio.sleep(1.0)
        conn = reader_conn(gw)
        transport = conn.transport  # type: ignore[attr-defined]
        job = conn.readers._jobs[0]  # type: ignore[attr-defined]
        assert job.cursor < job.end, "the gateway must stop, not push the whole log"
        frame = 16 * 1024 + 64
        assert transport.get_write_buffer_size() <= MAX_BACKLOG + frame
        # Producers are not affected by it.
        assert await fill(gw, "other", 5_000, producer_id=6) < 20
        await peer.close()
    finally:
        await gw.stop()


async def test_without_guarantees_nothing_is_sent_and_the_fetch_waits(tmp_path: Path) -> None:
    gw = Gateway(config(tmp_path))
    await gw.start()
    try:
        await fill(gw, "s", 500)
        peer = RawPeer(producer_id=0)
        await peer.connect(gw.address)
        peer.session.grant(m.STREAM_CHANNEL, 4096)
        peer.session.send_global(
            m.Fetch(request_id=7, stream="s", start_position=0, end_position=U64_MAX, max_bytes=0)
        )
        await peer.send()
        for _ in range(20):
            await peer.pump(0.02)
        assert any(isinstance(e, StreamBound) for e in peer.events)
        assert not any(isinstance(e, TailReceived) for e in peer.events)
        # Guarantees for about two frames: exactly what fits arrives.
        peer.session.grant(m.data_channel(0), 20_000)
        await peer.send()
        for _ in range(20):
            await peer.pump(0.02)
        tails = [e for e in peer.events if isinstance(e, TailReceived)]
        assert 1 <= len(tails) <= 2 and sum(t.size for t in tails) <= 20_000
        assert not peer.errors() and not peer.closed
        await peer.close()
    finally:
        await gw.stop()


@pytest.mark.parametrize(
    "request_",
    [
        m.Fetch(request_id=1, stream="ghost", start_position=0, end_position=0, max_bytes=0),
        m.Fetch(request_id=1, stream="s", start_position=64, end_position=0, max_bytes=0),
        m.Fetch(request_id=1, stream="s", start_position=0, end_position=10**12, max_bytes=0),
        m.Subscribe(stream="ghost", start=m.StartAt.NOW),
        m.Subscribe(stream="s", start=10**12),
    ],
)
async def test_requests_that_cannot_be_served_are_refused_with_a_reason(
    tmp_path: Path, request_: m.Fetch | m.Subscribe
) -> None:
    gw = Gateway(config(tmp_path))
    await gw.start()
    try:
        await fill(gw, "s", 10)
        peer = RawPeer(producer_id=0)
        await peer.connect(gw.address)
        peer.session.send_global(request_)
        await peer.send()
        for _ in range(50):
            if peer.closed or peer.errors():
                break
            await peer.pump(0.02)
        (error,) = peer.errors()
        assert error.code == ErrorCode.UNEXPECTED_FRAME
        assert "ghost" in error.text or "cannot read" in error.text
        # The gateway goes on serving others.
        assert await fill(gw, "s", 10, producer_id=9) < 20
    finally:
        await gw.stop()


async def test_a_connection_cannot_pile_up_subscriptions(tmp_path: Path) -> None:
    gw = Gateway(config(tmp_path))
    await gw.start()
    try:
        await fill(gw, "s", 10)
        peer = RawPeer(producer_id=0)
        await peer.connect(gw.address)
        # No bind guarantees: every Subscribe waits for a handle, and piles up.
        for _ in range(GatewayConfig().max_subscriptions + 1):
            peer.session.send_global(m.Subscribe(stream="s", start=m.StartAt.NOW))
        await peer.send()
        for _ in range(100):
            if peer.closed or peer.errors():
                break
            await peer.pump(0.02)
        (error,) = peer.errors()
        assert error.code == ErrorCode.RESOURCE_EXHAUSTED
        assert f"at most {GatewayConfig().max_subscriptions} subscriptions" in error.text
        await asyncio.sleep(0.1)
        assert "s" not in gw.tails.subscriptions, "the closed connection's tails are gone"
    finally:
        await gw.stop()
