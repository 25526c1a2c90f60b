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

Deleting is now the exception: once the release is durable, up to
:data:`~headgate.log.term.MAX_SPARE_TERMS` freed terms are kept as spares
for the preparer to recycle (:class:`~headgate.log.term.TermSpares`), because
on a file system mounted with ``discard`` each deletion stalled the next group
commits for 30 to 40 ms (see :mod:`headgate.log.term`). Only the rest are
deleted, each cut down a few MiB at a time first
(:func:`~headgate.log.term.delete_gradually`), so that the trims of a large
release never hold a commit's fdatasync for long.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from headgate.log.term import TermFile, TermSpares

_log = logging.getLogger(__name__)

__all__ = ["TermDeleter"]


class TermDeleter:
    """Retires terms handed to :meth:`delete` (kept as spares or unlinked), on one helper thread."""

    __slots__ = ("_lock", "_queue", "_running", "_spares", "_thread")

    def __init__(self, spares: TermSpares) -> None:
        self._spares = spares
        self._lock = threading.Lock()
        self._queue: list[tuple[Callable[[], None] | None, list[TermFile]]] = []
        self._running = False
        self._thread: threading.Thread | None = None

    def delete(self, terms: list[TermFile], first: Callable[[], None] | None = None) -> None:
        """Close ``terms`` soon, after ``first()`` returns, and keep or unlink each. Never blocks.

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
            _delete(batch, self._spares)

    def close(self) -> None:
        """Wait until every term handed over so far is deleted."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join()
        # Whatever a thread that ended meanwhile did not take (none, unless it died).
        with self._lock:
            left, self._queue = self._queue, []
        _delete(left, self._spares)


def _delete(
    batch: list[tuple[Callable[[], None] | None, list[TermFile]]], spares: TermSpares
) -> None:
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
        if durable:
            spares.retire(terms, gradually=True)
        else:
            for term in terms:
                term.close()
