"""The records block: one batch of records, as one channel message.

A producer sends a batch of records as one block; the gateway checks it with
:func:`validate_records` and stores it, byte for byte, as the payload of one
log frame; Spark decodes it with :func:`decode_records`. The block *is* Arrow's
layout for a binary column (an ``int32`` offsets array and a data area), so a
producer holding Arrow arrays encodes with one copy and Spark decodes with no
copy at all: neither side loops over records in Python.

Layout (all integers little-endian; ``n`` = record count)::

    byte 0         4             8
    +--------------+-------------+---------------------------------------+
    | n: u32       | flags: u32  | value_offsets: i32 x (n + 1)          |
    +--------------+-------------+---------------------------------------+
    only if flags & HAS_KEYS (bit 0):
    +-----------------------------+---------------------------------------+
    | key_offsets: i32 x (n + 1)  | key validity bitmap: ceil(n / 8)      |
    |                             | bytes, zero-padded to a multiple of 4 |
    +-----------------------------+---------------------------------------+
    then the data:
    +-----------------------------+---------------------------------------+
    | value bytes:                | only if HAS_KEYS: zero bytes up to a  |
    | value_offsets[n] of them    | multiple of 4, then the key bytes:    |
    |                             | key_offsets[n] of them                |
    +-----------------------------+---------------------------------------+

    total = 8 + 4(n + 1)                                   without keys
          + value_offsets[n]
    total = 8 + 8(n + 1) + pad4(ceil(n / 8))               with keys
          + pad4(value_offsets[n]) + key_offsets[n]

Both offset arrays start at 0 and never decrease (Arrow's rule). The bitmap is
Arrow's validity bitmap: bit ``i`` (LSB first) set means record ``i`` has a key.

Every section starts on a 4-byte boundary (relative to the block), so the
offsets can be viewed in place as ``int32`` arrays. Record ``i``'s value is
``value_bytes[value_offsets[i]:value_offsets[i + 1]]``; its key is the same
slice of the key bytes when bit ``i`` of the bitmap is set, and absent
otherwise. An absent key is encoded with length zero, but a key slot marked
absent may cover bytes (as Arrow allows); they are ignored.

The length of a block is exact: a block is valid only if it ends where its
last section ends. Padding bytes and the bitmap's bits past ``n`` are zero,
and the only defined flag is ``HAS_KEYS``; any other bit is an error, so a
later version can add sections behind a new flag.

This module stays sans-IO and cheap to import: pyarrow is imported only by
the Arrow functions, and numpy, when present, only by validation (which falls
back to the standard library, still without a Python loop per record).
"""

from __future__ import annotations

import functools
import operator
import struct
import sys
from collections.abc import Sequence
from itertools import accumulate, pairwise
from typing import TYPE_CHECKING, Any

from headgate.protocol.errors import MessageError

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = [
    "BLOCK_BASE",
    "HAS_KEYS",
    "HEADER_SIZE",
    "KEYED_BLOCK_BASE",
    "KEYED_RECORD_OVERHEAD",
    "MAX_SECTION_BYTES",
    "RECORD_OVERHEAD",
    "RecordsView",
    "block_size",
    "decode_records",
    "encode_arrow",
    "encode_records",
    "record_cost",
    "validate_records",
]

#: Flag bit 0: the block carries a key column (offsets, bitmap and bytes).
HAS_KEYS = 0x1
_KNOWN_FLAGS = HAS_KEYS

_HEADER = struct.Struct("<II")
#: Size of the fixed header: record count and flags.
HEADER_SIZE = _HEADER.size

#: Offsets are int32, so each byte section (values, keys) is below 2 GiB.
MAX_SECTION_BYTES = 2**31 - 1

_LITTLE_ENDIAN = sys.byteorder == "little"


def _pad4(size: int) -> int:
    return (size + 3) & ~3


def _bitmap_size(count: int) -> int:
    return (count + 7) // 8


# --- sizes ------------------------------------------------------------------
#
# A producer fills a batch record by record and must know, before it encodes,
# whether the next record still fits under its limit. Without keys the size
# is linear in the records, so the rule is exact; with keys the padding makes
# it a step function, so a producer adds a bound per record that is never
# below the real growth (8 bytes of offsets, at most 1 of bitmap, the key)
# on a base that covers the worst padding of the header's sections.

