"""A spooling producer's writes wait for the fsync of their batches' entries,
go in order, and stop when the fsync fails or the connection went away."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from headgate.client.spool_sync import SyncedWrites


class FakeSpool:
    """Entries to sync until an fsync is taken; each fsync waits for ``release``."""

    def __init__(self) -> None:
        self.needs_sync = False
        self.release = threading.Event()
        self.fsyncs = 0
        self.fail: OSError | None = None

    def take_sync(self) -> Callable[[], None]:
        self.needs_sync = False

        def sync() -> None:
            assert self.release.wait(10)
            self.fsyncs += 1
            if self.fail is not None:
                raise self.fail

        return sync


class Wire:
    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.open = True
        self.errors: list[OSError] = []

    def writes(self, spool: FakeSpool) -> SyncedWrites:
        return SyncedWrites(spool, self.sent.append, lambda: self.open, self.errors.append)


async def settle(until: Callable[[], bool]) -> None:
    for _ in range(500):  # bounded: 5 s
        if until():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not settled within 5 s")


def test_bytes_wait_for_the_fsync_of_their_entries_and_keep_their_order() -> None:
    async def scenario() -> None:
        spool, wire = FakeSpool(), Wire()
        writes = wire.writes(spool)
        writes.write(b"a")
        assert wire.sent == [b"a"], "nothing to sync: at once"
        spool.needs_sync = True
        writes.write(b"b")
        writes.write(b"c")  # during the fsync: waits for it too
        await asyncio.sleep(0.05)
        assert wire.sent == [b"a"], "not before the fsync"
        spool.release.set()
        await settle(lambda: len(wire.sent) == 3)
        assert wire.sent == [b"a", b"b", b"c"] and spool.fsyncs == 1
        writes.write(b"d")
        assert wire.sent[-1] == b"d"

    asyncio.run(scenario())


def test_a_failed_fsync_sends_nothing_and_says_so() -> None:
    async def scenario() -> None:
        spool, wire = FakeSpool(), Wire()
        writes = wire.writes(spool)
        spool.needs_sync = True
        spool.fail = OSError(28, "No space left on device")
        writes.write(b"batch")
        spool.release.set()
        await settle(lambda: bool(wire.errors))
        assert wire.sent == [] and "No space left" in str(wire.errors[0])

    asyncio.run(scenario())


def test_bytes_of_a_connection_lost_during_the_fsync_are_dropped() -> None:
    async def scenario() -> None:
        spool, wire = FakeSpool(), Wire()
        writes = wire.writes(spool)
        spool.needs_sync = True
        writes.write(b"batch")
        wire.open = False  # its batches are resent on the next connection
        spool.release.set()
        await settle(lambda: spool.fsyncs == 1)
        await asyncio.sleep(0.05)
        assert wire.sent == [] and wire.errors == []

    asyncio.run(scenario())
