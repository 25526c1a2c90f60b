"""A producer that gave up, resumed exactly once, against a real gateway.

The hard case is a batch the gateway stored whose acknowledgement never
reached the producer: resending it under a fresh sequence would store it
twice. A proxy between producer and gateway holds the gateway's replies
back, so that such batches are certain to exist when the producer gives up.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from headgate.client import PendingBatch, Producer, ProducerGaveUp
from headgate.protocol.records import encode_records
from tests.helpers import AckHoldingProxy, KiB, gateway, read_log, records, run, values_in_order


def test_a_producer_that_gave_up_resends_its_pending_batches_exactly_once(
    tmp_path: Path,
) -> None:
    values = records("r", 3000)

    async def scenario() -> None:
        async with gateway(tmp_path) as gw:
            proxy = AckHoldingProxy(gw.address)
            address = await proxy.start()
            p = Producer(address, reconnect_timeout=0.5, max_batch_bytes=2 * KiB, linger_ms=1)
            for value in values[:1000]:
                await p.send("s", value)
            await p.flush()
            # From here the gateway stores what it gets, and its Acks are lost.
            proxy.hold = True
            for value in values[1000:2000]:
                await p.send("s", value)
            stats = p.statistics().streams["s"]
            for _ in range(200):
                if stats.batches_queued == 0 and stats.open_records == 0:
                    break
                await asyncio.sleep(0.01)
                stats = p.statistics().streams["s"]
            await asyncio.sleep(0.2)  # the gateway's group commit
            stored = values_in_order(read_log(tmp_path, "s"), p.producer_id)
            await proxy.close()
            # Handed to the producer while the gateway cannot be reached.
            for value in values[2000:]:
                await p.send("s", value)
            with pytest.raises(ProducerGaveUp) as raised:
                await p.flush()
            await p.abort()
        gave_up = raised.value
        pending = gave_up.pending["s"]
        assert gave_up.producer_id == p.producer_id and gave_up.producer_secret
        assert gave_up.pending_records == 2000
        numbered = [b for b in pending if b.first_sequence is not None]
        assert numbered and numbered[0].first_sequence == 1000
        assert pending[-1].first_sequence is None  # the records sent while it was away
        # The gateway holds some of the pending batches: resending them under
        # fresh sequences would duplicate those.
        assert len(stored) > 1000
        pending_values = [v for b in pending for v in b.records()[0]]
        assert pending_values == values[1000:]

        async with (
            gateway(tmp_path) as gw,
            Producer(
                gw.address,
                producer_id=gave_up.producer_id,
                producer_secret=gave_up.producer_secret,
            ) as again,
        ):
            deliveries = again.resend(gave_up.pending)
            result = await deliveries["s"]
            assert result.record_count == 2000
            await again.send("s", b"after")
            await again.flush()
            assert again.statistics().streams["s"].next_sequence == 3001
        log = values_in_order(read_log(tmp_path, "s"), gave_up.producer_id)
        assert log == [*values, b"after"]

    run(scenario(), timeout=20)


def test_resend_refuses_a_stream_already_used_and_batches_out_of_order(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with gateway(tmp_path) as gw, Producer(gw.address) as p:
            await p.send("used", b"x")
            with pytest.raises(ValueError, match="already used"):
                p.resend([PendingBatch("used", 5, 1, b"")])
            late = PendingBatch("other", None, 1, b"")
            with pytest.raises(ValueError, match="sequence order"):
                p.resend([late, PendingBatch("other", 3, 1, b"")])

    run(scenario())


def test_batches_after_a_gap_in_what_is_resent_are_numbered_afresh(tmp_path: Path) -> None:
    # Sequences 2..4 are missing from what the application kept; the gateway
    # stores a producer's sequence contiguously, so it holds nothing from the
    # gap on, and the batches after it go under fresh numbers, once each.
    first, later = [b"a", b"b"], [b"f", b"g"]

    async def scenario() -> None:
        async with gateway(tmp_path) as gw, Producer(gw.address, producer_id=99) as p:
            deliveries = p.resend(
                [
                    PendingBatch("s", 0, 2, encode_records(first)),
                    PendingBatch("s", 5, 2, encode_records(later)),
                    PendingBatch("s", None, 1, encode_records([b"new"])),
                ]
            )
            await deliveries["s"]
            assert p.statistics().streams["s"].next_sequence == 5
        assert values_in_order(read_log(tmp_path, "s"), 99) == [*first, *later, b"new"]

    run(scenario())


def test_a_delivery_renumbered_after_a_gap_reports_its_new_first_sequence(
    tmp_path: Path,
) -> None:
    # The gateway holds nothing of producer 98: its resent batch at 3 follows
    # a gap, so it is stored at 0, and its BatchResult must say 0, not 3.
    async def scenario() -> None:
        async with gateway(tmp_path) as gw, Producer(gw.address, producer_id=98) as p:
            deliveries = p.resend(
                [
                    PendingBatch("s", 3, 2, encode_records([b"a", b"b"])),
                    PendingBatch("s", 5, 1, encode_records([b"c"])),
                ]
            )
            result = await deliveries["s"]
            assert (result.first_sequence, result.record_count) == (0, 3)
        frames = read_log(tmp_path, "s")
        assert [f.first_sequence for f in frames] == [0, 2]
        assert values_in_order(frames, 98) == [b"a", b"b", b"c"]

    run(scenario())
