"""Hostile peers, each a coroutine that attacks a gateway and reports what it was told.

Run as a process of its own, so that the attackers' CPU is not the good
producer's (the suite in ``test_hostile.py`` does this)::

    python -m tests.hostile.attacks NAME HOST:PORT TOKEN SECONDS

It prints one JSON :class:`Report`. Every attack is bounded in time and in
connections, and is deterministic for a given seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import sys
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass, field
from typing import Any

from headgate.config import parse_address
from headgate.protocol import messages as m
from headgate.protocol.codec import FrameDecoder, encode_frame
from headgate.protocol.errors import ErrorCode, ProtocolError
from headgate.protocol.frames import (
    Absolve,
    AnnounceDropping,
    Apologise,
    Frame,
    IssueGuarantees,
    SendChannel,
    SendGlobal,
)
from headgate.protocol.records import encode_records

Address = tuple[str, int]


@dataclass
class Report:
    """What one attack saw."""

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


class Peer:
    """One raw connection: write bytes, collect what the gateway answers."""

    def __init__(self, report: Report) -> None:
        self.report = report
        self.decoder = FrameDecoder(max_payload=1 << 24)
        self.frames: list[Frame] = []
        self.codes: list[int] = []
        self.closed = False
        self.reader: asyncio.StreamReader
        self.writer: asyncio.StreamWriter

    async def open(self, address: Address, *, rcvbuf: int | None = None) -> None:
        if rcvbuf is None:
            self.reader, self.writer = await asyncio.open_connection(*address)
        else:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, address)
            self.reader, self.writer = await asyncio.open_connection(sock=sock)
        self.report.connections += 1
        self.report.errors.append(self.codes)

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

    async def read(self, timeout: float) -> None:
        """Read what arrives within ``timeout``; notes EOF."""
        if self.closed:
            return
        try:
            data = await asyncio.wait_for(self.reader.read(1 << 16), timeout)
        except TimeoutError:
            return
        except ConnectionError:
            data = b""
        if not data:
            self.closed = True
            self.report.closed += 1
            return
        try:
            frames = self.decoder.feed(data)
        except ProtocolError:
            return
        for frame in frames:
            self.frames.append(frame)
            if isinstance(frame, AnnounceDropping):
                self.report.dropping.append(frame.channel)
            elif isinstance(frame, SendGlobal):
                try:
                    message = m.decode_global(frame.payload)
                except ProtocolError:
                    continue
                if isinstance(message, m.Error):
                    if message.scope is None:
                        self.codes.append(int(message.code))
                    else:
                        self.report.scoped_errors.append(int(message.code))

    async def until_closed(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.closed and loop.time() < deadline:
            await self.read(deadline - loop.time())

    def guarantees(self, channel: int) -> int:
        return sum(
            f.amount for f in self.frames if isinstance(f, IssueGuarantees) and f.channel == channel
        )

    def close(self) -> None:
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
            glob(m.FreeHandle(handle_type=m.HandleType.STREAM, handle=0, mine=True)),
        ]
    )


async def opened(address: Address, token: str, report: Report) -> Peer:
    peer = Peer(report)
    await peer.open(address)
    await peer.send(hello(token, random.getrandbits(62)))
    await peer.read(2.0)
    return peer


# -- the attacks -----------------------------------------------------------------------


async def random_frames(address: Address, token: str, seconds: float) -> Report:
    """Hello, then random bytes; or random bytes from the first byte on."""
    report = Report()
    rng = random.Random(1)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while loop.time() < deadline and report.connections < 40:
        peer = Peer(report)
        await peer.open(address)
        prefix = hello(token, rng.getrandbits(62)) if rng.random() < 0.7 else b""
        await peer.send(prefix + rng.randbytes(rng.randrange(1, 4096)))
        await peer.until_closed(4.0)
        peer.close()
    return report


async def mutated_frames(address: Address, token: str, seconds: float) -> Report:
    """A valid transcript with bytes flipped, inserted, deleted or repeated."""
    report = Report()
    rng = random.Random(2)
    base = transcript(token, "h-mutated")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while loop.time() < deadline and report.connections < 40:
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
        await peer.open(address)
        await peer.send(bytes(data))
        await peer.until_closed(4.0)
        peer.close()
    return report


async def truncated_frames(address: Address, token: str, seconds: float) -> Report:
    """A valid transcript cut short, then silence: the peer holds a half frame."""
    report = Report()
    rng = random.Random(3)
    base = transcript(token, "h-truncated")
    peers = []
    for _ in range(12):
        peer = Peer(report)
        await peer.open(address)
        await peer.send(base[: rng.randrange(1, len(base) - 1)])
        peers.append(peer)
    await asyncio.gather(*(p.until_closed(seconds + 4.0) for p in peers))
    for peer in peers:
        peer.close()
    return report


async def huge_lengths(address: Address, token: str, seconds: float) -> Report:
    """Frames that declare payloads of up to 2**64-1 bytes, before and after Hello."""
    report = Report()
    lies = [
        b"\x8f" + b"\xff" * 8,  # SendGlobal, 8-byte length
        b"\x8e\x7f\xff\xff\xff",  # SendGlobal, 4-byte length
        b"\x72" + b"\xff" * 8,  # SendChannel on channel 2, 8-byte length
        b"\x60\xff\xff\xff\xff",  # SendChannel on channel 0, 4-byte length
        b"\x52\xff\xff",  # SendChannel on channel 2, 65535 (above max_message_size)
    ]
    for lie in lies:
        for prefix in (b"", hello(token, 5)):
            peer = Peer(report)
            await peer.open(address)
            await peer.send(prefix + lie + b"\x00" * 64)
            await peer.until_closed(4.0)
            peer.close()
    return report


async def bind_flood(address: Address, token: str, seconds: float) -> Report:
    """Binds of new streams, far beyond the bind guarantees, on several connections."""
    report = Report()
    peers = [await opened(address, token, report) for _ in range(4)]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    sent = 0
    while loop.time() < deadline and sent < 20_000:
        for i, peer in enumerate(peers):
            chunk = b"".join(bind(f"h-flood-{i}-{sent + k}") for k in range(200))
            await peer.send(chunk)
            await peer.read(0.01)
        sent += 200
    for peer in peers:
        await peer.read(0.5)
        peer.close()
    report.facts["binds_sent"] = sent * len(peers)
    report.facts["bind_guarantees"] = sum(p.guarantees(0) for p in peers)
    return report


async def bad_frees(address: Address, token: str, seconds: float) -> Report:
    """Frees of handles never bound, of the gateway's own handles, and double frees."""
    report = Report()
    stream = m.HandleType.STREAM
    cases = [
        glob(m.FreeHandle(handle_type=stream, handle=42, mine=True)),
        glob(m.FreeHandle(handle_type=stream, handle=0, mine=False)),
        glob(m.FreeHandle(handle_type=m.HandleType.SCHEMA, handle=3, mine=True)),
        bind("h-free")
        + glob(m.FreeHandle(handle_type=stream, handle=0, mine=True))
        + glob(m.FreeHandle(handle_type=stream, handle=0, mine=True)),
    ]
    for case in cases:
        peer = await opened(address, token, report)
        await peer.send(case)
        await peer.until_closed(4.0)
        peer.close()
    return report