#: Bytes of a block without keys before its first record: header and offset 0.
BLOCK_BASE = HEADER_SIZE + 4
#: Bytes each record adds to a block without keys, besides its value.
RECORD_OVERHEAD = 4
#: A bound on a keyed block's bytes before its first record: header, both
#: offset 0s, and the worst padding after the bitmap and after the values.
KEYED_BLOCK_BASE = 32
#: A bound on the bytes each record adds to a keyed block, besides its
#: value and key: two offsets and (rounded up) its bitmap bit.
KEYED_RECORD_OVERHEAD = 9


def block_size(count: int, value_bytes: int, key_bytes: int | None = None) -> int:
    """The exact length of a block of ``count`` records (the layout's totals above).

    ``value_bytes`` and ``key_bytes`` are the summed lengths of the values
    and the present keys; ``key_bytes`` is None for a block without keys.
    """
    if key_bytes is None:
        return BLOCK_BASE + RECORD_OVERHEAD * count + value_bytes
    return (
        HEADER_SIZE + 8 * (count + 1) + _pad4(_bitmap_size(count)) + _pad4(value_bytes) + key_bytes
    )


def record_cost(value: int, key: int | None, *, keyed: bool) -> int:
    """What one record adds to a block's size (exact without keys, a bound with keys).

    ``value`` and ``key`` are the lengths; ``keyed`` says whether the block
    carries a key column (any record with a key makes it carry one).
    """
    if not keyed:
        return value + RECORD_OVERHEAD
    return value + (0 if key is None else key) + KEYED_RECORD_OVERHEAD


# --- encoding ---------------------------------------------------------------


def _offsets_bytes(lengths: Sequence[int]) -> bytes:
    import array

    offsets = array.array("i", accumulate(lengths, initial=0))
    if not _LITTLE_ENDIAN:
        offsets.byteswap()
    return offsets.tobytes()


def _assemble(
    count: int,
    value_offsets: Any,
    value_bytes: Any,
    value_size: int,
    keys: tuple[Any, Any, Any, int] | None,
) -> bytes:
    """Join the sections; ``keys`` is (offsets, bitmap, bytes, size) or None."""
    if value_size > MAX_SECTION_BYTES:
        raise ValueError(f"records hold {value_size} value bytes; a block holds at most 2 GiB")
    if keys is None:
        return b"".join((_HEADER.pack(count, 0), value_offsets, value_bytes))
    key_offsets, bitmap, key_bytes, key_size = keys
    if key_size > MAX_SECTION_BYTES:
        raise ValueError(f"records hold {key_size} key bytes; a block holds at most 2 GiB")
    bitmap_pad = bytes(_pad4(_bitmap_size(count)) - _bitmap_size(count))
    value_pad = bytes(_pad4(value_size) - value_size)
    return b"".join(
        (
            _HEADER.pack(count, HAS_KEYS),
            value_offsets,
            key_offsets,
            bitmap,
            bitmap_pad,
            value_bytes,
            value_pad,
            key_bytes,
        )
    )


def encode_records(values: Sequence[bytes], keys: Sequence[bytes | None] | None = None) -> bytes:
    """Encode a batch of records given as Python byte strings.

    This is the convenient path for small batches; a producer that already
    holds Arrow arrays should use :func:`encode_arrow`, which does not touch
    each record.

    Args:
        values: one value per record.
        keys: ``None`` for a batch without keys, or one key per record, where
            ``None`` means that record has no key.
    """
    count = len(values)
    value_offsets = _offsets_bytes([len(v) for v in values])
    value_bytes = b"".join(values)
    if keys is None:
        return _assemble(count, value_offsets, value_bytes, len(value_bytes), None)
    if len(keys) != count:
        raise ValueError(f"{len(keys)} keys for {count} values")
    present = [k for k in keys if k is not None]
    key_bytes = b"".join(present)
    bits = 0
    for index, key in enumerate(keys):
        if key is not None:
            bits |= 1 << index
    bitmap = bits.to_bytes(_bitmap_size(count), "little")
    key_offsets = _offsets_bytes([0 if k is None else len(k) for k in keys])
    return _assemble(
        count,
        value_offsets,
        value_bytes,
        len(value_bytes),
        (key_offsets, bitmap, key_bytes, len(key_bytes)),
    )


