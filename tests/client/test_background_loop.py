"""The loop in a thread that the blocking clients share: work handed over from
other threads runs on it, a wait that times out cancels its work, and stopping
leaves neither a task nor a thread behind."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from headgate.client import ReleaseClient
from headgate.client.background_loop import BackgroundLoop


def test_work_handed_over_runs_on_the_loop_thread() -> None:
    background = BackgroundLoop("test-loop")
    try:

        async def where() -> str:
            return threading.current_thread().name

        assert background.run(where(), 5) == "test-loop"
        seen = threading.Event()
        background.call(seen.set)
        assert seen.wait(5)
        assert background.submit(where()).result(5) == "test-loop"
    finally:
        background.stop()


async def _forever(cancelled: threading.Event) -> None:
    """Sleep a minute; set ``cancelled`` if cancelled first."""
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        cancelled.set()
        raise


def test_a_wait_that_times_out_cancels_the_work() -> None:
    background = BackgroundLoop("test-loop")
    cancelled = threading.Event()

    try:
        with pytest.raises(TimeoutError, match=r"not done within 0\.1 s"):
            background.run(_forever(cancelled), 0.1)
        assert cancelled.wait(5)
    finally:
        background.stop()


def test_stop_cancels_what_still_runs_and_ends_the_thread() -> None:
    background = BackgroundLoop("test-loop-stop")
    cancelled = threading.Event()

    future = background.submit(_forever(cancelled))
    background.stop()
    assert cancelled.is_set() and future.cancelled()
    assert background.loop.is_closed()
    assert "test-loop-stop" not in [t.name for t in threading.enumerate()]
    background.stop()  # again: nothing to do
    background.call(lambda: None)  # on a closed loop: nothing happens


def test_closing_a_release_client_stuck_in_a_handshake_ends_its_thread() -> None:
    """A gateway that accepts and never says Welcome: close() does not wait for the handshake."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    try:
        client = ReleaseClient(f"127.0.0.1:{port}", connect_timeout=30)
        client.release("s", 64)
        started = time.monotonic()
        assert not client.close(0.2), "nothing was confirmed"
        assert time.monotonic() - started < 5
        name = f"headgate-release-127.0.0.1:{port}"
        assert name not in [t.name for t in threading.enumerate()]
        assert client.statistics().pending == {"s": 64}
    finally:
        listener.close()
