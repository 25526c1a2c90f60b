"""The release client against real gateways: releases free log space, survive
an absent or restarting gateway, never block the caller, and a refusal does
not stop the releases after it."""

from __future__ import annotations

import logging
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from headgate.cli.demo import BackgroundLoop
from headgate.client import ReleaseClient, SyncProducer
from headgate.config import GatewayConfig
from headgate.gateway import Gateway, GatewayStreamStatistics


class Served:
    """A gateway on its own event loop thread, listening on TCP and a Unix socket."""

    def __init__(self, data_dir: Path, sock: Path) -> None:
        self.loop = BackgroundLoop("test-gateway")
        self.gateway = Gateway(
            GatewayConfig(
                listen=("127.0.0.1", 0),
                unix_socket=sock,
                data_dir=data_dir,
                term_length=64 * 1024,
                max_message_size=16 * 1024,
                stream_capacity=1024 * 1024,
            )
        )
        self.loop.run(self.gateway.start(), 30)
        host, port = self.gateway.address
        self.tcp = f"{host}:{port}"
        self.unix = f"unix:{sock}"

    def stats(self, stream: str) -> GatewayStreamStatistics:
        async def snapshot() -> GatewayStreamStatistics:
            # After the releases so far are stored: the log frees only then.
            await self.gateway.consumers_saved()
            return self.gateway.streams[stream].statistics()

        result: GatewayStreamStatistics = self.loop.run(snapshot(), 10)
        return result

    def stop(self) -> None:
        self.loop.run(self.gateway.stop(), 30)
        self.loop.stop()


@pytest.fixture
def sock() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="hg-", dir="/tmp"))
    try:
        yield directory / "gw.sock"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def produce(address: str, stream: str, batches: int) -> list[int]:
    """Send ``batches`` bulk calls; return the durable log position after each."""
    positions = []
    with SyncProducer(address, producer_id=11, connect_timeout=10) as p:
        for b in range(batches):
            delivery = p.send_many(stream, [b"%d-%d" % (b, i) for i in range(50)])
            p.flush(30)
            positions.append(delivery.result(30).durable_position)
    assert positions == sorted(set(positions))
    return positions


@pytest.mark.parametrize("listener", ["tcp", "unix"])
def test_a_release_reaches_the_gateway_and_frees_log_space(
    tmp_path: Path, sock: Path, listener: str
) -> None:
    served = Served(tmp_path / "data", sock)
    try:
        address = served.tcp if listener == "tcp" else served.unix
        ends = produce(address, "s", 3)
        before = served.stats("s")
        assert before.release_position == 0 and before.tail_position == ends[-1]
        with ReleaseClient(address) as client:
            client.release("s", ends[0])
            client.release("s", ends[-1])
            client.release("s", ends[1])  # older than what was asked: changes nothing
            assert client.flush(10)
            stats = client.statistics()
            assert stats.settled == stats.applied == {"s": ends[-1]} and stats.pending == {}
            assert stats.connected and stats.connections == 1
        after = served.stats("s")
        assert after.release_position == ends[-1]
        assert after.free_capacity == after.capacity
    finally:
        served.stop()


def test_releases_wait_for_an_absent_gateway_and_survive_its_restart(
    tmp_path: Path, sock: Path
) -> None:
    data = tmp_path / "data"
    first = Served(data, sock)
    ends = produce(first.unix, "s", 3)
    first.stop()
    client = ReleaseClient(f"unix:{sock}", max_backoff=0.2)
    try:
        started = time.monotonic()
        client.release("s", ends[0])
        assert time.monotonic() - started < 0.05, "release() must never wait for the gateway"
        assert not client.flush(0.3), "nobody to confirm it"
        assert client.statistics().pending == {"s": ends[0]}
        second = Served(data, sock)
        try:
            assert client.flush(15), "sent once the gateway came back"
            assert second.stats("s").release_position == ends[0]
        finally:
            second.stop()
        client.release("s", ends[1])  # while the gateway is down again
        third = Served(data, sock)
        try:
            assert client.flush(15)
            assert third.stats("s").release_position == ends[1]
            assert client.statistics().connections == 2
        finally:
            third.stop()
    finally:
        client.close(1.0)


def test_a_refused_release_is_reported_and_later_releases_still_flow(
    tmp_path: Path, sock: Path, caplog: pytest.LogCaptureFixture
) -> None:
    served = Served(tmp_path / "data", sock)
    try:
        ends = produce(served.tcp, "s", 2)
        with ReleaseClient(served.tcp, max_backoff=0.2) as client:
            with caplog.at_level(logging.ERROR, logger="headgate.release"):
                client.release("nosuch", 64)  # a stream the gateway does not have
                assert client.flush(10)
            stats = client.statistics()
            assert stats.refusals == 1
            assert stats.settled == {"nosuch": 64} and stats.applied == {}
            assert any("refused a release" in r.getMessage() for r in caplog.records)
            client.release("s", ends[0])
            assert client.flush(10)
        assert served.stats("s").release_position == ends[0]
    finally:
        served.stop()


def test_bad_arguments_and_a_gateway_speaking_garbage(tmp_path: Path) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    served = 0

    def garbage() -> None:
        nonlocal served
        listener.settimeout(10)
        for _ in range(2):  # bounded: two connection attempts
            conn, _ = listener.accept()
            conn.sendall(b"\xff" * 64)
            conn.close()
            served += 1

    thread = threading.Thread(target=garbage, daemon=True)
    thread.start()
    client = ReleaseClient(f"127.0.0.1:{port}", max_backoff=0.1, connect_timeout=2)
    try:
        with pytest.raises(ValueError, match="not a stream name"):
            client.release("no spaces", 1)
        with pytest.raises(ValueError, match="unsigned 64-bit"):
            client.release("s", -1)
        client.release("s", 64)
        thread.join(15)
        assert served == 2, "the client kept trying"
        assert not client.flush(0.2)
        error = client.statistics().last_error
        assert error is not None and "broke the protocol" in error
    finally:
        assert not client.close(0.5), "the release was never confirmed, and close says so"
        listener.close()


def test_pings_keep_an_idle_connection_alive_when_the_gateway_asks() -> None:
    """A gateway with an idle timeout hears a Ping at a third of it, releases or not."""
    from headgate.protocol import messages as m
    from headgate.protocol.session import Role, Session

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    pings: list[int] = []

    def gateway() -> None:
        listener.settimeout(10)
        conn, _ = listener.accept()
        session = Session(Role.GATEWAY)
        welcomed = False
        conn.settimeout(0.2)
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            try:
                data = conn.recv(4096)
            except TimeoutError:
                continue
            if not data:
                break
            session.receive_data(data)
            if welcomed and session.pending_output:
                pings.append(session.pending_output)  # the session answers a Ping with a Pong
            if session.opened and not welcomed:
                session.send_global(
                    m.Welcome(server_name="t", max_message_size=1 << 20, idle_timeout_ms=300)
                )
                welcomed = True
            conn.sendall(session.data_to_send())
        conn.close()

    thread = threading.Thread(target=gateway, daemon=True)
    thread.start()
    client = ReleaseClient(f"127.0.0.1:{port}", connect_timeout=2)
    try:
        thread.join(10)
        assert len(pings) >= 5, (pings, client.statistics())  # one per 0.1 s after Welcome
    finally:
        client.close(0.5)
        listener.close()
