"""Hostile peers, each a coroutine that attacks a gateway and reports what it was told.

One home for every attack of the hostile suite (``tests/hostile``) and of
``bench/hostile.py``. An attack runs in a process of its own, so that its CPU
is not the good producer's: :mod:`tests.hostile.harness` starts this module as
a worker and talks to it one JSON line at a time::

    python -m tests.hostile.attacks          # a worker, reading stdin

    -> {"attack": NAME, "target": {...}}      start NAME against the target
    <- engaged                                the attack is at full force
    -> stop                                   the measurement is over
    <- report {...}                           one JSON :class:`Report`
    -> {"prepare": true, "target": {...}}     write the streams attacks read
    <- report {...}

An attack presses on until it is told to stop (or :data:`LONGEST_ATTACK`
passes), then waits a bounded time for the gateway's answers. Every loop is
bounded in count and in time; every attack is deterministic for its seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import socket
import ssl
import struct
import sys
import traceback
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass, field
from typing import Any

from headgate.config import parse_address
from headgate.costs import batch_cost
from headgate.protocol import messages as m
from headgate.protocol.c64 import U64_MAX
from headgate.protocol.codec import FrameDecoder, encode_frame
from headgate.protocol.errors import ErrorCode, ProtocolError
from headgate.protocol.frames import (
    Absolve,
    AnnounceDropping,
    Apologise,
    Frame,
    IssueGuarantees,
    Plead,
    SendChannel,
    SendGlobal,
)
from headgate.protocol.records import encode_records

Address = tuple[str, int]

#: No attack presses on longer than this, told to stop or not (seconds).
LONGEST_ATTACK = 30.0
#: Frames of the stream that ``fetch_tiny_frames`` reads (written by ``prepare``).
TINY_FRAMES = 20_000
SMALL_FRAMES = 16
#: Credit-free frames a second that a flooder sends per connection (just under
#: the old per-connection limit of 5000 a second): a steady flood in which
#: every frame costs the gateway work, charged to the flooder's token.
FLOOD_RATE = 4500
#: The loopback address that attacks meant to come from another host connect from.
ATTACKER_HOST = "127.0.0.3"
#: The stream the noisy writers write (its capacity is large: nobody releases it).
NOISY_STREAM = "h-noisy"
#: A batch's first sequence, as it is written in the batch (messages.encode_batch_header).
_SEQUENCE = struct.Struct("<Q")
#: The u64 values every u64 field of the hostile-input cases is tried with.
U64_EDGES = (0, 1, 1 << 63, U64_MAX)


@dataclass
class Target:
    """Who and what an attack aims at (the harness fills it in)."""

    #: The gateway, ``host:port``.
    address: str
    #: A token that may write ``h-*`` and the good producer's streams, and read ``h-*``.
    token: str
    #: A token that may only read (every stream).
    reader_token: str
    #: A token that may write only ``h-flood-*`` (its quota is its own).
    flood_token: str
    #: A token with the admin right on ``h-*`` (Release).
    admin_token: str
    #: The good producer's stream in this round, and its producer id.
    victim_stream: str = ""
    victim_producer: int = 0
    #: The stream of TINY_FRAMES one-record frames (see :func:`prepare_tiny`).
    tiny_stream: str = "h-tiny"
    #: A stream of SMALL_FRAMES frames, for requests that must not cost much to answer.
    small_stream: str = "h-small"
    #: The gateway's TLS listener (``host:port``) and its CA file, if it has one.
    tls_address: str = ""
    tls_ca: str = ""


@dataclass
class Report:
    """What one attack saw."""

    attack: str = ""
    #: Connections opened.
    connections: int = 0
    #: Connections the gateway closed (EOF or reset) within the attack.
    closed: int = 0
    #: Connection-wide Error codes received, one list per connection.
    errors: list[list[int]] = field(default_factory=list)
    #: Stream-scoped Error codes received.
    scoped_errors: list[int] = field(default_factory=list)
    #: AnnounceDropping frames received, by channel.
    dropping: list[int] = field(default_factory=list)
    #: Free-form facts for the test (bytes sent, streams bound, ...).
    facts: dict[str, int] = field(default_factory=dict)
    #: Per case, for attacks made of cases: the Error codes of its connection.
    cases: dict[str, list[int]] = field(default_factory=dict)
    #: The attack's own failure (a bug in the attack, not the gateway's answer).
    exception: str = ""

    def count(self, fact: str, by: int = 1) -> None:
        self.facts[fact] = self.facts.get(fact, 0) + by


class Run:
    """One attack's run: when to press on, and how to say it is at full force."""

    def __init__(self, engaged: Callable[[], None]) -> None:
        self.stop = asyncio.Event()
        self._engaged = engaged
        self._said = False
        self.deadline = asyncio.get_running_loop().time() + LONGEST_ATTACK

    def engage(self) -> None:
        """The attack is at full force: the good producer may start measuring."""
        if not self._said:
            self._said = True
            self._engaged()

    def active(self) -> bool:
        return not self.stop.is_set() and asyncio.get_running_loop().time() < self.deadline

    async def pause(self, seconds: float) -> None:
        """Sleep, but wake when told to stop."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop.wait(), seconds)


class Peer:
    """One raw connection: write bytes; a task reads and decodes what the gateway answers.

    A peer that reads (``reader=True``) also plays the LCMUX server of the
    down session, as a log reader does: it issues guarantees for the
    gateway's binds and for the data of each handle the gateway binds.
    """

    def __init__(self, report: Report, *, reader: bool = False, credit: int = 1 << 26) -> None:
        self.report = report
        self.decoder = FrameDecoder(max_payload=1 << 24)
        self.codes: list[int] = []
        self.scoped: list[int] = []
        self.closed = False
        self.welcomed = False
        self.reader_role = reader
        self.credit = credit
        #: Guarantees the gateway issued, by channel; what we spent of them on channel 0.
        self.issued: dict[int, int] = {}
        self.spent_binds = 0
        #: Highest next_sequence acknowledged, by stream handle.
        self.acks: dict[int, int] = {}
        #: Plead frames, FreeHandle frames and binds from the gateway; data received.
        self.pleads = 0
        #: When the first Plead came (loop time), and the deadline Welcome announced (s).
        self.first_plead_at: float | None = None
        self.plead_deadline = 0.0
        self.frees_from_gateway = 0
        self.gateway_binds = 0
        self.pongs = 0
        self.fetches_done = 0
        self.tail_records = 0
        self.tail_bytes = 0
        self.stream_lists: list[m.StreamList] = []
        self._down_unissued: dict[int, int] = {}
        self._changed = asyncio.Event()
        self._pump: asyncio.Task[None] | None = None
        self.reader: asyncio.StreamReader
        self.writer: asyncio.StreamWriter

    async def open(
        self,
        address: Address,
        *,
        rcvbuf: int | None = None,
        tls: ssl.SSLContext | None = None,
        read: bool = True,
        source: str | None = None,
    ) -> None:
        if rcvbuf is None:
            self.reader, self.writer = await asyncio.wait_for(
                asyncio.open_connection(
                    *address, ssl=tls, local_addr=None if source is None else (source, 0)
                ),
                10,
            )
        else:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, address)
            self.reader, self.writer = await asyncio.open_connection(sock=sock)
        self.report.connections += 1
        self.report.errors.append(self.codes)
        if read:
            self.start_reading()

    def start_reading(self) -> None:
        if self._pump is None:
            self._pump = asyncio.get_running_loop().create_task(self._read_all())

    async def send(self, data: bytes) -> bool:
        """Write; False once the gateway has closed the connection."""
        if self.closed:
            return False
        try:
            self.writer.write(data)
            await asyncio.wait_for(self.writer.drain(), 2.0)
        except (ConnectionError, TimeoutError):
            return not self.writer.transport.is_closing()
        return True

    def write(self, frame: Frame) -> None:
        """Queue a frame without waiting (answers from the read task)."""
        if not self.closed and not self.writer.transport.is_closing():
            self.writer.write(encode_frame(frame))

    async def _read_all(self) -> None:
        while True:
            try:
                data = await self.reader.read(1 << 16)
            except (ConnectionError, OSError, ssl.SSLError):
                data = b""
            if not data:
                self.closed = True
                self.report.closed += 1
                self._changed.set()
                return
            try:
                frames = self.decoder.feed(data)
            except ProtocolError:
                frames = []
            for frame in frames:
                self._on_frame(frame)
            self._changed.set()

    def _on_frame(self, frame: Frame) -> None:
        if isinstance(frame, IssueGuarantees):
            self.issued[frame.channel] = self.issued.get(frame.channel, 0) + frame.amount
        elif isinstance(frame, AnnounceDropping):
            self.report.dropping.append(frame.channel)
        elif isinstance(frame, Plead):
            self.pleads += 1
            if self.first_plead_at is None:
                self.first_plead_at = asyncio.get_running_loop().time()
        elif isinstance(frame, SendChannel):
            self._on_down(frame)
        elif isinstance(frame, SendGlobal):
            try:
                message = m.decode_global(frame.payload)
            except ProtocolError:
                return
            self._on_message(message)

    def _on_down(self, frame: SendChannel) -> None:
        """A message of the down session, where this peer is the LCMUX server."""
        if frame.channel == m.STREAM_CHANNEL:
            handle = self.gateway_binds
            self.gateway_binds += 1
            if self.reader_role:
                self.write(IssueGuarantees(channel=m.data_channel(handle), amount=self.credit))
            return
        self.tail_records += 1
        self.tail_bytes += len(frame.payload)
        if self.reader_role:
            # Hand back what we took, in lumps, as a reader that keeps up does.
            unissued = self._down_unissued.get(frame.channel, 0) + batch_cost(len(frame.payload))
            if unissued >= self.credit // 4:
                self.write(IssueGuarantees(channel=frame.channel, amount=unissued))
                unissued = 0
            self._down_unissued[frame.channel] = unissued

    def _on_message(self, message: m.GlobalMessage) -> None:
        if isinstance(message, m.Welcome):
            self.welcomed = True
            self.plead_deadline = message.plead_deadline_ms / 1000
            if self.reader_role:
                self.write(IssueGuarantees(channel=m.STREAM_CHANNEL, amount=1 << 20))
        elif isinstance(message, m.Error):
            if message.scope is None:
                self.codes.append(int(message.code))
            else:
                self.scoped.append(int(message.code))
                self.report.scoped_errors.append(int(message.code))
        elif isinstance(message, m.Ack):
            self.acks[message.handle] = max(self.acks.get(message.handle, 0), message.next_sequence)
        elif isinstance(message, m.Pong):
            self.pongs += 1
        elif isinstance(message, m.FreeHandle):
            self.frees_from_gateway += 1
        elif isinstance(message, m.FetchDone):
            self.fetches_done += 1
        elif isinstance(message, m.StreamList):
            self.stream_lists.append(message)

    async def read(self, timeout: float) -> None:
        """Wait until something arrives (or the close), at most ``timeout``."""
        if self.closed:
            return
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), max(timeout, 0.0))

    async def until(self, condition: Callable[[], bool], timeout: float) -> bool:
        """Read until ``condition()`` or the close, at most ``timeout``; return ``condition()``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not condition() and not self.closed and loop.time() < deadline:
            await self.read(deadline - loop.time())
        return condition()

    async def until_closed(self, timeout: float) -> None:
        await self.until(lambda: self.closed, timeout)

    def guarantees(self, channel: int) -> int:
        return self.issued.get(channel, 0)

    def bind_room(self) -> int:
        """Channel-0 guarantees left: how many bind bytes the gateway will surely take."""
        return self.guarantees(m.STREAM_CHANNEL) - self.spent_binds

    def bind(self, name: str) -> bytes:
        payload = m.encode_message(m.BindStream(stream=name))
        self.spent_binds += len(payload)
        return encode_frame(SendChannel(channel=m.STREAM_CHANNEL, payload=payload))

    async def bind_many(self, name: str, most: int) -> int:
        """Bind stream ``name`` up to ``most`` times, within the bind guarantees; how many."""
        size = len(m.encode_message(m.BindStream(stream=name)))
        handles = 0
        while handles < most and self.bind_room() >= size and not self.closed:
            await self.send(self.bind(name))
            handles += 1
        return handles

    def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
        with contextlib.suppress(Exception):
            self.writer.close()


