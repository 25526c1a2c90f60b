"""Compact U64: the variable-width unsigned integers of LCMUX.

Every integer in an LCMUX frame header (channels, lengths, amounts, bounds) is
a *compact U64*: a tag of ``width`` bits (2 to 8), packed into some header byte,
followed by zero, one, two, four or eight big-endian bytes. With ``top`` the
largest tag, ``2**width - 1``::

    tag              bytes that follow   value
    0 .. top-4       none                the tag itself
    top-3            1                   n < 2**8
    top-2            2                   n < 2**16
    top-1            4                   n < 2**32
    top              8                   any u64

A *standalone* compact U64 has a tag byte of its own (``width`` 8), so 0..251
cost one byte. The spec defines an encoding *relation*: any tag wide enough for
the value is valid, so decoders accept every tag, while the encoders here always
write the shortest one. ``PROTOCOL.md`` has the table with examples.

Decoding never raises on short input: a function that needs bytes which are not
there yet returns ``None``, because a stream decoder treats "not yet" as normal.
"""

from __future__ import annotations

__all__ = [
    "U64_MAX",
    "Buffer",
    "decode_compact",
    "decode_standalone",
    "encode_compact",
    "encode_standalone",
    "encode_standalone_into",
    "minimal_tag",
    "tail_size",
]

Buffer = bytes | bytearray | memoryview

#: The largest value a compact U64 can carry.
U64_MAX = (1 << 64) - 1

# Bytes that follow each tag, per width: index [width][tag]. Tables rather than
# arithmetic because decoders look these up once per field on the hot path.
_TAIL_SIZES: tuple[tuple[int, ...], ...] = tuple(
    tuple(
        0 if tag <= (1 << width) - 5 else (1, 2, 4, 8)[tag - ((1 << width) - 4)]
        for tag in range(1 << width)
    )
    if width >= 2
    else ()
    for width in range(9)
)

# Standalone tags, looked up once per value on the hot path of the decoder.
_STANDALONE_TAIL = _TAIL_SIZES[8]


def _check_width(width: int) -> None:
    if not 2 <= width <= 8:
        raise ValueError(f"compact U64 tag width must be 2..8 bits, not {width}")


def _check_value(value: int) -> None:
    if not 0 <= value <= U64_MAX:
        raise ValueError(f"{value} is not an unsigned 64-bit integer")


def minimal_tag(value: int, width: int) -> int:
    """Return the shortest tag of ``width`` bits that can carry ``value``.

    Raises ``ValueError`` for a width outside 2..8 or a value outside 0..2**64-1.
    """
    _check_width(width)
    _check_value(value)
    top = (1 << width) - 1
    if value <= top - 4:
        return value
    if value < 0x100:
        return top - 3
    if value < 0x1_0000:
        return top - 2
    if value < 0x1_0000_0000:
        return top - 1
    return top


def tail_size(tag: int, width: int) -> int:
    """Return how many bytes follow a tag of ``width`` bits (0, 1, 2, 4 or 8)."""
    _check_width(width)
    if not 0 <= tag < (1 << width):
        raise ValueError(f"tag {tag} does not fit in {width} bits")
    return _TAIL_SIZES[width][tag]


def encode_compact(value: int, width: int) -> tuple[int, bytes]:
    """Encode ``value`` minimally for a ``width``-bit tag.

    Returns ``(tag, tail)``: the caller packs ``tag`` into its header byte and
    writes ``tail`` (possibly empty) after it.
    """
    tag = minimal_tag(value, width)
    size = _TAIL_SIZES[width][tag]
    return tag, value.to_bytes(size, "big") if size else b""


def encode_standalone(value: int) -> bytes:
    """Encode ``value`` as a standalone compact U64 (tag byte, then tail)."""
    tag, tail = encode_compact(value, 8)
    return bytes((tag,)) + tail


def encode_standalone_into(value: int, out: bytearray) -> None:
    """Append the standalone encoding of ``value`` to ``out``."""
    tag, tail = encode_compact(value, 8)
    out.append(tag)
    if tail:
        out += tail


def decode_compact(tag: int, width: int, buf: Buffer, offset: int) -> tuple[int, int] | None:
    """Read the value whose ``width``-bit ``tag`` was already taken from a header.

    The tail, if any, is read from ``buf`` starting at ``offset``. Returns
    ``(value, offset_after)``, or ``None`` when ``buf`` ends before the tail
    does. Every valid tag is accepted, minimal or not.
    """
    _check_width(width)
    if not 0 <= tag < (1 << width):
        raise ValueError(f"tag {tag} does not fit in {width} bits")
    if offset < 0:
        raise ValueError("offset must not be negative")
    size = _TAIL_SIZES[width][tag]
    if size == 0:
        return tag, offset
    end = offset + size
    if end > len(buf):
        return None
    if size == 1:
        return buf[offset], end
    return int.from_bytes(buf[offset:end], "big"), end


def decode_standalone(buf: Buffer, offset: int) -> tuple[int, int] | None:
    """Read a standalone compact U64 at ``offset`` in ``buf``.

    Returns ``(value, offset_after)``, or ``None`` if ``buf`` ends too early.
    """
    if offset < 0:
        raise ValueError("offset must not be negative")
    if offset >= len(buf):
        return None
    tag = buf[offset]
    size = _STANDALONE_TAIL[tag]
    start = offset + 1
    if size == 0:
        return tag, start
    end = start + size
    if end > len(buf):
        return None
    if size == 1:
        return buf[start], end
    return int.from_bytes(buf[start:end], "big"), end
