"""Writes that wait for the spool: a batch's bytes leave only once its spool entry is on disk.

A producer with a spool (:mod:`headgate.client.spooling`) promises that
every batch the gateway may have seen is in the spool, so that the next
producer on it can send again what was not acknowledged. So the bytes of a
round of batches are held until the spool's fsync covers their entries.
The fsync runs in a thread, so that acknowledgements and sends go on
meanwhile; bytes produced during one wait for the next, in order.
:class:`SyncedWrites` is that rule for one connection; without entries to
sync, bytes go at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

__all__ = ["SyncedWrites", "SyncingSpool"]


class SyncingSpool(Protocol):
    """What the writes need of a :class:`~headgate.client.spool.Spool`."""

    @property
    def needs_sync(self) -> bool:
        """Whether entries were written since the last fsync."""
        ...

    def take_sync(self) -> Callable[[], None]:
        """The fsync of the entries written so far, to run in another thread."""
        ...


class SyncedWrites:
    """One connection's writes, held while the spool has entries to fsync.

    Args:
        spool: the producer's spool.
        send: writes bytes to the connection.
        writable: whether the connection still takes bytes (if it was
            lost meanwhile, its batches are resent on the next one).
        failed: called when the fsync fails: nothing more may be sent.
    """

    def __init__(
        self,
        spool: SyncingSpool,
        send: Callable[[bytes], None],
        writable: Callable[[], bool],
        failed: Callable[[OSError], None],
    ) -> None:
        self._spool = spool
        self._send = send
        self._writable = writable
        self._failed = failed
        # Bytes waiting for an fsync to come, and whether one runs now.
        self._held: list[bytes] = []
        self._syncing = False

    def write(self, data: bytes) -> None:
        """Write ``data`` now, or once the spool entries of its batches are durable."""
        if not self._syncing and not self._spool.needs_sync:
            self._send(data)
            return
        self._held.append(data)
        if not self._syncing:
            self._start_sync()

    def _start_sync(self) -> None:
        covered, self._held = self._held, []
        self._syncing = True
        future = asyncio.get_running_loop().run_in_executor(None, self._spool.take_sync())
        future.add_done_callback(lambda done: self._synced(covered, done))

    def _synced(self, covered: list[bytes], done: asyncio.Future[None]) -> None:
        self._syncing = False
        if done.cancelled() or done.exception() is not None:
            error = done.exception() if not done.cancelled() else None
            self._failed(error if isinstance(error, OSError) else OSError(str(error)))
            return
        if not self._writable():
            return  # those batches are resent on the next connection
        self._send(b"".join(covered))
        if self._held:
            if self._spool.needs_sync:
                self._start_sync()
            else:
                held, self._held = self._held, []
                self._send(b"".join(held))