def hello(token: str, producer_id: int = 1) -> bytes:
    message = m.Hello(producer_id=producer_id, client_name="hostile", token=token.encode())
    return encode_frame(SendGlobal(payload=m.encode_message(message)))


def bind(name: str) -> bytes:
    return encode_frame(SendChannel(channel=0, payload=m.encode_message(m.BindStream(stream=name))))


def batch(handle: int, sequence: int, values: list[bytes]) -> bytes:
    payload = m.encode_batch_header(sequence) + encode_records(values)
    return encode_frame(SendChannel(channel=m.data_channel(handle), payload=payload))


def glob(message: m.GlobalMessage) -> bytes:
    return encode_frame(SendGlobal(payload=m.encode_message(message)))


def free(handle: int, *, mine: bool = True) -> bytes:
    return glob(m.FreeHandle(handle_type=m.HandleType.STREAM, handle=handle, mine=mine))


def transcript(token: str, stream: str) -> bytes:
    """A valid opening: Hello, a bind, three batches, a ping, a free."""
    return b"".join(
        [
            hello(token, 77),
            bind(stream),
            batch(0, 0, [b"a", b"b"]),
            batch(0, 2, [b"c" * 50]),
            batch(0, 3, [b"d"]),
            glob(m.Ping(nonce=5)),
            free(0),
        ]
    )


