"""No wire value can crash the gateway (issue 13).

Every u64 a peer can put on the wire, at 0, 1, 2**63 and 2**64 - 1, sent to
a real gateway after a valid opening: the peer gets an answer or an Error
(never INTERNAL, which would mean the value reached a bug), and the gateway
stays up: its background tasks run, nothing reaches the event loop's
exception handler, and another producer's batches are still stored and
acknowledged.

The first case is the crash found by the hostile run: a batch whose first
sequence is 2**64 - 1 was stored, its Ack (first + count) could not be
encoded, and the group commit task died with a traceback.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from headgate.gateway import Gateway
from headgate.gateway.server import GatewayConnection
from headgate.protocol import messages as m
from headgate.protocol.c64 import encode_standalone
from headgate.protocol.codec import FrameDecoder, encode_frame
from headgate.protocol.errors import ErrorCode
from headgate.protocol.frames import (
    Absolve,
    AnnounceDropping,
    Apologise,
    Frame,
    IssueGuarantees,
    LimitReceiving,
    LimitSending,
    Plead,
    SendChannel,
    SendGlobal,
)
from headgate.protocol.records import encode_records
from tests.helpers import RawPeer, config, stored

pytestmark = pytest.mark.timeout(60)

U64_EDGES = [0, 1, 2**63, 2**64 - 1]


def glob(message: m.GlobalMessage) -> bytes:
    return encode_frame(SendGlobal(payload=m.encode_message(message)))


def frame(f: Frame) -> bytes:
    return encode_frame(f)


def batch(handle: int, first_sequence: int, values: list[bytes]) -> bytes:
    payload = m.encode_batch_header(first_sequence) + encode_records(values)
    return encode_frame(SendChannel(channel=m.data_channel(handle), payload=payload))


def subscribe_every(value: int) -> bytes:
    # The encoder refuses sample_every 0 (the peer would); put it on the wire anyway.
    payload = m.encode_message(m.Subscribe(stream="s", start=m.StartAt.NOW, sample_every=1))
    assert payload.endswith(encode_standalone(1))
    return encode_frame(SendGlobal(payload=payload[:-1] + encode_standalone(value)))


#: (field, bytes for a value): every u64 field a gateway decodes from a peer.
FIELDS: list[tuple[str, Callable[[int], bytes]]] = [
    ("Batch.first_sequence", lambda v: batch(0, v, [b"x"])),
    ("Batch.first_sequence, empty", lambda v: batch(0, v, [])),
    ("Ping.nonce", lambda v: glob(m.Ping(nonce=v))),
    ("Pong.nonce", lambda v: glob(m.Pong(nonce=v))),
    (
        "FreeHandle.handle, mine",
        lambda v: glob(m.FreeHandle(handle_type=m.HandleType.STREAM, handle=v, mine=True)),
    ),
    (
        "FreeHandle.handle, theirs",
        lambda v: glob(m.FreeHandle(handle_type=m.HandleType.STREAM, handle=v, mine=False)),
    ),
    (
        "FreeHandle.handle, schema",
        lambda v: glob(m.FreeHandle(handle_type=m.HandleType.SCHEMA, handle=v, mine=True)),
    ),
    ("Release.position", lambda v: glob(m.Release(stream="s", position=v))),
    ("Subscribe.start", lambda v: glob(m.Subscribe(stream="s", start=v))),
    ("Subscribe.sample_every", subscribe_every),
    (
        "Fetch.request_id",
        lambda v: glob(
            m.Fetch(request_id=v, stream="s", start_position=0, end_position=2**64 - 1, max_bytes=0)
        ),
    ),
    (
        "Fetch.start_position",
        lambda v: glob(
            m.Fetch(request_id=1, stream="s", start_position=v, end_position=2**64 - 1, max_bytes=0)
        ),
    ),
    (
        "Fetch.end_position",
        lambda v: glob(
            m.Fetch(request_id=1, stream="s", start_position=0, end_position=v, max_bytes=0)
        ),
    ),
    (
        "Fetch.max_bytes",
        lambda v: glob(
            m.Fetch(request_id=1, stream="s", start_position=0, end_position=2**64 - 1, max_bytes=v)
        ),
    ),
    ("ListStreams.request_id", lambda v: glob(m.ListStreams(request_id=v))),
    ("DescribeStreams.request_id", lambda v: glob(m.DescribeStreams(request_id=v))),
    (
        "StreamDescriptions (unexpected)",
        lambda v: glob(
            m.StreamDescriptions(
                request_id=v,
                streams=(
                    m.StreamDescription(
                        info=m.StreamInfo(
                            stream="s",
                            start_position=v,
                            durable_position=v,
                            tail_position=v,
                            term_length=v,
                        ),
                        released_at_us=min(v, m.MAX_TIME_US),
                    ),
                ),
            )
        ),
    ),
    ("Ack", lambda v: glob(m.Ack(handle=v, next_sequence=v, durable_position=v))),
    ("Missed", lambda v: glob(m.Missed(handle=v, count=v))),
    ("FetchDone", lambda v: glob(m.FetchDone(request_id=v, next_position=v, batches=v))),
    (
        "StreamList",
        lambda v: glob(
            m.StreamList(
                request_id=v,
                streams=(
                    m.StreamInfo(
                        stream="s",
                        start_position=v,
                        durable_position=v,
                        tail_position=v,
                        term_length=v,
                    ),
                ),
            )
        ),
    ),
    (
        "Error.scope.handle",
        lambda v: glob(
            m.Error(
                code=ErrorCode.STORAGE_FULL,
                scope=m.HandleRef(handle_type=m.HandleType.STREAM, handle=v),
            )
        ),
    ),
    (
        "Welcome (unexpected)",
        lambda v: glob(
            m.Welcome(
                version=v,
                server_name="x",
                max_message_size=v,
                idle_timeout_ms=v,
                plead_deadline_ms=v,
            )
        ),
    ),
    ("IssueGuarantees.amount, bind channel", lambda v: frame(IssueGuarantees(channel=0, amount=v))),
    ("IssueGuarantees.channel", lambda v: frame(IssueGuarantees(channel=v, amount=v))),
    ("Absolve.amount", lambda v: frame(Absolve(channel=2, amount=v))),
    ("Absolve.amount, bind channel", lambda v: frame(Absolve(channel=0, amount=v))),
    ("Absolve.channel", lambda v: frame(Absolve(channel=v, amount=1))),
    ("Plead.target", lambda v: frame(Plead(channel=2, target=v))),
    ("Plead.channel", lambda v: frame(Plead(channel=v, target=0))),
    ("LimitSending.bound", lambda v: frame(LimitSending(channel=2, bound=v))),
    ("LimitSending.channel", lambda v: frame(LimitSending(channel=v, bound=0))),
    ("LimitReceiving", lambda v: frame(LimitReceiving(channel=v, bound=v))),
    ("AnnounceDropping.channel", lambda v: frame(AnnounceDropping(channel=v))),
    ("Apologise.channel", lambda v: frame(Apologise(channel=v))),
    ("SendChannel.channel", lambda v: frame(SendChannel(channel=v, payload=b"\x00" * 12))),
]


class LoopErrors:
    """What reaches the event loop's exception handler (an uncaught exception)."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        self.seen.append(context)


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[Gateway]:
    gw = Gateway(config(tmp_path))
    await gw.start()
    yield gw
    await gw.stop()


