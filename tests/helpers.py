"""Helpers that more than one test module uses, in one place.

A test module imports what it needs from here, never from another test module
(which would also make pytest's view of that module's fixtures depend on the
import). Helpers used by one module stay in it; ``tests/serving.py`` starts
``headgate serve`` child processes for the command-line tests.

Not here yet: the sans-IO session pair and codec strategies that
``tests/protocol`` modules share, and the fleet and TLS-gateway harnesses
(``tests/client/test_fleet.py``, ``test_secure_clients.py``) and the pipeline
harness of ``tests/spark`` that Spark test modules import.

Every wait here is bounded in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from headgate.cli.top import Snapshot, fetch, render_to_fit
from headgate.config import ConsumerSettings, GatewayConfig
from headgate.costs import batch_cost
from headgate.gateway import Gateway
from headgate.gateway.budget import Cost
from headgate.log import LogReader
from headgate.protocol import messages as m
from headgate.protocol.codec import encode_frame
from headgate.protocol.frames import Absolve, SendGlobal
from headgate.protocol.records import decode_records, encode_records
from headgate.protocol.session import (
    AckReceived,
    Event,
    MessageReceived,
    Role,
    Session,
    WelcomeReceived,
)

# -- a gateway in this process ---------------------------------------------------------


#: What the work budget charges for one pair of :func:`ping_pairs`.
PING_PAIR_COST = 2 * Cost.CONTROL + Cost.ABSOLVE


def ping_pairs(count: int, nonce: int = 1) -> bytes:
    """``count`` Pings, each followed by an Absolve of nothing on the bind channel.

    A flood of Pings with another frame between each is what the work budget,
    the write cap and the idle rule govern (each Ping still asks for a Pong).
    Pings alone, back to back, are ended after a few by the Ping rule
    (:meth:`headgate.protocol.lifecycle.Lifecycle.pinged`), before any of those.
    """
    ping = encode_frame(SendGlobal(payload=m.encode_message(m.Ping(nonce=nonce))))
    return (ping + encode_frame(Absolve(channel=0, amount=0))) * count


KiB = 1024
MiB = 1024 * KiB
# Small terms and messages make credit run out after a few hundred KiB.
SMALL = {"term_length": 64 * KiB, "max_message_size": 16 * KiB}


def config(tmp_path: Path, **kw: object) -> GatewayConfig:
    """A loopback gateway over ``tmp_path/data``, with terms small enough to fill in a test."""
    base: dict[str, object] = dict(
        listen=("127.0.0.1", 0),
        data_dir=tmp_path / "data",
        stream_capacity=256 * 1024,
        term_length=64 * 1024,
        max_message_size=16 * 1024,
        group_commit_interval_ms=1.0,
    )
    base.update(kw)
    return GatewayConfig(**base)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def gateway(data_dir: Path, **settings: Any) -> AsyncIterator[Gateway]:
    """A started in-process gateway on 127.0.0.1 over ``data_dir``, stopped on leaving."""
    gw = Gateway(GatewayConfig(listen=("127.0.0.1", 0), data_dir=data_dir, **settings))
    await gw.start()
    try:
        yield gw
    finally:
        await gw.stop()


def run(coroutine: Coroutine[Any, Any, None], timeout: float = 9.0) -> None:
    """Run ``coroutine`` on a fresh event loop, failing past ``timeout`` seconds."""

    async def bounded() -> None:
        async with asyncio.timeout(timeout):
            await coroutine

    asyncio.run(bounded())


def stored(data_dir: Path, stream: str) -> list[tuple[int, int, list[bytes]]]:
    """(producer id, first sequence, values) of each published frame of ``stream``."""
    reader = LogReader.open(data_dir / "streams" / stream)
    try:
        frames = reader.read(reader.start_position(), reader.published_position())
        out = []
        for f in frames:
            values, _ = decode_records(f.payload).to_lists()
            out.append((f.producer_id, f.first_sequence, values))
        return out
    finally:
        reader.close()


async def scrape(gateway: Gateway) -> Snapshot:
    """The gateway's metrics endpoint, parsed."""
    # The HTTP server's thread asks this loop for the snapshot: never block it.
    assert gateway.metrics_address is not None
    return await asyncio.to_thread(fetch, gateway.metrics_address)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (as of now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# -- reading the stream logs back, as Spark would --------------------------------------


@dataclass
class Frame:
    """One frame of a stream log, its records decoded."""

    producer_id: int
    first_sequence: int
    record_count: int
    values: list[bytes]
    keys: list[bytes | None] | None


def read_log(data_dir: Path, stream: str) -> list[Frame]:
    """Every frame the stream's log still holds, decoded."""
    with LogReader.open(data_dir / "streams" / stream) as reader:
        return [
            Frame(f.producer_id, f.first_sequence, f.record_count, *record_lists(f.payload))
            for f in reader.read(reader.start_position())
        ]


def record_lists(payload: memoryview) -> tuple[list[bytes], list[bytes | None] | None]:
    """The values and keys of a records block."""
    return decode_records(payload).to_lists()


def values_in_order(frames: list[Frame], producer_id: int, first: int = 0) -> list[bytes]:
    """The producer's values, checking its sequence numbers run on without gap or repeat."""
    out: list[bytes] = []
    expected = first
    for frame in frames:
        if frame.producer_id != producer_id:
            continue
        assert frame.first_sequence == expected, (frame.first_sequence, expected)
        assert frame.record_count == len(frame.values)
        expected += frame.record_count
        out.extend(frame.values)
    return out


def records(prefix: str, count: int, start: int = 0) -> list[bytes]:
    """``count`` distinct values, numbered from ``start``, that sort in sending order."""
    return [f"{prefix}-{i:07d}".encode() for i in range(start, start + count)]


class Releaser:
    """What Spark does: read what is durable, keep it, release it."""

    def __init__(self, gw: Gateway, data_dir: Path, stream: str) -> None:
        self.gw = gw
        self.directory = data_dir / "streams" / stream
        self.stream = stream
        self.reader: LogReader | None = None
        self.position = 0
        self.frames: list[Frame] = []

    def poll(self) -> None:
        if self.reader is None:
            if not self.directory.exists():
                return
            self.reader = LogReader.open(self.directory)
            self.position = self.reader.start_position()
        end = self.reader.durable_position()
        if end > self.position:
            for f in self.reader.read(self.position, end):
                self.frames.append(
                    Frame(f.producer_id, f.first_sequence, f.record_count, *record_lists(f.payload))
                )
            self.position = end
            self.gw.release(self.stream, end)

    async def run_until(self, done: asyncio.Future[Any] | asyncio.Task[Any]) -> None:
        while not done.done():
            self.poll()
            await asyncio.sleep(0.01)
        self.poll()

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()


# -- a gateway in a child process, to be killed ----------------------------------------


class GatewayProcess:
    """``headgate serve`` in a subprocess, so that it can be SIGKILLed."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.port = 0
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> tuple[str, int]:
        command = [sys.executable, "-m", "headgate.cli", "serve"]
        command += ["--listen", f"127.0.0.1:{self.port}", "--data-dir", str(self.data_dir)]
        deadline = time.monotonic() + 5.0
        while True:
            self.proc = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
            )
            assert self.proc.stdout is not None
            ready, _, _ = select.select([self.proc.stdout], [], [], 5.0)
            line = self.proc.stdout.readline() if ready else ""
            if line.startswith("listening on "):
                self.port = int(line.rsplit(":", 1)[1])
                return ("127.0.0.1", self.port)
            # The old process's port may take a moment to be free again.
            self.proc.kill()
            self._reap()
            if time.monotonic() > deadline:
                raise RuntimeError(f"headgate serve did not start: {line!r}")
            time.sleep(0.1)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self._reap()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._reap()

    def _reap(self) -> None:
        if self.proc is not None:
            self.proc.wait(5)
            if self.proc.stdout is not None:
                self.proc.stdout.close()


# -- a raw protocol peer, pumped by hand -----------------------------------------------


class RawPeer:
    """A producer session over a socket, pumped by hand."""

    def __init__(self, producer_id: int = 1, secret: bytes = b"", token: bytes = b"") -> None:
        self.session = Session(Role.PRODUCER, data_cost=batch_cost)
        self.producer_id = producer_id
        self.token = token
        #: The secret that proves the producer id: given, or from Welcome.
        self.secret = secret
        self.events: list[Event] = []
        self.reader: asyncio.StreamReader
        self.writer: asyncio.StreamWriter
        self.closed = False

    async def connect(self, address: tuple[str, int]) -> None:
        self.reader, self.writer = await asyncio.open_connection(*address)
        self.session.send_global(
            m.Hello(
                producer_id=self.producer_id,
                client_name="raw",
                token=self.token,
                secret=self.secret,
            )
        )
        await self.send()
        await self.until(lambda: self.session.opened)
        for event in self.events:
            if isinstance(event, WelcomeReceived) and event.welcome.producer_secret:
                self.secret = event.welcome.producer_secret

    async def send(self, raw: bytes = b"") -> None:
        self.writer.write(self.session.data_to_send() + raw)
        await self.writer.drain()

    async def pump(self, timeout: float = 0.05) -> None:
        try:
            data = await asyncio.wait_for(self.reader.read(1 << 16), timeout)
        except TimeoutError:
            return
        if not data:
            self.closed = True
            return
        self.events += self.session.receive_data(data)
        await self.send()

    async def until(self, condition: object, timeout: float = 10.0) -> None:
        assert callable(condition)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not condition():
            assert loop.time() < deadline, "timed out waiting"
            assert not self.closed, f"connection closed; events: {self.events[-3:]}"
            await self.pump()

    def acked(self, handle: int) -> int:
        acks = [e.ack for e in self.events if isinstance(e, AckReceived) and e.ack.handle == handle]
        return acks[-1].next_sequence if acks else -1

    def errors(self) -> list[m.Error]:
        return [
            e.message
            for e in self.events
            if isinstance(e, MessageReceived) and isinstance(e.message, m.Error)
        ]

    async def bind(self, stream: str) -> int:
        handle = self.session.bind_stream(stream)
        assert handle is not None
        await self.send()
        await self.until(lambda: self.acked(handle) >= 0)
        return handle

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()


async def write_what_fits(peer: RawPeer, handle: int, sequence: int) -> int:
    """Send 1 KiB batches while the peer's guarantees allow; the next sequence."""
    block = encode_records([b"x" * 1000])
    while peer.session.send_batch(handle, sequence, block):
        sequence += 1
    await peer.send()
    return sequence


async def earn(peer: RawPeer, handle: int, gw: Gateway, stream: str, least: float) -> int:
    """Write what fits, the consumer releasing it, until ``peer`` holds ``least`` guarantees.

    Credit follows use: a writer holds much of a stream only once it has
    used much. Returns the next sequence.
    """

    def held() -> int:
        return peer.session.outbound(m.data_channel(handle)).guarantees

    sequence = max(0, peer.acked(handle))
    for _ in range(200):
        if held() >= least:
            break
        sequence = await write_what_fits(peer, handle, sequence)
        await peer.until(lambda n=sequence: peer.acked(handle) == n)
        gw.release(stream, gw.streams[stream].log.durable_position)
        await gw.consumers_saved()  # credit follows once the position is stored
        await peer.pump()
    assert held() >= least
    return sequence


async def send_batches(peer: RawPeer, handle: int, count: int) -> None:
    """Send ``count`` two-record batches as guarantees allow, and wait until all are acked."""
    for i in range(count):
        await peer.until(lambda: peer.session.can_send_batch(handle, 40))
        peer.session.send_batch(handle, 2 * i, encode_records([b"r" * 10, b"s" * 10]))
        await peer.send()
    await peer.until(lambda: peer.acked(handle) == 2 * count)


# -- named consumers -------------------------------------------------------------------


BLOCKING = ConsumerSettings()


def consumers(**named: ConsumerSettings) -> tuple[tuple[str, ConsumerSettings], ...]:
    """A stream's ``consumers`` setting from keyword arguments."""
    return tuple(named.items())


class Consumer(Releaser):
    """One named consumer: reads the durable log from its own position, then releases it."""

    def __init__(self, gw: Gateway, data_dir: Path, stream: str, name: str) -> None:
        super().__init__(gw, data_dir, stream)
        self.name = name

    def poll(self, max_bytes: int | None = None) -> None:
        if self.reader is None:
            if not self.directory.exists():
                return
            self.reader = LogReader.open(self.directory)
            self.position = self.reader.start_position()
        end = self.reader.durable_position()
        if end <= self.position:
            return
        frames = self.reader.read(self.position, end)
        if not frames:
            # [position, end) held only a term's padding, which read() skips.
            self.position = end
            self.gw.release(self.stream, self.position, self.name)
            return
        if max_bytes is not None:
            frames = [f for f in frames if f.end_position - self.position <= max_bytes][:1] or [
                frames[0]
            ]
        for f in frames:
            self.frames.append(
                Frame(f.producer_id, f.first_sequence, f.record_count, *record_lists(f.payload))
            )
        self.position = frames[-1].end_position
        self.gw.release(self.stream, self.position, self.name)


def positions(gw: Gateway, stream: str) -> dict[str, int]:
    """Each consumer's position on ``stream``, as the gateway holds it."""
    return {n: c.position for n, c in gw.streams[stream].consumers.consumers.items()}


# -- a proxy that loses the gateway's replies ------------------------------------------


class AckHoldingProxy:
    """Forwards a TCP connection both ways, until told to hold the gateway's replies."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.hold = False
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> tuple[str, int]:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port: int = self.server.sockets[0].getsockname()[1]
        return ("127.0.0.1", port)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        self.writers += [writer, up_writer]

        async def pipe(
            src: asyncio.StreamReader, dst: asyncio.StreamWriter, *, replies: bool
        ) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    if not (replies and self.hold):
                        dst.write(data)
                        await dst.drain()
            dst.close()

        await asyncio.gather(
            pipe(reader, up_writer, replies=False), pipe(up_reader, writer, replies=True)
        )

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.transport.abort()
        await self.server.wait_closed()


# -- headgate top ----------------------------------------------------------------------


def busy_gateway() -> tuple[Snapshot, Snapshot]:
    """Two scrapes a second apart, with wide numbers and a name too long for 80 columns."""
    row = {
        "stream_fill_ratio": 0.773,
        "stream_capacity_bytes": 64.0 * 2**20,
        "stream_tail_position": 123_456_789_012.0,
        "stream_durable_position": 123_456_789_012.0,
        "stream_release_position": 123_456_000_000.0,
        "stream_guarantees_outstanding_bytes": 3.0 * 2**20,
        "stream_writers": 3.0,
        "stream_appended_records_total": 12_345_678.0,
        "stream_dropped_batches_total": 12.0,
        "stream_fsync_seconds_sum": 1.0,
        "stream_fsync_seconds_count": 1000.0,
    }
    snap = Snapshot(at=2.0, gateway={"connections": 1.0})
    snap.streams["ticks"] = row
    snap.streams["a-stream-name-longer-than-the-column"] = dict(row)
    snap.fsync_buckets["ticks"] = [(0.001, 500.0), (0.0025, 990.0), (float("inf"), 1000.0)]
    snap.fsync_buckets["a-stream-name-longer-than-the-column"] = [(float("inf"), 10.0)]
    snap.connections["12"] = {
        "peer": "[2001:db8:1234:5678::1]:54321",
        "producer": "6851760619763790384",
        "connection_debt": 1234.0,
        "connection_debt_threshold": 4096.0,
        "connection_peak_debt": 4000.0,
        "connection_reads_paused": 1.0,
        "connection_read_pauses_total": 3.0,
        "connection_ring_in_use_bytes": 65536.0,
        "connection_ring_bytes": 1048576.0,
    }
    previous = Snapshot(at=1.0, streams={"ticks": {"stream_appended_records_total": 12_000_000.0}})
    return snap, previous


def shown(width: int, snap: Snapshot, previous: Snapshot) -> list[str]:
    """The lines ``headgate top`` prints for ``snap`` at ``width`` columns."""
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(render_to_fit(console, snap, previous))
    return console.export_text().splitlines()
