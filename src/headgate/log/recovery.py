"""Recovery: reopening a log after its writer stopped, cleanly or not.

The writer may have been killed at any instruction, or the machine may have
lost power. Recovery finds the last committed, intact frame, cuts off what
follows, and leaves the log ready to continue exactly there. The rules (and
why each is safe) are in LOG.md, "Recovery"; in short:

1. The durable/release pair in the metadata page is believed only if its
   checksum holds, and then only as a lower bound for the tail.
2. The scan starts at the durable position (a frame boundary, below which
   everything was fsynced before it was stored) and checks every frame's
   checksum until the first one that is not whole and intact: that is the tail.
3. A tail below the durable position means history that was reported durable
   is damaged: :class:`LogCorruptError`, naming the file and offset.
4. Everything after the tail is zeroed (in the tail's term) or deleted (later
   terms), made durable, and only then are the positions rewritten.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from headgate.log.errors import LogCorruptError
from headgate.log.frame import FRAME_ALIGNMENT, HEADER_LENGTH
from headgate.log.metadata import POSITIONS_OFFSET, MetadataPage
from headgate.log.position import (
    MAX_POSITION,
    normalize_position,
    term_id_of,
    term_offset_of,
    term_start,
)
from headgate.log.scanner import FrameProblem, FrameScanner
from headgate.log.term import TermFile, fsync_directory, list_term_files, term_file_name

#: Bytes compared (and zeroed) at a time after the tail: a slice of the map is
#: a ``memcpy`` and the comparison a ``memcmp``, both in C.
_ZERO_CHUNK: Final = bytes(1024 * 1024)


@dataclass(frozen=True, slots=True, kw_only=True)
class RecoveryReport:
    """What recovery found when a log was reopened, for the operator's log."""

    #: Where appends continue.
    tail: int
    #: The release position recovery settled on.
    release: int
    #: Where the frame-by-frame check started (the durable position).
    scanned_from: int
    #: Whether the stored durable/release pair passed its checksum.
    positions_trusted: bool
    #: Why the frame at the tail was not accepted, if it was not simply empty:
    #: a torn or half-written frame that was cut off.
    cut: str | None
    #: Bytes after the tail that were not zero and were zeroed: a frame the
    #: writer had begun but not committed, or the remains of one cut off.
    zeroed_bytes: int


@dataclass(slots=True)
class RecoveredLog:
    """The state a writer continues from."""

    #: Open, full-size term files from the release position's term to the tail's term.
    terms: dict[int, TermFile]
    #: The next append position; every frame before it is whole, intact and durable.
    tail: int
    #: The release position (space before it is free).
    release: int
    #: What recovery found.
    report: RecoveryReport