async def answered_or_closed(peer: RawPeer, nonce: int) -> None:
    """Send a Ping after what was sent; wait for its Pong or for the close."""
    peer.session.send_global(m.Ping(nonce=nonce))
    await peer.send()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    decoder = FrameDecoder(max_payload=1 << 20)
    # The session may have failed on the gateway's Error; read frames raw.
    while loop.time() < deadline:
        try:
            data = await asyncio.wait_for(peer.reader.read(1 << 16), deadline - loop.time())
        except ConnectionError:
            data = b""
        if not data:
            peer.closed = True
            return
        for f in decoder.feed(data):
            if isinstance(f, SendGlobal):
                message = m.decode_global(f.payload)
                if isinstance(message, m.Error):
                    peer.events.append(_error_event(message))
                if message == m.Pong(nonce=nonce):
                    return
    raise AssertionError("neither an answer nor a close within 10 s")


def _error_event(message: m.Error) -> Any:
    from headgate.protocol.session import MessageReceived

    return MessageReceived(message=message)


async def assert_gateway_serves(gw: Gateway, data: Path, producer_id: int) -> None:
    """The gateway is up: its tasks run and a new producer's batch is stored and acked."""
    assert all(not task.done() for task in gw._tasks), [t for t in gw._tasks if t.done()]
    good = RawPeer(producer_id=producer_id)
    await good.connect(gw.address)
    h = await good.bind("good")
    await good.until(lambda: good.session.outbound(m.data_channel(h)).guarantees > 0)
    assert good.session.send_batch(h, 0, encode_records([b"good-%d" % producer_id]))
    await good.send()
    await good.until(lambda: good.acked(h) == 1)
    assert [b"good-%d" % producer_id] in [values for _, _, values in stored(data, "good")]
    await good.close()


async def test_a_batch_at_the_last_u64_sequence_is_refused_and_the_gateway_stays_up(
    gateway: Gateway, tmp_path: Path
) -> None:
    errors = LoopErrors()
    asyncio.get_running_loop().set_exception_handler(errors)
    peer = RawPeer(producer_id=5)
    await peer.connect(gateway.address)
    h = await peer.bind("s")
    await peer.send(batch(h, 2**64 - 1, [b"x", b"y"]))
    await peer.until(lambda: peer.closed or bool(peer.errors()))
    assert [e.code for e in peer.errors()] == [ErrorCode.MALFORMED_MESSAGE]
    assert "past the last sequence" in peer.errors()[0].text
    await gateway.commit()
    assert stored(tmp_path / "data", "s") == []
    await asyncio.sleep(0.05)  # a few group commits
    await assert_gateway_serves(gateway, tmp_path / "data", producer_id=6)
    assert errors.seen == []


