"""The gateway against raw protocol peers on loopback.

These peers drive a sans-IO producer session by hand over a real socket, so a
test can send exactly the frames it wants, including wrong ones. The producer
library has its own tests (tests/client).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from headgate.gateway import Gateway
from headgate.protocol import messages as m
from headgate.protocol.codec import FrameDecoder, encode_frame
from headgate.protocol.errors import ErrorCode
from headgate.protocol.frames import Absolve, Apologise, SendChannel, SendGlobal
from headgate.protocol.records import encode_records
from headgate.protocol.session import (
    GuaranteesReceived,
)
from tests.helpers import RawPeer, config, earn, stored, write_what_fits

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[Gateway]:
    gw = Gateway(config(tmp_path))
    await gw.start()
    yield gw
    await gw.stop()


async def test_batches_are_stored_acked_when_durable_and_credit_comes_from_log_space(
    gateway: Gateway, tmp_path: Path
) -> None:
    peer = RawPeer()
    await peer.connect(gateway.address)
    h = await peer.bind("ticks")
    await peer.until(lambda: peer.session.outbound(m.data_channel(h)).guarantees > 0)
    stream = gateway.streams["ticks"]
    # Guarantees never exceed what the log can take beyond the padding reserve.
    assert peer.session.outbound(2).guarantees <= stream.log.free_capacity - stream.reserve
    for i in range(10):
        assert peer.session.send_batch(h, i * 2, encode_records([b"v%d" % i, b"w%d" % i]))
    await peer.send()
    await peer.until(lambda: peer.acked(h) == 20)
    assert stream.log.durable_position >= stream.log.tail_position - 0
    got = stored(tmp_path / "data", "ticks")
    assert [s for _, s, _ in got] == list(range(0, 20, 2))
    assert got[0] == (1, 0, [b"v0", b"w0"])
    await peer.close()


async def test_a_full_stream_waits_while_another_on_the_same_connection_flows(
    tmp_path: Path,
) -> None:
    gw = Gateway(config(tmp_path))
    await gw.start()
    try:
        peer = RawPeer()
        await peer.connect(gw.address)
        a = await peer.bind("a")
        b = await peer.bind("b")
        block = encode_records([b"x" * 1000] * 8)
        sent_a = 0
        await peer.until(lambda: peer.session.outbound(m.data_channel(a)).guarantees > 0)
        # A uses all it is granted, and so earns more, until its log is full.
        for _ in range(20):
            before = sent_a
            while peer.session.send_batch(a, sent_a * 8, block):
                sent_a += 1
            await peer.send()
            for _ in range(5):
                await peer.pump()
            if sent_a == before:
                break
        assert 0 < sent_a < 64, "A's credit is bounded by its log's capacity"
        # Nothing releases A. B still flows, many times A's capacity over time.
        sent_b = 0
        for _ in range(200):
            await peer.until(lambda: peer.session.can_send_batch(b, len(block)))
            while peer.session.send_batch(b, sent_b * 8, block):
                sent_b += 1
            await peer.send()
            await peer.until(lambda n=sent_b: peer.acked(b) == n * 8)
            # B's consumer keeps up: release everything durable.
            gw.release("b", gw.streams["b"].log.durable_position)
            if sent_b > 3 * sent_a:
                break
        assert sent_b > 3 * sent_a
        assert not peer.session.can_send_batch(a, len(block)), "A must still be waiting"
        # Spark releases A: A resumes.
        await peer.until(lambda: peer.acked(a) == sent_a * 8)
        gw.release("a", gw.streams["a"].log.durable_position)
        await peer.until(lambda: peer.session.can_send_batch(a, len(block)))
        await peer.close()
    finally:
        await gw.stop()


async def test_resent_batches_are_not_stored_twice_even_across_a_restart(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    gw = Gateway(cfg)
    await gw.start()
    peer = RawPeer(producer_id=42)
    await peer.connect(gw.address)
    h = await peer.bind("s")
    await peer.until(lambda: peer.session.outbound(2).guarantees > 0)
    for i in range(5):
        peer.session.send_batch(h, i, encode_records([b"%d" % i]))
    await peer.send()
    await peer.until(lambda: peer.acked(h) == 5)
    await peer.close()
    await gw.stop()

    gw = Gateway(cfg)  # a restart on the same data
    await gw.start()
    try:
        again = RawPeer(producer_id=42, secret=peer.secret)
        await again.connect(gw.address)
        h = await again.bind("s")
        assert again.acked(h) == 5, "the initial ack says where the sequence resumes"
        await again.until(lambda: again.session.outbound(2).guarantees > 0)
        # A resend of everything (say the acks were lost), then one new batch.
        for i in range(6):
            again.session.send_batch(h, i, encode_records([b"%d" % i]))
        await again.send()
        await again.until(lambda: again.acked(h) == 6)
        seqs = [s for _, s, _ in stored(tmp_path / "data", "s")]
        assert seqs == [0, 1, 2, 3, 4, 5]
        assert gw.streams["s"].duplicate_batches == 5
        await again.close()
    finally:
        await gw.stop()


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (encode_frame(Absolve(channel=2, amount=10**9)), ErrorCode.ABSOLVED_TOO_MUCH),
        (encode_frame(Apologise(channel=2)), ErrorCode.UNEXPECTED_APOLOGY),
        (
            encode_frame(SendChannel(channel=2, payload=m.encode_batch_header(0) + b"junk")),
            ErrorCode.MALFORMED_MESSAGE,
        ),
        (encode_frame(SendChannel(channel=40, payload=b"x" * 20)), ErrorCode.UNKNOWN_HANDLE),
        (b"\x8f" + b"\xff" * 8, ErrorCode.FRAME_TOO_LARGE),
    ],
)
async def test_a_misbehaving_client_gets_its_error_and_others_are_undisturbed(
    gateway: Gateway, tmp_path: Path, raw: bytes, code: ErrorCode
) -> None:
    good = RawPeer(producer_id=1)
    await good.connect(gateway.address)
    hg = await good.bind("good")
    bad = RawPeer(producer_id=2)
    await bad.connect(gateway.address)
    await bad.bind("bad")
    await bad.send(raw)
    await bad.until(lambda: bad.closed)
    assert [e.code for e in bad.errors()] == [code]
    # The good client on the same gateway keeps working and loses nothing.
    await good.until(lambda: good.session.outbound(m.data_channel(hg)).guarantees > 0)
    for i in range(20):
        assert good.session.send_batch(hg, i, encode_records([b"ok"]))
    await good.send()
    await good.until(lambda: good.acked(hg) == 20)
    assert len(stored(tmp_path / "data", "good")) == 20
    await good.close()


async def test_a_peer_that_sends_no_hello_is_told_so(gateway: Gateway) -> None:
    reader, writer = await asyncio.open_connection(*gateway.address)
    writer.write(encode_frame(Apologise(channel=0)))
    data = await asyncio.wait_for(reader.read(), 5)
    frames = FrameDecoder(max_payload=1 << 16).feed(data)
    assert len(frames) == 1 and isinstance(frames[0], SendGlobal)
    error = m.decode_global(frames[0].payload)
    assert isinstance(error, m.Error) and error.code is ErrorCode.BAD_HELLO
    writer.close()


async def test_two_writers_of_one_stream_share_its_capacity(gateway: Gateway) -> None:
    first = RawPeer(producer_id=1)
    await first.connect(gateway.address)
    h1 = await first.bind("shared")
    stream = gateway.streams["shared"]
    room = stream.log.capacity - stream.reserve

    def held(peer: RawPeer, h: int) -> int:
        return peer.session.outbound(m.data_channel(h)).guarantees

    # A writer that uses its credit earns the whole stream, the consumer keeping up.
    s1 = await earn(first, h1, gateway, "shared", room * 3 // 4 + 1)
    alone = held(first, h1)
    second = RawPeer(producer_id=2)
    await second.connect(gateway.address)
    h2 = await second.bind("shared")
    # Both write: the first is pleaded down; the second gets the absolved space.
    s2 = 0
    for _ in range(5):
        s1 = await write_what_fits(first, h1, s1)
        s2 = await write_what_fits(second, h2, s2)
        await first.until(lambda n=s1: first.acked(h1) == n)
        await second.until(lambda n=s2: second.acked(h2) == n)
        gateway.release("shared", stream.log.durable_position)
        await gateway.consumers_saved()  # credit follows once the position is stored
        await first.pump()
        await second.pump()
    # While both write, each holds half. (Once quiet, each falls back to a first grant.)
    g1, g2 = held(first, h1), held(second, h2)
    assert g1 < alone and g2 > alone // 3
    assert g1 + g2 <= stream.log.free_capacity - stream.reserve
    assert abs(g1 - g2) <= alone // 10
    events = [e for e in second.events if isinstance(e, GuaranteesReceived)]
    assert events
    await first.close()
    await second.close()


async def test_an_unused_grant_stays_small_and_a_newcomer_gets_the_rest_at_once(
    gateway: Gateway,
) -> None:
    """Credit follows use: a writer that binds and never writes holds a first
    grant only, so a second writer is granted the rest without a Plead."""
    idle = RawPeer(producer_id=1)
    await idle.connect(gateway.address)
    h1 = await idle.bind("unused")
    stream = gateway.streams["unused"]
    room = stream.log.capacity - stream.reserve
    await idle.until(lambda: idle.session.outbound(m.data_channel(h1)).guarantees > 0)
    await idle.pump(0.3)
    first_grant = idle.session.outbound(m.data_channel(h1)).guarantees
    assert 0 < first_grant < room // 2, "not the whole stream, as it was alone"
    newcomer = RawPeer(producer_id=2)
    await newcomer.connect(gateway.address)
    h2 = await newcomer.bind("unused")
    # The newcomer uses what it gets, and earns the rest of the stream
    # (short of a frame's rounding).
    await earn(newcomer, h2, gateway, "unused", room - first_grant - 16 * 1024)
    assert stream.writers[0].pleaded is None, "nobody had to be pleaded"
    await idle.close()
    await newcomer.close()


async def test_a_release_beyond_the_tail_or_between_frames_is_refused_and_loses_nothing(
    gateway: Gateway, tmp_path: Path
) -> None:
    peer = RawPeer()
    await peer.connect(gateway.address)
    h = await peer.bind("r")
    await peer.until(lambda: peer.session.outbound(m.data_channel(h)).guarantees > 0)
    for i in range(4):
        peer.session.send_batch(h, i, encode_records([b"v"]))
    await peer.send()
    await peer.until(lambda: peer.acked(h) == 4)
    stream = gateway.streams["r"]
    for bad in (2**60, stream.log.tail_position + 8, 8):
        spark = RawPeer(producer_id=99)
        await spark.connect(gateway.address)
        spark.session.send_global(m.Release(stream="r", position=bad))
        await spark.send()
        await spark.until(lambda s=spark: s.closed)
        assert [e.code for e in spark.errors()] == [ErrorCode.UNEXPECTED_FRAME]
    assert stream.log.release_position == 0
    assert len(stored(tmp_path / "data", "r")) == 4


async def test_a_release_on_an_idle_stream_reclaims_its_terms(tmp_path: Path) -> None:
    gw = Gateway(config(tmp_path, term_length=16 * 1024, max_message_size=4096))
    await gw.start()
    try:
        peer = RawPeer()
        await peer.connect(gw.address)
        h = await peer.bind("idle")
        block = encode_records([b"z" * 3000])
        sent = 0
        while gw.streams["idle"].log.tail_position < 3 * 16 * 1024:
            await peer.until(lambda: peer.session.can_send_batch(h, len(block)))
            peer.session.send_batch(h, sent, block)
            sent += 1
            await peer.send()
            await peer.until(lambda n=sent: peer.acked(h) == n)
        terms = tmp_path / "data" / "streams" / "idle"
        before = len(list(terms.glob("*.term")))
        gw.release("idle", gw.streams["idle"].log.durable_position)
        # Nothing more is appended; the release alone must reach the disk.
        for _ in range(100):
            await asyncio.sleep(0.02)
            if len(list(terms.glob("*.term"))) < before:
                break
        assert len(list(terms.glob("*.term"))) < before
    finally:
        await gw.stop()
