"""Reserving the next term file ahead of need, on a helper thread.

A new term's blocks are reserved with ``posix_fallocate``: nothing is written,
so preparing a term puts no data on the disk queue that the group commit's
``fdatasync`` (whose latency is the producers' ack latency) would wait
behind. Writing zeros instead, as an earlier version did, made each rotation
of a 16 MiB term cost tens of milliseconds of disk writes and showed up as
ack-latency spikes; reading the new term once to cache its zero pages, as a
later version did, slowed the concurrent fdatasyncs too (see
``TermFile.prepare``). The term is fdatasynced, which writes only the
allocation. All of it runs on a short-lived helper thread whenever the writer
enters a new term; every call releases the GIL.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from headgate.log.errors import LogError
from headgate.log.term import TermFile

MIN_PREPARED_TERM_LENGTH = 64 * 1024
"""Smaller terms (tests use 4 KiB) are created when needed: for them, a thread
start and an fsync per term cost more than they would save."""


class TermPreparer:
    """Prepares one term at a time ahead of the writer; hands it over through ``install``.

    ``install`` is called on the helper thread with the prepared term (under
    its temporary name). It returns ``False`` if the term is not wanted any
    more (the writer created it itself meanwhile, or closed), and the preparer
    then throws it away.
    """

    __slots__ = ("_directory", "_install", "_term_length", "_thread")

    def __init__(
        self, directory: Path, term_length: int, install: Callable[[TermFile], bool]
    ) -> None:
        self._directory = directory
        self._term_length = term_length
        self._install = install
        self._thread: threading.Thread | None = None

    def request(self, term_id: int) -> None:
        """Start preparing ``term_id`` unless a preparation is still running. Never blocks."""
        if self._term_length < MIN_PREPARED_TERM_LENGTH:
            return
        if self._thread is not None and self._thread.is_alive():
            return
        self._thread = threading.Thread(
            target=self._prepare, args=(term_id,), name=f"headgate-term-{term_id}", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Wait for a running preparation to finish (it then finds the log closed)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _prepare(self, term_id: int) -> None:
        try:
            term = TermFile.prepare(self._directory, term_id, self._term_length)
        except (LogError, OSError):
            # A full disk is not this thread's to report: the writer creates
            # the term itself when it needs it, and raises there.
            return
        if not self._install(term):
            term.discard()