@pytest.mark.parametrize("value", U64_EDGES, ids=[str(v) for v in U64_EDGES])
@pytest.mark.parametrize(("field", "make"), FIELDS, ids=[name for name, _ in FIELDS])
async def test_no_u64_value_crashes_the_gateway(
    gateway: Gateway, tmp_path: Path, field: str, make: Callable[[int], bytes], value: int
) -> None:
    errors = LoopErrors()
    asyncio.get_running_loop().set_exception_handler(errors)
    peer = RawPeer(producer_id=5)
    await peer.connect(gateway.address)
    h = await peer.bind("s")
    await peer.until(lambda: peer.session.outbound(m.data_channel(h)).guarantees > 0)
    assert peer.session.send_batch(h, 0, encode_records([b"first"]))
    await peer.send()
    await peer.until(lambda: peer.acked(h) == 1)
    await peer.send(make(value))
    await answered_or_closed(peer, nonce=777)
    codes = [e.code for e in peer.errors()]
    assert ErrorCode.INTERNAL not in codes, (field, value, peer.errors())
    if peer.closed:
        assert codes, "a peer is told why it is cut off"
    await asyncio.sleep(0.01)  # a group commit or two
    await assert_gateway_serves(gateway, tmp_path / "data", producer_id=6)
    assert errors.seen == []
    # The peer's own stream holds what it wrote within the rules, and nothing
    # past the last sequence number.
    for _, first, values in stored(tmp_path / "data", "s"):
        assert first + len(values) <= m.SEQUENCE_LIMIT
    await peer.close()


@pytest.mark.parametrize("producer_id", U64_EDGES, ids=[str(v) for v in U64_EDGES])
async def test_no_hello_producer_id_crashes_the_gateway(
    gateway: Gateway, tmp_path: Path, producer_id: int
) -> None:
    peer = RawPeer(producer_id=producer_id)
    peer.reader, peer.writer = await asyncio.open_connection(*gateway.address)
    hello = m.Hello(producer_id=producer_id, client_name="edge", secret=b"\xff" * 64)
    await peer.send(glob(hello) + glob(m.Ping(nonce=3)))
    await answered_or_closed(peer, nonce=3)
    codes = [e.code for e in peer.errors()]
    if producer_id >= 2**63:
        assert codes == [ErrorCode.BAD_HELLO]
    else:
        assert codes == []
    await assert_gateway_serves(gateway, tmp_path / "data", producer_id=6)
    await peer.close()


async def test_a_bug_while_handling_a_frame_ends_only_that_connection(
    gateway: Gateway, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Any unexpected exception stands for a bug in the gateway, not the
    # peer's doing: the peer is told INTERNAL, the gateway goes on.
    def broken(self: GatewayConnection) -> None:
        raise RuntimeError("a bug")

    errors = LoopErrors()
    asyncio.get_running_loop().set_exception_handler(errors)
    monkeypatch.setattr(GatewayConnection, "_claim_producer_id", broken)
    peer = RawPeer(producer_id=5)
    await peer.connect(gateway.address)
    assert peer.session.bind_stream("s") is not None
    await peer.send()
    await peer.until(lambda: peer.closed or bool(peer.errors()))
    assert [e.code for e in peer.errors()] == [ErrorCode.INTERNAL]
    monkeypatch.undo()
    await assert_gateway_serves(gateway, tmp_path / "data", producer_id=6)
    assert errors.seen == []


async def test_a_log_written_before_the_sequence_limit_still_serves(tmp_path: Path) -> None:
    # An older gateway stored a batch past the limit; its producer's Ack must
    # still be a u64, so the next sequence is held at the limit.
    from headgate.log import StreamLog

    cfg = config(tmp_path)
    log_ = StreamLog.open(
        Path(cfg.data_dir) / "streams" / "s",
        term_length=cfg.term_length,
        capacity=cfg.stream_capacity,
    )
    log_.append(
        encode_records([b"old"]),
        producer_id=5,
        first_sequence=2**64 - 1,
        record_count=1,
        timestamp_us=0,
    )
    log_.sync()
    log_.close()
    gw = Gateway(cfg)
    await gw.start()
    try:
        peer = RawPeer(producer_id=5)
        await peer.connect(gw.address)
        h = await peer.bind("s")
        assert peer.acked(h) == m.SEQUENCE_LIMIT
        assert [e.code for e in peer.errors()] == []
        await assert_gateway_serves(gw, tmp_path / "data", producer_id=6)
        await peer.close()
    finally:
        await gw.stop()
