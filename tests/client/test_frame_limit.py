"""Batches sealed before the gateway's Welcome said how large its frames may be (issue 19).

A producer seals batches up to ``max_batch_bytes`` until the Welcome tells
it the gateway's ``max_message_size``; a fleet producer, which connects in
the background, does so routinely. Such a batch is cut to the gateway's
limit before it goes, so the session is not refused with FRAME_TOO_LARGE,
and its records land once, in order, under consecutive sequence numbers.
Real gateways on 127.0.0.1, with small frames.
"""

from __future__ import annotations

from pathlib import Path

from headgate.client import Producer, StreamRefused
from headgate.client.errors import PendingBatch
from headgate.protocol.errors import ErrorCode
from headgate.protocol.records import encode_records
from tests.helpers import KiB, gateway, read_log, records, run, values_in_order

#: The gateway's frame limit here; the producers' batches are 256 KiB by default.
FRAME = 16 * KiB


def test_records_taken_before_the_welcome_are_cut_to_the_gateways_frames(tmp_path: Path) -> None:
    values = records("early", 6000)  # about 100 KiB: one batch under the default limit
    keys: list[bytes | None] = [None if i % 3 else b"k%d" % (i % 11) for i in range(6000)]

    async def scenario() -> None:
        async with gateway(tmp_path, max_message_size=FRAME) as gw:
            p = Producer(gw.address, linger_ms=1000)
            try:
                # send_nowait starts connecting and takes the records at once:
                # all of them are in the open batch before the Welcome.
                for value in values:
                    p.send_nowait("plain", value)
                for value, key in zip(values, keys, strict=True):
                    p.send_nowait("keyed", value, key)
                assert not p.connected
                await p.flush()
                stats = p.statistics()
                assert stats.reconnects == 0 and stats.failure is None
                for name in ("plain", "keyed"):
                    assert stats.streams[name].records_acked == 6000
                    assert stats.streams[name].next_sequence == 6000
                    assert stats.streams[name].buffered_bytes == 0
            finally:
                await p.close()
            for name in ("plain", "keyed"):
                frames = read_log(gw.config.data_dir, name)
                assert len(frames) > 6, "the one sealed batch went in pieces"
                assert values_in_order(frames, p.producer_id) == values
            keyed = read_log(gw.config.data_dir, "keyed")
            assert [k for f in keyed for k in (f.keys or [None] * f.record_count)] == keys

    run(scenario(), timeout=30)


def test_resent_batches_larger_than_the_frames_keep_their_sequences(tmp_path: Path) -> None:
    """Batches another producer numbered (ProducerGaveUp.pending) are cut, numbers kept."""
    first = records("given", 3000)
    second = records("given", 3000, start=3000)
    pending = [
        PendingBatch("s", 0, 3000, encode_records(first)),
        PendingBatch("s", 3000, 3000, encode_records(second)),
    ]

    async def scenario() -> None:
        async with gateway(tmp_path, max_message_size=FRAME) as gw:
            async with Producer(gw.address, producer_id=77) as p:
                deliveries = p.resend(pending)
                result = await deliveries["s"]
                assert result.first_sequence == 0 and result.record_count == 6000
                assert p.statistics().streams["s"].next_sequence == 6000
                await p.send("s", b"after")
            frames = read_log(gw.config.data_dir, "s")
            assert values_in_order(frames, 77) == first + second + [b"after"]

    run(scenario(), timeout=30)


def test_a_record_beyond_the_gateways_frames_refuses_its_stream_only(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with gateway(tmp_path, max_message_size=FRAME) as gw:
            p = Producer(gw.address, linger_ms=1000)
            try:
                p.send_nowait("big", b"x" * (2 * FRAME))  # fits max_batch_bytes, not the frame
                p.send_nowait("fine", b"small")
                try:
                    await p.flush("big")
                except StreamRefused as exc:
                    assert exc.code is ErrorCode.FRAME_TOO_LARGE
                    assert "max_message_size" in str(exc)
                else:
                    raise AssertionError("the oversized record was taken")
                await p.flush("fine")
                assert p.statistics().streams["fine"].records_acked == 1
                assert p.statistics().reconnects == 0, "the session survived"
            finally:
                await p.abort()

    run(scenario(), timeout=30)
