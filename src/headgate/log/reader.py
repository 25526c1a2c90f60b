"""LogReader: reading a stream's log from another process while the writer appends.

A Spark executor opens a ``LogReader`` on the stream's directory and reads
frames by position. It takes no locks and writes nothing. It reads the
published position from the metadata page, then walks frames up to it,
checking every frame's checksum. The writer commits a frame's bytes before its
length and its length before the published position, but Python gives no
memory barriers, so on a weakly ordered CPU the reader may briefly see a
published position ahead of the bytes it covers. Such a view is torn, never
silently wrong: the length is still zero or the checksum fails. The reader then
retries a bounded number of times before it calls the frame corrupt. LOG.md,
"Ordering", has the whole argument.

The writer recycles freed term files (:mod:`headgate.log.term`): a term this
reader still maps may be cleared to zeros and refilled with other positions
once the writer's release passes it. So after every read the reader looks at
the release position again, and if it has passed ``start`` the read is a
:class:`LogError` ("freed while being read") rather than frames whose bytes
may already have changed under their views.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import TracebackType
from typing import Final

from headgate.log.errors import LogCorruptError, LogError
from headgate.log.frame import HEADER_LENGTH, LogFrame
from headgate.log.metadata import MetadataPage
from headgate.log.position import MAX_TERM_LENGTH, MIN_TERM_LENGTH, normalize_position, term_id_of
from headgate.log.scanner import FrameProblem, FrameScanner
from headgate.log.term import TermFile, term_file_name

RETRY_ATTEMPTS: Final = 60
"""How many times a read looks again at a frame that is not (yet) whole below the published
position: 20 immediate retries, then 2 ms apart, about 0.1 s in all."""

_IMMEDIATE_RETRIES: Final = 20
_RETRY_PAUSE: Final = 0.002


class LogReader:
    """Reads frames by position from a log another process is writing; read-only, lock-free.

    Open one with :meth:`open`. Positions come from the writer (a frame's
    ``position`` and ``end_position``, the published position); any frame
    boundary at or after :meth:`start_position` can be read from.
    """

    def __init__(self, directory: Path, meta: MetadataPage) -> None:
        self._directory = directory
        self._meta = meta
        self._published_seen = 0
        self._term_length = meta.settings.term_length
        self._shift = self._term_length.bit_length() - 1
        self._terms: dict[int, TermFile] = {}
        self._scanner = FrameScanner(directory, self._term_length, self._term)
        self._closed = False

    @classmethod
    def open(cls, directory: str | Path) -> LogReader:
        """Open the log in ``directory`` for reading; it must exist."""
        path = Path(directory)
        meta = MetadataPage.open(path, HEADER_LENGTH, writable=False)
        term_length = meta.settings.term_length
        if (
            term_length < MIN_TERM_LENGTH
            or term_length > MAX_TERM_LENGTH
            or term_length & (term_length - 1)
        ):
            meta.close()
            raise LogCorruptError(meta.path, 16, f"stored term length {term_length} is invalid")
        return cls(path, meta)

    @property
    def directory(self) -> Path:
        """The log's directory."""
        return self._directory

    @property
    def term_length(self) -> int:
        """Bytes per term file."""
        return self._term_length

    def published_position(self) -> int:
        """Every frame before this position is committed; read fresh from the metadata page."""
        self._check_open()
        return self._published()

    def _published(self) -> int:
        # The writer only moves the published position forward. A smaller value
        # than one already seen can only be a store caught half-way (the writer
        # stores it in one 8-byte copy, which x86-64 makes a single store, but
        # nothing in Python promises that), so the larger value stands.
        value = self._meta.published
        if value < self._published_seen:
            return self._published_seen
        self._published_seen = value
        return value

    def durable_position(self) -> int:
        """Every frame before this position is on the device.

        A consumer that must never see a frame that a power failure could
        still take away (and a producer then send again) reads up to here
        rather than up to the published position.
        """
        self._check_open()
        return self._meta.read_positions().durable

    def start_position(self) -> int:
        """The oldest position still retained: the writer's release position."""
        self._check_open()
        return self._meta.read_positions().release

    def read(
        self, start: int, end: int | None = None, *, max_bytes: int | None = None
    ) -> list[LogFrame]:
        """The data frames from ``start`` up to ``end`` (default: published), padding skipped.

        ``start`` must be a frame boundary at or after :meth:`start_position`,
        and ``end`` at most the published position. With ``max_bytes``, frames
        stop before ``end_position - start`` of the last one would exceed it,
        but at least one frame is returned if there is any. Payloads are views
        over the mapped terms: copy what must outlive :meth:`close`.
        """
        self._check_open()
        published = self._published()
        if end is None:
            end = published
        release = self._meta.read_positions().release
        if not release <= start <= end <= published:
            raise LogError(
                f"cannot read [{start}, {end}) from {self._directory}: need start position "
                f"{release} <= start <= end <= published position {published}"
            )
        if normalize_position(start, self._term_length, HEADER_LENGTH) != start:
            raise LogError(f"cannot read from {start}: not a frame boundary")
        self._forget_terms_before(release)

        frames: list[LogFrame] = []
        resume = start
        for attempt in range(RETRY_ATTEMPTS):
            try:
                for position, next_position, term, offset, header in self._scanner.frames(
                    resume, end
                ):
                    if frames and max_bytes is not None and next_position - start > max_bytes:
                        return self._still_retained(frames, start)
                    frames.append(
                        LogFrame(
                            position,
                            next_position,
                            header[6],
                            header[7],
                            header[5],
                            header[8],
                            term.view[offset + HEADER_LENGTH : offset + header[0]],
                        )
                    )
                return self._still_retained(frames, start)
            except FrameProblem as problem:
                resume = problem.position
                # The file may have been replaced (a writer that recovered
                # from a crash recreates terms): look it up afresh next time.
                self._forget_term(term_id_of(resume, self._shift))
                if attempt + 1 < RETRY_ATTEMPTS:
                    time.sleep(0 if attempt < _IMMEDIATE_RETRIES else _RETRY_PAUSE)
                    continue
                raise self._give_up(problem, start) from None
            except ValueError as exc:
                raise LogError(f"end {end} is not a frame boundary: {exc}") from None
        raise AssertionError("unreachable")  # pragma: no cover

    def close(self) -> None:
        """Unmap every term and the metadata page. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for term in self._terms.values():
            term.close()
        self._terms.clear()
        self._meta.close()

    def __enter__(self) -> LogReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<LogReader {self._directory}>"

    def _still_retained(self, frames: list[LogFrame], start: int) -> list[LogFrame]:
        """``frames``, unless the writer released past ``start`` meanwhile.

        A freed term's file is recycled: cleared, then refilled with other
        positions, under mappings this reader may hold, so frames read from a
        range released during the read may no longer hold their bytes. The
        writer stores the release before it frees any file, so a release seen
        at or below ``start`` here means every byte read was still retained.
        """
        release = self._meta.read_positions().release
        if release > start:
            raise LogError(
                f"[{start}, ...) of {self._directory} was freed while being read "
                f"(the log now starts at {release}); read again from {release}"
            )
        return frames

    def _give_up(self, problem: FrameProblem, start: int) -> LogError:
        release = self._meta.read_positions().release
        if problem.position < release:
            return LogError(
                f"position {problem.position} of {self._directory} was released while "
                f"being read (the log now starts at {release})"
            )
        if problem.position == start:
            return LogError(
                f"no intact frame at position {start}: not a frame boundary, or damaged "
                f"({problem.path} at byte offset {problem.offset}: {problem.reason})"
            )
        return LogCorruptError(problem.path, problem.offset, problem.reason)

    def _term(self, term_id: int) -> TermFile | None:
        term = self._terms.get(term_id)
        if term is None:
            path = self._directory / term_file_name(term_id)
            try:
                term = TermFile.open(path, term_id, writable=False)
            except FileNotFoundError:
                return None
            self._terms[term_id] = term
        return term

    def _forget_term(self, term_id: int) -> None:
        term = self._terms.pop(term_id, None)
        if term is not None:
            term.close()

    def _forget_terms_before(self, position: int) -> None:
        first = term_id_of(position, self._shift)
        for term_id in [t for t in self._terms if t < first]:
            self._forget_term(term_id)

    def _check_open(self) -> None:
        if self._closed:
            raise LogError(f"the reader of {self._directory} is closed")
