"""StreamLog: the single writer of one stream's log.

The gateway owns one ``StreamLog`` per stream. Its event-loop thread (the
*owner*) appends batches as they arrive and releases space as Spark commits;
a worker thread runs :meth:`StreamLog.sync`, the group commit, every few
milliseconds; Spark executors in other processes read the same files through
:class:`~headgate.log.reader.LogReader`.

``StreamLog`` opens, recovers, releases, reads back and closes; each of its
other jobs has a room of its own:

* :class:`~headgate.log.appender.Appender`: the tail, the space books and
  the one write loop behind :meth:`append` and :meth:`append_many`. Appends
  take no lock. A ``StreamLog`` is an ``Appender`` (its ``append`` is the
  appender's own, with no call in between), and holds the other two:
* :class:`~headgate.log.group_commit.GroupCommit`: the durable position and
  the commit that moves it (fsyncs with no lock held, so appends never wait
  for the disk; what is locked is in its module).
* :class:`~headgate.log.term_table.TermTable`: the open term files and the
  one lock under which the appender, the term preparer and the group commit
  share them (and the durable/release pair of the metadata page).

Only the owner thread may call ``append``, ``release``, ``read`` and
``scan_headers``; ``sync``, ``wait_durable`` and the position properties may be
used from any thread.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Final

from headgate.log.appender import Appender, check_capacity
from headgate.log.errors import LogCorruptError, LogError, storage_error
from headgate.log.frame import (
    HEADER_LENGTH,
    FrameHeader,
    LogFrame,
)
from headgate.log.group_commit import GroupCommit
from headgate.log.lock import try_lock
from headgate.log.metadata import (
    META_FILE_NAME,
    MetadataPage,
    Settings,
)
from headgate.log.position import (
    MAX_TERM_LENGTH,
    MIN_TERM_LENGTH,
    normalize_position,
    term_offset_of,
)
from headgate.log.preparer import MIN_PREPARED_TERM_LENGTH, TermPreparer
from headgate.log.recovery import LogRecovery, RecoveryReport
from headgate.log.scanner import FrameProblem, FrameScanner
from headgate.log.term import TermFile, list_term_files
from headgate.log.term_table import TermTable

DEFAULT_TERM_LENGTH: Final = 16 * 1024 * 1024
"""Term length of a new log when none is given."""

DEFAULT_TERMS_PER_CAPACITY: Final = 4
"""A new log's capacity, when none is given, is this many terms."""

LOCK_FILE_NAME: Final = "writer.lock"


