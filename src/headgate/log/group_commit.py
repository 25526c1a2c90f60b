"""Group commit: make what the appender wrote durable, in groups, off the owner thread.

A worker thread calls :meth:`GroupCommit.sync` every few milliseconds (the
gateway decides when: ``group_commit_mode``). One commit fsyncs every term
from the durable position to the tail, and the directory if a term's name
is new, then stores the new durable position in the metadata page (with the
release position, under one checksum) and wakes whoever waits for it. Two
chores ride along, after the durable position is out: the pages of terms
that are wholly durable and behind the writer leave the process, and term
files that a release has freed are retired once that release is on disk
(a few kept as spares for the preparer to recycle, the rest deleted: see
:mod:`headgate.log.term`).

What is locked:

* :attr:`GroupCommit.lock` serialises commits (and ``close``), so two
  commits never interleave their fsyncs and durable-position updates.
* The :class:`TermTable`'s lock is taken twice per commit, briefly: to
  snapshot what to fsync, and to publish the new durable position. The
  fsyncs run with no lock held (and without the GIL), so appends never wait
  for the disk.
* The tail is read once (an int attribute read is atomic under the GIL):
  every frame below it is already whole in the page cache (see
  :mod:`headgate.log.appender`), so the fsync that follows covers it.
"""

from __future__ import annotations

import threading

from headgate.log.appender import Appender
from headgate.log.deleter import TermDeleter
from headgate.log.errors import storage_error
from headgate.log.metadata import MetadataPage
from headgate.log.position import term_id_of, term_start
from headgate.log.term import TermFile, fsync_directory, pwrite_all
from headgate.log.term_table import TermTable

__all__ = ["GroupCommit"]

_REDIRTY_CHUNK = 1 << 20


