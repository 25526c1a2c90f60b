"""What no peer can make the gateway hold: connections, time, memory, streams.

Every limit here is a configuration setting; the tests set it small so that
reaching it takes milliseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from headgate.client import Producer, StreamRefused
from headgate.gateway import Gateway
from headgate.gateway.budget import UNITS_PER_MS
from headgate.gateway.turns import FIRST_SLICE, TurnTaker
from headgate.protocol import messages as m
from headgate.protocol.codec import FrameDecoder, encode_frame
from headgate.protocol.errors import ErrorCode
from headgate.protocol.frames import AnnounceDropping, SendChannel, SendGlobal
from headgate.protocol.records import encode_records
from headgate.protocol.session import WelcomeReceived
from tests.helpers import PING_PAIR_COST, RawPeer, config, ping_pairs, stored

pytestmark = pytest.mark.timeout(60)


async def read_until_closed(reader: asyncio.StreamReader, timeout: float = 10) -> list[object]:
    """Frames until the gateway closes (a reset after its last bytes counts as closing)."""
    data = bytearray()
    async with asyncio.timeout(timeout):
        while True:
            try:
                chunk = await reader.read(1 << 16)
            except ConnectionError:
                break
            if not chunk:
                break
            data += chunk
    return list(FrameDecoder(max_payload=1 << 20).feed(data))


def errors_in(frames: list[object]) -> list[m.Error]:
    out = []
    for frame in frames:
        if isinstance(frame, SendGlobal):
            message = m.decode_global(frame.payload)
            if isinstance(message, m.Error):
                out.append(message)
    return out


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[Gateway]:
    gw = Gateway(
        config(
            tmp_path,
            idle_timeout_ms=400,
            handshake_timeout_ms=300,
            max_connections=8,
            max_write_buffer=64 * 1024,
            max_streams=3,
            bind_budget=512,
        )
    )
    await gw.start()
    yield gw
    await gw.stop()


async def test_welcome_announces_the_idle_timeout_and_a_silent_peer_is_closed(
    gateway: Gateway,
) -> None:
    peer = RawPeer()
    await peer.connect(gateway.address)
    welcomes = [e.welcome for e in peer.events if isinstance(e, WelcomeReceived)]
    assert [w.idle_timeout_ms for w in welcomes] == [400]
    loop = asyncio.get_running_loop()
    started = loop.time()
    while not peer.closed and loop.time() - started < 5:
        await peer.pump(0.1)
    assert peer.closed
    assert 0.3 < loop.time() - started < 3
    assert [e.code for e in peer.errors()] == [ErrorCode.TIMEOUT]


async def test_a_producer_keeps_an_idle_connection_alive_with_pings(tmp_path: Path) -> None:
    gateway = Gateway(config(tmp_path, idle_timeout_ms=900))
    await gateway.start()
    try:
        async with Producer(gateway.address, reconnect_timeout=5) as producer:
            await producer.send("s", b"before")
            await producer.flush()
            await asyncio.sleep(2.5)  # almost three idle timeouts
            stats = producer.statistics()
            assert stats.connected and stats.reconnects == 0
            await producer.send("s", b"after")
            await producer.flush()
    finally:
        await gateway.stop()
    assert [vs for _, _, vs in stored(tmp_path / "data", "s")] == [[b"before"], [b"after"]]


async def test_a_slowloris_opening_is_cut_off_by_the_handshake_timeout(gateway: Gateway) -> None:
    reader, writer = await asyncio.open_connection(*gateway.address)
    hello = encode_frame(
        SendGlobal(payload=m.encode_message(m.Hello(producer_id=1, client_name="slow")))
    )
    loop = asyncio.get_running_loop()
    started = loop.time()
    writer.write(hello[:3])  # and then one byte now and then, never all of it
    closed = False
    for byte in hello[3:-1]:
        await asyncio.sleep(0.05)
        if reader.at_eof():
            closed = True
            break
        try:
            writer.write(bytes([byte]))
        except ConnectionError:
            closed = True
            break
    frames = await read_until_closed(reader, 5)
    elapsed = loop.time() - started
    assert closed or elapsed < 2
    assert [e.code for e in errors_in(frames)] == [ErrorCode.TIMEOUT]
    writer.close()


async def test_connections_beyond_the_limit_are_refused(gateway: Gateway) -> None:
    peers = []
    for _ in range(8):
        peer = RawPeer()
        await peer.connect(gateway.address)
        peers.append(peer)
    reader, writer = await asyncio.open_connection(*gateway.address)
    frames = await read_until_closed(reader)
    assert [e.code for e in errors_in(frames)] == [ErrorCode.RESOURCE_EXHAUSTED]
    writer.close()
    assert len(gateway.connections) == 8
    for peer in peers:
        await peer.close()


@pytest.mark.parametrize("pings_per_second", [5000, 10_000_000])
async def test_a_peer_that_never_reads_cannot_make_the_gateway_buffer(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, pings_per_second: int
) -> None:
    """Pings by the megabyte, never a byte read.

    With the default control budget the Pings are slowed down long before
    the Pongs fill anything, and the peer meets the idle timeout. Without
    it (a huge budget), the Pongs fill the socket, reading stops, the write
    cap is reached and the peer is cut off for that.
    """
    gateway = Gateway(
        config(
            tmp_path,
            idle_timeout_ms=400,
            max_write_buffer=64 * 1024,
            work_budget_ms=min(1000.0, pings_per_second * PING_PAIR_COST / UNITS_PER_MS),
        )
    )
    await gateway.start()
    try:
        await _never_read(gateway)
    finally:
        await gateway.stop()
    reasons = [r.getMessage() for r in caplog.records if r.name == "headgate.gateway"]
    expected = (
        "TIMEOUT"
        if pings_per_second == 5000
        else "RESOURCE_EXHAUSTED: the peer does not read what the gateway sends"
    )
    assert any(expected in reason for reason in reasons), reasons


async def _never_read(gateway: Gateway) -> None:
    # A small receive buffer, so that the kernel does not absorb megabytes
    # of Pongs before the gateway's own buffer is put to the test.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, gateway.address)
    _reader, writer = await asyncio.open_connection(sock=sock, limit=1024)
    transport = writer.transport
    assert isinstance(transport, asyncio.Transport)
    transport.pause_reading()  # never read again
    hello = m.Hello(producer_id=3, client_name="deaf")
    pairs = ping_pairs(1000)  # Pings alone would be cut off first (the Ping rule)
    writer.write(encode_frame(SendGlobal(payload=m.encode_message(hello))))
    peak = 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    # Every Ping asks for a Pong: 6 MB of Pongs would be asked for, more than
    # the kernel buffers of both ends absorb.
    sent = 0
    while sent < 600_000 and loop.time() < deadline and gateway.connections:
        writer.write(pairs)
        sent += 1000
        with contextlib.suppress(TimeoutError, ConnectionError):
            await asyncio.wait_for(writer.drain(), 0.2)
        peak = max(peak, gateway.buffered_bytes())
    # Held in memory: never more than the write cap plus one read chunk of Pongs.
    assert 0 < peak <= 64 * 1024 + 256 * 1024
    # And the peer does not hold its connection forever: cut off within the
    # idle timeout (reading stopped) plus the close grace.
    while gateway.connections and loop.time() < deadline + 5:
        await asyncio.sleep(0.1)
    assert not gateway.connections
    writer.close()


async def test_binds_beyond_the_stream_limit_are_refused_per_stream(
    gateway: Gateway, tmp_path: Path
) -> None:
    async with Producer(gateway.address, reconnect_timeout=5) as producer:
        for name in ("a", "b", "c", "d"):
            await producer.send(name, name.encode())
        with pytest.raises(StreamRefused) as refused:
            await producer.flush()
        assert refused.value.stream == "d" and refused.value.code is ErrorCode.RESOURCE_EXHAUSTED
        await producer.send("a", b"more")
        await producer.flush("a")
    assert [vs for _, _, vs in stored(tmp_path / "data", "a")] == [[b"a"], [b"more"]]
    assert not (tmp_path / "data" / "streams" / "d").exists()


async def test_binds_beyond_the_bind_guarantees_are_dropped_not_bound(gateway: Gateway) -> None:
    peer = RawPeer()
    await peer.connect(gateway.address)
    # 512 bytes of guarantees: a 101-byte bind payload fits five times.
    name = "n" * 100
    raw = encode_frame(SendChannel(channel=0, payload=m.encode_message(m.BindStream(stream=name))))
    peer.writer.write(raw * 50)
    await peer.writer.drain()
    data = await asyncio.wait_for(peer.reader.read(1 << 16), 5)
    frames = FrameDecoder(max_payload=1 << 20).feed(data)
    assert AnnounceDropping(channel=0) in frames
    conn = next(iter(gateway.connections.values()))
    assert len(conn.session.streams.theirs) <= 5
    assert conn.buffered_bytes < 64 * 1024
    await peer.close()


async def test_optimistic_batches_beyond_guarantees_are_dropped_until_an_apology(
    gateway: Gateway, tmp_path: Path
) -> None:
    peer = RawPeer()
    await peer.connect(gateway.address)
    handle = await peer.bind("opt")
    await peer.until(lambda: peer.session.outbound(m.data_channel(handle)).guarantees > 0)
    granted = peer.session.outbound(m.data_channel(handle)).guarantees
    records = encode_records([b"x" * 1000])
    # Far beyond the guarantees, bypassing the session so no apology is ever sent.
    frame = encode_frame(
        SendChannel(channel=m.data_channel(handle), payload=m.encode_batch_header(0) + records)
    )
    count = 2 * granted // 1000 + 10
    peer.writer.write(frame * count)
    await peer.writer.drain()
    data = await asyncio.wait_for(peer.reader.read(1 << 16), 5)
    frames = FrameDecoder(max_payload=1 << 20).feed(data)
    assert any(isinstance(f, AnnounceDropping) for f in frames)
    await asyncio.sleep(0.2)
    kept = stored(tmp_path / "data", "opt")
    # What fit was stored once (sequence 0 deduplicated); the rest was dropped.
    assert len(kept) <= 1
    conn = next(iter(gateway.connections.values()))
    assert conn.buffered_bytes < 64 * 1024
    await peer.close()


async def test_bind_guarantees_come_back_when_a_binding_is_freed(gateway: Gateway) -> None:
    peer = RawPeer()
    await peer.connect(gateway.address)
    bind_channel = peer.session.outbound(m.STREAM_CHANNEL)
    await peer.until(lambda: bind_channel.guarantees == 512)
    handle = await peer.bind("x" * 200)
    assert bind_channel.guarantees < 512
    peer.session.free_stream(handle)
    await peer.send()
    # The gateway confirms the free and issues the binding's bytes again.
    await peer.until(lambda: bind_channel.guarantees == 512)
    await peer.close()


async def test_a_ping_flood_is_slowed_to_the_control_budget(tmp_path: Path) -> None:
    # A budget of 200 Pings a second (each with its Pong, and the other frame of
    # its pair: Pings alone, back to back, would be cut off by the Ping rule).
    budget_ms = 200 * PING_PAIR_COST / UNITS_PER_MS
    gw = Gateway(config(tmp_path, work_budget_ms=budget_ms, idle_timeout_ms=0))
    await gw.start()
    try:
        reader, writer = await asyncio.open_connection(*gw.address)
        hello = m.Hello(producer_id=3, client_name="pinger")
        writer.write(encode_frame(SendGlobal(payload=m.encode_message(hello))) + ping_pairs(5000))
        decoder = FrameDecoder(max_payload=1 << 20)
        pongs = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 1.0
        while loop.time() < deadline:
            with contextlib.suppress(TimeoutError):
                data = await asyncio.wait_for(reader.read(1 << 16), deadline - loop.time())
                pongs += sum(
                    1
                    for f in decoder.feed(data)
                    if isinstance(f, SendGlobal) and isinstance(m.decode_global(f.payload), m.Pong)
                )
        # A burst of 200, then 200 a second; the budget is charged after each
        # slice, so the first slice (16 KiB, 1365 pairs of 12 bytes) goes through whole.
        assert 200 <= pongs <= 200 + 200 + FIRST_SLICE // 12
        assert pongs < 5000 // 2
        writer.close()
    finally:
        await gw.stop()


async def test_connections_take_turns_with_what_they_received() -> None:
    order: list[str] = []
    waiting = {"a": 200_000, "b": 200_000}

    def taker(name: str) -> TurnTaker:
        def step(limit: int) -> int:
            took = min(limit, waiting[name])
            if took:
                time.sleep(0.001)  # an expensive slice: many tiny frames
                order.append(name)
                waiting[name] -= took
            return took

        return TurnTaker(step, lambda: None, lambda backlogged: None, lambda: False)

    a, b = taker("a"), taker("b")
    a.received()
    b.received()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while (a.waiting or b.waiting) and loop.time() < deadline:
        await asyncio.sleep(0.001)
    assert waiting == {"a": 0, "b": 0}
    # b got its first turn long before a was done: a's first turn stopped at
    # the time budget, after a few slices.
    assert order.index("b") < len(order) // 4
    # Turns alternate: a slice costs 1 ms and a turn at most 2 ms (checked
    # after each slice), so while both have bytes waiting, neither gets more
    # than a few slices in a row (the last run is whoever finished last).
    runs = [len(list(group)) for _, group in itertools.groupby(order)]
    assert len(runs) > 10 and max(runs[:-1]) <= 4, runs


@pytest.mark.parametrize(
    "ending",
    [m.Goodbye(code=ErrorCode.NONE), m.Error(code=ErrorCode.INTERNAL, text="peer gives up")],
    ids=["goodbye", "unscoped-error"],
)
async def test_a_peer_that_ends_the_session_but_keeps_its_socket_is_closed_at_once(
    gateway: Gateway, ending: m.Goodbye | m.Error
) -> None:
    """The peer's Goodbye, or its Error about the whole session, ends it (the
    lifecycle's CLOSED): the gateway closes the connection then, not never (no
    idle clock runs for an ended session, so it would hold its slot for ever)."""
    reader, writer = await asyncio.open_connection(*gateway.address)
    opening = [m.Hello(producer_id=1, client_name="ender"), ending]
    writer.write(b"".join(encode_frame(SendGlobal(payload=m.encode_message(g))) for g in opening))
    await writer.drain()
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        frames = await read_until_closed(reader, 3)
        assert loop.time() - started < 1.0  # at once, not after an idle timeout (0.4 s)
    finally:
        writer.close()
    told = [m.decode_global(f.payload) for f in frames if isinstance(f, SendGlobal)]
    assert [type(g) for g in told][:1] == [m.Welcome]
    assert not errors_in(frames)


async def test_nothing_follows_the_gateway_s_ending_and_nothing_precedes_its_welcome(
    gateway: Gateway,
) -> None:
    """The gateway's Error that ends a session is its last frame: a Ping that
    came after the refused frame (a release client sends Release, then a Ping
    as its probe) gets no Pong. And a Ping sent along with Hello is answered
    after the Welcome, never ahead of it."""

    def framed(*messages: m.GlobalMessage) -> bytes:
        return b"".join(encode_frame(SendGlobal(payload=m.encode_message(g))) for g in messages)

    reader, writer = await asyncio.open_connection(*gateway.address)
    try:
        writer.write(framed(m.Hello(producer_id=1, client_name="prober"), m.Ping(nonce=5)))
        await writer.drain()
        decoder = FrameDecoder(max_payload=1 << 20)
        told: list[m.GlobalMessage] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while not any(isinstance(g, m.Pong) for g in told) and loop.time() < deadline:
            chunk = await asyncio.wait_for(reader.read(65536), 5)
            assert chunk, "the gateway closed the connection"
            told += [
                m.decode_global(f.payload) for f in decoder.feed(chunk) if isinstance(f, SendGlobal)
            ]
        assert [type(g) for g in told] == [m.Welcome, m.Pong]
        # A Release of a stream that does not exist ends the session; the
        # Ping behind it in the same write is moot.
        writer.write(framed(m.Release(stream="nowhere", position=0), m.Ping(nonce=6)))
        await writer.drain()
        frames = await read_until_closed(reader, 5)
    finally:
        writer.close()
    after = [m.decode_global(f.payload) for f in frames if isinstance(f, SendGlobal)]
    [error] = after
    assert isinstance(error, m.Error)
    assert error.code is ErrorCode.UNEXPECTED_FRAME and error.scope is None
