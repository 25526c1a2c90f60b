"""The LCMUX frames' layouts, declared once, with a plain codec read from them.

codec.py encodes and decodes frames by hand, tuned for the traffic (a table of
small SendChannel headers, a decoder that works in place); it is the codec the
peers use. This module says what those bytes are, field by field, as
PROTOCOL.md draws them: the constant bits of the first byte, the compact-U64
tags packed after them (most significant first), then each tag's tail in the
same order, then the standalone compact U64s, then the payload. Its
:meth:`FrameLayout.encode` and :meth:`FrameLayout.decode` are slow and plain on
purpose: the tests hold codec.py to them, and read PROTOCOL.md's frame
diagrams against :data:`FRAME_LAYOUTS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from headgate.protocol.c64 import (
    Buffer,
    decode_compact,
    decode_standalone,
    encode_compact,
    encode_standalone_into,
)
from headgate.protocol.frames import (
    Absolve,
    AnnounceDropping,
    Apologise,
    IssueGuarantees,
    LimitReceiving,
    LimitSending,
    Plead,
    SendChannel,
    SendGlobal,
)

__all__ = ["FRAME_LAYOUTS", "FrameLayout", "frame_layout_of_first_byte"]

#: The attribute a ``length`` tag measures: it is the payload's length, not a field.
LENGTH = "length"


@dataclass(frozen=True, slots=True)
class FrameLayout:
    """One frame: its first byte's constant bits and tags, then what follows it."""

    #: The frame class.
    cls: type
    #: The constant leading bits of the first byte, as written ("1111", "0").
    prefix: str
    #: The integers whose compact tags fill the rest of the first byte, in
    #: order, each ``(attribute, tag width in bits)``; ``length`` is the payload's.
    tags: tuple[tuple[str, int], ...]
    #: Integers after the tags' tails, each a standalone compact U64.
    standalone: tuple[str, ...] = ()
    #: Whether the frame ends with ``length`` bytes of payload.
    payload: bool = False
    #: The order of the tags' tails after the first byte, where it is not the
    #: tags' order (SendChannel: the channel's tail comes first).
    tail_order: tuple[str, ...] = ()

    def _tail_order(self) -> tuple[str, ...]:
        return self.tail_order or tuple(attr for attr, _ in self.tags)

    def __post_init__(self) -> None:
        if len(self.prefix) + sum(width for _, width in self.tags) != 8:
            raise ValueError(f"{self.cls.__name__}: the first byte is not 8 bits")

    def matches(self, first_byte: int) -> bool:
        """Tell whether a frame starting with ``first_byte`` is this one."""
        return format(first_byte, "08b").startswith(self.prefix)

    def encode(self, frame: Any) -> bytes:
        first = int(self.prefix, 2)
        tails: dict[str, bytes] = {}
        for attr, width in self.tags:
            value = len(frame.payload) if attr == LENGTH else getattr(frame, attr)
            tag, tails[attr] = encode_compact(value, width)
            first = (first << width) | tag
        out = bytearray((first,))
        for attr in self._tail_order():
            out += tails[attr]
        for attr in self.standalone:
            encode_standalone_into(getattr(frame, attr), out)
        if self.payload:
            out += bytes(frame.payload)
        return bytes(out)

    def decode(self, data: Buffer) -> tuple[Any, int]:
        """Return ``(frame, bytes used)`` from a buffer holding a whole frame."""
        first = data[0]
        shift = 8 - len(self.prefix)
        tags: dict[str, tuple[int, int]] = {}
        for attr, width in self.tags:
            shift -= width
            tags[attr] = ((first >> shift) & ((1 << width) - 1), width)
        fields: dict[str, Any] = {}
        offset = 1
        for attr in self._tail_order():
            tag, width = tags[attr]
            got = decode_compact(tag, width, data, offset)
            if got is None:
                raise ValueError(f"{self.cls.__name__}: truncated in {attr}")
            fields[attr], offset = got
        for attr in self.standalone:
            standalone = decode_standalone(data, offset)
            if standalone is None:
                raise ValueError(f"{self.cls.__name__}: truncated in {attr}")
            fields[attr], offset = standalone
        if self.payload:
            length = fields.pop(LENGTH)
            if offset + length > len(data):
                raise ValueError(f"{self.cls.__name__}: truncated in payload")
            fields["payload"] = bytes(data[offset : offset + length])
            offset += length
        return self.cls(**fields), offset


#: Every LCMUX frame, as PROTOCOL.md ("Frames") draws it.
FRAME_LAYOUTS: tuple[FrameLayout, ...] = (
    FrameLayout(IssueGuarantees, "1111", (("channel", 4),), ("amount",)),
    FrameLayout(Plead, "1110", (("channel", 4),), ("target",)),
    FrameLayout(LimitReceiving, "1101", (("channel", 4),), ("bound",)),
    FrameLayout(AnnounceDropping, "1100", (("channel", 4),)),
    FrameLayout(Absolve, "1011", (("channel", 4),), ("amount",)),
    FrameLayout(LimitSending, "1010", (("channel", 4),), ("bound",)),
    FrameLayout(Apologise, "1001", (("channel", 4),)),
    FrameLayout(SendGlobal, "1000", ((LENGTH, 4),), payload=True),
    FrameLayout(
        SendChannel,
        "0",
        ((LENGTH, 3), ("channel", 4)),
        payload=True,
        tail_order=("channel", LENGTH),
    ),
)


def frame_layout_of_first_byte(first_byte: int) -> FrameLayout:
    """The one layout a frame starting with ``first_byte`` has (every byte starts one)."""
    (layout,) = [layout for layout in FRAME_LAYOUTS if layout.matches(first_byte)]
    return layout