class GroupCommit:
    """The durable position of one log, and the commit that moves it.

    Reads the appender's tail and release position, never writes them.
    """

    __slots__ = (
        "_appender",
        "_deleter",
        "_durable_changed",
        "_meta",
        "_pages_dropped_below",
        "_redirty_from",
        "_table",
        "durable",
        "lock",
        "meta_dirty",
    )

    def __init__(
        self, table: TermTable, meta: MetadataPage, appender: Appender, *, durable: int
    ) -> None:
        self._table = table
        self._meta = meta
        self._appender = appender
        #: Every frame before this position is on the device (fsynced).
        self.durable = durable
        #: Held by a commit, and by ``close`` around the last one.
        self.lock = threading.Lock()
        self._durable_changed = threading.Condition(table.lock)
        #: Whether the stored durable/release pair changed since the page was last fsynced.
        self.meta_dirty = False
        # After a failed fsync, where the bytes that may not have reached the
        # disk begin (see commit); None while every fsync succeeded.
        self._redirty_from: int | None = None
        # Terms below this id have had their pages dropped (see TermFile.drop_pages).
        self._pages_dropped_below = min(table.files, default=0)
        # Set by delete_in_background: freed terms are deleted off the commit's path.
        self._deleter: TermDeleter | None = None

    def sync(self) -> int:
        """One group commit, unless the log is closed; the new durable position."""
        with self.lock:
            self._table.check_open()
            return self.commit()

    def commit(self) -> int:
        """The commit itself; the caller holds :attr:`lock`."""
        table = self._table
        shift = table.shift
        with table.lock:
            target = self._appender.tail_position
            durable = self.durable
            directory_dirty = table.directory_dirty
            table.directory_dirty = False
            redirty_from = self._redirty_from
            first = term_id_of(durable if redirty_from is None else redirty_from, shift)
            last = term_id_of(target, shift)
            dirty = [table.files[t] for t in range(first, last + 1) if t in table.files]
        if target > durable or directory_dirty or redirty_from is not None:
            try:
                if redirty_from is not None:
                    self._redirty(dirty, redirty_from, target)
                for term in dirty:
                    term.sync()
                if directory_dirty:
                    fsync_directory(table.directory)
            except OSError as exc:
                with table.lock:
                    table.directory_dirty |= directory_dirty
                    table.directory_changes += 1
                    # Linux may mark the pages of a failed write-back clean,
                    # so a later fsync would "succeed" without them: the next
                    # commit first rewrites everything since the last good one.
                    self._redirty_from = durable if redirty_from is None else redirty_from
                raise storage_error(
                    f"group commit of {table.directory} failed",
                    exc.filename or table.directory,
                    exc,
                ) from exc
            self._redirty_from = None
        with table.lock:
            release = self._appender.release_position
            if target > self.durable:
                self.durable = target
                self._meta.store_positions(target, release)
                self.meta_dirty = True
                self._durable_changed.notify_all()
            release_term = term_id_of(release, shift)
            freed = [t for t in table.files if t < release_term]
            # Terms wholly durable and behind the writer: their pages leave
            # the process (each term once).
            done_below = term_id_of(self.durable, shift)
            finished = [
                table.files[t]
                for t in range(self._pages_dropped_below, done_below)
                if t in table.files and t >= release_term
            ]
            self._pages_dropped_below = max(self._pages_dropped_below, done_below)
        for term in finished:
            term.drop_pages()
        if freed:
            # The release that frees these terms must reach the disk before
            # they leave it, or recovery would find history missing.
            if self._deleter is not None:
                with table.lock:
                    doomed = [table.files.pop(t) for t in freed]
                # Both off this commit's path: the page's fdatasync, then the deletions.
                self._deleter.delete(doomed, first=self._meta.sync)
                return self.durable
            try:
                self._meta.sync()
            except OSError as exc:
                raise storage_error(
                    f"cannot make the release of {table.directory} durable", self._meta.path, exc
                ) from exc
            self.meta_dirty = False
            with table.lock:
                doomed = [table.files.pop(t) for t in freed]
            table.spares.retire(doomed)
        return self.durable

    def finish(self) -> None:
        """The last commit, at close: everything appended, and the stored pair, durable."""
        self.commit()
        if self.meta_dirty:
            self._meta.sync()

    def store_release(self, position: int) -> None:
        """Store the pair (durable, ``position``); the caller holds the table's lock.

        The page reaches the disk with the next commit that frees a term, or at close.
        """
        self._meta.store_positions(self.durable, position)
        self.meta_dirty = True

    def _redirty(self, terms: list[TermFile], start: int, end: int) -> None:
        """Store again, unchanged, the committed bytes in ``[start, end)`` so fsync writes them.

        Those bytes are immutable history (below the tail snapshot), so
        rewriting them with their own values changes nothing a reader sees.
        """
        shift = self._table.shift
        term_length = self._table.term_length
        for term in terms:
            base = term_start(term.term_id, shift)
            low = max(start, base) - base
            high = min(end, base + term_length) - base
            view = term.view
            for offset in range(low, high, _REDIRTY_CHUNK):
                stop = min(offset + _REDIRTY_CHUNK, high)
                # Through the descriptor, as appends write (see the appender).
                pwrite_all(term.fd, [bytes(view[offset:stop])], offset)

    def wait(self, position: int, timeout: float | None) -> bool:
        """Block until ``position`` is durable; ``False`` on timeout or close."""
        with self._durable_changed:
            self._durable_changed.wait_for(
                lambda: self.durable >= position or self._table.closed, timeout
            )
            return self.durable >= position

    def wake_waiters(self) -> None:
        """The log closed: whoever waits stops waiting. The caller holds the table's lock."""
        self._durable_changed.notify_all()

    def delete_in_background(self) -> None:
        """From now on, freed term files are deleted on a helper thread."""
        if self._deleter is None:
            self._deleter = TermDeleter(self._table.spares)

    def close(self) -> None:
        """Wait for the deletions handed to the helper thread, if any."""
        if self._deleter is not None:
            self._deleter.close()
