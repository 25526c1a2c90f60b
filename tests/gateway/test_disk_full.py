"""A full disk under a real gateway: the stream is held, told why, and recovers by itself.

``headgate serve`` runs as a child process with its data on a small disk
(tests/_small_disk.py: a tmpfs the test mounts and fills, or a file size
limit on the child where mounting is not permitted); real producers talk to
it over loopback. Stream ``a`` grows past its reserved terms while the disk
is full; stream ``b``, on the same connection, fits in its reserved term and
must keep flowing.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from headgate.client import Producer
from headgate.log import LogReader
from headgate.protocol.records import decode_records
from tests._small_disk import SmallDisk, small_disk

pytestmark = pytest.mark.timeout(90)

KiB = 1024
PRODUCER_ID = 42


class Serve:
    """``headgate serve`` in a child process."""

    def __init__(self, config: Path, stderr: Path) -> None:
        self._stderr = stderr.open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "headgate.cli", "serve", "-c", str(config)],
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], 20.0)
        line = self.process.stdout.readline() if ready else ""
        assert line.startswith("listening on "), f"headgate serve did not start: {line!r}"
        self.address = ("127.0.0.1", int(line.rsplit(":", 1)[1]))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._stderr.close()


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[SmallDisk]:
    with small_disk(tmp_path, 2 * 1024 * KiB) as disk:
        yield disk


@pytest.fixture
def serve(disk: SmallDisk, tmp_path: Path) -> Iterator[Serve]:
    config = tmp_path / "gateway.toml"
    config.write_text(
        "[gateway]\n"
        'listen = "127.0.0.1:0"\n'
        f'data_dir = "{disk.directory / "data"}"\n'
        'stream_capacity = "1MiB"\n'
        'term_length = "64KiB"\n'
        'max_message_size = "16KiB"\n'
        "group_commit_interval_ms = 2\n"
    )
    server = Serve(config, tmp_path / "serve.stderr")
    try:
        yield server
    finally:
        server.stop()


def run(coroutine: Coroutine[Any, Any, None], timeout: float = 60.0) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(timeout):
            await coroutine

    asyncio.run(bounded())


async def until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def stored_values(data_dir: Path, stream: str) -> list[bytes]:
    """The values in a stream's log, checking that sequences run on without gap or repeat."""
    values: list[bytes] = []
    with LogReader.open(data_dir / "streams" / stream) as reader:
        for frame in reader.read(reader.start_position(), reader.published_position()):
            assert frame.producer_id == PRODUCER_ID
            assert frame.first_sequence == len(values), (frame.first_sequence, len(values))
            batch, _ = decode_records(frame.payload).to_lists()
            assert len(batch) == frame.record_count
            values.extend(batch)
    return values


def terms_reserved(data_dir: Path, stream: str) -> bool:
    return (data_dir / "streams" / stream / f"{1:016x}.term").exists()


def value(stream: str, i: int) -> bytes:
    return f"{stream}-{i:06d}-".encode() + b"x" * 180


