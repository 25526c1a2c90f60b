"""The producer's spool against a real gateway: crashes, outages, a full spool, damage.

Each test reads the stream log back and checks that every record the spool
held is there exactly once: sequence numbers run on without gap or repeat
(``values_in_order``) and the values are the ones sent, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from headgate.client import Producer, ProducerGaveUp
from headgate.client.spool import Spool, SpoolError
from headgate.protocol.records import decode_records, encode_records
from tests.helpers import AckHoldingProxy, KiB, gateway, read_log, records, run, values_in_order


def spooled_values(directory: Path) -> list[bytes]:
    """The values a spool holds, read as a producer resuming it would."""
    spool = Spool(directory, 1 << 30)
    try:
        return [
            value
            for batches in spool.recovered.values()
            for batch in batches
            for value in decode_records(batch.block).to_lists()[0]
        ]
    finally:
        spool.close()


CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from headgate.client import Producer

    async def main() -> None:
        host, port, spool = sys.argv[1], int(sys.argv[2]), sys.argv[3]
        p = Producer((host, port), spool=spool, linger_ms=1, max_batch_bytes=2048)
        await p.connect()
        for i in range(10_000_000):
            await p.send("k", b"c-%07d" % i)
            if i % 500 == 0:
                print(i, p.statistics().streams["k"].records_acked, flush=True)
                await asyncio.sleep(0)

    asyncio.run(main())
    """
)


def test_a_producer_killed_mid_stream_is_resumed_from_its_spool_exactly_once(
    tmp_path: Path,
) -> None:
    spool_dir = tmp_path / "spool"
    data_dir = tmp_path / "data"

    async def scenario() -> None:
        async with gateway(data_dir) as gw:
            proxy = AckHoldingProxy(gw.address)
            host, port = await proxy.start()
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
            child = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                CHILD,
                host,
                str(port),
                str(spool_dir),
                stdout=asyncio.subprocess.PIPE,
                env=env,
            )
            assert child.stdout is not None
            try:
                sent = acked = 0
                while sent < 20_000 or acked < 10_000:  # mid-stream, the gateway storing
                    line = await child.stdout.readline()
                    assert line, "the child producer ended early"
                    sent, acked = map(int, line.split())
                # From here the gateway stores batches whose Acks never arrive.
                proxy.hold = True
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.5):
                        while line := await child.stdout.readline():
                            sent, acked = map(int, line.split())
            finally:
                child.send_signal(signal.SIGKILL)
                await child.wait()
                await proxy.close()
        stored = {v for f in read_log(data_dir, "k") for v in f.values}
        assert len(stored) > acked  # some spooled batches are stored, unacknowledged
        in_spool = spooled_values(spool_dir)
        assert in_spool  # the kill left batches the gateway had not acknowledged
        must_hold = stored | set(in_spool)

        async with gateway(data_dir) as gw, Producer(gw.address, spool=spool_dir) as again:
            await again.flush()
            producer_id = again.producer_id
            assert again.statistics().spool_bytes == 0
        log = values_in_order(read_log(data_dir, "k"), producer_id)
        assert log == records("c", len(log))  # in order, each once, none skipped
        assert set(log) == must_hold

    run(scenario(), timeout=60)


def test_a_producer_that_gave_up_is_resumed_from_its_spool_exactly_once(tmp_path: Path) -> None:
    values = records("r", 3000)
    spool_dir = tmp_path / "spool"

    async def scenario() -> None:
        async with gateway(tmp_path / "data") as gw:
            proxy = AckHoldingProxy(gw.address)
            address = await proxy.start()
            p = Producer(address, reconnect_timeout=0.5, max_batch_bytes=2 * KiB, spool=spool_dir)
            for value in values[:1000]:
                await p.send("s", value)
            await p.flush()
            proxy.hold = True  # stored from here on, never acknowledged
            for value in values[1000:2000]:
                await p.send("s", value)
            for _ in range(200):
                stats = p.statistics().streams["s"]
                if stats.batches_queued == 0 and stats.open_records == 0:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # the gateway's group commit
            stored = values_in_order(read_log(tmp_path / "data", "s"), p.producer_id)
            await proxy.close()
            for value in values[2000:]:  # handed over while the gateway is away
                await p.send("s", value)
            with pytest.raises(ProducerGaveUp):
                await p.flush()
            with pytest.raises(SpoolError, match="in use"):
                Producer(gw.address, spool=spool_dir)
            await p.abort()
        assert len(stored) > 1000  # some pending batches are stored already
        # Everything not acknowledged, and maybe acknowledged entries of a
        # segment not full yet (the gateway drops those).
        in_spool = spooled_values(spool_dir)
        assert len(in_spool) >= 2000 and in_spool == values[-len(in_spool) :]
        with pytest.raises(ValueError, match="belongs to producer id"):
            Producer("127.0.0.1:1", spool=spool_dir, producer_id=p.producer_id + 1)

        async with (
            gateway(tmp_path / "data") as gw,
            Producer(gw.address, spool=spool_dir) as again,
        ):
            assert again.producer_id == p.producer_id
            await again.send("s", b"after")
        assert values_in_order(read_log(tmp_path / "data", "s"), p.producer_id) == [
            *values,
            b"after",
        ]
        assert sorted(spool_dir.glob("*.seg")) == []

    run(scenario(), timeout=30)


