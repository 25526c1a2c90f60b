"""Reserving the next term file ahead of need, on a helper thread.

A new term's blocks are reserved with ``posix_fallocate``: nothing is written,
so preparing a term puts no data on the disk queue that the group commit's
``fdatasync`` (whose latency is the producers' ack latency) would wait
behind. Writing zeros instead, as an earlier version did, made each rotation
of a 16 MiB term cost tens of milliseconds of disk writes and showed up as
ack-latency spikes; reading the new term once to cache its zero pages, as a
later version did, slowed the concurrent fdatasyncs too (see
``TermFile.prepare``). The term is fdatasynced, which writes only the
allocation. All of it runs on a helper thread whenever the writer enters a
new term; every call releases the GIL. The helper threads live as long as the
process and serve every log in it (:data:`PREPARING_THREADS`): starting a
thread per term, as an earlier version did, made the writer wait for the new
thread to be scheduled at every rotation (on a busy two-core machine, a
tenth of the event loop's time at a rotation every 10 ms).

When the log has a spare (a freed term whose release is durable, kept by
:class:`~headgate.log.term.TermSpares`), the preparer recycles it instead of
creating a file: renamed, cleared with ``FALLOC_FL_ZERO_RANGE`` and
fdatasynced (:meth:`TermFile.prepare`). Deleting freed terms on this
machine's ext4 mounted with ``discard`` stalled the group commits for 30 to
40 ms at each release that freed a term (:mod:`headgate.log.term`).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from pathlib import Path

from headgate.log.errors import LogError
from headgate.log.term import TermFile, TermSpares

MIN_PREPARED_TERM_LENGTH = 64 * 1024
"""Smaller terms (tests use 4 KiB) are created when needed: for them, a thread
start and an fsync per term cost more than they would save."""


#: Threads that prepare terms, shared by every log of the process: a few, so
#: that one slow fdatasync does not hold up every other log's next term.
PREPARING_THREADS = 2


class _Helpers:
    """The process's term-preparing threads and the queue of their work.

    Started at the first request, and again after a ``fork`` (a child
    inherits the queue but not the threads).
    """

    def __init__(self, count: int) -> None:
        self._count = count
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        threads = self._threads
        if len(threads) < self._count or not all(t.is_alive() for t in threads):
            self._start()
        self._jobs.put(job)

    def _start(self) -> None:
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            while len(self._threads) < self._count:
                thread = threading.Thread(target=self._run, name="headgate-terms", daemon=True)
                thread.start()
                self._threads.append(thread)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            # A job reports its own failures (TermPreparer._prepare): one
            # that raises anyway must not take the thread with it.
            with contextlib.suppress(Exception):
                job()


_HELPERS = _Helpers(PREPARING_THREADS)


class TermPreparer:
    """Prepares one term at a time ahead of the writer; hands it over through ``install``.

    ``install`` is called on the helper thread with the prepared term (under
    its temporary name). It returns ``False`` if the term is not wanted any
    more (the writer created it itself meanwhile, or closed), and the preparer
    then throws it away.
    """

    __slots__ = ("_directory", "_idle", "_install", "_spares", "_term_length")

    def __init__(
        self,
        directory: Path,
        term_length: int,
        install: Callable[[TermFile], bool],
        spares: TermSpares | None = None,
    ) -> None:
        self._directory = directory
        self._spares = spares
        self._term_length = term_length
        self._install = install
        #: Set while no preparation of this log's is queued or running.
        self._idle = threading.Event()
        self._idle.set()

    def request(self, term_id: int) -> None:
        """Start preparing ``term_id`` unless a preparation is still pending. Never blocks."""
        if self._term_length < MIN_PREPARED_TERM_LENGTH or not self._idle.is_set():
            return
        self._idle.clear()
        _HELPERS.submit(lambda: self._prepare(term_id))

    def close(self) -> None:
        """Wait for a pending preparation to finish (it then finds the log closed)."""
        self._idle.wait()

    def _prepare(self, term_id: int) -> None:
        try:
            try:
                spare = self._spares.take() if self._spares is not None else None
                term = TermFile.prepare(self._directory, term_id, self._term_length, spare)
            except (LogError, OSError):
                # A full disk is not this thread's to report: the writer creates
                # the term itself when it needs it, and raises there.
                return
            if not self._install(term):
                term.discard()
        finally:
            self._idle.set()
