"""Position arithmetic: pure functions between log positions and (term id, term offset).

A *position* is a 64-bit byte offset into the stream's whole history, as if
every term were laid end to end::

    position = term_id * term_length + term_offset

Term lengths are powers of two, so the split is a shift and a mask. Term ids
start at 0 and only grow; a term file is named after its id, so a position
names exactly one file and one offset in it, forever.

Frames are aligned to :data:`~headgate.log.frame.FRAME_ALIGNMENT` and never
cross a term. When less than a frame header is left at the end of a term, no
frame fits there, not even padding, so the next frame starts at the next term.
:func:`normalize_position` maps such a position to that next term start.
"""

from __future__ import annotations

MIN_TERM_LENGTH = 4 * 1024
"""Smallest term length; real logs use 64 KiB or more, tests use 4 KiB."""

MAX_TERM_LENGTH = 1024 * 1024 * 1024
"""Largest term length: frame lengths are 32-bit and one term is one mmap."""

MAX_POSITION = (1 << 63) - 1
"""Positions are signed 64-bit on disk (readers in other languages use int64)."""


def position_bits_to_shift(term_length: int) -> int:
    """The shift that turns a position into its term id (``log2(term_length)``)."""
    return term_length.bit_length() - 1


def compute_position(term_id: int, term_offset: int, shift: int) -> int:
    """The position of ``term_offset`` inside term ``term_id``."""
    return (term_id << shift) + term_offset


def term_id_of(position: int, shift: int) -> int:
    """The id of the term that holds ``position``."""
    return position >> shift


def term_offset_of(position: int, term_length: int) -> int:
    """The byte offset of ``position`` inside its term."""
    return position & (term_length - 1)


def term_start(term_id: int, shift: int) -> int:
    """The position of the first byte of term ``term_id``."""
    return term_id << shift


def align(value: int, alignment: int) -> int:
    """``value`` rounded up to a multiple of ``alignment`` (a power of two)."""
    return (value + alignment - 1) & -alignment


def normalize_position(position: int, term_length: int, header_length: int) -> int:
    """The position where the frame at or after ``position`` can start.

    Identity, except in the last ``header_length - 1`` bytes of a term: no
    frame header fits there, so the log skips to the next term without
    writing anything (see LOG.md, "implicit padding").
    """
    offset = position & (term_length - 1)
    if offset and term_length - offset < header_length:
        return position - offset + term_length
    return position
