"""The producer against a real gateway, over real sockets on 127.0.0.1.

Every test reads the stream logs back (as Spark would) and checks that each
record is there exactly once, in order, with consecutive sequence numbers.
Gateways run in-process unless the test kills one, which then runs as a
``headgate serve`` subprocess.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from headgate.client import Producer, ProducerError, StreamRefused, SyncProducer
from headgate.config import GatewayConfig, StreamSettings
from headgate.costs import batch_cost
from headgate.gateway import Gateway
from headgate.protocol import messages as m
from headgate.protocol.errors import ErrorCode
from headgate.protocol.session import (
    BatchReceived,
    HelloReceived,
    Role,
    Session,
    StreamBound,
)
from tests.helpers import (
    SMALL,
    GatewayProcess,
    KiB,
    MiB,
    Releaser,
    free_port,
    gateway,
    read_log,
    records,
    run,
    values_in_order,
)

# --- delivery -------------------------------------------------------------------


def test_three_streams_arrive_exactly_once_and_in_order(tmp_path: Path) -> None:
    streams = {"alpha": records("a", 20_000), "beta": records("b", 20_000)}
    streams["gamma"] = records("c", 20_000)
    keys: list[bytes | None] = [None if i % 5 == 0 else b"k%d" % (i % 7) for i in range(20_000)]

    async def scenario() -> None:
        async with (
            gateway(tmp_path) as gw,
            Producer(gw.address, max_batch_bytes=16 * KiB) as p,
        ):
            for i in range(20_000):
                await p.send("alpha", streams["alpha"][i])
                await p.send("beta", streams["beta"][i])
                await p.send("gamma", streams["gamma"][i], key=keys[i])
            await p.flush()
            stats = p.statistics()
            for name in streams:
                assert stats.streams[name].records_acked == 20_000
                assert stats.streams[name].buffered_bytes == 0
                assert stats.streams[name].next_sequence == 20_000
            producer_id = p.producer_id
        for name, expected in streams.items():
            frames = read_log(tmp_path, name)
            assert len(frames) > 3  # several batches, so order across batches is tested
            assert values_in_order(frames, producer_id) == expected
        gamma = read_log(tmp_path, "gamma")
        gamma_keys = [k for f in gamma for k in (f.keys or [None] * len(f.values))]
        assert gamma_keys == keys

    run(scenario())


def test_send_many_with_arrow_and_lists_reports_durable_ranges(tmp_path: Path) -> None:
    values = pa.array(records("v", 5000), type=pa.binary())
    keys = pa.array([None if i % 3 else b"key%d" % i for i in range(5000)], type=pa.binary())
    batch = pa.RecordBatch.from_arrays([values, keys], names=["value", "key"])

    async def scenario() -> None:
        async with (
            gateway(tmp_path) as gw,
            Producer(gw.address, max_batch_bytes=8 * KiB) as p,
        ):
            await p.send("s", b"single")
            first = await p.send_many("s", batch)
            second = await p.send_many("s", [b"x", b"y", b"z"], keys=[b"1", None, b"3"])
            third = await p.send_many("s", pa.array(["p", "q"]))
            r1, r2, r3 = await first, await second, await third
            assert (r1.first_sequence, r1.record_count) == (1, 5000)
            assert (r2.first_sequence, r2.record_count) == (5001, 3)
            assert (r3.first_sequence, r3.record_count) == (5004, 2)
            assert r1.durable_position <= r2.durable_position <= r3.durable_position
            assert first.done() and first.result() == r1
            producer_id = p.producer_id
        frames = read_log(tmp_path, "s")
        expected = [b"single", *records("v", 5000), b"x", b"y", b"z", b"p", b"q"]
        assert values_in_order(frames, producer_id) == expected
        assert len(frames) > 10  # 5000 records were split by max_batch_bytes
        got_keys = [k for f in frames for k in (f.keys or [None] * len(f.values))]
        assert got_keys == [None, *keys.to_pylist(), b"1", None, b"3", None, None]

    run(scenario())


def test_linger_seals_a_lone_record_without_flush(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with gateway(tmp_path) as gw, Producer(gw.address, linger_ms=20) as p:
            await p.send("lone", b"one")
            for _ in range(200):
                if p.statistics().streams["lone"].records_acked == 1:
                    break
                await asyncio.sleep(0.01)
            assert p.statistics().streams["lone"].records_acked == 1

    run(scenario())


# --- flow control -----------------------------------------------------------------


def test_a_stream_out_of_credit_does_not_hold_up_another(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with (
            gateway(
                tmp_path,
                **SMALL,
                stream_capacity=16 * MiB,
                streams={"A": StreamSettings(capacity=256 * KiB)},
            ) as gw,
            Producer(gw.address, max_buffered_bytes=2 * MiB, linger_ms=2) as p,
        ):
            a_values = records("A" * 90, 12_000)  # about 1.2 MB, far beyond A's log
            for value in a_values:
                await p.send("A", value)
            flush_a = asyncio.create_task(p.flush("A"))
            await asyncio.sleep(0.2)
            assert not flush_a.done()
            a_stats = p.statistics().streams["A"]
            assert a_stats.batches_queued > 0 and a_stats.buffered_bytes > 256 * KiB

            b_values = records("B", 50_000)
            started = time.monotonic()
            for value in b_values:
                await p.send("B", value)
            await p.flush("B")
            assert time.monotonic() - started < 4.0
            assert not flush_a.done(), "A got credit it should not have had"
            assert p.statistics().streams["B"].records_acked == 50_000

            # Spark catches up on A: space comes back and A completes.
            releaser = Releaser(gw, tmp_path, "A")
            await releaser.run_until(flush_a)
            await flush_a
            releaser.close()
            assert values_in_order(releaser.frames, p.producer_id) == a_values
            producer_id = p.producer_id
        assert values_in_order(read_log(tmp_path, "B"), producer_id) == b_values

    run(scenario())


def test_send_waits_once_the_stream_buffer_is_full(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with (
            gateway(tmp_path, **SMALL, streams={"A": StreamSettings(capacity=256 * KiB)}) as gw,
            Producer(gw.address, max_buffered_bytes=512 * KiB, linger_ms=2) as p,
        ):
            values = records("w" * 200, 6000)  # about 1.3 MB

            async def sender() -> None:
                for value in values:
                    await p.send("A", value)

            task = asyncio.create_task(sender())
            await asyncio.sleep(0.3)
            assert not task.done()
            buffered = p.statistics().streams["A"].buffered_bytes
            assert buffered <= 512 * KiB + 16 * KiB
            releaser = Releaser(gw, tmp_path, "A")
            flushed = asyncio.ensure_future(_after(task, p.flush("A")))
            await releaser.run_until(flushed)
            await flushed
            releaser.close()
            assert values_in_order(releaser.frames, p.producer_id) == values

    run(scenario())


async def _after(task: asyncio.Task[None], then: Coroutine[Any, Any, None]) -> None:
    await task
    await then


def test_optimistic_policy_resends_dropped_batches_exactly_once(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with (
            gateway(tmp_path, **SMALL, streams={"O": StreamSettings(capacity=256 * KiB)}) as gw,
            Producer(gw.address, policy="optimistic", max_buffered_bytes=8 * MiB) as p,
        ):
            values = records("o" * 300, 4000)  # about 1.2 MB into a 256 KiB log
            for value in values:
                await p.send("O", value)
            flushed = asyncio.create_task(p.flush("O"))
            await asyncio.sleep(0.2)
            assert not flushed.done()
            releaser = Releaser(gw, tmp_path, "O")
            await releaser.run_until(flushed)
            await flushed
            releaser.close()
            stats = p.statistics().streams["O"]
            assert stats.batches_dropped > 0, "the gateway never dropped; nothing was tested"
            assert stats.records_acked == len(values)
            assert values_in_order(releaser.frames, p.producer_id) == values

    run(scenario())


# --- failures ---------------------------------------------------------------------------


def test_gateway_killed_mid_load_and_restarted_loses_and_repeats_nothing(
    tmp_path: Path,
) -> None:
    served = GatewayProcess(tmp_path)
    address = served.start()
    values = records("k", 60_000)

    async def scenario() -> int:
        async with Producer(address, linger_ms=2, max_batch_bytes=16 * KiB) as p:

            async def sender() -> None:
                for i, value in enumerate(values):
                    await p.send("k", value)
                    if i % 200 == 0:
                        await asyncio.sleep(0.001)  # a steady load, not one burst

            sending = asyncio.create_task(sender())
            while p.statistics().streams.get("k") is None or (
                p.statistics().streams["k"].records_acked < 10_000
            ):
                await asyncio.sleep(0.005)
            served.kill()
            before = p.statistics().streams["k"]
            assert not sending.done()  # the kill really is mid-load
            await asyncio.sleep(0.3)
            assert not p.connected
            served.start()
            await sending
            await p.flush()
            stats = p.statistics()
            assert stats.reconnects >= 1
            assert stats.streams["k"].records_acked == len(values)
            assert 10_000 <= before.records_acked < len(values)
            return p.producer_id

    try:
        producer_id = asyncio.run(asyncio.wait_for(scenario(), 9.0))
    finally:
        served.stop()
    assert values_in_order(read_log(tmp_path, "k"), producer_id) == values


CHILD = """
import asyncio, sys
from headgate.client import Producer

