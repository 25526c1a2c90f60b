"""Benchmark: one connection, two streams, one stalled consumer.

    .venv/bin/python bench/flow.py            # about 2 minutes
    .venv/bin/python bench/flow.py --quick    # about 1 minute

Scenario, the same for every system. One producer connection carries streams
A and B, each offered at the same steady rate (1-KiB records, 64 per batch).
A's consumer stalls for a few seconds and then resumes; B's consumer is
always fast. Each system also runs B alone, for the reference rate.

Systems, all on 127.0.0.1 in this run:

* headgate with each flow-control policy (``credit``, ``window``,
  ``xonxoff``). The gateway is a child process (its RSS is sampled); the
  consumer is another child that reads each stream's log by position and
  sends Release, as Spark's progress does; "stalls" means it stops reading
  and releasing A.
* HTTP/2 (the ``h2`` library, server in a child process): two request
  streams on one connection, 1-MiB stream and connection windows. The
  server's A consumer stops acknowledging A's data, which withholds both
  stream and connection credit.
* Plain TCP: one connection, frames tagged by stream; the reader stops
  reading while A's consumer stalls (it cannot skip A's bytes).
* Redis Streams (``redis-server`` started here on a random port, if
  installed): XADD to A and B on one connection; A's reader stops XREADing.
* ZeroMQ PUSH/PULL with a high-water mark: one PUSH socket; the PULL side
  hands A's messages to A's consumer, whose queue fills while it stalls.
* NATS JetStream (``nats-server -js`` started here on a free port, if
  installed; ``--nats-server PATH`` picks another): A and B are work-queue
  streams on the file store, each holding at most the headgate log's capacity,
  ``discard: new``, so a full stream refuses publishes ("maximum bytes
  exceeded") instead of dropping old messages. One connection publishes both,
  one message per record, at most 8 batches of acks outstanding per stream;
  a refused message is published again after a pause (20 ms, doubling to
  320 ms). The consumer pulls and acknowledges each message (a work queue
  deletes what is acknowledged: its release); A's stops pulling. How durable
  an ack is depends on the server: see ``bench/natsjs.py``.

Figures, per system:

* ``B ratio``: B's delivered rate while A is stalled (from half a second into
  the stall to its end) over B's rate when running alone.
* ``A overshoot/drops``: what A sent that the receiver could not put where
  it belongs: headgate's bytes held in gateway memory beyond the log (window,
  xonxoff) or dropped; bytes stuck in kernel buffers (TCP); A's backlog in
  Redis memory; messages queued in ZeroMQ; JetStream's refused publishes.
* ``peak RSS``: the receiving process (gateway, h2 server, Redis, TCP reader,
  ZeroMQ puller); the
  gateway's budget is its RSS before the load plus each stream's mapped log
  (capacity and two terms) plus 16 MiB of working memory.
* ``round trips / batch``: messages the sender had to receive per batch sent
  (IssueGuarantees for headgate, WINDOW_UPDATE for h2, the pipelined XADD
  replies for Redis); 0 where the sender never hears back.
* ``A recovery``: seconds from the consumer's resume until A's delivered rate
  is back to 90% of its offered rate in a 100-ms bucket.

Plots go to ``bench/plots/``, one PNG per system: A's delivered rate, B's on
its own scale, and the receiving process's RSS and heap over time (sampled
every 50 ms). Every loop is bounded by the run's end time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

KiB = 1024
MiB = 1024 * KiB
RECORD = 1 * KiB
BATCH_RECORDS = 64
BATCH = RECORD * BATCH_RECORDS
BUCKET_S = 0.1
PLOTS = Path(__file__).resolve().parent / "plots"


@dataclass(frozen=True)
class Timing:
    """When things happen, in seconds from the start of a run."""

    rate: int  # offered bytes/s per stream
    stall_at: float
    resume_at: float
    end: float
    solo: float

    @classmethod
    def default(cls, quick: bool) -> Timing:
        if quick:
            return cls(rate=4 * MiB, stall_at=1.0, resume_at=2.5, end=4.0, solo=1.5)
        return cls(rate=8 * MiB, stall_at=2.0, resume_at=5.0, end=8.0, solo=3.0)


@dataclass(frozen=True)
class MemorySample:
    """The receiving process's memory at one moment of the run."""

    seconds: float  # from the run's start
    rss: int  # VmRSS, bytes (mapped log files included)
    anon: int  # RssAnon, bytes (the heap)


@dataclass
class Result:
    system: str
    solo_rate: float = 0.0
    stall_rate: float = 0.0
    overshoot: str = "0"
    peak_rss: int | None = None
    peak_anon: int | None = None
    budget: int | None = None
    ctl_per_batch: float | None = None
    recovery: float | None = None
    note: str = ""
    buckets: dict[str, list[float]] = field(default_factory=dict)
    #: The receiving process's memory over the run (every 50 ms), for the plot.
    memory: list[MemorySample] = field(default_factory=list)
    skipped: str | None = None

    @property
    def ratio(self) -> float:
        return self.stall_rate / self.solo_rate if self.solo_rate else 0.0


# --- timelines ------------------------------------------------------------------------


class Timeline:
    """Bytes delivered per stream per 100-ms bucket, from ``t0`` (CLOCK_MONOTONIC)."""

    def __init__(self, t0: float, end: float) -> None:
        self.t0 = t0
        self.n = int(end / BUCKET_S) + 1
        self.buckets: dict[str, list[float]] = {"A": [0.0] * self.n, "B": [0.0] * self.n}

    def add(self, stream: str, nbytes: int) -> None:
        i = int((time.monotonic() - self.t0) / BUCKET_S)
        if 0 <= i < self.n:
            self.buckets[stream][i] += nbytes