def test_a_full_disk_holds_one_stream_and_it_recovers_exactly_once(
    disk: SmallDisk, serve: Serve
) -> None:
    data = disk.directory / "data"
    sent_a: list[bytes] = []
    sent_b: list[bytes] = []

    async def scenario() -> None:
        async with Producer(serve.address, producer_id=PRODUCER_ID, linger_ms=1) as producer:
            for i in range(50):
                for stream, sent in (("a", sent_a), ("b", sent_b)):
                    sent.append(value(stream, i))
                    await producer.send(stream, sent[-1])
            await producer.flush()
            # Term 1 of each log is reserved ahead; the disk fills after that.
            await until(
                lambda: terms_reserved(data, "a") and terms_reserved(data, "b"), 10, "terms"
            )
            disk.fill(serve.process.pid)

            async def send_a() -> None:
                # About 300 KiB: well past a's two reserved terms.
                for i in range(50, 1550):
                    sent_a.append(value("a", i))
                    await producer.send("a", sent_a[-1])

            sending = asyncio.create_task(send_a())

            def notice() -> str | None:
                return producer.statistics().streams["a"].storage_full

            await until(lambda: notice() is not None, 20, "the STORAGE_FULL notice")
            reason = notice()
            assert reason is not None and "stream a" in reason and "cannot store" in reason
            # Held: nothing more of a's is acknowledged, the connection stays.
            await asyncio.sleep(0.3)
            acked = producer.statistics().streams["a"].records_acked
            await asyncio.sleep(0.5)
            stats = producer.statistics()
            assert stats.connected
            assert stats.streams["a"].records_acked == acked < len(sent_a)
            assert stats.streams["a"].storage_full is not None
            # b, on the same connection, keeps flowing.
            for i in range(50, 90):
                sent_b.append(value("b", i))
                await producer.send("b", sent_b[-1])
            await asyncio.wait_for(producer.flush("b"), 10)
            assert producer.statistics().streams["b"].records_acked == len(sent_b)
            assert producer.statistics().streams["b"].storage_full is None

            disk.free(serve.process.pid)
            await asyncio.wait_for(sending, 30)
            await asyncio.wait_for(producer.flush("a"), 30)
            stats = producer.statistics()
            assert stats.streams["a"].records_acked == len(sent_a)
            assert stats.streams["a"].storage_full is None
            assert stats.reconnects == 0

    run(scenario())
    assert serve.process.poll() is None, "the gateway died"
    serve.stop()
    assert serve.process.returncode == 0
    assert stored_values(data, "a") == sent_a
    assert stored_values(data, "b") == sent_b


def test_a_new_producer_resumes_after_the_held_batches_of_the_old_one(
    disk: SmallDisk, serve: Serve
) -> None:
    # The first producer's batches are held when it goes away; the second,
    # with the same producer id, must not be told to number its records from
    # before them, or it would overwrite their sequence numbers.
    data = disk.directory / "data"
    first_sent: list[bytes] = []
    second_sent: list[bytes] = []

    async def scenario() -> None:
        first = Producer(serve.address, producer_id=PRODUCER_ID, linger_ms=1)
        await first.connect()
        for i in range(20):
            first_sent.append(value("a", i))
            await first.send("a", first_sent[-1])
        await first.flush()
        await until(lambda: terms_reserved(data, "a"), 10, "term 1")
        disk.fill(serve.process.pid)

        async def send_first() -> None:
            for i in range(20, 1000):
                first_sent.append(value("a", i))
                await first.send("a", first_sent[-1])

        sending = asyncio.create_task(send_first())
        await until(
            lambda: first.statistics().streams["a"].storage_full is not None, 20, "the notice"
        )
        await asyncio.sleep(0.3)  # let what it sent reach the gateway
        sending.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sending
        await first.abort()

        # The same producer, resumed: its id and the secret that proves it.
        second = Producer(
            serve.address,
            producer_id=PRODUCER_ID,
            producer_secret=first.producer_secret,
            linger_ms=1,
        )
        await second.connect()
        for i in range(100):
            second_sent.append(b"second-%06d" % i)
            await second.send("a", second_sent[-1])
        flushing = asyncio.create_task(second.flush("a"))
        await asyncio.sleep(0.5)
        assert not flushing.done()  # held: nothing of it is acknowledged yet
        # Told at its bind, and still so after its channel's opening (a zero
        # guarantee, which does not end the notice).
        assert second.statistics().streams["a"].storage_full is not None
        disk.free(serve.process.pid)
        await asyncio.wait_for(flushing, 30)
        assert second.statistics().streams["a"].storage_full is None
        await second.close()

    run(scenario())
    serve.stop()
    stored = stored_values(data, "a")
    # All of the second producer's records, exactly once, after a prefix of
    # the first's (what it had sent before it was aborted, also exactly once).
    assert stored[-len(second_sent) :] == second_sent
    prefix = stored[: -len(second_sent)]
    assert prefix == first_sent[: len(prefix)]
    assert len(prefix) > 20