async def opened(
    address: Address,
    token: str,
    report: Report,
    *,
    producer_id: int | None = None,
    reader: bool = False,
    tls: ssl.SSLContext | None = None,
) -> Peer:
    """A peer past Hello: Welcome received (or refused, then closed)."""
    peer = Peer(report, reader=reader)
    await peer.open(address, tls=tls)
    if producer_id is None:
        producer_id = random.getrandbits(62)
    await peer.send(hello(token, producer_id))
    await peer.until(lambda: peer.welcomed and (reader or peer.bind_room() > 0), 5.0)
    return peer


async def keep_alive(peers: list[Peer], run: Run, every: float = 0.3) -> None:
    """Ping every open peer until the run stops, so that idleness closes none of them."""
    nonce = 0
    while run.active():
        for peer in peers:
            if not peer.closed:
                nonce += 1
                peer.write(SendGlobal(payload=m.encode_message(m.Ping(nonce=nonce))))
        await run.pause(every)


def close_all(peers: list[Peer]) -> None:
    for peer in peers:
        peer.close()


# -- the attacks of the first suite -------------------------------------------------


async def random_frames(target: Target, run: Run) -> Report:
    """Hello, then random bytes; or random bytes from the first byte on."""
    report = Report()
    rng = random.Random(1)
    run.engage()
    while run.active() and report.connections < 40:
        peer = Peer(report)
        await peer.open(parse_address(target.address))
        prefix = hello(target.token, rng.getrandbits(62)) if rng.random() < 0.7 else b""
        await peer.send(prefix + rng.randbytes(rng.randrange(1, 4096)))
        await peer.until_closed(4.0)
        peer.close()
    return report


async def mutated_frames(target: Target, run: Run) -> Report:
    """A valid transcript with bytes flipped, inserted, deleted or repeated."""
    report = Report()
    rng = random.Random(2)
    base = transcript(target.token, "h-mutated")
    run.engage()
    while run.active() and report.connections < 40:
        data = bytearray(base)
        for _ in range(rng.randrange(1, 6)):
            at = rng.randrange(len(data))
            op = rng.randrange(4)
            if op == 0:
                data[at] ^= 1 << rng.randrange(8)
            elif op == 1:
                data[at:at] = rng.randbytes(rng.randrange(1, 8))
            elif op == 2:
                del data[at : at + rng.randrange(1, 8)]
            else:
                data[at] = rng.choice([0x00, 0x7F, 0x80, 0xFF])
        peer = Peer(report)
        await peer.open(parse_address(target.address))
        await peer.send(bytes(data))
        await peer.until_closed(4.0)
        peer.close()
    return report


async def truncated_frames(target: Target, run: Run) -> Report:
    """A valid transcript cut short, then silence: the peer holds a half frame."""
    report = Report()
    rng = random.Random(3)
    base = transcript(target.token, "h-truncated")
    peers = []
    for _ in range(12):
        peer = Peer(report)
        await peer.open(parse_address(target.address))
        await peer.send(base[: rng.randrange(1, len(base) - 1)])
        peers.append(peer)
    run.engage()
    await asyncio.gather(*(p.until_closed(8.0) for p in peers))
    close_all(peers)
    return report


async def huge_lengths(target: Target, run: Run) -> Report:
    """Frames that declare payloads of up to 2**64-1 bytes, before and after Hello."""
    report = Report()
    lies = [
        b"\x8f" + b"\xff" * 8,  # SendGlobal, 8-byte length
        b"\x8e\x7f\xff\xff\xff",  # SendGlobal, 4-byte length
        b"\x72" + b"\xff" * 8,  # SendChannel on channel 2, 8-byte length
        b"\x60\xff\xff\xff\xff",  # SendChannel on channel 0, 4-byte length
        b"\x52\xff\xff",  # SendChannel on channel 2, 65535 (above max_message_size)
    ]
    run.engage()
    for lie in lies:
        for prefix in (b"", hello(target.token, 5)):
            peer = Peer(report)
            await peer.open(parse_address(target.address))
            await peer.send(prefix + lie + b"\x00" * 64)
            await peer.until_closed(4.0)
            peer.close()
    return report


async def bind_flood(target: Target, run: Run) -> Report:
    """Binds of new streams, far beyond the bind guarantees, on several connections."""
    report = Report()
    address = parse_address(target.address)
    peers = [await opened(address, target.flood_token, report) for _ in range(4)]
    run.engage()
    sent = 0
    # Chunks of 600: past twice the bind guarantees within three rounds of
    # reads, however little CPU a busy machine leaves the attacker.
    while run.active() and sent < 20_000:
        for i, peer in enumerate(peers):
            chunk = b"".join(bind(f"h-flood-{i}-{sent + k}") for k in range(600))
            await peer.send(chunk)
            await peer.read(0.01)
        sent += 600
    for peer in peers:
        await peer.read(0.5)
    close_all(peers)
    report.facts["binds_sent"] = sent * len(peers)
    report.facts["bind_guarantees"] = sum(p.guarantees(0) for p in peers)
    return report


async def bad_frees(target: Target, run: Run) -> Report:
    """Frees of handles never bound, of the gateway's own handles, and double frees."""
    report = Report()
    cases = [
        free(42),
        free(0, mine=False),
        glob(m.FreeHandle(handle_type=m.HandleType.SCHEMA, handle=3, mine=True)),
        bind("h-free") + free(0) + free(0),
    ]
    run.engage()
    for case in cases:
        peer = await opened(parse_address(target.address), target.token, report)
        await peer.send(case)
        await peer.until_closed(4.0)
        peer.close()
    return report


async def absolve_and_apologise(target: Target, run: Run) -> Report:
    """Absolving more than it holds; apologising when nothing was dropped."""
    report = Report()
    run.engage()
    for case in range(4):
        peer = await opened(parse_address(target.address), target.token, report)
        await peer.send(bind("h-absolve"))
        await peer.until(lambda p=peer: p.guarantees(2) > 0, 3.0)  # type: ignore[misc]
        held = peer.guarantees(2)
        if case == 0:
            await peer.send(encode_frame(Absolve(channel=2, amount=held + 1)))
        elif case == 1:
            await peer.send(encode_frame(Absolve(channel=0, amount=peer.guarantees(0) + 1)))
        elif case == 2:
            await peer.send(encode_frame(Apologise(channel=2)))
        else:
            await peer.send(encode_frame(Apologise(channel=0)))
        await peer.until_closed(4.0)
        peer.close()
    return report


