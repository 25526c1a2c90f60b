"""Every client notices a gateway that Welcomes it and then says nothing.

A gateway that froze, or a connection that went half-open (the peer's host
vanished, a middlebox dropped the flow), answers no Ping. The lifecycle's
client clock (``headgate.protocol.lifecycle``) closes the session once the
gateway has been silent for the whole idle timeout its Welcome announced;
before, only the producer noticed, and a Reader's call or a ReleaseClient
waited on such a connection for ever.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator

import pytest

from headgate.client import Producer, Reader, ReaderError, ReleaseClient
from headgate.protocol import messages as m
from headgate.protocol.session import HelloReceived, Role, Session

pytestmark = pytest.mark.timeout(30)

IDLE_TIMEOUT_MS = 300


class SilentGateway:
    """Welcomes each connection, then reads everything and answers nothing."""

    def __init__(self) -> None:
        self.connections = 0
        self.address: tuple[str, int] = ("127.0.0.1", 0)
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.address = self._server.sockets[0].getsockname()[:2]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        session = Session(Role.GATEWAY)
        try:
            welcomed = False
            for _ in range(10_000):  # bounded: a read per turn until the peer leaves
                data = await reader.read(1 << 16)
                if not data:
                    return
                if welcomed:
                    continue  # silence: not even a Pong
                for event in session.receive_data(data):
                    if isinstance(event, HelloReceived):
                        session.send_global(
                            m.Welcome(
                                server_name="silent",
                                max_message_size=1 << 20,
                                idle_timeout_ms=IDLE_TIMEOUT_MS,
                            )
                        )
                        session.grant(m.STREAM_CHANNEL, 4096)
                        writer.write(session.data_to_send())
                        welcomed = True
        except ConnectionError:
            return
        finally:
            writer.close()


@pytest.fixture
async def silent() -> AsyncIterator[SilentGateway]:
    gateway = SilentGateway()
    await gateway.start()
    yield gateway
    await gateway.stop()


async def test_a_reader_call_fails_once_the_gateway_is_silent_for_the_idle_timeout(
    silent: SilentGateway,
) -> None:
    reader = Reader(silent.address)
    await reader.connect()
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(ReaderError, match="no word from the gateway"):
        async with asyncio.timeout(5):
            await reader.list_streams()
    # After the idle timeout (its Pings at a third of it went unanswered).
    assert IDLE_TIMEOUT_MS / 1000 * 0.9 < loop.time() - started < 2.0
    await reader.close()


async def test_a_producer_reconnects_when_the_gateway_is_silent(silent: SilentGateway) -> None:
    producer = Producer(silent.address, reconnect_timeout=10)
    await producer.connect()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while silent.connections < 2 and loop.time() < deadline:
        await asyncio.sleep(0.05)
    assert producer.statistics().reconnects >= 1
    assert silent.connections >= 2
    async with asyncio.timeout(5):
        await producer.close()


async def test_a_release_client_reconnects_when_the_gateway_is_silent(
    silent: SilentGateway,
) -> None:
    client = ReleaseClient(silent.address, connect_timeout=2.0, max_backoff=0.1)
    stop = threading.Event()

    def watch() -> str | None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not stop.is_set():
            stats = client.statistics()
            if stats.connections >= 2:
                return stats.last_error
            time.sleep(0.05)
        return None

    try:
        last_error = await asyncio.to_thread(watch)
    finally:
        stop.set()
        await asyncio.to_thread(client.close, 0.5)
    assert last_error is not None
    assert "no word from the gateway" in last_error