def rate_between(buckets: list[float], start: float, stop: float) -> float:
    first, last = int(start / BUCKET_S), int(stop / BUCKET_S)
    chosen = buckets[first:last]
    return sum(chosen) / (len(chosen) * BUCKET_S) if chosen else 0.0


def recovery_time(buckets: list[float], timing: Timing) -> float | None:
    first = int(timing.resume_at / BUCKET_S)
    for i in range(first, len(buckets)):
        if buckets[i] / BUCKET_S >= 0.9 * timing.rate:
            return (i + 1) * BUCKET_S - timing.resume_at
    return None


async def start_child(conn: Connection, *, ready: bool = True) -> float:
    """Wait for a child to be ready (``ready``: it sends one message first), then
    give it the run's start time, shortly ahead."""
    if ready:
        await asyncio.to_thread(conn.recv)
    t0 = time.monotonic() + 0.3
    conn.send(t0)
    return t0


def schedule(t0: float, timing: Timing) -> tuple[float, float, float]:
    return t0 + timing.stall_at, t0 + timing.resume_at, t0 + timing.end


def proc_status(pid: int, key: str) -> int:
    """A ``/proc/<pid>/status`` size field in bytes (0 if the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class RssSampler:
    """VmRSS and RssAnon of a process, sampled every 50 ms in a thread: their
    peaks for the table, and every sample for the plot's memory panel (a backlog
    that grows in the receiver, as Redis's does, shows as a rising line)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        #: Peak of the anonymous part (heap), without mapped files such as logs.
        self.peak_anon = 0
        #: ``(time.monotonic(), VmRSS, RssAnon)`` per sample, in bytes.
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            rss = proc_status(self.pid, "VmRSS")
            anon = proc_status(self.pid, "RssAnon")
            self.peak = max(self.peak, rss)
            self.peak_anon = max(self.peak_anon, anon)
            self.samples.append((time.monotonic(), rss, anon))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(1.0)
        self.peak = max(self.peak, proc_status(self.pid, "VmHWM"))
        return self.peak

    def over_time(self, t0: float) -> list[MemorySample]:
        """The samples taken from the run's start ``t0`` on, in seconds from it
        (samples of a process that was already gone read 0 and are left out)."""
        return [MemorySample(t - t0, rss, anon) for t, rss, anon in self.samples if t >= t0 and rss]


