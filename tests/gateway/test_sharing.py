"""A gateway that is safe to share: credit, Pleads, slow peers and owned handles.

Each test is one attack of issue 13 against a real gateway on loopback, with
raw protocol peers that misbehave exactly as the attack does:

* many handles on one stream take one connection's share, not one each;
* an Absolve flood costs one rebalance per pass, not one per Absolve;
* a writer that ignores a Plead is closed with TIMEOUT at the deadline, and
  the good producer then gets the credit;
* a frame trickled byte by byte, or complete frames dripped, are no activity:
  TIMEOUT at the idle or frame deadline;
* a peer cannot free a handle the gateway bound: UNEXPECTED_FRAME.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from headgate.config import StreamSettings
from headgate.gateway import Gateway
from headgate.gateway.policies import WindowFlow
from headgate.protocol import messages as m
from headgate.protocol.c64 import U64_MAX
from headgate.protocol.codec import FrameDecoder, encode_frame
from headgate.protocol.errors import ErrorCode
from headgate.protocol.frames import Absolve, Apologise, SendChannel, SendGlobal
from headgate.protocol.records import encode_records
from headgate.protocol.session import MessageReceived, StreamBound, WelcomeReceived
from tests.gateway._tokens import Token, write_tokens
from tests.helpers import RawPeer, config, earn

pytestmark = pytest.mark.timeout(60)


def guarantees(peer: RawPeer, handle: int) -> int:
    return peer.session.outbound(m.data_channel(handle)).guarantees


def shareable(gw: Gateway, name: str) -> int:
    """What the writers of stream ``name`` share: its capacity minus the reserve."""
    stream = gw.streams[name]
    return stream.log.capacity - stream.reserve


class DeafToPleas(RawPeer):
    """A producer that never answers a Plead: its Absolves are never sent."""

    async def send(self, raw: bytes = b"") -> None:
        frames = FrameDecoder(max_payload=1 << 20).feed(self.session.data_to_send() + raw)
        kept = b"".join(encode_frame(f) for f in frames if not isinstance(f, Absolve))
        self.writer.write(kept)
        await self.writer.drain()


async def started(tmp_path: Path, **kw: object) -> Gateway:
    gw = Gateway(config(tmp_path, stream_capacity=1 << 20, **kw))
    await gw.start()
    return gw


# --- shares per connection ------------------------------------------------------------


async def test_a_thousand_handles_on_one_stream_do_not_take_the_good_producers_share(
    tmp_path: Path,
) -> None:
    gw = await started(tmp_path, bind_budget=64 * 1024, work_budget_ms=1000.0)
    try:
        flood = RawPeer(producer_id=2)
        await flood.connect(gw.address)
        handles = [flood.session.bind_stream("shared") for _ in range(1000)]
        assert None not in handles
        await flood.send()
        await flood.until(lambda: flood.acked(999) >= 0)
        # The flood's session absolves when pleaded (as long as it is read).
        pumping = asyncio.create_task(pump_forever(flood))
        good = RawPeer(producer_id=1)
        await good.connect(gw.address)
        h = await good.bind("shared")
        # With one other writer the good producer would get half; a thousand
        # handles of one connection are still one other writer. (Well before
        # the Plead deadline, which would otherwise cut the flood off.) It
        # earns its share by using it.
        half = shareable(gw, "shared") // 2
        started_at = time.monotonic()
        await earn(good, h, gw, "shared", 0.9 * half)
        assert time.monotonic() - started_at < 3
        stream = gw.streams["shared"]
        assert stream.outstanding() <= stream.log.free_capacity - stream.reserve
        assert not flood.closed
        pumping.cancel()
        await flood.close()
        await good.close()
    finally:
        await gw.stop()


async def pump_forever(peer: RawPeer) -> None:
    while not peer.closed:
        await peer.pump()


async def test_an_absolve_flood_over_600_handles_rebalances_once_per_pass(
    tmp_path: Path,
) -> None:
    gw = await started(tmp_path, bind_budget=64 * 1024, work_budget_ms=1000.0)
    try:
        flood = RawPeer(producer_id=2)
        await flood.connect(gw.address)
        handles = [flood.session.bind_stream("absolved") for _ in range(600)]
        await flood.send()
        await flood.until(lambda: flood.acked(599) >= 0)
        await flood.until(lambda: guarantees(flood, 599) > 0)
        flow = gw.flow(gw.streams["absolved"])
        rebalances = 0
        rebalance = flow.rebalance

        def counted(now: float) -> None:
            nonlocal rebalances
            rebalances += 1
            rebalance(now)

        flow.rebalance = counted  # type: ignore[method-assign,misc]  # counts the calls
        absolves = b"".join(
            encode_frame(Absolve(channel=m.data_channel(h), amount=0))
            for _ in range(10)
            for h in handles
            if h is not None
        )
        ping = SendGlobal(payload=m.encode_message(m.Ping(nonce=77)))
        await flood.send(absolves + encode_frame(ping))
        await flood.until(
            lambda: any(
                isinstance(e, MessageReceived) and e.message == m.Pong(nonce=77)
                for e in flood.events
            )
        )
        # 6,000 Absolves; the stream was re-shared once per pass of the loop
        # (plus the 0.1 s housekeeping), not once per Absolve.
        assert 0 < rebalances < 600
        await flood.close()
    finally:
        await gw.stop()


async def test_a_window_stream_bound_many_times_by_one_connection_gives_it_one_window(
    tmp_path: Path,
) -> None:
    window = StreamSettings(policy="window", window=4)
    gw = await started(tmp_path, streams={"w": window})
    try:
        many = RawPeer(producer_id=2)
        await many.connect(gw.address)
        handles = [many.session.bind_stream("w") for _ in range(10)]
        await many.send()
        await many.until(lambda: many.acked(9) >= 0)
        flow = gw.flow(gw.streams["w"])
        assert isinstance(flow, WindowFlow)
        slot_bytes = flow.slot  # guarantees per window slot
        await many.until(lambda: sum(guarantees(many, h) for h in handles if h is not None) > 0)
        good = RawPeer(producer_id=1)
        await good.connect(gw.address)
        h = await good.bind("w")
        await good.until(lambda: guarantees(good, h) == 4 * slot_bytes)
        await many.pump(0.2)
        assert sum(guarantees(many, x) for x in handles if x is not None) == 4 * slot_bytes
        # A freed handle's slots go to a sibling that has none.
        first = next(x for x in handles if x is not None and guarantees(many, x) > 0)
        many.session.free_stream(first)
        await many.send()
        await many.until(
            lambda: (
                sum(guarantees(many, x) for x in handles if x not in (None, first))
                == 4 * slot_bytes
            )
        )
        await many.close()
        await good.close()
    finally:
        await gw.stop()


# --- the Plead deadline ---------------------------------------------------------------------


async def test_a_writer_that_ignores_a_plead_is_closed_at_the_deadline_and_the_good_one_gets_credit(
    tmp_path: Path,
) -> None:
    gw = await started(tmp_path, plead_deadline_ms=500)
    try:
        hog = DeafToPleas(producer_id=2)
        await hog.connect(gw.address)
        welcome = [e.welcome for e in hog.events if isinstance(e, WelcomeReceived)]
        assert [w.plead_deadline_ms for w in welcome] == [500]
        hh = await hog.bind("victim")
        total = shareable(gw, "victim")
        await earn(hog, hh, gw, "victim", 0.9 * total)  # alone and writing: all of it
        good = RawPeer(producer_id=1)
        await good.connect(gw.address)
        pleaded_at = time.monotonic()
        h = await good.bind("victim")
        await good.until(lambda: guarantees(good, h) > 0)
        assert time.monotonic() - pleaded_at < 0.5 + 1.5
        await hog.until(lambda: hog.closed, timeout=5)
        [error] = hog.errors()
        assert error.code is ErrorCode.TIMEOUT
        assert "did not absolve" in error.text and "'victim'" in error.text
        # The good producer writes with it.
        for i in range(10):
            assert good.session.send_batch(h, i, encode_records([b"mine"]))
        await good.send()
        await good.until(lambda: good.acked(h) == 10)
        await good.close()
    finally:
        await gw.stop()


async def test_the_plead_deadline_waits_while_the_gateway_does_not_read_the_writer(
    tmp_path: Path,
) -> None:
    # The hog also writes an XON/XOFF stream; past its watermark the gateway
    # stops reading the hog's whole connection, so an Absolve could not be
    # read: the deadline does not run until the gateway reads again.
    xonxoff = StreamSettings(policy="xonxoff", xoff=32 * 1024, xon=0)
    gw = await started(tmp_path, plead_deadline_ms=300, streams={"x": xonxoff})
    try:
        hog = DeafToPleas(producer_id=2)
        await hog.connect(gw.address)
        hv = await hog.bind("victim")
        await earn(hog, hv, gw, "victim", 0.9 * shareable(gw, "victim"))
        hx = await hog.bind("x")
        await hog.until(lambda: guarantees(hog, hx) > 0)
        for i in range(8):
            assert hog.session.send_batch(hx, i, encode_records([b"x" * 8000]))
        await hog.send()
        (conn,) = [c for c in gw.connections.values() if c.writers]
        await hog.until(lambda: conn.reading_paused)
        good = RawPeer(producer_id=1)
        await good.connect(gw.address)
        await good.bind("victim")  # the hog is pleaded now
        await asyncio.sleep(1.0)  # three deadlines
        await hog.pump()
        assert not hog.closed and not hog.errors()
        # The consumer catches up: the gateway reads the hog again, and now
        # its deadline runs (and, deaf, it misses it).
        gw.release("x", gw.streams["x"].log.durable_position)
        await gw.commit()
        gw.release("x", gw.streams["x"].log.tail_position)
        await hog.until(lambda: hog.closed, timeout=5)
        assert [e.code for e in hog.errors()] == [ErrorCode.TIMEOUT]
        await good.close()
    finally:
        await gw.stop()


async def test_a_deaf_writer_that_spends_its_budget_on_pings_still_meets_the_plead_deadline(
    tmp_path: Path,
) -> None:
    # Held by its own budget, the hog is read only now and then: were that a
    # reason to stop its Plead clock, a Ping flood would let it keep the
    # victim's guarantees until the idle timeout.
    hog_token, good_token = b"hog-" + b"h" * 40, b"good-" + b"g" * 40
    tokens = write_tokens(
        tmp_path / "tokens.toml",
        Token("hog", hog_token.decode(), write=("victim",)),
        Token("good", good_token.decode(), write=("victim",)),
    )
    gw = await started(tmp_path, plead_deadline_ms=500, work_budget_ms=2.0, auth_file=tokens)
    try:
        hog = DeafToPleas(producer_id=2, token=hog_token)
        await hog.connect(gw.address)
        hh = await hog.bind("victim")
        total = shareable(gw, "victim")
        await earn(hog, hh, gw, "victim", 0.9 * total)
        # A Metadata request between Pings (its Absolves it drops, and Pings
        # alone, back to back, would be cut off first by the Ping rule).
        pings = b"".join(
            encode_frame(SendGlobal(payload=m.encode_message(message)))
            for i in range(25)
            for message in (m.Ping(nonce=i), m.Metadata(request_id=i))
        )
        good = RawPeer(producer_id=1, token=good_token)
        await good.connect(gw.address)
        h = await good.bind("victim")  # the hog is pleaded now
        (conn,) = [c for c in gw.connections.values() if c.rights and c.rights.name == "hog"]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5.0
        held = False
        while not hog.closed and loop.time() < deadline:
            # 1,250 Pings and as many Metadata a second: far beyond its budget.
            await hog.send(pings)
            await hog.pump(0.02)
            held = held or conn.pauses_own_reads(time.monotonic())
        assert held, "the flood never spent the hog's budget: the test proves nothing"
        assert hog.closed, "the deaf hog kept its guarantees by flooding Pings"
        assert [e.code for e in hog.errors()] == [ErrorCode.TIMEOUT]
        await earn(good, h, gw, "victim", 0.9 * total)
        await good.close()
    finally:
        await gw.stop()


# --- slow peers -----------------------------------------------------------------------


async def trickle(
    writer: asyncio.StreamWriter,
    reader: asyncio.StreamReader,
    data: bytes,
    every: float,
    limit: float,
) -> tuple[float, list[m.Error]]:
    """Send ``data`` one byte per ``every`` s until the gateway closes; (when, its Errors)."""
    started = time.monotonic()
    received = bytearray()
    for byte in data:
        if time.monotonic() - started > limit:
            break
        try:
            writer.write(bytes([byte]))
            chunk = await asyncio.wait_for(reader.read(1 << 16), every)
        except TimeoutError:
            continue
        except ConnectionError:
            break
        if not chunk:
            break
        received += chunk
    closed_after = time.monotonic() - started
    frames = FrameDecoder(max_payload=1 << 20).feed(bytes(received))
    errors = []
    for frame in frames:
        if isinstance(frame, SendGlobal):
            message = m.decode_global(frame.payload)
            if isinstance(message, m.Error):
                errors.append(message)
    return closed_after, errors


async def opened(gw: Gateway) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(*gw.address)
    hello = m.Hello(producer_id=9, client_name="slow")
    writer.write(encode_frame(SendGlobal(payload=m.encode_message(hello))))
    await writer.drain()
    await asyncio.wait_for(reader.read(1 << 16), 5)  # Welcome and bind guarantees
    return reader, writer


@pytest.mark.parametrize(
    ("settings", "deadline"),
    [
        # Idle counts complete frames: the trickle is silence.
        ({"idle_timeout_ms": 800}, 0.8),
        # With idle off, the frame's own deadline (0.5 s + 32 KiB at 64 KiB/s).
        ({"idle_timeout_ms": 0, "frame_timeout_ms": 500}, 1.0),
    ],
)
async def test_half_a_32k_frame_trickled_a_byte_at_a_time_is_closed_with_timeout(
    tmp_path: Path, settings: dict[str, int], deadline: float
) -> None:
    gw = await started(tmp_path, max_message_size=32 * 1024, term_length=128 * 1024, **settings)
    try:
        peers = [await opened(gw) for _ in range(80)]
        # Eighty connections each send half of a 32 KiB frame at once...
        frame = encode_frame(SendChannel(channel=2, payload=b"x" * (32 * 1024 - 8)))
        for _, writer in peers:
            writer.write(frame[: len(frame) // 2])
        started_at = time.monotonic()
        # ... and then one byte per 0.2 s, against a deadline of about a second.
        results = await asyncio.gather(
            *(trickle(w, r, frame[len(frame) // 2 :], 0.2, 6.0) for r, w in peers)
        )
        for when, errors in results:
            assert [e.code for e in errors] == [ErrorCode.TIMEOUT]
            assert when < deadline + 1.0
        assert time.monotonic() - started_at >= deadline - 0.1
        for _, writer in peers:
            writer.close()
    finally:
        await gw.stop()


PINGS = b"".join(
    encode_frame(SendGlobal(payload=m.encode_message(m.Ping(nonce=n)))) for n in range(40)
)
ABSOLVES = encode_frame(Absolve(channel=0, amount=0)) * 40  # two bytes each


@pytest.mark.parametrize(
    ("drip", "every", "idle_ms"),
    [
        # About ten bytes a Ping, one byte per 0.15 s: a Ping per 1.5 s, each
        # byte well inside the idle timeout; no frame completes in time.
        (PINGS, 0.15, 1000),
        # Two-byte frames, one byte per 0.6 s: a frame per 1.2 s, inside the
        # idle timeout, but none arrives whole: none is activity.
        (ABSOLVES, 0.6, 1500),
    ],
    ids=["pings", "two-byte-frames"],
)
async def test_valid_frames_dripped_a_byte_at_a_time_are_closed_with_timeout(
    tmp_path: Path, drip: bytes, every: float, idle_ms: int
) -> None:
    gw = await started(tmp_path, idle_timeout_ms=idle_ms)
    try:
        reader, writer = await opened(gw)
        when, errors = await trickle(writer, reader, drip, every, 8.0)
        assert [e.code for e in errors] == [ErrorCode.TIMEOUT]
        assert idle_ms / 1000 - 0.1 < when < idle_ms / 1000 + 1.5
        writer.close()
    finally:
        await gw.stop()


async def test_a_producer_that_pings_in_whole_frames_stays_connected(tmp_path: Path) -> None:
    gw = await started(tmp_path, idle_timeout_ms=600, frame_timeout_ms=300)
    try:
        peer = RawPeer()
        await peer.connect(gw.address)
        for n in range(8):
            peer.session.send_global(m.Ping(nonce=n))
            await peer.send()
            await asyncio.sleep(0.25)
            await peer.pump()
        assert not peer.closed and not peer.errors()
        await peer.close()
    finally:
        await gw.stop()


async def test_a_peer_that_keeps_sending_after_its_refusal_still_reads_the_error(
    tmp_path: Path,
) -> None:
    gw = await started(tmp_path)
    try:
        reader, writer = await opened(gw)
        # Refused at once (nothing was dropped on channel 0), and the peer
        # goes on writing without reading: the gateway lingers, so its Error
        # is not thrown away by a reset.
        writer.write(encode_frame(Apologise(channel=0)))
        for _ in range(20):
            await asyncio.sleep(0.02)
            try:
                writer.write(encode_frame(SendGlobal(payload=m.encode_message(m.Ping(nonce=1)))))
            except ConnectionError:
                break
        received = bytearray()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                while chunk := await reader.read(1 << 16):
                    received += chunk
        frames = FrameDecoder(max_payload=1 << 20).feed(bytes(received))
        codes = [
            message.code
            for frame in frames
            if isinstance(frame, SendGlobal)
            and isinstance(message := m.decode_global(frame.payload), m.Error)
        ]
        assert codes == [ErrorCode.UNEXPECTED_APOLOGY]
        writer.close()
    finally:
        await gw.stop()


# --- handles the gateway owns --------------------------------------------------------------


async def test_a_peer_cannot_free_a_handle_the_gateway_bound(tmp_path: Path) -> None:
    gw = await started(tmp_path)
    try:
        producer = RawPeer(producer_id=1)
        await producer.connect(gw.address)
        h = await producer.bind("fetched")
        await producer.until(lambda: guarantees(producer, h) > 0)
        assert producer.session.send_batch(h, 0, encode_records([b"a", b"b"]))
        await producer.send()
        await producer.until(lambda: producer.acked(h) == 2)

        reader = RawPeer(producer_id=0)
        await reader.connect(gw.address)
        reader.session.grant(m.STREAM_CHANNEL, 4096)
        fetch = m.Fetch(
            request_id=1, stream="fetched", start_position=0, end_position=U64_MAX, max_bytes=0
        )
        reader.session.send_global(fetch)
        await reader.send()
        bound: Callable[[], bool] = lambda: any(  # noqa: E731
            isinstance(e, StreamBound) for e in reader.events
        )
        await reader.until(bound)
        # The gateway bound handle 0 for the fetch; the reader proposes to free
        # it (mine=False: the reader did not bind it), then fetches again.
        reader.session.send_global(
            m.FreeHandle(handle_type=m.HandleType.STREAM, handle=0, mine=False)
        )
        reader.session.send_global(dataclasses.replace(fetch, request_id=2))
        await reader.send()
        await reader.until(lambda: reader.closed, timeout=5)
        assert [e.code for e in reader.errors()] == [ErrorCode.UNEXPECTED_FRAME]
        # No confirming FreeHandle came back, and the gateway is fine.
        frees = [
            e
            for e in reader.events
            if isinstance(e, MessageReceived) and isinstance(e.message, m.FreeHandle)
        ]
        assert frees == []
        assert producer.session.send_batch(h, 2, encode_records([b"c"]))
        await producer.send()
        await producer.until(lambda: producer.acked(h) == 3)
        await producer.close()
    finally:
        await gw.stop()


async def test_a_token_holds_at_most_max_stream_credit_of_a_big_stream(tmp_path: Path) -> None:
    """A fair share of a big stream is not all sent ahead: what one writer holds
    unused or in flight stays under max_stream_credit, granted again as it is
    used, so that it writes far more than the cap all the same."""
    from headgate.client import Producer

    cap = 256 * 1024
    gw = Gateway(
        config(tmp_path, stream_capacity=64 * 1024**2, term_length=1024**2, max_stream_credit=cap)
    )
    await gw.start()
    try:
        async with Producer(gw.address, linger_ms=1) as producer:
            most_held = 0
            for i in range(12_000):  # ~1.6 MiB of log: six times the cap
                await producer.send("s", b"%099d" % i)
                if i % 500 == 0:
                    await asyncio.sleep(0)
                    stream = gw.streams.get("s")
                    for w in stream.writers if stream is not None else ():
                        held = w.inbound.capacity - w.inbound.buffered_bytes
                        most_held = max(most_held, held)
            await asyncio.wait_for(producer.flush(), 20)
            assert 0 < most_held <= cap, most_held
        assert gw.streams["s"].appended_records == 12_000
        assert gw.streams["s"].log.tail_position > 4 * cap
    finally:
        await gw.stop()