def _as_binary(array: Any, what: str) -> Any:
    import pyarrow as pa

    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if not isinstance(array, pa.Array):
        raise TypeError(f"{what} must be a pyarrow Array, not {type(array).__name__}")
    kind = array.type
    if not (
        pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
        or pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
    ):
        raise TypeError(f"{what} must be a binary or string array, not {kind}")
    if not pa.types.is_binary(kind):
        # string -> binary reuses the buffers; large -> 32-bit offsets checks overflow.
        array = array.cast(pa.binary())
    return array


def _arrow_sections(array: Any) -> tuple[bytes, memoryview, int]:
    """Offsets (rebased to 0, as LE bytes) and data bytes of a binary array."""
    import numpy as np

    count = len(array)
    if count == 0:
        return bytes(4), memoryview(b""), 0
    buffers = array.buffers()
    offsets = np.frombuffer(buffers[1], dtype="<i4", count=count + 1, offset=4 * array.offset)
    first, last = int(offsets[0]), int(offsets[-1])
    if first != 0:
        offsets = offsets - np.int32(first)
    data = memoryview(buffers[2])[first:last] if buffers[2] is not None else memoryview(b"")
    return offsets.astype("<i4", copy=False).tobytes(), data, last - first


def _arrow_bitmap(array: Any) -> bytes:
    """The validity bitmap of ``array``, starting at bit 0, tail bits zero."""
    count = len(array)
    size = _bitmap_size(count)
    if array.null_count == 0:
        bitmap = bytearray(b"\xff" * size)
    else:
        # is_valid() materialises a fresh bitmap at offset 0, whatever the slice.
        bitmap = bytearray(memoryview(array.is_valid().buffers()[1])[:size])
    if count % 8:
        bitmap[-1] &= (1 << (count % 8)) - 1
    return bytes(bitmap)


def encode_arrow(values: pa.Array, keys: pa.Array | None = None) -> bytes:
    """Encode a batch of records held in Arrow arrays, copying each byte once.

    Args:
        values: a binary, large_binary, string or large_string array (a slice
            is fine) with no nulls: every record has a value.
        keys: ``None`` for a batch without keys, or an array of the same kinds
            and length, where a null means that record has no key.
    """
    values = _as_binary(values, "values")
    if values.null_count:
        raise ValueError(f"values contain {values.null_count} nulls; every record needs a value")
    count = len(values)
    value_offsets, value_bytes, value_size = _arrow_sections(values)
    if keys is None:
        return _assemble(count, value_offsets, value_bytes, value_size, None)
    keys = _as_binary(keys, "keys")
    if len(keys) != count:
        raise ValueError(f"{len(keys)} keys for {count} values")
    key_offsets, key_bytes, key_size = _arrow_sections(keys)
    return _assemble(
        count,
        value_offsets,
        value_bytes,
        value_size,
        (key_offsets, _arrow_bitmap(keys), key_bytes, key_size),
    )


# --- validation and decoding ------------------------------------------------


def _malformed(reason: str) -> MessageError:
    return MessageError(f"records block: {reason}")


@functools.cache
def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy is a dependency, but optional here
        return None
    return numpy


def load_accelerator() -> bool:
    """Import the optional accelerator (numpy) now; True if it is there.

    Checking a records block imports it on first use, which takes tens of
    milliseconds: a server calls this at start, so that no batch waits for it.
    """
    return _numpy() is not None


def _offsets_in_order(section: memoryview) -> bool:
    """True if the little-endian int32 array in ``section`` never decreases."""
    np = _numpy()
    if np is not None:
        offsets = np.frombuffer(section, dtype="<i4")
        return bool((offsets[1:] >= offsets[:-1]).all())
    if _LITTLE_ENDIAN:
        ints: Sequence[int] = section.cast("i")
    else:  # pragma: no cover - no big-endian machine in CI
        import array

        swapped = array.array("i", section.tobytes())
        swapped.byteswap()
        ints = swapped
    # map/all run in C: no Python bytecode per record.
    return all(map(operator.le, ints, ints[1:]))