async def paced(
    stream: str, timing: Timing, t0: float, send: Callable[[str, int], Any], end: float
) -> None:
    """Offer ``timing.rate`` bytes/s of ``stream`` in batches until ``end``; a late
    sender catches up on what was due (the source keeps its backlog)."""
    sent = 0
    loop_end = t0 + end
    while time.monotonic() < loop_end:
        due = timing.rate * (time.monotonic() - t0)
        while sent + BATCH <= due and time.monotonic() < loop_end:
            await send(stream, sent // BATCH)
            sent += BATCH
        await asyncio.sleep(0.005)


# --- headgate -------------------------------------------------------------------------

GATEWAY_CHILD = "--gateway-child"
#: The window policy's batches in flight per writer.
WINDOW = 8
#: The gateway's RSS budget is its RSS before the load, plus each stream's
#: mapped log (capacity and two terms), plus this for connections and batches.
WORKING_MEMORY = 16 * MiB
TERM = 1 * MiB


def capacity_for(timing: Timing) -> int:
    """Each stream's log: one second of its offered rate (at least 4 terms), so
    that A's stall fills it early in the stall."""
    return max(4 * TERM, timing.rate // TERM * TERM)


def gateway_child(settings: dict[str, Any]) -> None:
    """Run in the gateway child process: serve until stdin closes, print flow stats."""
    from headgate.config import GatewayConfig, StreamSettings
    from headgate.gateway import Gateway

    policy = settings["policy"]
    capacity = settings["capacity"]
    streams = {
        name: StreamSettings(capacity=capacity, xoff=capacity * 3 // 4, xon=capacity // 4)
        for name in ("A", "B")
    }
    config = GatewayConfig(
        listen=("127.0.0.1", 0),
        data_dir=Path(settings["data_dir"]),
        stream_capacity=capacity,
        term_length=TERM,
        max_message_size=BATCH + 4 * KiB,
        group_commit_interval_ms=2.0,
        policy=policy,
        window=settings["window"],
        streams=streams,
    )

    async def main() -> None:
        gw = Gateway(config)
        await gw.start()
        print(f"listening {gw.address[1]}", flush=True)
        loop = asyncio.get_running_loop()
        done = asyncio.Event()
        threading.Thread(
            target=lambda: (sys.stdin.read(), loop.call_soon_threadsafe(done.set)),
            daemon=True,
        ).start()
        await done.wait()
        stats: dict[str, Any] = {}
        for name in gw.streams:
            f = gw.flow_statistics(name)
            stats[name] = {
                "held": f.peak_held_bytes,
                "pauses": f.pauses,
                "resumes": f.resumes,
                "paused": f.paused,
                "peak_level": f.peak_level,
                "max_in_flight": f.max_in_flight,
            }
        stats["held connections"] = {
            str(c.conn_id): sorted(c.reads.reasons)
            for c in gw.connections.values()
            if c.reads.reasons
        }
        print(json.dumps(stats), flush=True)
        await gw.stop()

    asyncio.run(main())


def headgate_consumer(
    conn: Connection, data_dir: str, port: int, timing: Timing, streams: list[str]
) -> None:
    """Read each stream's log by position and Release it over the protocol; A stalls."""
    from headgate.costs import batch_cost
    from headgate.log import LogReader
    from headgate.protocol import messages as m
    from headgate.protocol.session import Role, Session

    conn.send("ready")
    t0: float = conn.recv()
    stall, resume, end = schedule(t0, timing)
    timeline = Timeline(t0, timing.end)
    session = Session(Role.PRODUCER, data_cost=batch_cost)
    session.send_global(m.Hello(producer_id=random.getrandbits(62), client_name="consumer"))
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(None)  # blocking sends; receives use MSG_DONTWAIT
    readers: dict[str, LogReader] = {}
    positions: dict[str, int] = {}
    while time.monotonic() < end:
        with contextlib.suppress(BlockingIOError, TimeoutError):
            data = sock.recv(1 << 16, socket.MSG_DONTWAIT)
            if data:
                session.receive_data(data)
        for name in streams:
            if name == "A" and stall <= time.monotonic() < resume:
                continue
            if name not in readers:
                directory = Path(data_dir) / "streams" / name
                if not (directory / "meta").exists():
                    continue
                try:
                    readers[name] = LogReader.open(directory)
                except Exception:
                    continue
                positions[name] = readers[name].start_position()
            reader = readers[name]
            durable = reader.durable_position()
            if durable > positions[name]:
                got = sum(len(f.payload) for f in reader.read(positions[name], durable))
                timeline.add(name, got)
                positions[name] = durable
                session.send_global(m.Release(stream=name, position=durable))
        out = session.data_to_send()
        if out:
            sock.sendall(out)
        time.sleep(0.003)
    sock.close()
    conn.send(timeline.buckets)


async def run_headgate(policy: str, timing: Timing, solo: bool) -> Result:
    from headgate.client import Producer

    result = Result(system=f"headgate {policy}")
    data_dir = Path(tempfile.mkdtemp(prefix="hg-flow-"))
    capacity = capacity_for(timing)
    child = subprocess.Popen(
        [
            sys.executable,
            __file__,
            GATEWAY_CHILD,
            json.dumps(
                {
                    "policy": policy,
                    "data_dir": str(data_dir),
                    "window": WINDOW,
                    "capacity": capacity,
                }
            ),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        line = child.stdout.readline()
        port = int(line.split()[1])
        idle_rss = proc_status(child.pid, "VmRSS")
        sampler = RssSampler(child.pid)
        length = timing.solo if solo else timing.end
        run = Timing(timing.rate, timing.stall_at, timing.resume_at, length, timing.solo)
        if solo:
            run = Timing(timing.rate, length + 1, length + 1, length, timing.solo)
        ctx = multiprocessing.get_context("spawn")
        parent, kid = ctx.Pipe()
        streams = ["B"] if solo else ["A", "B"]
        consumer = ctx.Process(
            target=headgate_consumer, args=(kid, str(data_dir), port, run, streams)
        )
        consumer.start()
        t0 = await start_child(parent)
        producer = Producer(
            ("127.0.0.1", port),
            policy="window" if policy == "window" else "wait",
            linger_ms=2,
            max_batch_bytes=BATCH + 1024,
            max_buffered_bytes=4 * MiB,
        )
        await producer.connect()
        guarantees = [0]
        conn = producer._conn  # bench instrumentation: count guarantee frames
        assert conn is not None
        session: Any = conn.session
        original = session._on_guarantees

        def counting(channel: int, amount: int, events: list[Any]) -> None:
            if channel >= 2:
                guarantees[0] += 1
            original(channel, amount, events)

        session._on_guarantees = counting
        batch = [os.urandom(RECORD)] * BATCH_RECORDS

        async def send(stream: str, _: int) -> None:
            await producer.send_many(stream, batch)

        await asyncio.sleep(max(0.0, t0 - time.monotonic()))
        tasks = [asyncio.create_task(paced(s, run, t0, send, run.end)) for s in streams]
        await asyncio.sleep(max(0.0, t0 + run.end - time.monotonic()))
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        stats = producer.statistics()
        batches = sum(s.bytes_sent for s in stats.streams.values()) / BATCH
        await producer.abort()
        buckets = await asyncio.to_thread(parent.recv)
        consumer.join(5)
        result.peak_rss = sampler.stop()
        result.memory = sampler.over_time(t0)
        result.peak_anon = sampler.peak_anon
        result.budget = idle_rss + 2 * (capacity + 2 * TERM) + WORKING_MEMORY
        child.stdin.close()
        flow = json.loads(child.stdout.readline() or "{}")
        child.wait(10)
        result.buckets = buckets
        result.ctl_per_batch = guarantees[0] / batches if batches else None
        a = flow.get("A", {})
        dropped = sum(s.batches_dropped for s in stats.streams.values())
        if policy == "xonxoff":
            over = max(0, a.get("peak_level", 0) - capacity * 3 // 4)
            result.overshoot = f"{over / KiB:.0f} KiB past xoff, {dropped} drops"
            result.note = f"{a.get('pauses', 0)} pause(s), {a.get('resumes', 0)} resume(s)"
            if a.get("paused"):
                result.note += ", still paused at the end"
        else:
            result.overshoot = f"{a.get('held', 0) / KiB:.0f} KiB held, {dropped} drops"
        if policy == "window":
            result.note = f"max {a.get('max_in_flight', 0)} in flight (window {WINDOW})"
        if flow.get("held connections"):
            result.note += f"; reads still paused at the end: {flow['held connections']}"
        return result
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(5)
        shutil.rmtree(data_dir, ignore_errors=True)


# --- HTTP/2 ---------------------------------------------------------------------------

#: The server's connection window, and its stream windows: larger than the
#: connection's, so one stream may use the whole connection (a common setting).
H2_CONNECTION_WINDOW = 1 * MiB
H2_STREAM_WINDOW = 4 * MiB


def h2_server(conn: Connection, timing: Timing) -> None:
    import h2.config
    import h2.connection
    import h2.events
    import h2.settings

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    conn.send(listener.getsockname()[1])
    t0: float = conn.recv()
    stall, resume, end = schedule(t0, timing)
    timeline = Timeline(t0, timing.end)
    listener.settimeout(5)
    sock, _ = listener.accept()
    sock.settimeout(0.01)
    h2c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    h2c.initiate_connection()
    h2c.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: H2_STREAM_WINDOW})
    h2c.increment_flow_control_window(H2_CONNECTION_WINDOW - 65535)
    sock.sendall(h2c.data_to_send())
    names: dict[int, str] = {}
    unacked: list[tuple[int, int]] = []
    while time.monotonic() < end:
        try:
            data = sock.recv(1 << 16)
        except TimeoutError:
            data = b""
        except OSError:
            break
        for event in h2c.receive_data(data) if data else []:
            if isinstance(event, h2.events.RequestReceived):
                path = dict(event.headers).get(b":path", b"/B")
                names[event.stream_id] = path.decode()[1:]
            elif isinstance(event, h2.events.DataReceived):
                name = names.get(event.stream_id, "?")
                timeline.add(name, len(event.data))
                if name == "A" and stall <= time.monotonic() < resume:
                    unacked.append((event.flow_controlled_length, event.stream_id))
                else:
                    h2c.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        if unacked and time.monotonic() >= resume:
            for length, sid in unacked:
                h2c.acknowledge_received_data(length, sid)
            unacked.clear()
        out = h2c.data_to_send()
        if out:
            sock.sendall(out)
    sock.close()
    conn.send(timeline.buckets)


async def run_h2(timing: Timing, solo: bool) -> Result:
    import h2.config
    import h2.connection
    import h2.events

    result = Result(system="HTTP/2 (h2)")
    length = timing.solo if solo else timing.end
    run = Timing(timing.rate, timing.stall_at, timing.resume_at, length, timing.solo)
    if solo:
        run = Timing(timing.rate, length + 1, length + 1, length, timing.solo)
    ctx = multiprocessing.get_context("spawn")
    parent, kid = ctx.Pipe()
    server = ctx.Process(target=h2_server, args=(kid, run))
    server.start()
    port = await asyncio.to_thread(parent.recv)
    t0 = await start_child(parent, ready=False)
    sampler = RssSampler(server.pid or 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    h2c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    h2c.initiate_connection()
    streams = ["B"] if solo else ["A", "B"]
    ids = {}
    for name in streams:
        sid = h2c.get_next_available_stream_id()
        h2c.send_headers(
            sid,
            [(":method", "POST"), (":path", f"/{name}"), (":scheme", "http"), (":authority", "x")],
        )
        ids[name] = sid
    writer.write(h2c.data_to_send())
    updates = [0]
    frames = [0]
    opened = asyncio.Event()

    async def read_loop() -> None:
        while True:
            data = await reader.read(1 << 16)
            if not data:
                return
            for event in h2c.receive_data(data):
                if isinstance(event, h2.events.WindowUpdated):
                    updates[0] += 1
                    opened.set()
            out = h2c.data_to_send()
            if out:
                writer.write(out)

    reading = asyncio.create_task(read_loop())
    payload = os.urandom(BATCH)
    longest_block = dict.fromkeys(streams, 0.0)

    async def send(stream: str, _: int) -> None:
        sid = ids[stream]
        view = memoryview(payload)
        blocked_since = None
        while view and time.monotonic() < t0 + run.end:
            room = min(h2c.local_flow_control_window(sid), h2c.max_outbound_frame_size, len(view))
            if room <= 0:
                blocked_since = blocked_since or time.monotonic()
                opened.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(opened.wait(), 0.05)
                continue
            if blocked_since is not None:
                blocked = time.monotonic() - blocked_since
                longest_block[stream] = max(longest_block[stream], blocked)
                blocked_since = None
            h2c.send_data(sid, view[:room].tobytes())
            frames[0] += 1
            view = view[room:]
            writer.write(h2c.data_to_send())
            await writer.drain()
        if blocked_since is not None:
            blocked = time.monotonic() - blocked_since
            longest_block[stream] = max(longest_block[stream], blocked)

    await asyncio.sleep(max(0.0, t0 - time.monotonic()))
    tasks = [asyncio.create_task(paced(s, run, t0, send, run.end)) for s in streams]
    await asyncio.sleep(max(0.0, t0 + run.end - time.monotonic()))
    for task in [*tasks, reading]:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await task
    writer.close()
    result.buckets = await asyncio.to_thread(parent.recv)
    server.join(5)
    result.peak_rss = sampler.stop()
    result.memory = sampler.over_time(t0)
    batches = frames[0] * h2c.max_outbound_frame_size / BATCH
    result.ctl_per_batch = updates[0] / batches if batches else None
    result.overshoot = "0 (blocked by windows)"
    if not solo:
        result.note = f"B's sender blocked up to {longest_block['B']:.1f} s at once"
    return result


# --- plain TCP ------------------------------------------------------------------------


def tcp_reader(conn: Connection, timing: Timing) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    conn.send(listener.getsockname()[1])
    t0: float = conn.recv()
    stall, resume, end = schedule(t0, timing)
    timeline = Timeline(t0, timing.end)
    listener.settimeout(5)
    sock, _ = listener.accept()
    sock.settimeout(0.01)
    buffer = bytearray()
    received = 0
    while time.monotonic() < end:
        if stall <= time.monotonic() < resume:
            time.sleep(0.01)  # A's consumer stalls: nobody reads the socket
            continue
        try:
            data = sock.recv(1 << 18)
        except TimeoutError:
            continue
        if not data:
            break
        received += len(data)
        buffer += data
        while len(buffer) >= 5:
            tag, size = struct.unpack_from("!cI", buffer)
            if len(buffer) < 5 + size:
                break
            timeline.add(tag.decode(), size)
            del buffer[: 5 + size]
    sock.close()
    conn.send((timeline.buckets, received))


async def run_tcp(timing: Timing, solo: bool) -> Result:
    result = Result(system="plain TCP")
    length = timing.solo if solo else timing.end
    run = Timing(timing.rate, timing.stall_at, timing.resume_at, length, timing.solo)
    if solo:
        run = Timing(timing.rate, length + 1, length + 1, length, timing.solo)
    ctx = multiprocessing.get_context("spawn")
    parent, kid = ctx.Pipe()
    reader_proc = ctx.Process(target=tcp_reader, args=(kid, run))
    reader_proc.start()
    port = await asyncio.to_thread(parent.recv)
    sampler = RssSampler(reader_proc.pid or 0)
    t0 = await start_child(parent, ready=False)
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = os.urandom(BATCH)
    sent = [0]
    peak_gap = [0]
    streams = ["B"] if solo else ["A", "B"]

    async def send(stream: str, _: int) -> None:
        writer.write(struct.pack("!cI", stream.encode(), BATCH) + payload)
        sent[0] += BATCH + 5
        await writer.drain()

    await asyncio.sleep(max(0.0, t0 - time.monotonic()))
    tasks = [asyncio.create_task(paced(s, run, t0, send, run.end)) for s in streams]
    await asyncio.sleep(max(0.0, t0 + run.stall_at + 1.0 - time.monotonic()))
    peak_gap[0] = sent[0]
    await asyncio.sleep(max(0.0, t0 + run.end - time.monotonic()))
    for task in tasks:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await task
    writer.transport.abort()
    buckets, _ = await asyncio.to_thread(parent.recv)
    reader_proc.join(5)
    result.peak_rss = sampler.stop()
    result.memory = sampler.over_time(t0)
    result.buckets = buckets
    delivered_by_then = sum(
        sum(b[: int((run.stall_at + 1.0) / BUCKET_S)]) for b in buckets.values()
    )
    in_kernel = max(0, peak_gap[0] - int(delivered_by_then))
    result.overshoot = f"{in_kernel / KiB:.0f} KiB in kernel buffers"
    result.ctl_per_batch = 0.0
    return result


# --- Redis Streams ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def redis_consumer(conn: Connection, port: int, timing: Timing, streams: list[str]) -> None:
    import redis

    conn.send("ready")
    t0: float = conn.recv()
    stall, resume, end = schedule(t0, timing)
    timeline = Timeline(t0, timing.end)
    client = redis.Redis(host="127.0.0.1", port=port)
    last = dict.fromkeys(streams, "0-0")
    while time.monotonic() < end:
        wanted = {
            s: last[s] for s in streams if not (s == "A" and stall <= time.monotonic() < resume)
        }
        if not wanted:
            time.sleep(0.01)
            continue
        replies: Any = client.xread(wanted, count=256, block=10) or []  # type: ignore[arg-type]
        for name, entries in replies:
            stream = name.decode()
            for entry_id, fields in entries:
                timeline.add(stream, len(fields[b"v"]))
                last[stream] = entry_id.decode()
            # The consumer is done with what it read: trim it, as a release.
            client.xtrim(stream, minid=last[stream])
    conn.send(timeline.buckets)


async def run_redis(timing: Timing, solo: bool) -> Result:
    result = Result(system="Redis Streams")
    binary = shutil.which("redis-server")
    if binary is None:
        result.skipped = "not installed (no redis-server)"
        return result
    import redis

    port = free_port()
    server = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        client = redis.Redis(host="127.0.0.1", port=port)
        for _ in range(100):
            with contextlib.suppress(redis.ConnectionError):
                if client.ping():
                    break
            await asyncio.sleep(0.05)
        sampler = RssSampler(server.pid)
        length = timing.solo if solo else timing.end
        run = Timing(timing.rate, timing.stall_at, timing.resume_at, length, timing.solo)
        if solo:
            run = Timing(timing.rate, length + 1, length + 1, length, timing.solo)
        streams = ["B"] if solo else ["A", "B"]
        ctx = multiprocessing.get_context("spawn")
        parent, kid = ctx.Pipe()
        consumer = ctx.Process(target=redis_consumer, args=(kid, port, run, streams))
        consumer.start()
        t0 = await start_child(parent)
        value = os.urandom(RECORD)
        peak_backlog = [0]
        lock = asyncio.Lock()

        def xadd_batch(stream: str) -> None:
            pipe = client.pipeline(transaction=False)
            for _ in range(BATCH_RECORDS):
                pipe.xadd(stream, {"v": value})
            pipe.execute()

        async def send(stream: str, _: int) -> None:
            async with lock:  # one connection carries both streams
                await asyncio.to_thread(xadd_batch, stream)

        async def watch() -> None:
            while True:
                await asyncio.sleep(0.2)
                if "A" in streams:
                    n = await asyncio.to_thread(client.xlen, "A")
                    peak_backlog[0] = max(peak_backlog[0], int(n) * RECORD)

        await asyncio.sleep(max(0.0, t0 - time.monotonic()))
        tasks = [asyncio.create_task(paced(s, run, t0, send, run.end)) for s in streams]
        watcher = asyncio.create_task(watch())
        await asyncio.sleep(max(0.0, t0 + run.end - time.monotonic()))
        for task in [*tasks, watcher]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        result.buckets = await asyncio.to_thread(parent.recv)
        consumer.join(5)
        result.peak_rss = sampler.stop()
        result.memory = sampler.over_time(t0)
        result.overshoot = f"{peak_backlog[0] / KiB:.0f} KiB backlog in Redis, no push-back"
        # The sender waits for each batch's pipelined XADD replies: one round
        # trip per batch, though none of it is flow control.
        result.ctl_per_batch = 1.0
        result.note = "1 round trip = the XADD pipeline's replies"
        client.close()
        return result
    finally:
        server.terminate()
        try:
            server.wait(5)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(5)


# --- NATS JetStream -------------------------------------------------------------------

#: Batches each stream's publisher keeps unacknowledged (publish_async's bound is
#: this many batches' records), as headgate's window policy does.
NATS_WINDOW = WINDOW
#: A refused batch is published again after this, doubling up to NATS_RETRY_MAX_S.
NATS_RETRY_S = 0.02
NATS_RETRY_MAX_S = 0.32


def nats_consumer(conn: Connection, url: str, timing: Timing, streams: list[str]) -> None:
    """Pull each stream's messages and acknowledge each one (a work-queue stream
    deletes what is acknowledged: JetStream's release); A stalls."""
    import nats

    async def main() -> dict[str, list[float]]:
        nc = await nats.connect(url)
        js = nc.jetstream()
        subs = {s: await js.pull_subscribe(s, durable=f"consumer-{s}", stream=s) for s in streams}
        conn.send("ready")
        t0: float = await asyncio.to_thread(conn.recv)
        stall, resume, end = schedule(t0, timing)
        timeline = Timeline(t0, timing.end)

        async def drain(stream: str) -> None:
            while time.monotonic() < end:
                if stream == "A" and stall <= time.monotonic() < resume:
                    await asyncio.sleep(0.01)
                    continue
                try:
                    messages = await subs[stream].fetch(256, timeout=0.05)
                except (nats.errors.TimeoutError, TimeoutError):  # nats-py raises either
                    continue
                for message in messages:
                    timeline.add(stream, len(message.data))
                    await message.ack()

        await asyncio.gather(*(drain(s) for s in streams))
        await nc.close()
        return timeline.buckets

    conn.send(asyncio.run(main()))


async def run_nats(timing: Timing, solo: bool, binary: str | None) -> Result:
    """JetStream on a file store: streams A and B as work-queue streams of the same
    capacity as headgate's logs, ``discard: new`` (a full stream refuses new
    messages rather than dropping old ones, which is what flow control needs),
    one connection publishing both with publish_async."""
    import natsjs

    result = Result(system="NATS JetStream")
    found = natsjs.find_server(binary)
    missing = natsjs.client_missing()
    if missing or found is None:
        result.skipped = missing or natsjs.skip_reason(binary)
        return result
    import nats
    from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType

    server = natsjs.JetStreamServer.start(found)
    try:
        result.system = f"NATS JetStream ({server.label})"
        capacity = capacity_for(timing)
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        publisher = natsjs.AckedPublisher(nc, 2 * NATS_WINDOW * BATCH_RECORDS)
        await publisher.start()
        length = timing.solo if solo else timing.end
        run = Timing(timing.rate, timing.stall_at, timing.resume_at, length, timing.solo)
        if solo:
            run = Timing(timing.rate, length + 1, length + 1, length, timing.solo)
        streams = ["B"] if solo else ["A", "B"]
        for name in streams:
            await js.add_stream(
                name=name,
                subjects=[name],
                storage=StorageType.FILE,
                retention=RetentionPolicy.WORK_QUEUE,
                discard=DiscardPolicy.NEW,
                max_bytes=capacity,
            )
        sampler = RssSampler(server.pid)
        ctx = multiprocessing.get_context("spawn")
        parent, kid = ctx.Pipe()
        consumer = ctx.Process(target=nats_consumer, args=(kid, server.url, run, streams))
        consumer.start()
        t0 = await start_child(parent)
        value = os.urandom(RECORD)
        batches = [0]
        refused: dict[str, int] = dict.fromkeys(streams, 0)
        reasons: set[str] = set()
        in_flight: dict[str, list[asyncio.Task[None]]] = {s: [] for s in streams}
        stop_at = t0 + run.end

        async def publish(stream: str, count: int) -> list[asyncio.Future[str | None]]:
            return [await publisher.publish(stream, value) for _ in range(count)]

        async def settle(stream: str, futures: list[asyncio.Future[str | None]]) -> None:
            """Wait for a batch's acks; publish what was refused again, backing off."""
            delay = NATS_RETRY_S
            while futures:
                outcomes = await asyncio.gather(*futures)
                failed = [o for o in outcomes if o is not None]
                if not failed:
                    return
                refused[stream] += len(failed)
                reasons.add(failed[0])
                if time.monotonic() + delay >= stop_at:
                    return
                await asyncio.sleep(delay)
                delay = min(2 * delay, NATS_RETRY_MAX_S)
                futures = await publish(stream, len(failed))

        async def send(stream: str, _: int) -> None:
            batches[0] += 1
            window = in_flight[stream]
            while len(window) >= NATS_WINDOW:
                await window.pop(0)
            window.append(asyncio.create_task(settle(stream, await publish(stream, BATCH_RECORDS))))

        peak_stored = [0]

        async def watch() -> None:
            while "A" in streams:
                await asyncio.sleep(0.2)
                info = await js.stream_info("A")
                peak_stored[0] = max(peak_stored[0], info.state.bytes)

        await asyncio.sleep(max(0.0, t0 - time.monotonic()))
        tasks = [asyncio.create_task(paced(s, run, t0, send, run.end)) for s in streams]
        watcher = asyncio.create_task(watch())
        await asyncio.sleep(max(0.0, stop_at - time.monotonic()))
        for task in [*tasks, watcher]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, nats.errors.Error):
                await task
        for task in [t for window in in_flight.values() for t in window]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, nats.errors.Error):
                await task
        if not await asyncio.to_thread(parent.poll, 30.0):
            sampler.stop()
            consumer.kill()
            result.skipped = "failed: the consumer process sent no result (see its error above)"
            return result
        result.buckets = parent.recv()
        consumer.join(5)
        result.peak_rss = sampler.stop()
        result.memory = sampler.over_time(t0)
        result.peak_anon = sampler.peak_anon
        await nc.close()
        # PubAcks and refusals received per batch offered (refused records come back).
        replies = publisher.acks + publisher.refusals
        result.ctl_per_batch = replies / batches[0] if batches[0] else None
        reason = f" ({sorted(reasons)[0]})" if reasons else ""
        result.overshoot = (
            f"{refused.get('A', 0):,} publishes to A refused{reason}, each published again; "
            f"A stored at most {peak_stored[0] / KiB:,.0f} KiB "
            f"(max_bytes {capacity / KiB:,.0f} KiB)"
        )
        result.note = f"1 PubAck per record; {server.durability}"
        return result
    finally:
        server.stop()


# --- ZeroMQ ---------------------------------------------------------------------------

ZMQ_HWM = 64  # messages (batches) per socket queue
A_QUEUE = 64  # A's consumer queue in the receiving process, in batches


def zmq_puller(conn: Connection, timing: Timing) -> None:
    import zmq

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, ZMQ_HWM)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    conn.send(port)
    t0: float = conn.recv()
    stall, resume, end = schedule(t0, timing)
    timeline = Timeline(t0, timing.end)
    a_queue = 0
    peak_queue = 0
    while time.monotonic() < end:
        stalled = stall <= time.monotonic() < resume
        if not stalled and a_queue:
            timeline.add("A", a_queue * BATCH)  # A's consumer catches up
            a_queue = 0
        if stalled and a_queue >= A_QUEUE:
            time.sleep(0.01)  # the reader cannot hand A's message on: it stops
            continue
        if not pull.poll(10):
            continue
        stream, payload = pull.recv_multipart()
        if stream == b"A" and stalled:
            a_queue += 1
            peak_queue = max(peak_queue, a_queue)
        else:
            timeline.add(stream.decode(), len(payload))
    pull.close(0)
    ctx.term()
    conn.send((timeline.buckets, peak_queue))


async def run_zmq(timing: Timing, solo: bool) -> Result:
    import zmq
    import zmq.asyncio

    result = Result(system="ZeroMQ PUSH/PULL")
    length = timing.solo if solo else timing.end
    run = Timing(timing.rate, timing.stall_at, timing.resume_at, length, timing.solo)
    if solo:
        run = Timing(timing.rate, length + 1, length + 1, length, timing.solo)
    mp = multiprocessing.get_context("spawn")
    parent, kid = mp.Pipe()
    puller = mp.Process(target=zmq_puller, args=(kid, run))
    puller.start()
    port = await asyncio.to_thread(parent.recv)
    sampler = RssSampler(puller.pid or 0)
    t0 = await start_child(parent, ready=False)
    ctx = zmq.asyncio.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, ZMQ_HWM)
    push.connect(f"tcp://127.0.0.1:{port}")
    payload = os.urandom(BATCH)
    streams = ["B"] if solo else ["A", "B"]

    async def send(stream: str, _: int) -> None:
        remaining = t0 + run.end - time.monotonic()
        if remaining > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(push.send_multipart([stream.encode(), payload]), remaining)

    await asyncio.sleep(max(0.0, t0 - time.monotonic()))
    tasks = [asyncio.create_task(paced(s, run, t0, send, run.end)) for s in streams]
    await asyncio.sleep(max(0.0, t0 + run.end - time.monotonic()))
    for task in tasks:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    push.close(0)
    ctx.term()
    buckets, peak_queue = await asyncio.to_thread(parent.recv)
    puller.join(5)
    result.peak_rss = sampler.stop()
    result.memory = sampler.over_time(t0)
    result.buckets = buckets
    result.overshoot = f"{peak_queue} batches queued for A (HWM {ZMQ_HWM})"
    result.ctl_per_batch = 0.0
    return result


# --- running, table, plots ------------------------------------------------------------------


async def measure(name: str, timing: Timing, nats_server: str | None = None) -> Result:
    runners: dict[str, Callable[[bool], Any]] = {
        "credit": lambda solo: run_headgate("credit", timing, solo),
        "window": lambda solo: run_headgate("window", timing, solo),
        "xonxoff": lambda solo: run_headgate("xonxoff", timing, solo),
        "h2": lambda solo: run_h2(timing, solo),
        "tcp": lambda solo: run_tcp(timing, solo),
        "redis": lambda solo: run_redis(timing, solo),
        "zmq": lambda solo: run_zmq(timing, solo),
        "nats": lambda solo: run_nats(timing, solo, nats_server),
    }
    solo: Result = await runners[name](True)
    if solo.skipped:
        return solo
    result: Result = await runners[name](False)
    b_solo = solo.buckets["B"]
    result.solo_rate = rate_between(b_solo, 0.5, timing.solo)
    result.stall_rate = rate_between(result.buckets["B"], timing.stall_at + 0.5, timing.resume_at)
    result.recovery = recovery_time(result.buckets["A"], timing)
    return result


def draw(result: Result, timing: Timing) -> Figure:
    """One figure per system, three panels over the same seconds: A's delivered
    rate, B's on its own scale (A's catch-up after the stall runs at 20 to 30
    times the offered rate, which on a shared axis flattens B's steady rate into
    a line near zero), and the receiving process's memory, so that a backlog
    kept in the receiver (Redis's) shows as it grows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate_a, rate_b, memory) = plt.subplots(3, 1, figsize=(7, 6.5), sharex=True)
    offered = timing.rate / MiB
    for ax, stream, colour in ((rate_a, "A", "C0"), (rate_b, "B", "C1")):
        values = [v / BUCKET_S / MiB for v in result.buckets.get(stream, [])]
        ax.plot([i * BUCKET_S for i in range(len(values))], values, color=colour, label=stream)
        ax.axhline(offered, linestyle=":", color="black", linewidth=0.8, label="offered")
        ax.set_ylabel(f"{stream}: MiB/s")
        ax.set_ylim(bottom=0)
    rate_a.set_title(result.system)
    if result.memory:
        seconds = [s.seconds for s in result.memory]
        memory.plot(seconds, [s.rss / MiB for s in result.memory], color="C2", label="RSS")
        memory.plot(
            seconds, [s.anon / MiB for s in result.memory], "--", color="C3", label="heap (anon)"
        )
    else:
        memory.text(
            0.5, 0.5, "memory not sampled", ha="center", va="center", transform=memory.transAxes
        )
    if result.budget is not None:
        memory.axhline(
            result.budget / MiB, linestyle=":", color="black", linewidth=0.8, label="budget"
        )
    memory.set_ylabel("receiver MiB")
    memory.set_ylim(bottom=0)
    memory.set_xlabel("seconds")
    memory.set_xlim(0, timing.end)
    for ax in (rate_a, rate_b, memory):
        ax.axvspan(timing.stall_at, timing.resume_at, alpha=0.15, color="grey", label="A stalled")
        ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    return fig


def plot(result: Result, timing: Timing, directory: Path = PLOTS) -> Path:
    """Draw ``result`` and write it as ``flow-<system>.png`` in ``directory``."""
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    fig = draw(result, timing)
    slug = (
        result.system.lower().replace("/", "").replace(" ", "-").replace("(", "").replace(")", "")
    )
    path = directory / f"flow-{slug}.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def table(results: list[Result], timing: Timing) -> str:
    rows = [
        "| system | B ratio during A's stall | A overshoot / drops | peak RSS (budget), heap "
        "| round trips / batch | A recovery | notes |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.skipped:
            rows.append(f"| {r.system} | {r.skipped} | | | | | |")
            continue
        rss = "" if r.peak_rss is None else f"{r.peak_rss / MiB:.0f} MiB"
        if r.budget is not None:
            rss += f" ({r.budget / MiB:.0f} MiB)"
        if r.peak_anon:
            rss += f", heap {r.peak_anon / MiB:.0f} MiB"
        ctl = "" if r.ctl_per_batch is None else f"{r.ctl_per_batch:.2f}"
        rec = "not within the run" if r.recovery is None else f"{r.recovery:.1f} s"
        rows.append(
            f"| {r.system} | {r.ratio:.2f} ({r.stall_rate / MiB:.1f} of "
            f"{r.solo_rate / MiB:.1f} MiB/s) | {r.overshoot} | {rss} | {ctl} | {rec} | {r.note} |"
        )
    return "\n".join(rows)


SYSTEMS = ("credit", "window", "xonxoff", "h2", "tcp", "redis", "zmq", "nats")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == GATEWAY_CHILD:
        gateway_child(json.loads(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs (about 1 minute)")
    parser.add_argument(
        "--only", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="systems to run"
    )
    parser.add_argument(
        "--nats-server",
        metavar="PATH",
        help="the nats-server to compare with (default: nats-server on PATH; "
        "2.10 or later fsyncs before each ack, see bench/natsjs.py)",
    )
    args = parser.parse_args()
    timing = Timing.default(args.quick)
    print(
        f"offered {timing.rate / MiB:.0f} MiB/s per stream, A stalls from "
        f"{timing.stall_at:g} s to {timing.resume_at:g} s of {timing.end:g} s",
        flush=True,
    )
    results = []
    for name in args.only:
        started = time.monotonic()
        result = asyncio.run(measure(name, timing, args.nats_server))
        results.append(result)
        if not result.skipped:
            path = plot(result, timing)
            print(
                f"{result.system}: B ratio {result.ratio:.2f}, plot {path.name} "
                f"({time.monotonic() - started:.0f} s)",
                flush=True,
            )
        else:
            print(f"{result.system}: {result.skipped}", flush=True)
    print()
    print(table(results, timing))
    credit = next((r for r in results if r.system == "headgate credit"), None)
    if credit is not None:
        within = (credit.peak_rss or 0) <= (credit.budget or 0) and credit.peak_rss is not None
        print(
            f"\ncredit target: B ratio {credit.ratio:.2f} (>= 0.95: "
            f"{'met' if credit.ratio >= 0.95 else 'MISSED'}); gateway RSS within budget: "
            f"{'yes' if within else 'NO'}"
        )


if __name__ == "__main__":
    main()
