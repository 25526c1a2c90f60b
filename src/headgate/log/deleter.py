"""Deleting freed term files on a helper thread, off the group commit's path.

Once a release is durable, the term files wholly behind it go. Closing and
unlinking a 16 MiB term took 5 ms at the median and 15 ms at p99 here
(``bench/termsync.py``; this file system is mounted with ``discard``), and a
release every 2 s at 120 MB/s frees about 15 terms: done inside the group
commit, as before, the acks of that commit waited 90 to 140 ms for it, once
per release (``bench/acktrace.py``). Here one short-lived thread deletes
them, in order, while the next commits go on. A crash before it is done
leaves files behind the durable release, which recovery deletes.

The release that frees them must be on the disk before they leave it, or
recovery would find history missing. That fdatasync of the metadata page is
the thread's first step too (:meth:`TermDeleter.delete`'s ``first``): done
inside the commit it held every ack of that commit for one more fsync, once
per release that frees a term. If it fails, the terms stay on the disk (the
next release that frees a term syncs the page again, and recovery deletes
whatever lies behind the durable release).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable

from headgate.log.term import TermFile

_log = logging.getLogger(__name__)

__all__ = ["TermDeleter"]


class TermDeleter:
    """Closes and unlinks terms handed to :meth:`delete`, on one helper thread at a time."""

    __slots__ = ("_lock", "_queue", "_running", "_thread")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: list[tuple[Callable[[], None] | None, list[TermFile]]] = []
        self._running = False
        self._thread: threading.Thread | None = None

    def delete(self, terms: list[TermFile], first: Callable[[], None] | None = None) -> None:
        """Close and unlink ``terms`` soon, after ``first()`` returns. Never blocks.

        ``first`` makes the release that freed them durable; if it raises
        OSError, ``terms`` are closed but their files stay.
        """
        with self._lock:
            self._queue.append((first, terms))
            if self._running:
                return  # the running thread takes them before it ends
            self._running = True
            self._thread = threading.Thread(
                target=self._run, name="headgate-term-delete", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._running = False
                    return
                batch, self._queue = self._queue, []
            _delete(batch)

    def close(self) -> None:
        """Wait until every term handed over so far is deleted."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join()
        # Whatever a thread that ended meanwhile did not take (none, unless it died).
        with self._lock:
            left, self._queue = self._queue, []
        _delete(left)


def _delete(batch: list[tuple[Callable[[], None] | None, list[TermFile]]]) -> None:
    for first, terms in batch:
        durable = True
        if first is not None:
            try:
                first()
            except OSError as exc:
                durable = False
                _log.warning(
                    "cannot make a release durable (%s): %d freed term files stay on the disk "
                    "until a later release or a restart",
                    exc,
                    len(terms),
                )
        for term in terms:
            term.close()
            if durable:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(term.path)