async def main() -> None:
    async with Producer(sys.argv[1], producer_id=int(sys.argv[2]), linger_ms=1) as p:
        i = 0
        while i < 10_000_000:
            for _ in range(500):
                await p.send("r", b"old-%07d" % i)
                i += 1
            await p.flush()
            # What resuming this producer takes: its id and its secret.
            print(i, p.producer_secret.hex(), flush=True)

asyncio.run(main())
"""


def test_a_new_producer_with_the_same_id_continues_the_sequence(tmp_path: Path) -> None:
    producer_id = 4242

    async def scenario() -> None:
        async with gateway(tmp_path) as gw:
            host, port = gw.address
            child = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                CHILD,
                f"{host}:{port}",
                str(producer_id),
                stdout=asyncio.subprocess.PIPE,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            )
            assert child.stdout is not None
            flushed = 0
            secret = b""
            while flushed < 5000:
                line = await child.stdout.readline()
                assert line, "the child producer died"
                count, secret_hex = line.split()
                flushed, secret = int(count), bytes.fromhex(secret_hex.decode())
            child.kill()
            await child.wait()

            async with Producer(gw.address, producer_id=producer_id, producer_secret=secret) as p:
                for value in records("new", 1000):
                    await p.send("r", value)
                await p.flush()
                resumed = p.statistics().streams["r"].next_sequence
        frames = read_log(tmp_path, "r")
        got = values_in_order(frames, producer_id)  # consecutive: no gap, no repeat
        assert resumed == len(got)
        old = got[:-1000]
        assert len(old) >= flushed
        assert old == [b"old-%07d" % i for i in range(len(old))]
        assert got[-1000:] == records("new", 1000)

    run(scenario())


def test_unreachable_gateway_makes_connect_raise_within_the_timeout() -> None:
    port = free_port()

    async def scenario() -> None:
        p = Producer(("127.0.0.1", port), reconnect_timeout=1.0)
        started = time.monotonic()
        with pytest.raises(ProducerError, match=f"127.0.0.1:{port}.*connection refused"):
            await p.connect()
        assert 0.9 <= time.monotonic() - started < 3.0
        with pytest.raises(ProducerError):
            await p.send("s", b"late")
        await p.abort()

    run(scenario())


def test_gateway_gone_for_good_makes_flush_raise_within_the_timeout(tmp_path: Path) -> None:
    async def scenario() -> None:
        gw = Gateway(GatewayConfig(listen=("127.0.0.1", 0), data_dir=tmp_path))
        await gw.start()
        p = Producer(gw.address, reconnect_timeout=1.0)
        await p.connect()
        await p.send("s", b"kept")
        await p.flush()
        await gw.stop()
        await p.send("s", b"lost")
        started = time.monotonic()
        with pytest.raises(ProducerError, match="gave up on the gateway") as raised:
            await p.flush()
        assert time.monotonic() - started < 3.0
        assert f"{gw.address[0]}:{gw.address[1]}" in str(raised.value)
        with pytest.raises(ProducerError):
            await p.send("s", b"after")
        assert p.statistics().failure is not None
        with pytest.raises(ProducerError, match="gave up"):
            await p.close()  # never a silent loss

    run(scenario())


# --- a refused stream, from a scripted gateway -------------------------------------------


async def refusing_gateway(refuse: str) -> tuple[asyncio.Server, int]:
    """A minimal gateway that refuses stream ``refuse`` and acks everything else."""

    class Scripted(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            assert isinstance(transport, asyncio.Transport)
            self.transport = transport
            self.session = Session(Role.GATEWAY, data_cost=batch_cost)

        def data_received(self, data: bytes) -> None:
            for event in self.session.receive_data(data):
                if isinstance(event, HelloReceived):
                    self.session.send_global(
                        m.Welcome(server_name="scripted", max_message_size=MiB, idle_timeout_ms=0)
                    )
                    self.session.grant(m.STREAM_CHANNEL, 4096)
                elif isinstance(event, StreamBound):
                    if event.stream == refuse:
                        self.session.send_global(
                            m.Error(
                                code=ErrorCode.FORBIDDEN,
                                scope=m.HandleRef(
                                    handle_type=m.HandleType.STREAM, handle=event.handle
                                ),
                                text="not for you",
                            )
                        )
                    else:
                        self.session.send_global(
                            m.Ack(handle=event.handle, next_sequence=0, durable_position=0)
                        )
                        self.session.grant(m.data_channel(event.handle), MiB)
                elif isinstance(event, BatchReceived):
                    self.session.process(event.handle)
                    end = event.first_sequence + event.record_count
                    self.session.send_global(
                        m.Ack(handle=event.handle, next_sequence=end, durable_position=end)
                    )
            self.transport.write(self.session.data_to_send())

    server = await asyncio.get_running_loop().create_server(Scripted, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_a_refused_stream_raises_while_the_others_go_on() -> None:
    async def scenario() -> None:
        server, port = await refusing_gateway("secret")
        async with server, Producer(("127.0.0.1", port)) as p:
            await p.send("secret", b"s1")
            await p.send("open", b"o1")
            with pytest.raises(StreamRefused) as raised:
                await p.flush("secret")
            assert raised.value.stream == "secret"
            assert raised.value.code is ErrorCode.FORBIDDEN
            assert "not for you" in str(raised.value)
            with pytest.raises(StreamRefused):
                await p.send("secret", b"s2")
            for i in range(1000):
                await p.send("open", b"o%d" % i)
            await p.flush("open")
            assert p.statistics().streams["open"].records_acked == 1001
            assert p.statistics().streams["secret"].refused is not None
            await p.close()

    run(scenario())


# --- the synchronous wrapper ------------------------------------------------------------


def test_sync_producer_round_trip(tmp_path: Path) -> None:
    served = GatewayProcess(tmp_path)
    address = served.start()
    try:
        with SyncProducer(address, linger_ms=2) as p:
            for i in range(30_000):
                p.send("one", b"1-%06d" % i)
                if i % 3 == 0:
                    p.send("two", b"2-%06d" % i, key=b"k")
            many = p.send_many("two", [b"tail-1", b"tail-2"])
            p.flush(timeout=8)
            assert many.result(timeout=1).record_count == 2
            stats = p.statistics()
            assert stats.streams["one"].records_acked == 30_000
            producer_id = p.producer_id
            # A lone record after the flush goes out by linger, without a flush.
            p.send("one", b"late")
            deadline = time.monotonic() + 3
            while p.statistics().streams["one"].records_acked < 30_001:
                assert time.monotonic() < deadline
                time.sleep(0.01)
    finally:
        served.stop()
    assert values_in_order(read_log(tmp_path, "one"), producer_id) == [
        *(b"1-%06d" % i for i in range(30_000)),
        b"late",
    ]
    two = read_log(tmp_path, "two")
    assert values_in_order(two, producer_id) == [
        *(b"2-%06d" % i for i in range(0, 30_000, 3)),
        b"tail-1",
        b"tail-2",
    ]