class _Layout:
    """Where each section of a checked block lies (byte offsets into it)."""

    __slots__ = (
        "bitmap",
        "count",
        "has_keys",
        "key_bytes",
        "key_offsets",
        "value_bytes",
        "value_offsets",
    )

    def __init__(self, block: memoryview) -> None:
        size = len(block)
        if size < HEADER_SIZE:
            raise _malformed(f"{size} bytes is shorter than the {HEADER_SIZE}-byte header")
        count, flags = _HEADER.unpack_from(block)
        if flags & ~_KNOWN_FLAGS:
            raise _malformed(f"unknown flags {flags:#x}")
        has_keys = bool(flags & HAS_KEYS)
        offsets_size = 4 * (count + 1)
        value_offsets = (HEADER_SIZE, HEADER_SIZE + offsets_size)
        fixed_end = value_offsets[1]
        key_offsets = bitmap = (fixed_end, fixed_end)
        if has_keys:
            key_offsets = (fixed_end, fixed_end + offsets_size)
            bitmap = (key_offsets[1], key_offsets[1] + _bitmap_size(count))
            fixed_end = key_offsets[1] + _pad4(_bitmap_size(count))
        if fixed_end > size:
            raise _malformed(
                f"{count} records need at least {fixed_end} bytes, the block has {size}"
            )
        value_size = self._check_offsets(block, value_offsets, "value")
        value_end = fixed_end + value_size
        key_size = 0
        if has_keys:
            key_size = self._check_offsets(block, key_offsets, "key")
            value_end = fixed_end + _pad4(value_size)
        end = value_end + key_size
        if end > size:
            raise _malformed(f"offsets point past the data: {end} bytes needed, {size} present")
        if end < size:
            raise _malformed(f"{size - end} trailing bytes after the records")
        if has_keys:
            self._check_zero(block, bitmap[1], fixed_end, "bitmap padding")
            self._check_zero(block, fixed_end + value_size, value_end, "value padding")
            if count % 8 and block[bitmap[1] - 1] >> (count % 8):
                raise _malformed("key bitmap has bits set past the last record")
        self.count: int = count
        self.has_keys = has_keys
        self.value_offsets = value_offsets
        self.value_bytes = (fixed_end, fixed_end + value_size)
        self.key_offsets = key_offsets
        self.bitmap = bitmap
        self.key_bytes = (value_end, end)

    @staticmethod
    def _check_offsets(block: memoryview, where: tuple[int, int], what: str) -> int:
        first, last = (struct.unpack_from("<i", block, at)[0] for at in (where[0], where[1] - 4))
        if first != 0:
            raise _malformed(f"{what} offsets start at {first}, not 0")
        if last < 0 or not _offsets_in_order(block[where[0] : where[1]]):
            raise _malformed(f"{what} offsets decrease")
        return int(last)

    @staticmethod
    def _check_zero(block: memoryview, start: int, end: int, what: str) -> None:
        if block[start:end].tobytes().strip(b"\0"):
            raise _malformed(f"{what} is not zero")


