"""The term files of one open log, by id, and the lock that guards them.

Three parties touch a log's terms: the appender (on the owner thread) creates
a term it needs that the preparer has not written, the term preparer (on its
helper thread) hands over the terms it wrote ahead, and the group commit (on
its worker thread) fsyncs them and deletes those a release has freed. This
table is what they share, and :attr:`TermTable.lock` is the one lock they
share it under. The same lock guards the durable/release pair of the
metadata page (see :mod:`headgate.log.group_commit`), so that a commit sees
a release and the terms it frees together.
"""

from __future__ import annotations

import threading
from pathlib import Path

from headgate.log.errors import LogError
from headgate.log.position import position_bits_to_shift
from headgate.log.preparer import MIN_PREPARED_TERM_LENGTH
from headgate.log.term import (
    MAX_SPARE_TERMS,
    TermFile,
    TermSpares,
    fsync_directory,
    most_term_files,
)

__all__ = ["TermTable"]


class TermTable:
    """The open terms, whether the directory's names are durable, and whether the log is closed."""

    __slots__ = (
        "closed",
        "directory",
        "directory_changes",
        "directory_dirty",
        "files",
        "lock",
        "shift",
        "spares",
        "term_length",
    )

    def __init__(
        self, directory: Path, term_length: int, files: dict[int, TermFile], capacity: int
    ) -> None:
        self.directory = directory
        self.term_length = term_length
        self.shift = position_bits_to_shift(term_length)
        #: Term id to its open file; changed only under :attr:`lock`.
        self.files = files
        self.lock = threading.Lock()
        #: Whether a term's name (or a deletion) may not be on disk yet.
        self.directory_dirty = False
        #: Bumped whenever the directory becomes dirty: the term preparer's own
        #: directory fsync counts only if nothing changed the directory since.
        self.directory_changes = 0
        self.closed = False
        #: Freed terms kept for the preparer to recycle (none for terms too
        #: small to be prepared: nothing would take them).
        self.spares = TermSpares(
            term_length,
            MAX_SPARE_TERMS if term_length >= MIN_PREPARED_TERM_LENGTH else 0,
            most_term_files(capacity, term_length),
            lambda: len(self.files),
        )

    def check_open(self) -> None:
        """Raise :class:`LogError` once the log is closed."""
        if self.closed:
            raise LogError(f"the stream log at {self.directory} is closed")

    def mark_directory_dirty(self) -> None:
        """The directory changed: the next group commit fsyncs it. Call under :attr:`lock`."""
        self.directory_dirty = True
        self.directory_changes += 1

    def ensure(self, term_id: int) -> None:
        """Make term ``term_id`` exist: usually the preparer has written it already."""
        if term_id in self.files:
            return
        # Under the lock, so that a term the preparer finishes meanwhile
        # cannot be renamed over this one.
        with self.lock:
            if term_id not in self.files:
                self.files[term_id] = TermFile.create(self.directory, term_id, self.term_length)
                self.mark_directory_dirty()

    def install_prepared(self, term: TermFile) -> bool:
        """Take a term the preparer wrote ahead (called on its thread).

        The preparer also makes the term's name durable (fsyncs the
        directory), here, ahead of need: otherwise the group commit that
        first syncs the new term would fsync the directory too, on top of
        two terms' fdatasyncs, and its acks would wait for all three (a
        commit entering a term took 4 to 5 times the others' time at the
        median, ``bench/termsync.py``). If the directory changed meanwhile,
        or the fsync fails, the next group commit syncs it as before.
        """
        with self.lock:
            if term.term_id in self.files or self.closed:
                return False
            term.install()
            self.files[term.term_id] = term
            self.mark_directory_dirty()
            changes = self.directory_changes
        try:
            fsync_directory(self.directory)
        except OSError:
            return True  # the group commit syncs the directory (and reports its failure)
        with self.lock:
            if self.directory_changes == changes:
                self.directory_dirty = False
        return True
