"""Walking committed frames by position, checking each one on the way.

The writer's reads, the cross-process reader, recovery and the header scan all
walk the log the same way: start at a frame boundary, check the frame there,
skip padding to the next term, step to the next aligned boundary. The walk
stops with a :class:`FrameProblem` at the first frame that is not a whole,
committed, intact frame; what that means (the tail, a frame not visible yet,
or corruption) is for the caller to decide.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

from headgate.log.frame import (
    DATA_FRAME,
    FORMAT_VERSION,
    FRAME_ALIGNMENT,
    HEADER,
    HEADER_LENGTH,
    MAX_U32,
    TYPE_OFFSET,
    frame_problem,
)
from headgate.log.position import normalize_position
from headgate.log.term import TermFile, term_file_name

TermLookup = Callable[[int], TermFile | None]
"""Gives the open term file for a term id, or ``None`` if there is no such file."""

RawHeader = tuple[int, int, int, int, int, int, int, int, int]
"""A header as :data:`~headgate.log.frame.HEADER` unpacks it."""

_ALIGN_MASK: Final = -FRAME_ALIGNMENT


class FrameProblem(Exception):
    """The walk met something that is not a committed, intact frame."""

    def __init__(self, position: int, path: Path, offset: int, reason: str) -> None:
        super().__init__(f"position {position} ({path} at byte offset {offset}): {reason}")
        #: Where the frame was expected.
        self.position = position
        #: The term file that should hold it.
        self.path = path
        #: Its byte offset in that file.
        self.offset = offset
        #: What is wrong there.
        self.reason = reason


class FrameScanner:
    """Walks committed data frames of one log, whose terms a lookup function provides."""

    __slots__ = ("_mask", "_shift", "_term_length", "_terms", "directory")

    def __init__(self, directory: Path, term_length: int, terms: TermLookup) -> None:
        self.directory = directory
        self._term_length = term_length
        self._shift = term_length.bit_length() - 1
        self._mask = term_length - 1
        self._terms = terms

    def frames(
        self, position: int, end: int, *, verify: bool = True
    ) -> Iterator[tuple[int, int, TermFile, int, RawHeader]]:
        """Data frames from ``position`` (a boundary) until ``end``.

        Yields ``(position, end_position, term, term_offset, header)`` and skips
        padding. Raises :class:`FrameProblem` where a frame is missing or bad,
        and ``ValueError`` if a frame runs past ``end`` (``end`` is then not a
        boundary). With ``verify`` off, payload checksums are not computed, so
        a header walk costs nothing per payload byte.
        """
        term_length = self._term_length
        shift = self._shift
        mask = self._mask
        crc32 = zlib.crc32
        unpack_from = HEADER.unpack_from
        term: TermFile | None = None
        term_id = -1
        while position < end:
            if position >> shift != term_id:
                term_id = position >> shift
                term = self._terms(term_id)
                if term is None:
                    raise FrameProblem(
                        position, self._term_path(term_id), 0, "term file is missing"
                    )
            assert term is not None
            offset = position & mask
            space = term_length - offset
            if term.size - offset < HEADER_LENGTH:
                raise FrameProblem(
                    position,
                    term.path,
                    offset,
                    f"term file ends at byte {term.size}, before a frame header",
                )
            header: RawHeader = unpack_from(term.buffer, offset)  # type: ignore[arg-type]
            length, checksum, frame_type, flags, version = header[:5]
            if not (
                frame_type == DATA_FRAME
                and version == FORMAT_VERSION
                and flags == 0
                and HEADER_LENGTH <= length <= space
            ):
                problem = frame_problem(length, frame_type, flags, version, space)
                if problem is None and length > term.size - offset:
                    problem = f"frame runs past the end of the file (byte {term.size})"
                if problem is not None:
                    raise FrameProblem(position, term.path, offset, problem)
                # A padding frame: only its header is checksummed.
                body = term.view[offset + TYPE_OFFSET : offset + HEADER_LENGTH]
                if crc32(body, (position ^ (position >> 32)) & MAX_U32) != checksum:
                    raise FrameProblem(position, term.path, offset, "padding checksum mismatch")
                position += space
                continue
            if length > term.size - offset:
                raise FrameProblem(
                    position,
                    term.path,
                    offset,
                    f"frame runs past the end of the file (byte {term.size})",
                )
            if (
                verify
                and crc32(
                    term.view[offset + TYPE_OFFSET : offset + length],
                    (position ^ (position >> 32)) & MAX_U32,
                )
                != checksum
            ):
                raise FrameProblem(position, term.path, offset, "checksum mismatch")
            next_position = position + ((length + FRAME_ALIGNMENT - 1) & _ALIGN_MASK)
            next_position = normalize_position(next_position, term_length, HEADER_LENGTH)
            if next_position > end:
                raise ValueError(
                    f"the frame at position {position} ends at {next_position}, past {end}"
                )
            yield position, next_position, term, offset, header
            position = next_position

    def check_frame(self, position: int) -> FrameProblem | None:
        """Whether a committed, intact frame (data or padding) starts at ``position``."""
        try:
            for _ in self.frames(position, position + self._term_length):
                break
        except FrameProblem as problem:
            if problem.position == position:
                return problem
        except ValueError:
            pass
        return None

    def _term_path(self, term_id: int) -> Path:
        return self.directory / term_file_name(term_id)