def _as_memoryview(block: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(block)
    if view.ndim != 1 or view.itemsize != 1 or not view.c_contiguous:
        view = memoryview(view.tobytes())
    if view.format != "B":
        view = view.cast("B")
    return view


#: Blocks of at most this many records, without keys, are checked by
#: :func:`_small_block_count`: numpy's fixed cost per call (about 4 us) is most
#: of the gateway's work on a one-record batch, while unpacking a few dozen
#: offsets with a prepared struct costs well under a microsecond.
SMALL_BLOCK_RECORDS = 64
#: The offsets array of a block of ``n`` records (``n + 1`` int32), by ``n``.
_SMALL_OFFSETS = tuple(struct.Struct(f"<{n + 1}i") for n in range(SMALL_BLOCK_RECORDS + 1))


def _small_block_count(block: memoryview) -> int | None:
    """The record count of a small, keyless, well-formed block; None for any other.

    A fast path only: None means "ask :class:`_Layout`", which checks every
    block (this one too) and names what is wrong, so the rules and their
    messages keep one home.
    """
    size = len(block)
    if size < HEADER_SIZE:
        return None
    count: int
    flags: int
    count, flags = _HEADER.unpack_from(block)
    if flags or count > SMALL_BLOCK_RECORDS:
        return None
    fixed_end = HEADER_SIZE + 4 * (count + 1)
    if fixed_end > size:
        return None
    offsets = _SMALL_OFFSETS[count].unpack_from(block, HEADER_SIZE)
    # Starts at 0, never decreases, and the last one ends the block exactly.
    if offsets[0] or fixed_end + offsets[-1] != size:
        return None
    if count > 1 and not all(map(operator.le, offsets, offsets[1:])):
        return None
    return count


def validate_records(block: bytes | bytearray | memoryview) -> int:
    """Check that ``block`` is a well-formed records block; return its record count.

    Raises:
        MessageError: (code ``MALFORMED_MESSAGE``) naming the first
            inconsistency found. Nothing else escapes, whatever the bytes.
    """
    view = _as_memoryview(block)
    count = _small_block_count(view)
    if count is not None:
        return count
    return _Layout(view).count


def decode_records(block: bytes | bytearray | memoryview) -> RecordsView:
    """Check ``block`` (as :func:`validate_records` does) and return a view over it.

    The view does not copy the block; keep the block's memory alive (and
    unchanged) while the view or any array taken from it is in use.
    """
    view = _as_memoryview(block)
    return RecordsView(view, _Layout(view))


class RecordsView:
    """A checked records block, read in place.

    Build one with :func:`decode_records`.
    """

    __slots__ = ("_block", "_layout")

    def __init__(self, block: memoryview, layout: _Layout) -> None:
        self._block = block
        self._layout = layout

    @property
    def record_count(self) -> int:
        """How many records the block holds."""
        return self._layout.count

    @property
    def has_keys(self) -> bool:
        """Whether the block carries a key column (its keys may still all be absent)."""
        return self._layout.has_keys

    def _section(self, where: tuple[int, int]) -> memoryview:
        return self._block[where[0] : where[1]]

    def to_arrow(self) -> tuple[pa.BinaryArray, pa.BinaryArray | None]:
        """The values and keys (``None`` without a key column) as Arrow arrays.

        The arrays share the block's memory: nothing is copied.
        """
        import pyarrow as pa

        layout = self._layout
        values = pa.Array.from_buffers(
            pa.binary(),
            layout.count,
            [
                None,
                pa.py_buffer(self._section(layout.value_offsets)),
                pa.py_buffer(self._section(layout.value_bytes)),
            ],
            null_count=0,
        )
        if not layout.has_keys:
            return values, None
        keys = pa.Array.from_buffers(
            pa.binary(),
            layout.count,
            [
                pa.py_buffer(self._section(layout.bitmap)),
                pa.py_buffer(self._section(layout.key_offsets)),
                pa.py_buffer(self._section(layout.key_bytes)),
            ],
        )
        return values, keys

    def to_lists(self) -> tuple[list[bytes], list[bytes | None] | None]:
        """The values and keys (``None`` without a key column) as Python lists."""
        layout = self._layout
        count = layout.count
        value_offsets = struct.unpack_from(f"<{count + 1}i", self._block, layout.value_offsets[0])
        data = self._section(layout.value_bytes).tobytes()
        values = [data[a:b] for a, b in pairwise(value_offsets)]
        if not layout.has_keys:
            return values, None
        key_offsets = struct.unpack_from(f"<{count + 1}i", self._block, layout.key_offsets[0])
        key_data = self._section(layout.key_bytes).tobytes()
        bitmap = self._section(layout.bitmap).tobytes()
        keys: list[bytes | None] = [
            key_data[key_offsets[i] : key_offsets[i + 1]] if bitmap[i >> 3] >> (i & 7) & 1 else None
            for i in range(count)
        ]
        return values, keys
