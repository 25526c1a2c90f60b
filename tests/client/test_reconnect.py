"""A gateway that opens sessions and closes them at once gets no reconnect storm.

The schedule itself (:class:`headgate.client.backoff.Backoff`) is tested with
time as an argument; the producer and the release client are tested against
a scripted gateway on 127.0.0.1 that welcomes each connection and closes it
with ``STORAGE_UNAVAILABLE``, as a second gateway on a data directory that
another one holds did.
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest

from headgate.client import Producer, ProducerError, ReleaseClient
from headgate.client.backoff import Backoff
from headgate.config import GatewayConfig
from headgate.costs import batch_cost
from headgate.gateway import Gateway
from headgate.protocol import messages as m
from headgate.protocol.errors import ErrorCode
from headgate.protocol.session import HelloReceived, Role, Session
from tests.helpers import MiB, read_log, run, values_in_order

# --- the schedule, with time as an argument ------------------------------------------


def schedule(**options: float | None) -> Backoff:
    return Backoff(100.0, jitter=0.0, **options)  # type: ignore[arg-type]


def test_failed_attempts_double_the_pause_up_to_the_longest_and_stop_at_the_deadline() -> None:
    backoff = schedule(give_up_after=5.0, first=0.5, longest=2.0)
    assert backoff.deadline == 105.0
    assert [backoff.failed(now) for now in (100.0, 100.5, 101.5, 103.5)] == [0.5, 1.0, 2.0, 1.5]
    # The last pause was cut to end at the deadline; then it gives up.
    assert backoff.failed(105.0) is None


def test_a_session_closed_soon_after_it_opened_is_a_failed_attempt() -> None:
    backoff = schedule(give_up_after=3.0, first=0.1, longest=1.0, healthy_after=2.0)
    now, pauses = 100.0, []
    # Each session opens at once and is closed 5 ms later, with nothing acknowledged.
    while (pause := backoff.ended(now, now + 0.005, progressed=False)) is not None:
        pauses.append(pause)
        now += 0.005 + pause
        assert len(pauses) < 100, "never gave up"
    assert pauses[:4] == [0.1, 0.2, 0.4, 0.8] and max(pauses) == 1.0
    assert now + 0.005 >= 103.0 and len(pauses) <= 8


def test_a_healthy_session_starts_the_schedule_afresh() -> None:
    backoff = schedule(give_up_after=3.0, first=0.1, longest=1.0, healthy_after=2.0)
    for now in (100.0, 100.1, 100.3):
        backoff.failed(now)
    # Progress makes even a short session healthy: reconnect at once, a new deadline.
    assert backoff.ended(100.5, 100.6, progressed=True) == 0.0
    assert backoff.deadline == 103.6
    assert backoff.failed(100.6) == 0.1
    # So does staying open for healthy_after, without progress.
    assert backoff.ended(101.0, 103.0, progressed=False) == 0.0
    assert backoff.deadline == 106.0


def test_a_short_timeout_shortens_what_counts_as_healthy() -> None:
    # Connected for 1.5 s with a 1 s timeout: the client still gets its 1 s of attempts.
    backoff = schedule(give_up_after=1.0, healthy_after=5.0)
    assert backoff.ended(100.5, 102.0, progressed=False) == 0.0
    assert backoff.deadline == 103.0


def test_without_a_deadline_the_schedule_never_gives_up() -> None:
    backoff = schedule(give_up_after=None, first=0.1, longest=0.4)
    pauses = [backoff.ended(t, t + 0.001, progressed=False) for t in range(100, 200)]
    assert backoff.deadline is None
    assert pauses[:3] == [0.1, 0.2, 0.4] and set(pauses[3:]) == {0.4}


def test_jitter_scales_each_pause_within_its_bounds() -> None:
    factors = iter([0.8, 1.2])
    backoff = Backoff(
        0.0,
        give_up_after=None,
        first=1.0,
        longest=4.0,
        jitter=0.2,
        uniform=lambda a, b: next(factors),
    )
    assert backoff.failed(0.0) == pytest.approx(0.8)
    assert backoff.failed(1.0) == pytest.approx(2.4)


# --- against a gateway that closes every session ----------------------------------------


class ClosingGateway:
    """Welcomes every connection and closes it 2 ms later with STORAGE_UNAVAILABLE."""

    def __init__(self) -> None:
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        gateway = self

        class Closing(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                assert isinstance(transport, asyncio.Transport)
                gateway.connections += 1
                self.transport = transport
                self.session = Session(Role.GATEWAY, data_cost=batch_cost)

            def data_received(self, data: bytes) -> None:
                for event in self.session.receive_data(data):
                    if isinstance(event, HelloReceived):
                        self.session.send_global(
                            m.Welcome(
                                server_name="closing", max_message_size=MiB, idle_timeout_ms=0
                            )
                        )
                        self.transport.write(self.session.data_to_send())
                        # A moment later, so that the client sees the session open first.
                        asyncio.get_running_loop().call_later(0.002, self.refuse)
                        return

            def refuse(self) -> None:
                self.session.send_global(
                    m.Error(
                        code=ErrorCode.STORAGE_UNAVAILABLE, text="already open by another writer"
                    )
                )
                self.transport.write(self.session.data_to_send())
                self.transport.close()

        self.server = await asyncio.get_running_loop().create_server(Closing, "127.0.0.1", 0)
        port: int = self.server.sockets[0].getsockname()[1]
        return port


def test_a_producer_backs_off_and_gives_up_on_a_gateway_that_closes_every_session() -> None:
    async def scenario() -> None:
        gateway = ClosingGateway()
        port = await gateway.start()
        assert gateway.server is not None
        async with gateway.server:
            p = Producer(("127.0.0.1", port), reconnect_timeout=1.5)
            started = time.monotonic()
            await p.connect()  # the first session opens
            await p.send("s", b"never stored")
            with pytest.raises(ProducerError, match="gave up") as raised:
                await p.flush()
            elapsed = time.monotonic() - started
            assert 1.4 <= elapsed < 4.0
            assert "STORAGE_UNAVAILABLE" in str(raised.value)
            assert "already open by another writer" in str(raised.value)
            # 50 ms doubling within 1.5 s: a handful of attempts, not one every few ms.
            assert 3 <= gateway.connections <= 10, gateway.connections
            await p.abort()

    run(scenario(), timeout=10)


def test_a_release_client_backs_off_from_a_gateway_that_closes_every_session() -> None:
    async def scenario() -> None:
        gateway = ClosingGateway()
        port = await gateway.start()
        assert gateway.server is not None
        async with gateway.server:
            client = ReleaseClient(f"127.0.0.1:{port}", max_backoff=0.4)
            try:
                await asyncio.sleep(1.5)
                # 0.05 + 0.1 + 0.2 + 0.4 + 0.4 + 0.4 ... : about 6 in 1.5 s.
                assert 2 <= gateway.connections <= 10, gateway.connections
            finally:
                await asyncio.to_thread(client.close, 0.1)

    run(scenario(), timeout=10)


def test_a_producer_without_a_reconnect_timeout_waits_for_a_gateway_that_comes_late(
    tmp_path: Path,
) -> None:
    # Past any short timeout (2.5 s here) a producer with None still waits,
    # backing off, and delivers once the gateway appears on its port.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    async def scenario() -> None:
        p = Producer(("127.0.0.1", port), reconnect_timeout=None)
        p.send_nowait("late", b"first")  # waits for the session, does not block
        await asyncio.sleep(2.5)
        assert not p.connected
        assert p.statistics().failure is None
        config = GatewayConfig(listen=("127.0.0.1", port), data_dir=tmp_path)
        gw = Gateway(config)
        await gw.start()
        try:
            await p.send("late", b"second")
            await p.flush()
            producer_id = p.producer_id
            await p.close()
        finally:
            await gw.stop()
        assert values_in_order(read_log(tmp_path, "late"), producer_id) == [b"first", b"second"]

    run(scenario(), timeout=10)
