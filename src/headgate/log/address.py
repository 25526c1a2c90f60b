"""A record's address: the position of its batch in the log, and its index in that batch.

A log position names a frame (one batch of records as a producer sent it),
not a record: three records sent together share a position. The address
``POSITION:INDEX`` names one record, the way Kafka's offset does::

    4096:0   4096:1   4096:2   4224:0 ...
    \\___ one frame at 4096 ___/  the next frame

``POSITION`` alone means ``POSITION:0``, the first record of the frame (so
every position that was valid before addresses existed still is). What
``headgate tail --format json`` and the Spark source's rows show (columns
``position`` and ``index``) is what ``tail --from`` and ``startingOffsets``
take back. This module is the one place where an address is written and read;
whether a frame starts at the position, and holds a record at the index,
only the log can say (:meth:`RecordAddress.check_in_frame`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from headgate.log.position import MAX_POSITION

#: A batch holds at most 2**32 - 1 records (its count is a u32), so no index reaches this.
MAX_INDEX = (1 << 32) - 1

#: Digits only: no sign, no spaces or ``_`` inside (which ``int()`` would take).
_ADDRESS = re.compile(r"([0-9]+)(?::([0-9]+))?")

#: How an address is written, for messages.
ADDRESS_FORM = "POSITION or POSITION:INDEX"


class AddressError(ValueError):
    """Text that is not a record address, or an address no record has; says which."""


@dataclass(frozen=True, slots=True, order=True)
class RecordAddress:
    """One record: the log position of its frame and its index among the frame's records."""

    #: Where the record's frame starts in the stream's log (a frame boundary).
    position: int
    #: The record's index in its frame, from 0.
    index: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.position <= MAX_POSITION:
            raise AddressError(
                f"position {_shown(str(self.position))} is outside 0 to {MAX_POSITION}"
            )
        if not 0 <= self.index < MAX_INDEX:
            raise AddressError(f"index {_shown(str(self.index))} is outside 0 to {MAX_INDEX - 1}")

    @classmethod
    def parse(cls, text: str) -> RecordAddress:
        """``"4096"`` or ``"4096:2"``; :class:`AddressError` says what is wrong with others."""
        match = _ADDRESS.fullmatch(text.strip())
        if match is None:
            raise AddressError(f"{text!r} is not a record address ({ADDRESS_FORM})")
        position, index = _bounded(match[1], MAX_POSITION), _bounded(match[2] or "0", MAX_INDEX)
        if position > MAX_POSITION:
            raise AddressError(f"position {_shown(match[1])} is larger than a log position can be")
        if index >= MAX_INDEX:
            raise AddressError(f"index {_shown(match[2])} is larger than a batch can hold")
        return cls(position, index)

    def __str__(self) -> str:
        """``POSITION:INDEX``, or ``POSITION`` alone for the first record of a frame."""
        return f"{self.position}:{self.index}" if self.index else str(self.position)

    def check_in_frame(self, stream: str, frame_position: int, record_count: int) -> None:
        """Raise :class:`AddressError` unless the frame found at ``position`` holds this record.

        ``frame_position`` is where the first frame at or after ``position``
        starts; another value means ``position`` is inside a frame.
        """
        if frame_position != self.position:
            raise AddressError(
                f"position {self.position} is not where a batch of {stream!r} starts "
                f"(the next one starts at {frame_position})"
            )
        if self.index >= record_count:
            raise AddressError(
                f"record address {self} is past the end of its batch in {stream!r}: the batch "
                f"at position {self.position} holds {record_count} record"
                f"{'' if record_count == 1 else 's'} (indexes 0 to {record_count - 1})"
            )


def _bounded(digits: str, limit: int) -> int:
    """The number ``digits`` says, or ``limit + 1`` for one with more digits than ``limit``.

    ``int()`` of a few thousand digits costs quadratic time, and Python refuses
    more than 4,300 with its own ValueError: a hostile address gets neither.
    """
    digits = digits.lstrip("0") or "0"
    return limit + 1 if len(digits) > len(str(limit)) else int(digits)


def _shown(digits: str) -> str:
    """Digits for a message, cut short when a hostile input is long."""
    return digits if len(digits) <= 40 else f"{digits[:20]}...({len(digits)} digits)"