async def optimistic_never_apologised(target: Target, run: Run) -> Report:
    """Batches far beyond the guarantees, and no apology for the drops, ever."""
    report = Report()
    peer = await opened(parse_address(target.address), target.token, report)
    await peer.send(bind("h-optimist"))
    value = b"o" * 1000
    sent = 0
    run.engage()
    while run.active() and not peer.closed and sent < 200_000:
        chunk = b"".join(batch(0, sent + k, [value]) for k in range(100))
        await peer.send(chunk)
        sent += 100
        await peer.read(0.01)
    report.facts["batches_sent"] = sent
    report.facts["guarantees"] = peer.guarantees(2)
    peer.close()
    return report


async def slowloris(target: Target, run: Run) -> Report:
    """Openings sent a byte at a time, slower than the handshake timeout allows."""
    report = Report()
    data = hello(target.token, 9)
    peers = []
    for _ in range(20):
        peer = Peer(report)
        await peer.open(parse_address(target.address))
        peers.append(peer)
    run.engage()

    async def drip(peer: Peer) -> None:
        for byte in data[:-1]:
            if not await peer.send(bytes([byte])):
                break
            await peer.read(0.2)
            if peer.closed:
                return
        await peer.until_closed(6.0)

    await asyncio.gather(*(drip(p) for p in peers))
    close_all(peers)
    return report


async def never_reads(target: Target, run: Run) -> Report:
    """Pings by the megabyte, and never a byte read: the Pongs have nowhere to go."""
    report = Report()
    peers = []
    for _ in range(3):
        peer = Peer(report)
        await peer.open(parse_address(target.address), rcvbuf=4096, read=False)
        await peer.send(hello(target.token, 11))
        peers.append(peer)
    ping = glob(m.Ping(nonce=1)) * 2000
    sent = 0
    run.engage()
    while run.active() and sent < 2_000_000:
        alive = False
        for peer in peers:
            if await peer.send(ping):
                alive = True
                sent += 2000
        if not alive:
            break
    report.facts["pings_sent"] = sent
    # Now read: the gateway should have cut each one off.
    for peer in peers:
        peer.start_reading()
        await peer.until_closed(6.0)
    close_all(peers)
    return report


# -- crashes and hostile values ----------------------------------------------------------


async def max_sequence(target: Target, run: Run) -> Report:
    """Batches whose sequences reach 2**64-1 or beyond it (first + count overflows)."""
    report = Report()
    cases = {
        "first=2^64-1": (U64_MAX, [b"x"]),
        "first=2^64-3,count=5": (U64_MAX - 2, [b"x"] * 5),
        "first=2^63": (1 << 63, [b"x"]),
        "first=2^64-1,empty": (U64_MAX, []),
    }
    run.engage()
    for case, (first, values) in cases.items():
        peer = await opened(parse_address(target.address), target.token, report)
        await peer.send(bind("h-maxseq"))  # a fresh producer id: its next sequence is 0
        await peer.until(lambda p=peer: 0 in p.acks, 3.0)  # type: ignore[misc]
        await peer.send(batch(0, first, values) + glob(m.Ping(nonce=1)))
        await peer.until(lambda p=peer: p.pongs > 0 or bool(p.scoped), 3.0)  # type: ignore[misc]
        await peer.read(0.3)  # an Ack after the group commit, if the batch was taken
        report.cases[case] = peer.codes + peer.scoped
        if peer.acks.get(0, 0) > 0:
            report.count("acked")
        peer.close()
    return report


def _u64_cases(stream: str, token: str) -> dict[str, tuple[str, list[bytes]]]:
    """Case name -> (who: writer, reader, admin, or hello: its own Hello; frames after Hello)."""
    cases: dict[str, tuple[str, list[bytes]]] = {}
    for v in U64_EDGES:
        name = {0: "0", 1: "1", 1 << 63: "2^63", U64_MAX: "2^64-1"}[v]
        fields: dict[str, Any] = {
            "request_id": 1,
            "start_position": 0,
            "end_position": U64_MAX,
            "max_bytes": 4096,
        }
        for attr in fields:
            fetch = m.Fetch(stream=stream, **{**fields, attr: v})
            cases[f"Fetch.{attr}={name}"] = ("reader", [glob(fetch)])
        cases[f"Hello.producer_id={name}"] = ("hello", [hello(token, v)])
        cases[f"Release.position={name}"] = ("admin", [glob(m.Release(stream=stream, position=v))])
        cases[f"Subscribe.position={name}"] = (
            "reader",
            [glob(m.Subscribe(stream=stream, start=v))],
        )
        if v > 0:
            cases[f"Subscribe.sample_every={name}"] = (
                "reader",
                [glob(m.Subscribe(stream=stream, start=m.StartAt.EARLIEST, sample_every=v))],
            )
        cases[f"Absolve.amount={name}"] = (
            "writer",
            [bind(stream), encode_frame(Absolve(channel=2, amount=v))],
        )
        cases[f"Absolve.channel={name}"] = ("writer", [encode_frame(Absolve(channel=v, amount=1))])
        # IssueGuarantees and Plead: this peer is the server of the down session.
        cases[f"IssueGuarantees.amount={name}"] = (
            "reader",
            [
                encode_frame(IssueGuarantees(channel=0, amount=v)),
                encode_frame(IssueGuarantees(channel=0, amount=v)),
            ],
        )
        cases[f"IssueGuarantees.channel={name}"] = (
            "reader",
            [encode_frame(IssueGuarantees(channel=v, amount=1 << 20))],
        )
        cases[f"Plead.target={name}"] = ("reader", [encode_frame(Plead(channel=0, target=v))])
        cases[f"Plead.channel={name}"] = ("reader", [encode_frame(Plead(channel=v, target=0))])
        cases[f"FreeHandle.handle={name}"] = ("writer", [free(v)])
    return cases


async def u64_fields(target: Target, run: Run) -> Report:
    """Every u64 field of the requests a peer sends, at 0, 1, 2**63 and 2**64-1.

    Hello, Fetch, Release, Subscribe, Absolve, IssueGuarantees, Plead and
    FreeHandle: one connection per case, the frame, then a Ping.
    """
    report = Report()
    address = parse_address(target.address)
    tokens = {"writer": target.token, "reader": target.reader_token, "admin": target.admin_token}
    run.engage()

    async def case(name: str, who: str, frames: list[bytes]) -> None:
        if who == "hello":
            peer = Peer(report)
            await peer.open(address)
        else:
            peer = await opened(address, tokens[who], report, reader=who == "reader")
        await peer.send(b"".join(frames) + glob(m.Ping(nonce=7)))
        await peer.until(lambda: peer.pongs > 0, 3.0)
        await peer.read(0.2)
        report.cases[name] = peer.codes + peer.scoped
        if not peer.closed and peer.pongs == 0:
            report.count("no_pong_and_open")
        peer.close()

    items = list(_u64_cases(target.small_stream, target.token).items())
    for start in range(0, len(items), 16):
        await asyncio.gather(*(case(n, who, fr) for n, (who, fr) in items[start : start + 16]))
    return report