class LogRecovery:
    """Recovers one log directory whose writer lock the caller holds."""

    def __init__(self, directory: Path, meta: MetadataPage) -> None:
        self._directory = directory
        self._meta = meta
        self._term_length = meta.settings.term_length
        self._shift = self._term_length.bit_length() - 1
        self._files = list_term_files(directory)
        self._open: dict[int, TermFile] = {}
        self._created = False
        self._extended = False

    def run(self) -> RecoveredLog:
        """Recover; on any error every file this opened is closed again."""
        try:
            return self._run()
        except BaseException:
            for term in self._open.values():
                term.close()
            raise

    def _run(self) -> RecoveredLog:
        shift = self._shift
        stored = self._meta.stored_positions()
        if stored is not None:
            durable, release = stored
            self._check_stored(durable, release)
        elif self._files:
            # The pair is torn or damaged. The oldest term start is the only
            # boundary left to trust; frames are then checked from there on.
            durable = release = term_start(min(self._files), shift)
        else:
            raise LogCorruptError(
                self._meta.path,
                POSITIONS_OFFSET,
                "durable/release positions fail their checksum and no term files exist",
            )

        first_term = term_id_of(release, shift)
        for term_id in [t for t in self._files if t < first_term]:
            # Released terms whose removal a crash interrupted.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._files.pop(term_id))

        scanner = FrameScanner(self._directory, self._term_length, self._lookup)
        # Frames before the durable position were fsynced before it was
        # stored: only what came after can be torn (see LOG.md, "What
        # recovery reads"). Their file must still reach that far.
        scan_from = max(durable, release)
        self._check_reaches(scan_from, durable)
        # Asked before the scan reads anything: readahead of the scan's reads
        # fills the page cache with zeros past the tail, which then counts
        # as data (see _data_ranges); what is a hole now stays zeros.
        ranges = self._data_ranges_from(scan_from)
        tail, cut = self._find_tail(scanner, scan_from, durable)
        tail_term = term_id_of(tail, shift)

        # History between the release and the scan start was not rescanned
        # (the durable hint is there for speed), but its files must be whole.
        for term_id in range(first_term, tail_term):
            term = self._lookup(term_id)
            if term is None:
                raise LogCorruptError(
                    self._directory / term_file_name(term_id), 0, "term file is missing"
                )
            if term.size != self._term_length:
                raise LogCorruptError(
                    term.path,
                    term.size,
                    f"term file is truncated to {term.size} bytes of {self._term_length}",
                )

        zeroed = self._cut_after(tail, tail_term, ranges.get(tail_term))
        # Frames after the old durable position may still be only in the page
        # cache (a killed process leaves them there); from here on they count
        # as durable, so they go to disk first. Older terms already are, and
        # after a clean close there is nothing to write at all.
        if tail != durable or zeroed or self._extended:
            for term_id in range(term_id_of(scan_from, shift), tail_term + 1):
                self._open[term_id].sync()
        if self._created:
            fsync_directory(self._directory)
        self._meta.store_published(tail)
        if stored != (tail, release):
            self._meta.store_positions(tail, release)
            self._meta.sync()
        report = RecoveryReport(
            tail=tail,
            release=release,
            scanned_from=scan_from,
            positions_trusted=stored is not None,
            cut=cut,
            zeroed_bytes=zeroed,
        )
        return RecoveredLog(terms=dict(self._open), tail=tail, release=release, report=report)

    def _check_stored(self, durable: int, release: int) -> None:
        term_length = self._term_length
        if not (
            0 <= release <= durable <= MAX_POSITION
            and release % FRAME_ALIGNMENT == 0
            and durable % FRAME_ALIGNMENT == 0
            and normalize_position(release, term_length, HEADER_LENGTH) == release
            and normalize_position(durable, term_length, HEADER_LENGTH) == durable
        ):
            raise LogCorruptError(
                self._meta.path,
                POSITIONS_OFFSET,
                f"stored positions durable={durable} release={release} are impossible",
            )

    def _check_reaches(self, position: int, durable: int) -> None:
        """The term file holding ``position`` must exist up to it (a term start needs nothing)."""
        offset = term_offset_of(position, self._term_length)
        if offset == 0:
            return
        term_id = term_id_of(position, self._shift)
        term = self._lookup(term_id)
        if term is None:
            raise LogCorruptError(
                self._directory / term_file_name(term_id),
                0,
                f"term file is missing; positions up to {durable} were reported durable",
            )
        if term.size < offset:
            raise LogCorruptError(
                term.path,
                term.size,
                f"term file is truncated to {term.size} bytes; "
                f"positions up to {durable} were reported durable",
            )

    def _find_tail(self, scanner: FrameScanner, start: int, durable: int) -> tuple[int, str | None]:
        try:
            for _ in scanner.frames(start, MAX_POSITION):
                pass
        except FrameProblem as problem:
            if problem.position < durable:
                raise LogCorruptError(
                    problem.path,
                    problem.offset,
                    f"{problem.reason}; positions up to {durable} were reported durable",
                ) from None
            committed_nothing = problem.reason.startswith("no frame committed")
            return problem.position, None if committed_nothing else problem.reason
        raise AssertionError("the scan ends at a problem")  # pragma: no cover

    def _data_ranges_from(self, position: int) -> dict[int, list[tuple[int, int]]]:
        """Per term file from ``position`` on, the ranges that may not be zeros."""
        first = term_id_of(position, self._shift)
        ranges = {}
        for term_id, path in self._files.items():
            if term_id < first:
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                start = term_offset_of(position, self._term_length) if term_id == first else 0
                ranges[term_id] = list(_data_ranges(fd, start, self._term_length))
            finally:
                os.close(fd)
        return ranges

    def _cut_after(self, tail: int, tail_term: int, ranges: list[tuple[int, int]] | None) -> int:
        """Zero the tail's term after the tail, delete later terms, create the tail's term.

        ``ranges`` are the tail term's data ranges before the scan (None: not known).
        """
        for term_id in [t for t in self._files if t > tail_term]:
            term = self._open.pop(term_id, None)
            if term is not None:
                term.close()
            os.unlink(self._files.pop(term_id))
        term = self._lookup(tail_term)
        if term is None:
            term = TermFile.create(self._directory, tail_term, self._term_length)
            self._files[tail_term] = term.path
            self._open[tail_term] = term
            self._created = True
            return 0
        if term.size < self._term_length:
            term.extend(self._term_length)
            self._extended = True
        start = term_offset_of(tail, self._term_length)
        if ranges is None:
            ranges = list(_data_ranges(term.fd, start, self._term_length))
        return _zero_after(term, [(max(a, start), b) for a, b in ranges if b > start])

    def _lookup(self, term_id: int) -> TermFile | None:
        term = self._open.get(term_id)
        if term is not None:
            return term
        path = self._files.get(term_id)
        if path is None:
            return None
        term = TermFile.open(path, term_id, writable=True)
        if term.size > self._term_length:
            term.close()
            raise LogCorruptError(
                path, self._term_length, f"term file is {term.size} bytes, longer than a term"
            )
        self._open[term_id] = term
        return term


def _zero_after(term: TermFile, ranges: list[tuple[int, int]]) -> int:
    """Zero every non-zero byte of ``term`` in ``ranges``; return how many there were.

    The ranges are those the file system reports as data (see
    :func:`_data_ranges`): after the tail a term is nearly always untouched
    reserved space, so this costs a few system calls instead of reading up
    to a whole term per stream.
    """
    zeroed = 0
    mapped = term.mapped
    chunk = len(_ZERO_CHUNK)
    for first, last in ranges:
        for offset in range(first, last, chunk):
            stop = min(offset + chunk, last)
            held = mapped[offset:stop]
            if held != _ZERO_CHUNK[: stop - offset]:
                zeroed += stop - offset - held.count(0)
                term.view[offset:stop] = _ZERO_CHUNK[: stop - offset]
    return zeroed


def _data_ranges(fd: int, start: int, end: int) -> Iterator[tuple[int, int]]:
    """The ranges of ``[start, end)`` that may hold a byte other than zero.

    ``lseek(SEEK_DATA)`` and ``SEEK_HOLE`` name the file's holes, and a hole
    reads as zeros by definition: whatever is not in a hole is reported as
    data, including pages only in the page cache (a killed writer's last
    frames, stored or written but never written back). Reserved, unwritten
    extents that nobody wrote or read count as holes on ext4, XFS and tmpfs.
    A file system that cannot tell reports everything as data, or refuses
    (``EINVAL``); then the whole range is read.
    """
    offset = start
    while offset < end:
        try:
            data = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: only holes from here to the end
                yield offset, end
            return
        if data >= end:
            return
        hole = min(os.lseek(fd, data, os.SEEK_HOLE), end)
        yield data, hole
        offset = hole