class StreamLog(Appender):
    """The single writer of one stream's log: append, group commit, release, read back.

    Open one with :meth:`open`. Appends write to the term files' page cache
    (``pwritev`` for large frames, stores into the map for small ones; reads
    go through memory maps of the same files) and never wait for the disk;
    :meth:`sync` makes them durable in groups; :meth:`release` frees the
    space a consumer is done with. Positions are byte offsets into the
    stream's whole history (see LOG.md).
    """

    def __init__(
        self,
        directory: Path,
        lock_fd: int,
        meta: MetadataPage,
        terms: dict[int, TermFile],
        tail: int,
        release: int,
    ) -> None:
        settings = meta.settings
        self._directory = directory
        self._lock_fd = lock_fd
        self._meta = meta
        self._recovery: RecoveryReport | None = None
        table = TermTable(directory, settings.term_length, terms, settings.capacity)
        self._scanner = FrameScanner(directory, settings.term_length, terms.get)
        self._preparer = TermPreparer(
            directory, settings.term_length, table.install_prepared, table.spares
        )
        super().__init__(
            table, meta, self._preparer, tail=tail, release=release, capacity=settings.capacity
        )
        self._commit = GroupCommit(table, meta, self, durable=tail)

    # --- opening and closing ------------------------------------------------

    @classmethod
    def open(
        cls,
        directory: str | os.PathLike[str],
        *,
        term_length: int | None = None,
        capacity: int | None = None,
        create: bool = True,
    ) -> StreamLog:
        """Open the log in ``directory``, creating it or recovering it as needed.

        Args:
            directory: One directory per stream; created if missing and ``create``.
            term_length: Bytes per term file, a power of two from 4 KiB to
                1 GiB (64 KiB or more outside tests). Default 16 MiB for a new
                log; an existing log keeps its own, and a different value
                given here is a :class:`LogError`.
            capacity: Most bytes between the release position and the tail,
                a multiple of 8 of at least a header. Default four terms. An
                existing log keeps its stored capacity.
            create: If false, a missing log is a :class:`LogError`.

        Reopening after a crash cuts off a torn tail and continues exactly
        after the last whole frame (see LOG.md, "Recovery"). A second writer
        on the same directory, in any process, gets a :class:`LogError`.
        """
        path = Path(directory)
        try:
            if not path.is_dir():
                if not create:
                    raise LogError(f"no stream log at {path}")
                path.mkdir(parents=True, exist_ok=True)
            lock_fd = _lock_directory(path)
        except OSError as exc:
            raise storage_error(f"cannot open the stream log at {path}", path, exc) from exc
        try:
            return cls._open_locked(path, lock_fd, term_length, capacity, create)
        except OSError as exc:
            os.close(lock_fd)
            raise storage_error(f"cannot open the stream log at {path}", path, exc) from exc
        except BaseException:
            os.close(lock_fd)
            raise

    @classmethod
    def _open_locked(
        cls,
        path: Path,
        lock_fd: int,
        term_length: int | None,
        capacity: int | None,
        create: bool,
    ) -> StreamLog:
        if term_length is not None:
            _check_term_length(term_length)
        if not (path / META_FILE_NAME).exists():
            if list_term_files(path):
                raise LogCorruptError(
                    path / META_FILE_NAME, 0, "metadata file is missing but term files exist"
                )
            if not create:
                raise LogError(f"no stream log at {path}")
            length = DEFAULT_TERM_LENGTH if term_length is None else term_length
            size = DEFAULT_TERMS_PER_CAPACITY * length if capacity is None else capacity
            check_capacity(size)
            meta = MetadataPage.create(path, Settings(length, size), HEADER_LENGTH)
            try:
                # Written ahead like every later term, so that the first
                # appends do not pay for block allocation either.
                if length >= MIN_PREPARED_TERM_LENGTH:
                    first = TermFile.prepare(path, 0, length)
                    first.install()
                else:
                    first = TermFile.create(path, 0, length)
            except BaseException:
                meta.close()
                raise
            log = cls(path, lock_fd, meta, {0: first}, tail=0, release=0)
            # Term 0's name reaches the disk with the first group commit. Should
            # it be lost before that, recovery recreates it: nothing was durable.
            log._table.mark_directory_dirty()
            return log

        meta = MetadataPage.open(path, HEADER_LENGTH, writable=True)
        try:
            stored = meta.settings
            try:
                _check_term_length(stored.term_length)
                check_capacity(stored.capacity)
            except LogError as exc:
                raise LogCorruptError(
                    meta.path, 16, f"stored settings are invalid: {exc}"
                ) from None
            if term_length is not None and term_length != stored.term_length:
                raise LogError(
                    f"{path} has term_length {stored.term_length}, not {term_length}; "
                    "the term length of an existing log cannot change"
                )
            recovered = LogRecovery(path, meta).run()
        except BaseException:
            meta.close()
            raise
        log = cls(path, lock_fd, meta, recovered.terms, recovered.tail, recovered.release)
        log._recovery = recovered.report
        return log

    def close(self) -> None:
        """Make everything appended durable, then close every file. Idempotent."""
        table = self._table
        with self._commit.lock:
            if table.closed:
                return
            try:
                self._commit.finish()
            finally:
                with table.lock:
                    table.closed = True
                    self._stop()
                    self._commit.wake_waiters()
                    for term in table.files.values():
                        term.close()
                    table.files.clear()
                self._preparer.close()
                self._commit.close()
                table.spares.close()
                self._meta.close()
                os.close(self._lock_fd)

    def __enter__(self) -> StreamLog:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # --- positions and capacity ---------------------------------------------

    @property
    def directory(self) -> Path:
        """The log's directory."""
        return self._directory

    @property
    def term_length(self) -> int:
        """Bytes per term file."""
        return self._term_length

    @property
    def recovery(self) -> RecoveryReport | None:
        """What recovery found when this existing log was opened; ``None`` for a new log."""
        return self._recovery

    @property
    def published_position(self) -> int:
        """What readers in other processes may read: every frame before it is committed.

        The writer publishes after every append, so this equals the tail; it is
        a separate name because readers see it through the metadata page.
        """
        return self._tail

    @property
    def durable_position(self) -> int:
        """Every frame before this position is on the device (fsynced)."""
        return self._commit.durable

    # --- durability -------------------------------------------------------------

    def sync(self) -> int:
        """Group commit: fsync what was appended, advance and store the durable position.

        Safe to call from a worker thread while the owner appends (see
        :mod:`headgate.log.group_commit`). Returns the new durable position.
        One chore rides along, after the durable position is out: term files
        that a release has freed are deleted, once that release is on disk.
        """
        return self._commit.sync()

    def delete_in_background(self) -> None:
        """From now on, term files freed by a release are deleted on a helper thread.

        :meth:`sync` then returns without waiting for their deletion (see
        :mod:`headgate.log.deleter`); :meth:`close` waits for it. Without
        this, :meth:`sync` deletes them itself before it returns.
        """
        self._commit.delete_in_background()

    def wait_durable(self, position: int, timeout: float | None = None) -> bool:
        """Block until ``position`` is durable; ``False`` on timeout or close.

        This only waits: some thread must be calling :meth:`sync`.
        """
        return self._commit.wait(position, timeout)

    # --- releasing ----------------------------------------------------------------

    def release(self, position: int) -> None:
        """Tell the log the consumer is done with everything before ``position``.

        ``position`` must be a frame boundary (a frame's ``position`` or
        ``end_position``, or the tail) from the release position to the
        durable position. The space is free at once; term files wholly before
        it are deleted at the next :meth:`sync`, after the new release
        position is on disk.
        """
        self._check_open()
        release, durable = self._release, self._commit.durable
        if not release <= position <= durable:
            raise LogError(
                f"cannot release to {position}: it must lie between the release position "
                f"{release} and the durable position {durable}"
            )
        if position != self._tail and term_offset_of(position, self._term_length) != 0:
            problem = self._scanner.check_frame(position)
            if problem is not None:
                raise LogError(
                    f"cannot release to {position}: not a frame boundary ({problem.reason})"
                )
        with self._table.lock:
            self._move_release(position)
            self._commit.store_release(position)

    def boundary_problem(self, position: int) -> str | None:
        """Why ``position`` is not a frame boundary of the log, or None if it is one.

        For a position from the release position to the durable position
        (what :meth:`release` accepts); the gateway checks a consumer's
        Release with it before anything moves.
        """
        self._check_open()
        release, durable = self._release, self._commit.durable
        if not release <= position <= durable:
            return f"outside [{release}, {durable}]"
        if position == self._tail or term_offset_of(position, self._term_length) == 0:
            return None
        problem = self._scanner.check_frame(position)
        return None if problem is None else problem.reason

    # --- reading back ---------------------------------------------------------------

    def read(
        self, start: int, end: int | None = None, *, max_bytes: int | None = None
    ) -> list[LogFrame]:
        """The data frames from ``start`` up to ``end`` (default: the tail), padding skipped.

        ``start`` must be a frame boundary at or after the release position.
        With ``max_bytes``, frames stop before ``end_position - start`` of the
        last one would exceed it, but at least one frame is returned if there
        is any. Payloads are read-only views over the mapped terms.
        """
        self._check_open()
        end = self._check_range(start, end)
        frames: list[LogFrame] = []
        try:
            for position, next_position, term, offset, header in self._scanner.frames(start, end):
                if frames and max_bytes is not None and next_position - start > max_bytes:
                    break
                frames.append(
                    LogFrame(
                        position,
                        next_position,
                        header[6],
                        header[7],
                        header[5],
                        header[8],
                        term.view[offset + HEADER_LENGTH : offset + header[0]].toreadonly(),
                    )
                )
        except FrameProblem as problem:
            raise _problem_error(problem, start) from None
        except ValueError as exc:
            raise LogError(f"end {end} is not a frame boundary: {exc}") from None
        return frames

    def scan_headers(
        self, start: int, end: int | None = None, *, verify: bool = True
    ) -> Iterator[FrameHeader]:
        """Headers of the data frames from ``start`` to ``end`` (default: the tail).

        For rebuilding per-producer state (last sequence per producer) after
        a restart. With ``verify`` false, payload checksums are skipped and
        the cost is a few header fields per frame.
        """
        self._check_open()
        end = self._check_range(start, end)
        try:
            for position, next_position, _, _, header in self._scanner.frames(
                start, end, verify=verify
            ):
                yield FrameHeader(
                    position, next_position, header[6], header[7], header[5], header[8]
                )
        except FrameProblem as problem:
            raise _problem_error(problem, start) from None
        except ValueError as exc:
            raise LogError(f"end {end} is not a frame boundary: {exc}") from None

    def _check_range(self, start: int, end: int | None) -> int:
        tail = self._tail
        release = self._release
        if end is None:
            end = tail
        if not release <= start <= end <= tail:
            raise LogError(
                f"cannot read [{start}, {end}): need release position {release} "
                f"<= start <= end <= tail {tail}"
            )
        if normalize_position(start, self._term_length, HEADER_LENGTH) != start:
            raise LogError(f"cannot read from {start}: not a frame boundary")
        return end

    def _check_open(self) -> None:
        self._table.check_open()

    def __repr__(self) -> str:
        return (
            f"<StreamLog {self._directory} release={self.release_position} "
            f"durable={self.durable_position} tail={self.tail_position} "
            f"capacity={self.capacity}>"
        )


def _problem_error(problem: FrameProblem, start: int) -> LogError:
    if problem.position == start:
        return LogError(
            f"no intact frame at position {start}: not a frame boundary, or damaged "
            f"({problem.path} at byte offset {problem.offset}: {problem.reason})"
        )
    return LogCorruptError(problem.path, problem.offset, problem.reason)


def _lock_directory(path: Path) -> int:
    fd = try_lock(path / LOCK_FILE_NAME)
    if fd is None:
        raise LogError(f"the stream log at {path} is already open by another writer")
    return fd


def _check_term_length(term_length: int) -> None:
    if (
        term_length < MIN_TERM_LENGTH
        or term_length > MAX_TERM_LENGTH
        or term_length & (term_length - 1)
    ):
        raise LogError(
            f"term_length must be a power of two from {MIN_TERM_LENGTH} to "
            f"{MAX_TERM_LENGTH}, got {term_length}"
        )
