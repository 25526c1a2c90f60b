"""The gateway's receive path end to end through the feed() seam: ring, slab, writer."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import pytest

from headgate.costs import batch_cost
from headgate.gateway import Gateway, GatewayConnection, Stream
from headgate.gateway.streams import AppendOutcome
from headgate.protocol import messages as m
from headgate.protocol.errors import ErrorCode
from headgate.protocol.records import encode_records
from headgate.protocol.session import Role, Session
from tests.helpers import RawPeer, config, stored

pytestmark = pytest.mark.timeout(60)


def exchange(conn: GatewayConnection, producer: Session, data: bytes, rng: random.Random) -> None:
    """Feed ``data`` in random pieces, then hand the gateway's answer back."""
    pos = 0
    while pos < len(data):
        cut = rng.choice([1, 7, 100, 4096, 70_000, 300_000])
        conn.feed(data[pos : pos + cut])
        pos += cut
    answer = conn.session.data_to_send()
    if answer:
        producer.receive_data(answer)


async def test_batches_fed_in_any_pieces_are_stored_once_in_order(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rng = random.Random(11)
    gw = Gateway(
        config(
            tmp_path,
            max_message_size=512 * 1024,
            term_length=2 << 20,
            stream_capacity=16 << 20,
        )
    )
    await gw.start()
    try:
        conn = GatewayConnection(gw, 999)  # no transport: what it answers stays queued
        gw.connections[conn.conn_id] = conn
        producer = Session(Role.PRODUCER, data_cost=batch_cost, max_message_size=1 << 20)
        producer.send_global(m.Hello(producer_id=5, client_name="fed"))
        exchange(conn, producer, producer.data_to_send(), rng)
        handle = producer.bind_stream("fed")
        assert handle is not None
        exchange(conn, producer, producer.data_to_send(), rng)
        expected: list[bytes] = []
        sequence = 0
        for _ in range(40):
            # Small batches and batches larger than the first ring, mixed.
            size = rng.choice([10, 1000, 60_000, 200_000, 400_000])
            values = [bytes([sequence % 251]) * (size // 4)] * 4
            block = encode_records(values)
            for _ in range(100):
                if producer.can_send_batch(handle, len(block)):
                    break
                await gw.commit()
                exchange(conn, producer, b"", rng)
            assert producer.send_batch(handle, sequence, block)
            expected += values
            sequence += len(values)
            exchange(conn, producer, producer.data_to_send(), rng)
            gw.release("fed", gw.streams["fed"].log.durable_position)
        await gw.commit()
        got = [v for _, _, values in stored(tmp_path / "data", "fed") for v in values]
        stream = gw.streams["fed"]
        assert stream.appended_records == len(expected)
        # Released frames are gone from the log; those left end the sequence.
        assert got == expected[len(expected) - len(got) :]
        ring = conn.ring.statistics()
        assert ring.grows >= 1 and ring.moved_bytes > 0, "big frames grew the ring"
        assert ring.messages == 0 and conn.account.debt == 0
        # Then garbage: refused with the decoder's error, nothing more stored.
        with caplog.at_level(logging.WARNING, logger="headgate.gateway"):
            conn.feed(b"\x8f" + b"\xff" * 8 + bytes(100))
        assert conn.session.closed
        assert [r.getMessage().split(":")[1].strip() for r in caplog.records] == [
            ErrorCode.FRAME_TOO_LARGE.name
        ]
        assert stream.appended_records == len(expected)
    finally:
        await gw.stop()


async def test_a_failing_append_ends_only_its_connection_and_every_loan_is_repaid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gw = Gateway(config(tmp_path))
    await gw.start()
    try:
        bad, good = RawPeer(producer_id=1), RawPeer(producer_id=2)
        for peer, name in ((bad, "broken"), (good, "fine")):
            await peer.connect(gw.address)
            h = await peer.bind(name)
            await peer.until(
                lambda p=peer, h=h: p.session.outbound(m.data_channel(h)).guarantees > 0
            )
        real_append = Stream.append

        def append(self: Stream, *args: Any, **kwargs: Any) -> AppendOutcome:
            if self.name == "broken":
                raise RuntimeError("a bug in the log writer")
            return real_append(self, *args, **kwargs)

        monkeypatch.setattr(Stream, "append", append)
        bad.session.send_batch(0, 0, encode_records([b"x"]))
        await bad.send()
        await bad.until(lambda: bad.closed or bool(bad.errors()))
        assert [e.code for e in bad.errors()] == [ErrorCode.INTERNAL]
        for i in range(5):
            good.session.send_batch(0, i, encode_records([b"y"]))
        await good.send()
        await good.until(lambda: good.acked(0) == 5)
        assert len(gw.queue) == 0
        for conn in gw.connections.values():
            assert conn.account.debt == 0
        await good.close()
    finally:
        await gw.stop()
