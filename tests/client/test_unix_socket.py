"""The gateway serves TCP and a Unix socket at once; producers use either.

Addresses are ``host:port`` or ``unix:PATH``. Every test reads the stream log
back and checks that each record is there exactly once, in order.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from headgate.cli.demo import BackgroundLoop
from headgate.client import GatewayAddress, Producer, ProducerError, SyncProducer
from headgate.config import ConfigError, GatewayConfig
from headgate.gateway import Gateway
from headgate.log import LogReader
from headgate.protocol.records import decode_records


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    # pytest's tmp_path can exceed the 107 bytes a socket path may have.
    path = Path(tempfile.mkdtemp(prefix="hg-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def stored(data_dir: Path, stream: str) -> list[tuple[int, int, list[bytes]]]:
    """(producer id, first sequence, values) of every frame in the stream's log."""
    with LogReader.open(data_dir / "streams" / stream) as reader:
        return [
            (f.producer_id, f.first_sequence, decode_records(f.payload).to_lists()[0])
            for f in reader.read(reader.start_position())
        ]


def values_of(frames: list[tuple[int, int, list[bytes]]], producer_id: int) -> list[bytes]:
    """One producer's values, checking its sequences run on without gap or repeat."""
    out: list[bytes] = []
    for pid, first, values in frames:
        if pid == producer_id:
            assert first == len(out), "a gap or a duplicate in the sequence numbers"
            out.extend(values)
    return out


def config(tmp_path: Path, sock: Path) -> GatewayConfig:
    return GatewayConfig(
        listen=("127.0.0.1", 0),
        unix_socket=sock,
        data_dir=tmp_path / "data",
        term_length=64 * 1024,
        max_message_size=16 * 1024,
        stream_capacity=1024 * 1024,
    )


def test_addresses_parse_and_print_back() -> None:
    assert GatewayAddress.parse("unix:/run/hg.sock") == GatewayAddress(path="/run/hg.sock")
    assert str(GatewayAddress.parse("unix:/run/hg.sock")) == "unix:/run/hg.sock"
    assert GatewayAddress.parse("unix:rel.sock").path == "rel.sock"
    assert GatewayAddress.parse("10.0.0.1:9000") == GatewayAddress("10.0.0.1", 9000)
    assert str(GatewayAddress.parse("[::1]:7000")) == "[::1]:7000"
    assert GatewayAddress.parse(("localhost", 5)).is_unix is False
    for bad, fragment in [
        ("unix:", "names no socket path"),
        ("unix:/" + "x" * 200, "at most 107"),
        ("unix:/a\0b", "NUL"),
        ("host:99999", "port must be"),
        ("", "empty address"),
    ]:
        with pytest.raises(ConfigError, match=fragment):
            GatewayAddress.parse(bad)


async def test_a_producer_over_the_unix_socket_gets_durable_acks_and_exactly_once(
    tmp_path: Path, sock_dir: Path
) -> None:
    sock = sock_dir / "gw.sock"
    gateway = Gateway(config(tmp_path, sock))
    await gateway.start()
    try:
        assert sock.is_socket()
        records = [b"unix-%05d" % i for i in range(3000)]
        async with asyncio.timeout(30):
            async with Producer(f"unix:{sock}", producer_id=7, max_batch_bytes=4096) as p:
                assert p.address.is_unix
                for value in records:
                    await p.send("u", value)
                delivery = await p.send_many("u", [b"bulk-%d" % i for i in range(500)])
                await p.flush()
                result = await delivery
                stats = p.statistics().streams["u"]
        assert stats.records_acked == stats.records_sent == 3500
        assert result.record_count == 500 and result.first_sequence == 3000
    finally:
        await gateway.stop()
    assert not sock.exists(), "the gateway removes its socket when it stops"
    assert values_of(stored(tmp_path / "data", "u"), 7) == records + [
        b"bulk-%d" % i for i in range(500)
    ]


async def test_tcp_and_unix_listeners_serve_at_once_on_one_stream(
    tmp_path: Path, sock_dir: Path
) -> None:
    sock = sock_dir / "gw.sock"
    gateway = Gateway(config(tmp_path, sock))
    await gateway.start()
    host, port = gateway.address

    async def produce(address: str, producer_id: int, tag: bytes) -> None:
        async with Producer(address, producer_id=producer_id, max_batch_bytes=2048) as p:
            for i in range(2000):
                await p.send("both", tag + b"%05d" % i)
            await p.flush()

    try:
        async with asyncio.timeout(30):
            await asyncio.gather(
                produce(f"{host}:{port}", 1, b"tcp-"), produce(f"unix:{sock}", 2, b"unix-")
            )
    finally:
        await gateway.stop()
    frames = stored(tmp_path / "data", "both")
    assert values_of(frames, 1) == [b"tcp-%05d" % i for i in range(2000)]
    assert values_of(frames, 2) == [b"unix-%05d" % i for i in range(2000)]
    assert {pid for pid, _, _ in frames} == {1, 2}


def test_the_sync_producer_over_the_unix_socket(tmp_path: Path, sock_dir: Path) -> None:
    sock = sock_dir / "gw.sock"
    loop = BackgroundLoop("test-gateway")
    gateway = Gateway(config(tmp_path, sock))
    loop.run(gateway.start(), 30)
    try:
        with SyncProducer(f"unix:{sock}", producer_id=3, connect_timeout=10) as p:
            for i in range(1000):
                p.send("s", b"%d" % i)
            p.flush(30)
            assert p.statistics().streams["s"].records_acked == 1000
    finally:
        loop.run(gateway.stop(), 30)
        loop.stop()
    assert values_of(stored(tmp_path / "data", "s"), 3) == [b"%d" % i for i in range(1000)]


async def test_a_missing_socket_is_reported_clearly(sock_dir: Path) -> None:
    producer = Producer(f"unix:{sock_dir / 'nobody.sock'}", reconnect_timeout=0.3)
    with pytest.raises(ProducerError, match=r"gave up on the gateway at unix:.*nobody\.sock"):
        async with asyncio.timeout(10):
            await producer.connect()
    await producer.abort()
