"""The frame: the unit the log appends, commits, checksums and reads back.

Every frame starts with a 40-byte header (little-endian)::

      0                   1                   2                   3
      0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
     +---------------------------------------------------------------+
   0 |                      Frame Length (u32)                       |
     +---------------------------------------------------------------+
   4 |                       Checksum (u32)                          |
     +-------------------------------+---------------+---------------+
   8 |           Type (u16)          |  Flags (u8)   |  Version (u8) |
     +-------------------------------+---------------+---------------+
  12 |                      Record Count (u32)                       |
     +---------------------------------------------------------------+
  16 |                      Producer Id (u64)                        |
     |                                                               |
     +---------------------------------------------------------------+
  24 |                    First Sequence (u64)                       |
     |                                                               |
     +---------------------------------------------------------------+
  32 |                   Timestamp, microseconds (i64)               |
     |                                                               |
     +---------------------------------------------------------------+
  40 |                          Payload ...                          |
     +---------------------------------------------------------------+

*Frame Length* counts the header and the payload but not the alignment gap
after it; the next frame starts at ``align(length, FRAME_ALIGNMENT)``. It is
written last, after every other byte of the frame, together with the checksum
as one 8-byte *commit word* (one aligned 8-byte slice assignment; never
``pack_into``, which zero-fills its target first). A frame whose length is zero has not been
committed yet, and nothing after it has either. Should the two halves of the
commit word ever become visible separately, a reader sees a length with a
stale checksum, which fails: torn, never wrong.

*Checksum* is CRC-32 (``zlib.crc32``) of bytes ``[8, length)`` of a data frame
(every header field after the checksum, and the payload), started from
:func:`checksum_seed` of the frame's position. A padding frame covers only
``[8, 40)``: its body is never written. The length is covered indirectly (a
different length covers a different byte range) and the position through the
seed, so a frame copied to the wrong place, or a term file given the wrong
name, fails its checksum instead of being read at a wrong position.

Alignment is 8 bytes. Every header field is then naturally aligned, frames
waste at most 7 bytes (a 100-byte payload costs 144 bytes; with 32-byte
alignment it would cost 160, and guarantees are counted in log bytes), and 8
divides 512, so no 8-byte word straddles a disk sector. The price is that a
term can end with fewer bytes than a header: no padding frame fits there, and
the rule "no frame starts in the last HEADER_LENGTH - 1 bytes of a term"
(implicit padding, :func:`~headgate.log.position.normalize_position`) covers it
with nothing written and nothing to corrupt.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Final, NamedTuple

FRAME_ALIGNMENT: Final = 8
"""Every frame starts at a multiple of this many bytes (see the module docstring)."""

HEADER_LENGTH: Final = 40
"""Bytes of header in front of every payload."""

LENGTH_OFFSET: Final = 0
CHECKSUM_OFFSET: Final = 4
TYPE_OFFSET: Final = 8
RECORD_COUNT_OFFSET: Final = 12
PRODUCER_ID_OFFSET: Final = 16
FIRST_SEQUENCE_OFFSET: Final = 24
TIMESTAMP_OFFSET: Final = 32

DATA_FRAME: Final = 0x0001
"""Type of a frame that carries one producer batch."""

PADDING_FRAME: Final = 0x00FE
"""Type of the frame that fills the end of a term the next frame did not fit in."""

FORMAT_VERSION: Final = 1
"""Frame format version; a reader refuses frames of a version it does not know."""

HEADER: Final = struct.Struct("<IIHBBIQQq")
"""The whole header, for reading: length, checksum, type, flags, version, count, ids, time."""

HEADER_BODY: Final = struct.Struct("<HBBIQQq")
"""The header after the checksum (bytes 8..40), written before the checksum and length."""

COMMIT: Final = struct.Struct("<II")
"""The commit word: length and checksum, stored together last, as one aligned 8-byte store."""

MAX_U32: Final = 0xFFFF_FFFF
MAX_U64: Final = 0xFFFF_FFFF_FFFF_FFFF


def frame_cost(payload_length: int) -> int:
    """Log bytes one data frame with ``payload_length`` bytes of payload takes.

    This is what the frame moves the tail by when it fits in the current term.
    Producers count guarantees with it. An append that does not fit in the
    rest of the current term also uses up that rest as padding; see
    :meth:`~headgate.log.StreamLog.append_cost`.
    """
    return (HEADER_LENGTH + payload_length + FRAME_ALIGNMENT - 1) & -FRAME_ALIGNMENT


def checksum_seed(position: int) -> int:
    """The CRC-32 starting value for the frame at ``position``.

    Folding the high half onto the low half gives different seeds to any two
    positions with the same term offset that are less than 4 GiB apart (their
    low halves differ in bits above the offset, while the XOR of two adjacent
    high halves is an all-ones mask that includes bit 0), which is what catches
    a misnamed term file or a frame copied to another term.
    """
    return (position ^ (position >> 32)) & MAX_U32


def padding_checksum(body: bytes | memoryview, position: int) -> int:
    """The checksum of a padding frame whose header bytes 8..40 are ``body``."""
    return zlib.crc32(body, checksum_seed(position))


def frame_problem(length: int, frame_type: int, flags: int, version: int, space: int) -> str | None:
    """Why a header with these fields cannot be a committed frame, or ``None`` if it can.

    ``space`` is how many bytes the term holds from the frame's start to the
    term's end. The checksum is checked separately, because it costs a pass
    over the payload.
    """
    if length == 0:
        return "no frame committed here (length 0)"
    if length < HEADER_LENGTH:
        return f"frame length {length} is shorter than a {HEADER_LENGTH}-byte header"
    if length > space:
        return f"frame length {length} runs past the end of the term ({space} bytes left)"
    if version != FORMAT_VERSION:
        return f"unknown frame version {version}"
    if flags != 0:
        return f"unknown frame flags {flags:#x}"
    if frame_type == DATA_FRAME:
        return None
    if frame_type == PADDING_FRAME:
        if length != space:
            return f"padding frame of {length} bytes does not end the term ({space} bytes left)"
        return None
    return f"unknown frame type {frame_type:#x}"


def padding_body() -> bytes:
    """Header bytes 8..40 of a padding frame (its only checksummed bytes)."""
    return HEADER_BODY.pack(PADDING_FRAME, 0, FORMAT_VERSION, 0, 0, 0, 0)


@dataclass(frozen=True, slots=True)
class LogFrame:
    """One committed data frame, as a reader gets it back."""

    #: Position of the frame's first byte.
    position: int
    #: Position right after the frame: where the next frame (or padding) starts.
    end_position: int
    #: The producer that sent the batch.
    producer_id: int
    #: Sequence number of the batch's first record.
    first_sequence: int
    #: How many records the batch holds.
    record_count: int
    #: When the gateway accepted the batch, in microseconds since the epoch.
    timestamp_us: int
    #: The batch bytes: a read-only view over the mapped term, not a copy.
    payload: memoryview


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """The header of one committed data frame, without its payload."""

    #: Position of the frame's first byte.
    position: int
    #: Position right after the frame.
    end_position: int
    #: The producer that sent the batch.
    producer_id: int
    #: Sequence number of the batch's first record.
    first_sequence: int
    #: How many records the batch holds.
    record_count: int
    #: When the gateway accepted the batch, in microseconds since the epoch.
    timestamp_us: int


class AppendResult(NamedTuple):
    """Where an append put its frame."""

    #: Position of the frame's first byte.
    position: int
    #: Position after the frame: the new tail, and the frame's ``end_position``.
    end_position: int