async def absolve_and_apologise(address: Address, token: str, seconds: float) -> Report:
    """Absolving more than it holds; apologising when nothing was dropped."""
    report = Report()
    for case in range(4):
        peer = await opened(address, token, report)
        await peer.send(bind("h-absolve"))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 3
        while peer.guarantees(2) == 0 and loop.time() < deadline and not peer.closed:
            await peer.read(0.1)
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


async def optimistic_never_apologised(address: Address, token: str, seconds: float) -> Report:
    """Batches far beyond the guarantees, and no apology for the drops, ever."""
    report = Report()
    peer = await opened(address, token, report)
    await peer.send(bind("h-optimist"))
    value = b"o" * 1000
    sent = 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while loop.time() < deadline and not peer.closed:
        chunk = b"".join(batch(0, sent + k, [value]) for k in range(100))
        await peer.send(chunk)
        sent += 100
        await peer.read(0.01)
    report.facts["batches_sent"] = sent
    report.facts["guarantees"] = peer.guarantees(2)
    peer.close()
    return report


async def slowloris(address: Address, token: str, seconds: float) -> Report:
    """Openings sent a byte at a time, slower than the handshake timeout allows."""
    report = Report()
    data = hello(token, 9)
    peers = []
    for _ in range(20):
        peer = Peer(report)
        await peer.open(address)
        peers.append(peer)

    async def drip(peer: Peer) -> None:
        for byte in data[:-1]:
            if not await peer.send(bytes([byte])):
                break
            await peer.read(0.2)
            if peer.closed:
                return
        await peer.until_closed(seconds + 4.0)

    await asyncio.gather(*(drip(p) for p in peers))
    for peer in peers:
        peer.close()
    return report


async def never_reads(address: Address, token: str, seconds: float) -> Report:
    """Pings by the megabyte, and never a byte read: the Pongs have nowhere to go."""
    report = Report()
    peers = []
    for _ in range(3):
        peer = Peer(report)
        await peer.open(address, rcvbuf=4096)
        transport = peer.writer.transport
        assert isinstance(transport, asyncio.Transport)
        transport.pause_reading()
        await peer.send(hello(token, 11))
        peers.append(peer)
    ping = glob(m.Ping(nonce=1)) * 2000
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    sent = 0
    while loop.time() < deadline and sent < 2_000_000:
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
        transport = peer.writer.transport
        assert isinstance(transport, asyncio.Transport)
        transport.resume_reading()
        loop_deadline = loop.time() + 6.0
        while not peer.closed and loop.time() < loop_deadline:
            await peer.read(0.5)
        peer.close()
    return report


ATTACKS: dict[str, Callable[[Address, str, float], Coroutine[Any, Any, Report]]] = {
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
}

#: Every code a gateway may close a connection with (PROTOCOL.md, "Error codes").
DOCUMENTED = {int(code) for code in ErrorCode if code is not ErrorCode.NONE}


def main() -> None:
    name, address, token, seconds = sys.argv[1:5]
    attack = ATTACKS[name]
    print("attacking", flush=True)
    report = asyncio.run(attack(parse_address(address), token, float(seconds)))
    print(json.dumps(asdict(report)))


if __name__ == "__main__":
    main()