# -- producer identity ------------------------------------------------------------------------


async def _victim_writing(target: Target, run: Run, report: Report) -> bool:
    """Wait (bounded) until the victim's stream grows: the victim is mid-run.

    The look-out is a reader of its own, which is no part of the attack's report.
    """
    peer = await opened(parse_address(target.address), target.reader_token, Report(), reader=True)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20.0
    request = 0
    first: int | None = None
    try:
        while not peer.closed and loop.time() < deadline and not run.stop.is_set():
            request += 1
            await peer.send(glob(m.ListStreams(request_id=request)))
            await peer.until(lambda r=request: len(peer.stream_lists) >= r, 2.0)  # type: ignore[misc]
            for info in peer.stream_lists[-1].streams if peer.stream_lists else ():
                if info.stream == target.victim_stream:
                    if first is None:
                        first = info.durable_position
                    elif info.durable_position > first:
                        return True
            await asyncio.sleep(0.02)
    finally:
        peer.close()
    return False


async def spoof_empty_batch(target: Target, run: Run) -> Report:
    """The victim's producer id from another token, and an empty batch at sequence 2**62.

    Documented answer: the bind of the victim's stream is refused with
    PRODUCER_FENCED (scoped to the stream handle); nothing is acknowledged.
    """
    report = Report()
    run.engage()
    if not await _victim_writing(target, run, report):
        report.exception = "the victim's stream never held data"
        return report
    peer = await opened(
        parse_address(target.address), target.token, report, producer_id=target.victim_producer
    )
    await peer.send(bind(target.victim_stream))
    await peer.until(lambda: 0 in peer.acks or bool(peer.scoped), 3.0)
    await peer.send(batch(0, 1 << 62, []) + glob(m.Ping(nonce=1)))
    await peer.until(lambda: peer.acks.get(0, 0) >= 1 << 62, 2.0)
    if peer.acks.get(0, 0) >= 1 << 62:
        report.count("acked_forgery")
    while run.active() and not peer.closed:
        peer.write(SendGlobal(payload=m.encode_message(m.Ping(nonce=2))))
        await run.pause(0.3)
    peer.close()
    return report


async def spoof_forged_record(target: Target, run: Run) -> Report:
    """The victim's producer id from another token, and a forged record at its next sequence.

    Repeated on fresh handles while the victim writes, so that one forgery
    lands ahead of the victim's own batch. Documented answer: PRODUCER_FENCED
    on each bind; no forged record stored.
    """
    report = Report()
    run.engage()
    if not await _victim_writing(target, run, report):
        report.exception = "the victim's stream never held data"
        return report
    peer = await opened(
        parse_address(target.address), target.token, report, producer_id=target.victim_producer
    )
    handle = 0
    while run.active() and not peer.closed and handle < 40 and peer.bind_room() > 64:
        answered = len(peer.acks) + len(peer.scoped)
        await peer.send(peer.bind(target.victim_stream))
        await peer.until(lambda n=answered: len(peer.acks) + len(peer.scoped) > n, 2.0)  # type: ignore[misc]
        if handle in peer.acks:
            forged = f"FORGED-{handle}".encode()
            await peer.send(batch(handle, peer.acks[handle], [forged]))
            report.count("forged_sent")
        handle += 1
        await run.pause(0.02)
    await peer.read(0.3)
    report.facts["binds"] = handle
    report.facts["acked_handles"] = len(peer.acks)
    peer.close()
    return report


async def sequence_gap(target: Target, run: Run) -> Report:
    """A batch at sequence 0, then one that skips ahead to 100 (its own stream and id).

    Documented answer: OUT_OF_SEQUENCE, the connection closed; the gap is never acked.
    """
    report = Report()
    run.engage()
    peer = await opened(parse_address(target.address), target.token, report)
    await peer.send(bind("h-gap"))
    await peer.until(lambda: 0 in peer.acks, 3.0)
    start = peer.acks.get(0, 0)
    await peer.send(batch(0, start, [b"first"]))
    await peer.until(lambda: peer.acks.get(0, 0) > start, 3.0)
    await peer.send(batch(0, start + 100, [b"gap"]) + glob(m.Ping(nonce=1)))
    await peer.until(lambda: peer.closed or peer.acks.get(0, 0) > start + 1, 3.0)
    await peer.read(0.2)
    report.facts["acked_beyond_gap"] = int(peer.acks.get(0, 0) > start + 1)
    peer.close()
    return report


# -- starving the others ---------------------------------------------------------------