def test_a_full_spool_makes_send_wait_and_loses_nothing(tmp_path: Path) -> None:
    values = [b"%06d-" % i + b"x" * 100 for i in range(20_000)]  # about 2.2 MB
    bound = 128 * KiB

    async def scenario() -> None:
        async with (
            gateway(tmp_path / "data") as gw,
            Producer(
                gw.address,
                spool=tmp_path / "spool",
                spool_max_bytes=bound,
                max_batch_bytes=8 * KiB,
            ) as p,
        ):
            peak_spool = peak_buffered = 0
            for i, value in enumerate(values):
                await p.send("s", value)
                if i % 50 == 0:
                    stats = p.statistics()
                    assert stats.spool_bytes is not None
                    peak_spool = max(peak_spool, stats.spool_bytes)
                    peak_buffered = max(peak_buffered, stats.streams["s"].buffered_bytes)
            await p.flush()
            stats = p.statistics()
            assert stats.spool_full > 0
            producer_id = p.producer_id
        assert peak_spool <= bound
        # send() waited for the spool, far below max_buffered_bytes (64 MiB).
        assert peak_buffered <= bound + 3 * 8 * KiB
        assert values_in_order(read_log(tmp_path / "data", "s"), producer_id) == values

    run(scenario(), timeout=60)


def test_a_damaged_spool_is_named_and_its_intact_entries_are_sent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spool_dir = tmp_path / "spool"
    batches = [records(f"b{n}", 10) for n in range(8)]
    spool = Spool(spool_dir, 1 << 20)
    spool.write_identity(4242, b"")
    for n in range(5):
        spool.append("s", 10 * n, 10, encode_records(batches[n]))
    spool.sync()
    spool.close()
    spool = Spool(spool_dir, 1 << 20)  # a second segment
    for n in range(5, 8):
        spool.append("s", 10 * n, 10, encode_records(batches[n]))
    spool.sync()
    spool.close()
    first, second = sorted(spool_dir.glob("*.seg"))
    # Batch 2's records are damaged on disk; batch 7 is cut short by a crash.
    data = bytearray(first.read_bytes())
    at = data.index(b"b2-0000005")
    data[at] ^= 0xFF
    first.write_bytes(bytes(data))
    with second.open("r+b") as f:
        f.truncate(second.stat().st_size - 7)

    async def scenario() -> None:
        async with gateway(tmp_path / "data") as gw:
            with caplog.at_level(logging.WARNING, logger="headgate.spool"):
                p = Producer(gw.address, spool=spool_dir)
            async with p:
                assert p.producer_id == 4242
                await p.flush()
        damaged = [r.getMessage() for r in caplog.records if r.name == "headgate.spool"]
        assert len(damaged) == 1 and str(first) in damaged[0] and "checksum" in damaged[0]
        intact = [v for n in (0, 1, 3, 4, 5, 6) for v in batches[n]]
        assert values_in_order(read_log(tmp_path / "data", "s"), 4242) == intact

    run(scenario(), timeout=20)


def test_a_restart_segment_replaces_older_ones_even_if_a_crash_kept_them(tmp_path: Path) -> None:
    # Batches numbered afresh are written to a RESTART segment before the old
    # segments are deleted; a crash in between leaves both, and the older
    # numbering must not come back (it would store the records twice).
    spool = Spool(tmp_path, 1 << 20)
    spool.write_identity(7, b"")
    spool.append("s", None, 2, encode_records([b"a", b"b"]))
    spool.sync()
    (old,) = tmp_path.glob("*.seg")
    kept = old.read_bytes()
    spool.restart("s", [(40, 2, encode_records([b"a", b"b"]))])
    assert not old.exists()
    spool.close()
    old.write_bytes(kept)  # as if the crash came before the deletion was durable
    again = Spool(tmp_path, 1 << 20)
    try:
        assert [(b.first_sequence, b.record_count) for b in again.recovered["s"]] == [(40, 2)]
        assert not old.exists()
        assert again.producer_id == 7
    finally:
        again.close()
