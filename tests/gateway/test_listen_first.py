"""A restarted gateway listens first and recovers its streams after (issue 15, section 2).

Each test fills a data directory through a real gateway, then starts a new
gateway on it whose recovery of chosen streams is held at a gate (the test's
hook on ``Gateway._open_stream``, which runs in the recovery thread): so
"while a stream is still recovering" lasts exactly as long as the test says,
on any machine. Everything else is real: the gateway on 127.0.0.1, the
producer, the reader and the files.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import pytest

from headgate.client import Producer, StreamRefused
from headgate.client.reader import Reader, ReaderRefused, TailBatch
from headgate.config import GatewayConfig
from headgate.gateway import Gateway
from headgate.gateway.streams import Stream
from headgate.log import LogError
from headgate.log.lock import DirectoryLock
from headgate.log.metadata import META_FILE_NAME
from headgate.protocol.errors import ErrorCode
from headgate.protocol.records import decode_records
from tests.helpers import RawPeer, read_log, run, scrape, values_in_order
from tests.serving import serve, stop

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
#: How long a test holds a stream in recovery before it looks at what waited.
HELD_S = 0.4


def settings(data_dir: Path, **more: object) -> GatewayConfig:
    base: dict[str, object] = dict(
        listen=("127.0.0.1", 0),
        data_dir=data_dir,
        term_length=2 * 1024 * 1024,
        stream_capacity=16 * 1024 * 1024,
        group_commit_interval_ms=1.0,
    )
    base.update(more)
    return GatewayConfig(**base)  # type: ignore[arg-type]


async def fill(data_dir: Path, streams: Iterable[str], records: int, producer_id: int) -> None:
    """Store ``records`` values in each stream through a gateway, then stop it cleanly."""
    gw = Gateway(settings(data_dir))
    await gw.start()
    try:
        async with Producer(gw.address, producer_id=producer_id, linger_ms=0) as producer:
            for name in streams:
                for i in range(records):
                    await producer.send(name, f"{name}-{i}".encode())
                    await producer.flush(name)  # a frame each
    finally:
        await gw.stop()


class Gates:
    """Holds the recovery of chosen streams until the test opens their gate."""

    def __init__(self, held: Iterable[str]) -> None:
        self.held = {name: threading.Event() for name in held}
        #: Streams whose recovery has started, in order.
        self.started: list[str] = []

    def open(self, name: str | None = None) -> None:
        for held, gate in self.held.items():
            if name is None or held == name:
                gate.set()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        original = Gateway._open_stream

        def gated(gateway: Gateway, name: str) -> Stream:
            self.started.append(name)
            gate = self.held.get(name)
            if gate is not None:
                assert gate.wait(20), f"the test never let {name} recover"
            return original(gateway, name)

        monkeypatch.setattr(Gateway, "_open_stream", gated)


@contextlib.asynccontextmanager
async def listening(data_dir: Path, gates: Gates, **more: object) -> AsyncIterator[Gateway]:
    gw = Gateway(settings(data_dir, **more))
    await gw.listen()
    try:
        yield gw
    finally:
        gates.open()
        await gw.stop()


def test_a_gateway_with_many_streams_accepts_a_connection_before_it_recovers_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = [f"s{i:02d}" for i in range(40)]

    async def scenario() -> None:
        await fill(tmp_path, names, 1, producer_id=1)
        gates = Gates(names)
        gates.install(monkeypatch)
        async with listening(tmp_path, gates, metrics=("127.0.0.1", 0)) as gw:
            peer = RawPeer(producer_id=2)
            await peer.connect(gw.address)  # Hello answered with Welcome
            assert gw.recovery.count == 40 and not gw.streams
            assert (await scrape(gw)).gateway["streams_recovering"] == 40
            await peer.close()
            gates.open()
            await asyncio.wait_for(gw.recovered(), 20)
            assert sorted(gw.streams) == names and gw.recovery.count == 0
            assert gw.recovery_seconds is not None
            assert (await scrape(gw)).gateway["streams_recovering"] == 0

    run(scenario(), timeout=40)


def test_a_producer_bound_to_a_recovering_stream_waits_then_stores_exactly_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> None:
        await fill(tmp_path, ["a"], 5, producer_id=7)
        gates = Gates(["a"])
        gates.install(monkeypatch)
        async with (
            listening(tmp_path, gates) as gw,
            Producer(gw.address, producer_id=9, linger_ms=0) as producer,
        ):
            for i in range(100):
                await producer.send("a", f"new-{i}".encode())
            flushed = asyncio.ensure_future(producer.flush("a"))
            await asyncio.sleep(HELD_S)
            # Refused with RECOVERING (at least once) and still trying.
            assert not flushed.done() and "a" not in gw.streams
            gates.open()
            await asyncio.wait_for(flushed, 20)
            assert producer.statistics().streams["a"].records_acked == 100
        frames = read_log(tmp_path, "a")
        assert values_in_order(frames, 7) == [f"a-{i}".encode() for i in range(5)]
        assert values_in_order(frames, 9) == [f"new-{i}".encode() for i in range(100)]

    run(scenario(), timeout=40)


def test_a_producer_that_outlives_its_gateway_waits_for_the_restart_to_recover_its_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> None:
        first = Gateway(settings(tmp_path))
        await first.start()
        address = first.address
        producer = Producer(address, producer_id=5, linger_ms=0, reconnect_timeout=30)
        await producer.connect()
        try:
            for i in range(50):
                await producer.send("a", f"r{i}".encode())
            await producer.flush("a")
            await first.stop()
            for i in range(50, 100):  # buffered while no gateway is there
                await producer.send("a", f"r{i}".encode())
            gates = Gates(["a"])
            gates.install(monkeypatch)
            async with listening(tmp_path, gates, listen=address) as gw:
                flushed = asyncio.ensure_future(producer.flush("a"))
                await asyncio.sleep(HELD_S)
                assert not flushed.done() and gw.recovery.recovering("a")
                gates.open()
                await asyncio.wait_for(flushed, 20)
                await producer.close()
        finally:
            await producer.abort()
        expected = [f"r{i}".encode() for i in range(100)]
        assert values_in_order(read_log(tmp_path, "a"), 5) == expected

    run(scenario(), timeout=40)


def test_a_recovering_stream_refuses_a_raw_bind_with_recovering_scoped_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> None:
        await fill(tmp_path, ["a"], 1, producer_id=7)
        gates = Gates(["a"])
        gates.install(monkeypatch)
        async with listening(tmp_path, gates) as gw:
            peer = RawPeer(producer_id=3)
            await peer.connect(gw.address)
            handle = peer.session.bind_stream("a")
            assert handle is not None
            await peer.send()
            await peer.until(lambda: bool(peer.errors()))
            (error,) = peer.errors()
            assert error.code is ErrorCode.RECOVERING
            assert error.scope is not None and error.scope.handle == handle
            assert "recovered" in error.text and "try again" in error.text
            assert not peer.closed  # scoped: the connection goes on
            await peer.close()

    run(scenario())


def test_a_bind_and_a_consumer_request_of_a_recovering_stream_get_one_refusal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One function builds the RECOVERING refusal (``StreamRecovery.refusal``):
    a writer's bind (scoped to its stream) and a consumer request (ListConsumers,
    which ends the connection) of a stream still recovering get the same code
    and the same text, and both move the stream to the front of the queue."""

    async def scenario() -> None:
        await fill(tmp_path, ["a"], 1, producer_id=7)
        gates = Gates(["a"])
        gates.install(monkeypatch)
        async with listening(tmp_path, gates) as gw:
            peer = RawPeer(producer_id=3)
            await peer.connect(gw.address)
            assert peer.session.bind_stream("a") is not None
            await peer.send()
            await peer.until(lambda: bool(peer.errors()))
            (bound,) = peer.errors()
            await peer.close()
            async with Reader(gw.address) as reader:
                with pytest.raises(ReaderRefused) as listed:
                    await reader.list_consumers("a")
            assert bound.code is listed.value.code is ErrorCode.RECOVERING
            assert bound.text == listed.value.text
            assert "'a'" in bound.text and "try again soon" in bound.text
            assert gw.recovery.recovering("a")

    run(scenario())