async def _flood(
    peers: list[Peer], run: Run, frame: bytes, report: Report, limit: int, pace: bool = True
) -> None:
    """Write ``frame`` on every peer, each just under the gateway's per-connection budget
    for credit-free frames (:data:`FLOOD_RATE`; or as fast as it is taken with
    ``pace=False``), until told to stop or ``limit`` frames are sent in all.

    An unpaced flood writes 64 KiB at a time: the gateway sees the same
    frames, and the attacker does not spend its own CPU on thousands of tiny
    writes. (On one 2-core machine that CPU is taken from the good producer,
    not from the gateway: with 200-byte writes the attacker process burned
    0.4-0.8 of a core filling its socket buffers.)
    """
    wave = 50 if pace else max(50, (64 * 1024) // len(frame))
    chunk = frame * wave
    sent = 0
    loop = asyncio.get_running_loop()

    async def one(peer: Peer) -> None:
        nonlocal sent
        started = loop.time()
        mine = 0
        while run.active() and sent < limit and not peer.closed:
            if not await peer.send(chunk):
                break
            sent += wave
            mine += wave
            if pace:
                await run.pause(started + mine / FLOOD_RATE - loop.time())
            else:
                await asyncio.sleep(0)

    await asyncio.gather(*(one(p) for p in peers))
    report.facts["frames_sent"] = sent


async def list_streams_flood(target: Target, run: Run) -> Report:
    """ListStreams as fast as one connection can send them, answers read and dropped."""
    report = Report()
    peer = await opened(parse_address(target.address), target.reader_token, report, reader=True)
    run.engage()
    await _flood([peer], run, glob(m.ListStreams(request_id=1)), report, 2_000_000, pace=False)
    await peer.read(0.3)
    peer.close()
    return report


async def absolve_zero_flood(target: Target, run: Run) -> Report:
    """600 handles of one stream on one connection, and Absolve(0) on each, without end."""
    report = Report()
    peer = await opened(parse_address(target.address), target.token, report)
    handles = await peer.bind_many("h-z", 600)
    await peer.read(0.3)
    report.facts["handles"] = handles
    run.engage()
    frame = b"".join(
        encode_frame(Absolve(channel=m.data_channel(h), amount=0)) for h in range(handles)
    )
    await _flood([peer], run, frame, report, 20_000)
    await peer.read(0.3)
    peer.close()
    return report


async def many_handles(target: Target, run: Run) -> Report:
    """1,000 handles of the victim's stream on one connection, each holding a share."""
    report = Report()
    peer = await opened(parse_address(target.address), target.token, report)
    handles = await peer.bind_many(target.victim_stream, 1000)
    report.facts["handles"] = handles
    await peer.until(lambda: len(peer.acks) + len(peer.scoped) >= handles, 3.0)
    run.engage()
    await keep_alive([peer], run)
    report.facts["pleads"] = peer.pleads
    peer.close()
    return report


async def plead_ignored(target: Target, run: Run) -> Report:
    """Four writers of the victim's stream hold its guarantees and ignore every Plead.

    Each writes a record now and then, so that it counts as active.

    Documented answer: past Welcome's plead_deadline_ms, TIMEOUT and the close.
    """
    report = Report()
    address = parse_address(target.address)
    peers = [await opened(address, target.token, report) for _ in range(4)]
    for peer in peers:
        await peer.send(peer.bind(target.victim_stream))
    for peer in peers:
        await peer.until(lambda p=peer: p.guarantees(2) > 0 and 0 in p.acks, 3.0)  # type: ignore[misc]
    report.facts["guarantees"] = sum(p.guarantees(2) for p in peers)
    run.engage()
    sequences = [p.acks.get(0, 0) for p in peers]
    while run.active() and not all(p.closed for p in peers):
        for i, peer in enumerate(peers):
            if not peer.closed:
                await peer.send(batch(0, sequences[i], [b"p"]))
                sequences[i] += 1
        await run.pause(0.3)
    report.facts["closed_under_attack"] = sum(p.closed for p in peers)
    report.facts["pleads"] = sum(p.pleads for p in peers)
    # Writers first pleaded long enough before the end for the deadline (and
    # the gateway's check, every 0.1 s) to have passed, with slack.
    stopped = asyncio.get_running_loop().time()
    report.facts["pleaded_past_deadline"] = sum(
        p.first_plead_at is not None
        and p.plead_deadline > 0
        and stopped - p.first_plead_at >= p.plead_deadline + 0.6
        for p in peers
    )
    # Past the measurement, silent: idleness or the Plead deadline ends it.
    await asyncio.gather(*(p.until_closed(4.0) for p in peers))
    close_all(peers)
    return report


async def fetch_tiny_frames(target: Target, run: Run) -> Report:
    """Four readers fetching a stream of TINY_FRAMES one-record frames, over and over."""
    report = Report()
    address = parse_address(target.address)
    peers = [await opened(address, target.reader_token, report, reader=True) for _ in range(4)]
    run.engage()

    async def reader(peer: Peer) -> None:
        request = 0
        while run.active() and not peer.closed and request < 1000:
            request += 1
            fetch = m.Fetch(
                request_id=request,
                stream=target.tiny_stream,
                start_position=0,
                end_position=U64_MAX,
                max_bytes=0,
            )
            await peer.send(glob(fetch))
            await peer.until(lambda r=request: peer.fetches_done >= r or not run.active(), 10.0)  # type: ignore[misc]

    await asyncio.gather(*(reader(p) for p in peers))
    report.facts["fetches_done"] = sum(p.fetches_done for p in peers)
    report.facts["tail_records"] = sum(p.tail_records for p in peers)
    close_all(peers)
    return report


async def reader_slots(target: Target, run: Run) -> Report:
    """Readers take every connection slot they can, and Ping to stay; then a producer comes.

    Documented answer: RESOURCE_EXHAUSTED to the readers beyond their share;
    a share of the slots is kept for writers.
    """
    report = Report()
    address = parse_address(target.address)
    peers: list[Peer] = []
    while len(peers) < 160 and run.active():
        peer = await opened(address, target.reader_token, report, reader=True)
        peers.append(peer)
        if peer.closed and len([p for p in peers if p.closed]) >= 8:
            break  # refused: the slots (or the token's share) are taken
    report.facts["held"] = sum(not p.closed for p in peers)
    run.engage()
    await keep_alive(peers, run)
    report.facts["held_at_end"] = sum(not p.closed for p in peers)
    close_all(peers)
    return report


async def _ping_flood(target: Target, run: Run, connections: int) -> Report:
    report = Report()
    address = parse_address(target.address)
    peers = [await opened(address, target.token, report) for _ in range(connections)]
    run.engage()
    await _flood(peers, run, glob(m.Ping(nonce=3)), report, 5_000_000)
    report.facts["pongs"] = sum(p.pongs for p in peers)
    close_all(peers)
    return report


async def _noisy_writer(peer: Peer, stream: str, run: Run, records: int, report: Report) -> None:
    """Write valid batches of ``records`` 100-byte records to ``stream``, within guarantees."""
    await peer.send(peer.bind(stream))
    channel = m.data_channel(0)
    if not await peer.until(lambda: peer.guarantees(channel) > 0, 3.0):
        return
    block = encode_records([b"n" * 100] * records)
    cost = batch_cost(8 + len(block))
    # One frame, and where its sequence goes: every frame differs only there,
    # so a chunk of frames is the template repeated with sequences written in
    # (the attacker spends little CPU of its own, which on one 2-core machine
    # would be taken from the good producer, not from the gateway).
    template = encode_frame(SendChannel(channel=channel, payload=bytes(8) + block))
    at = len(template) - len(block) - 8
    per_chunk = max(1, 32768 // len(template))
    chunk = bytearray(template * per_chunk)
    sequence = 0
    spent = 0
    while run.active() and not peer.closed:
        room = (peer.guarantees(channel) - spent) // cost
        if room <= 0:
            await peer.read(0.05)
            continue
        count = min(room, per_chunk)
        for i in range(count):
            _SEQUENCE.pack_into(chunk, i * len(template) + at, sequence + i * records)
        sequence += count * records
        spent += count * cost
        if not await peer.send(bytes(chunk[: count * len(template)])):
            break
    report.count("records_sent", sequence)


async def _noisy_writers(target: Target, run: Run, connections: int, records: int) -> Report:
    report = Report()
    address = parse_address(target.address)
    peers = [await opened(address, target.token, report) for _ in range(connections)]
    engaged = asyncio.get_running_loop().call_later(0.3, run.engage)
    try:
        await asyncio.gather(*(_noisy_writer(p, NOISY_STREAM, run, records, report) for p in peers))
    finally:
        engaged.cancel()
        run.engage()
    report.facts["acked"] = sum(p.acks.get(0, 0) for p in peers)
    # Each peer's sequences count from 0: acked records over records a batch.
    report.facts["batches"] = report.facts["acked"] // records
    close_all(peers)
    return report


async def noisy_writers_16(target: Target, run: Run) -> Report:
    """16 connections of one token write valid one-record batches to a stream of its own.

    Nothing here is refused: the data is within guarantees. What is measured
    is whether one token's many connections take the gateway from the others.
    (Sixteen, not more: each connection claims a producer id of its own, and
    the claims, an fsync each, are charged to the token's work budget; with
    sixty the budget, not the data, is what holds the writers back.)
    """
    return await _noisy_writers(target, run, 16, 1)


async def noisy_writers_4(target: Target, run: Run) -> Report:
    """4 connections of one token write valid 100-record batches to a stream of its own."""
    return await _noisy_writers(target, run, 4, 100)


async def ping_flood_60(target: Target, run: Run) -> Report:
    """Pings just under the per-connection budget (FLOOD_RATE/s each), from 60 connections."""
    return await _ping_flood(target, run, 60)


async def ping_flood_4(target: Target, run: Run) -> Report:
    """Pings just under the per-connection budget (FLOOD_RATE/s each), from 4 connections."""
    return await _ping_flood(target, run, 4)


async def empty_frame_flood(target: Target, run: Run) -> Report:
    """A read-only token floods the smallest frames it may send: IssueGuarantees of 0.

    Two bytes each (``f0 00``), credit-free, from 4 connections. (A SendChannel
    or SendGlobal of length 0 is a one-byte frame too, but the gateway closes
    on it at once: MALFORMED_MESSAGE or UNKNOWN_HANDLE.)
    """
    report = Report()
    peers = [
        await opened(parse_address(target.address), target.reader_token, report, reader=True)
        for _ in range(4)
    ]
    run.engage()
    nothing = encode_frame(IssueGuarantees(channel=m.STREAM_CHANNEL, amount=0))
    await _flood(peers, run, nothing, report, 20_000_000, pace=False)
    for peer in peers:
        await peer.read(0.2)
    close_all(peers)
    return report


async def subscribe_flood(target: Target, run: Run) -> Report:
    """8,192 Subscribes to the victim's stream, over 8 connections of one reader token."""
    report = Report()
    address = parse_address(target.address)
    peers = [await opened(address, target.reader_token, report, reader=True) for _ in range(8)]
    for peer in peers:
        peer.credit = 4096
    subscribe = glob(m.Subscribe(stream=target.victim_stream, start=m.StartAt.NOW))
    for peer in peers:
        for _ in range(8):
            await peer.send(subscribe * 128)
    report.facts["subscribes"] = 8 * 1024
    run.engage()
    await keep_alive(peers, run)
    report.facts["binds"] = sum(p.gateway_binds for p in peers)
    report.facts["tail_records"] = sum(p.tail_records for p in peers)
    close_all(peers)
    return report


async def forbidden_bind_flood(target: Target, run: Run) -> Report:
    """Binds of streams the token may not write, freed and bound again, without end."""
    report = Report()
    peer = await opened(parse_address(target.address), target.token, report)
    run.engage()
    handle = 0
    while run.active() and not peer.closed and handle < 200_000:
        wave = b""
        while peer.bind_room() >= 12 and len(wave) < 4096:
            wave += peer.bind(f"x-{handle % 1000}") + free(handle)
            handle += 1
        if wave:
            await peer.send(wave)
        else:
            await peer.read(0.05)
    report.facts["binds"] = handle
    peer.close()
    return report


async def tls_handshake_flood(target: Target, run: Run) -> Report:
    """TLS handshakes as fast as 8 connections at a time can finish them, then a close.

    From a loopback address of its own (:data:`ATTACKER_HOST`), as an attacker
    on another host would: the gateway's handshake budget is per address, and
    the good producer's own handshakes come from 127.0.0.1.
    """
    report = Report()
    if not target.tls_address:
        report.exception = "no TLS listener"
        return report
    context = ssl.create_default_context(cafile=target.tls_ca or None)
    context.check_hostname = False
    address = parse_address(target.tls_address)
    run.engage()

    async def one() -> None:
        while run.active() and report.connections < 5000:
            peer = Peer(report)
            try:
                await peer.open(address, tls=context, read=False, source=ATTACKER_HOST)
            except (OSError, ssl.SSLError, TimeoutError):
                report.count("refused")
                continue
            report.count("handshakes")
            peer.close()

    await asyncio.gather(*(one() for _ in range(8)))
    return report


async def drip_frames(target: Target, run: Run) -> Report:
    """40 connections sending valid Pings at one byte per 0.6 s: never idle, never a frame.

    Documented answer: a frame that has started must finish within a
    deadline; TIMEOUT and the close.
    """
    report = Report()
    address = parse_address(target.address)
    peers = [await opened(address, target.token, report) for _ in range(40)]
    run.engage()
    ping = glob(m.Ping(nonce=0x0101010101010101))
    loop = asyncio.get_running_loop()
    hold_until = loop.time() + 7.0

    async def drip(peer: Peer) -> None:
        at = 0
        while not peer.closed and loop.time() < hold_until:
            if not await peer.send(ping[at : at + 1]):
                break
            at = (at + 1) % len(ping)
            await peer.read(0.6)

    await asyncio.gather(*(drip(p) for p in peers))
    report.facts["open_at_end"] = sum(not p.closed for p in peers)
    close_all(peers)
    return report


async def dilute_shares(target: Target, run: Run) -> Report:
    """200 handles of the victim's stream, each writing a little, so each counts as active."""
    report = Report()
    peer = await opened(parse_address(target.address), target.token, report)
    handles = await peer.bind_many(target.victim_stream, 200)
    await peer.until(lambda: len(peer.acks) + len(peer.scoped) >= handles, 3.0)
    report.facts["handles"] = handles
    sequence = max(peer.acks.values(), default=0)
    run.engage()
    cost = batch_cost(m.BATCH_HEADER_SIZE + len(encode_records([b"d"])))
    spent: dict[int, int] = {}
    while run.active() and not peer.closed:
        wave = b""
        for h in range(handles):
            channel = m.data_channel(h)
            if peer.guarantees(channel) - spent.get(channel, 0) >= cost:
                wave += batch(h, sequence, [b"d"])
                spent[channel] = spent.get(channel, 0) + cost
                sequence += 1
        if wave:
            await peer.send(wave)
        await run.pause(0.3)
    report.facts["batches"] = sequence
    peer.close()
    return report


async def slowloris_half_frame(target: Target, run: Run) -> Report:
    """80 connections each send half of a 32 KiB frame, then trickle 1 byte per 0.5 s.

    The trickle beats the idle timeout; documented answer: the frame
    deadline closes each with TIMEOUT (held at most 6.5 s here).
    """
    report = Report()
    address = parse_address(target.address)
    peers = [await opened(address, target.token, report) for _ in range(80)]
    header = b"\x8d\x7f\xf0"  # SendGlobal with a 2-byte length: 32752 bytes follow
    half = header + b"\x05" + b"\x00" * 16_000
    for peer in peers:
        await peer.send(half)
    run.engage()
    loop = asyncio.get_running_loop()
    hold_until = loop.time() + 6.5

    async def trickle(peer: Peer) -> None:
        while not peer.closed and loop.time() < hold_until:
            if not await peer.send(b"\x00"):
                break
            await peer.read(0.5)

    await asyncio.gather(*(trickle(p) for p in peers))
    report.facts["open_at_end"] = sum(not p.closed for p in peers)
    close_all(peers)
    return report


async def free_gateway_handle(target: Target, run: Run) -> Report:
    """A reader frees the handle the gateway bound for its Fetch, then fetches again.

    Documented answer: an Error (the handle is the gateway's); never a
    confirmation of the free.
    """
    report = Report()
    run.engage()
    peer = await opened(parse_address(target.address), target.reader_token, report, reader=True)

    def fetch(request: int) -> bytes:
        return glob(
            m.Fetch(
                request_id=request,
                stream=target.tiny_stream,
                start_position=0,
                end_position=U64_MAX,
                max_bytes=256,
            )
        )

    await peer.send(fetch(1))
    await peer.until(lambda: peer.fetches_done >= 1, 3.0)
    await peer.send(free(0, mine=False) + fetch(2))
    await peer.until(lambda: peer.closed or peer.fetches_done >= 2, 3.0)
    await peer.read(0.2)
    report.facts["confirmed_free"] = peer.frees_from_gateway
    report.facts["fetches_done"] = peer.fetches_done
    peer.close()
    return report


Attack = Callable[[Target, Run], Coroutine[Any, Any, Report]]


async def no_attack(target: Target, run: Run) -> Report:
    """The control: nothing touches the gateway, so the ratio shows the measurement's noise."""
    run.engage()
    while run.active():
        await run.pause(1.0)
    return Report()


#: Runs measured like the attacks that are not attacks (bench/hostile.py).
CONTROLS: dict[str, Attack] = {"no_attack": no_attack}

ATTACKS: dict[str, Attack] = {
    "random_frames": random_frames,
    "mutated_frames": mutated_frames,
    "truncated_frames": truncated_frames,
    "huge_lengths": huge_lengths,
    "bind_flood": bind_flood,
    "bad_frees": bad_frees,
    "absolve_and_apologise": absolve_and_apologise,
    "optimistic_never_apologised": optimistic_never_apologised,
    "slowloris": slowloris,
    "never_reads": never_reads,
    "max_sequence": max_sequence,
    "u64_fields": u64_fields,
    "spoof_empty_batch": spoof_empty_batch,
    "spoof_forged_record": spoof_forged_record,
    "sequence_gap": sequence_gap,
    "list_streams_flood": list_streams_flood,
    "absolve_zero_flood": absolve_zero_flood,
    "many_handles": many_handles,
    "plead_ignored": plead_ignored,
    "fetch_tiny_frames": fetch_tiny_frames,
    "reader_slots": reader_slots,
    "ping_flood_60": ping_flood_60,
    "noisy_writers_16": noisy_writers_16,
    "noisy_writers_4": noisy_writers_4,
    "ping_flood_4": ping_flood_4,
    "empty_frame_flood": empty_frame_flood,
    "subscribe_flood": subscribe_flood,
    "forbidden_bind_flood": forbidden_bind_flood,
    "tls_handshake_flood": tls_handshake_flood,
    "drip_frames": drip_frames,
    "dilute_shares": dilute_shares,
    "slowloris_half_frame": slowloris_half_frame,
    "free_gateway_handle": free_gateway_handle,
}

#: Every code a gateway may close a connection with (PROTOCOL.md, "Error codes").
DOCUMENTED = {int(code) for code in ErrorCode if code is not ErrorCode.NONE}


# -- what attacks read ------------------------------------------------------------------


async def prepare(target: Target) -> Report:
    """Write the streams attacks read: TINY_FRAMES and SMALL_FRAMES one-record batches."""
    report = Report()
    for stream, frames in ((target.tiny_stream, TINY_FRAMES), (target.small_stream, SMALL_FRAMES)):
        report.facts[stream] = await _write_frames(target, stream, frames, report)
    return report


async def _write_frames(target: Target, stream: str, frames: int, report: Report) -> int:
    """One-record batches up to sequence ``frames``, within guarantees; the acked sequence."""
    peer = await opened(parse_address(target.address), target.token, report, producer_id=4242)
    await peer.send(bind(stream))
    await peer.until(lambda: 0 in peer.acks, 5.0)
    sequence = peer.acks.get(0, 0)
    cost = batch_cost(m.BATCH_HEADER_SIZE + len(encode_records([b"t"])))
    spent = 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while sequence < frames and not peer.closed and loop.time() < deadline:
        room = (peer.guarantees(2) - spent) // cost
        if room <= 0:
            await peer.read(0.05)
            continue
        count = min(room, frames - sequence, 2000)
        await peer.send(b"".join(batch(0, sequence + k, [b"t"]) for k in range(count)))
        spent += count * cost
        sequence += count
    await peer.until(lambda: peer.acks.get(0, 0) >= frames, 20.0)
    peer.close()
    return peer.acks.get(0, 0)


# -- the worker -------------------------------------------------------------------------------


async def _serve() -> None:
    """Read commands from stdin; run one attack at a time; print engaged and reports."""
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)

    def say(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    say("ready")
    while line := await stdin.readline():
        command = json.loads(line)
        target = Target(**command["target"])
        if "prepare" in command:
            report = await _guarded("prepare", prepare(target))
            say("report " + json.dumps(asdict(report)))
            continue
        name = command["attack"]
        run = Run(lambda: say("engaged"))
        attack = ATTACKS[name] if name in ATTACKS else CONTROLS[name]
        task = loop.create_task(_guarded(name, attack(target, run)))
        stop = loop.create_task(stdin.readline())
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        run.engage()  # an attack that ended before engaging: let the harness go on
        await stop
        run.stop.set()
        report = await task
        report.attack = name
        say("report " + json.dumps(asdict(report)))


async def _guarded(name: str, attack: Coroutine[Any, Any, Report]) -> Report:
    try:
        return await asyncio.wait_for(attack, LONGEST_ATTACK + 30)
    except Exception:
        return Report(attack=name, exception=traceback.format_exc(limit=4))


def main() -> None:
    # A peer the gateway cut off makes asyncio log each later write; the
    # report says what happened.
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    asyncio.run(_serve())


if __name__ == "__main__":
    main()