def test_a_recovered_stream_serves_while_another_still_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> None:
        await fill(tmp_path, ["a", "b"], 3, producer_id=7)
        gates = Gates(["b"])
        gates.install(monkeypatch)
        async with (
            listening(tmp_path, gates) as gw,
            Producer(gw.address, producer_id=9, linger_ms=0) as producer,
        ):
            await producer.send("b", b"b-new")
            waiting = asyncio.ensure_future(producer.flush("b"))
            for i in range(20):
                await producer.send("a", f"a-new-{i}".encode())
            await asyncio.wait_for(producer.flush("a"), 10)
            assert gw.recovery.recovering("b") and not waiting.done()
            gates.open("b")
            await asyncio.wait_for(waiting, 20)
        frames = read_log(tmp_path, "a")
        assert values_in_order(frames, 9) == [f"a-new-{i}".encode() for i in range(20)]
        assert values_in_order(read_log(tmp_path, "b"), 9) == [b"b-new"]

    run(scenario(), timeout=40)


def values(batches: list[TailBatch]) -> list[bytes]:
    return [v for b in batches for v in decode_records(b.records).to_lists()[0]]


def test_reader_requests_and_releases_wait_for_the_streams_they_need(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> None:
        await fill(tmp_path, ["a", "b"], 4, producer_id=7)
        gates = Gates(["b"])
        gates.install(monkeypatch)
        async with (
            listening(tmp_path, gates) as gw,
            Reader(gw.address) as lister,
            Reader(gw.address) as fetcher,
        ):
            listing = asyncio.ensure_future(lister.list_streams())
            # A recovered stream is fetched at once, on another connection.
            served, _ = await asyncio.wait_for(fetcher.fetch_all("a", 0), 10)
            assert values(served) == [f"a-{i}".encode() for i in range(4)]
            # b's frames lie where a's do (same sizes): so a position of b.
            second_end = served[1].end_position
            held = asyncio.ensure_future(fetcher.fetch_all("b", second_end))
            await asyncio.sleep(HELD_S)
            assert not listing.done() and not held.done()
            # Released while b recovers: applied once it is back.
            await fetcher.release("b", second_end)
            gates.open("b")
            batches, _ = await asyncio.wait_for(held, 20)
            assert values(batches) == [b"b-2", b"b-3"]
            infos = await asyncio.wait_for(listing, 20)
            assert [i.stream for i in infos] == ["a", "b"]
            assert infos[0].tail_position == infos[1].tail_position
            await asyncio.sleep(0.05)
            assert gw.streams["b"].log.release_position == second_end
            # Listed again, b now starts where the Release said.
            (_, b_info) = await asyncio.wait_for(lister.list_streams(), 10)
            assert b_info.start_position == second_end

    run(scenario(), timeout=40)


def test_a_producer_gives_up_a_stream_still_recovering_after_its_reconnect_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> None:
        await fill(tmp_path, ["a"], 1, producer_id=7)
        gates = Gates(["a"])
        gates.install(monkeypatch)
        async with listening(tmp_path, gates) as gw:
            producer = Producer(gw.address, producer_id=9, linger_ms=0, reconnect_timeout=0.5)
            await producer.connect()
            try:
                await producer.send("a", b"x")
                with pytest.raises(StreamRefused) as refused:
                    await asyncio.wait_for(producer.flush("a"), 10)
                assert refused.value.code is ErrorCode.RECOVERING
                assert "still recovering after 0.5 s" in str(refused.value)
            finally:
                await producer.abort()

    run(scenario(), timeout=30)


def damage(data_dir: Path, stream: str) -> Path:
    meta = data_dir / "streams" / stream / META_FILE_NAME
    meta.write_bytes(b"\xff" * 64)
    return meta


def test_a_stream_that_cannot_be_recovered_fails_the_start_and_refuses_its_binds(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        await fill(tmp_path, ["a", "broken"], 1, producer_id=7)
        damage(tmp_path, "broken")
        gw = Gateway(settings(tmp_path))
        await gw.listen()
        try:
            with pytest.raises(LogError, match=META_FILE_NAME):
                await asyncio.wait_for(gw.recovered(), 20)
            assert "a" in gw.streams  # the others were recovered
            peer = RawPeer(producer_id=3)
            await peer.connect(gw.address)
            peer.session.bind_stream("broken")
            await peer.send()
            await peer.until(lambda: bool(peer.errors()))
            (error,) = peer.errors()
            assert error.code is ErrorCode.STORAGE_UNAVAILABLE and error.scope is not None
            assert "could not be recovered" in error.text
            await peer.close()
        finally:
            await gw.stop()
        # start() raises it too, stopped again: the lock is free afterwards.
        gw = Gateway(settings(tmp_path))
        with pytest.raises(LogError, match=META_FILE_NAME):
            await gw.start()
        DirectoryLock.acquire(tmp_path, "gateway.lock").release()

    run(scenario(), timeout=40)


def test_serve_listens_then_reports_a_stream_it_cannot_recover_as_before(tmp_path: Path) -> None:
    run(fill(tmp_path, ["a", "broken"], 1, producer_id=7), timeout=20)
    damage(tmp_path, "broken")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "headgate.cli",
            "serve",
            "--data-dir",
            str(tmp_path),
            "--listen",
            "127.0.0.1:0",
            "--term-length",
            "2MiB",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert done.stdout.startswith("listening on 127.0.0.1:")
    assert "headgate serve: cannot start: " in done.stderr
    assert META_FILE_NAME in done.stderr and "Traceback" not in done.stderr


def test_serve_says_when_every_stream_is_recovered(tmp_path: Path) -> None:
    run(fill(tmp_path, ["a", "b", "c"], 1, producer_id=7), timeout=20)
    proc, _ = serve(tmp_path, "--term-length", "2MiB")
    assert proc.stderr is not None
    try:
        line = proc.stderr.readline()  # bounded: serve logs it within seconds, or stop() ends it
        assert "INFO headgate.serve: recovered 3 streams in " in line, line
    finally:
        stop(proc)
