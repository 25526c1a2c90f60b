"""The batch builder: records cut into records blocks of at most a given size.

A producer's records travel in batches, one records block each
(:mod:`headgate.protocol.records`), and no block may exceed the batch limit:
``max_batch_bytes``, or less where the gateway's Welcome says its frames are
smaller. This module cuts records into such blocks, from Python lists or
Arrow arrays, and cuts an encoded block again when the limit shrank after it
was sealed (a batch sealed before the Welcome, or held across a reconnect to
a gateway with a smaller frame limit).

The sizes come from the records module's rules (:func:`record_cost`, the
block bases), so the layout and its arithmetic have one home. Nothing here
knows about connections, sequences or time.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from itertools import accumulate
from typing import TYPE_CHECKING, Any, cast

from headgate.protocol.records import (
    BLOCK_BASE,
    KEYED_BLOCK_BASE,
    KEYED_RECORD_OVERHEAD,
    RECORD_OVERHEAD,
    decode_records,
    encode_arrow,
    encode_records,
    record_cost,
)

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = [
    "Block",
    "encode_blocks",
    "keyed_switch_extra",
    "record_bytes",
    "split_block",
    "without_first",
]

#: One encoded records block and how many records it holds.
Block = tuple[bytes, int]


def record_bytes(value: object, what: str) -> bytes:
    """A record's value or key (``what``) as bytes: bytes-like objects are copied, nothing else is.

    Raises:
        TypeError: ``value`` is not bytes-like.
    """
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    raise TypeError(f"a record {what} must be bytes, not {type(value).__name__}")


def keyed_switch_extra(count: int) -> int:
    """What an open batch of ``count`` keyless records grows by when it takes keys.

    The key sections' fixed part, and each earlier record's share of them
    (the bounds of :func:`~headgate.protocol.records.record_cost`).
    """
    return KEYED_BLOCK_BASE - BLOCK_BASE + (KEYED_RECORD_OVERHEAD - RECORD_OVERHEAD) * count


def encode_blocks(values: object, keys: object, limit: int) -> list[Block]:
    """Cut ``values`` (and ``keys``) into blocks of at most ``limit`` bytes, in order.

    ``values`` is a list of bytes, a pyarrow binary/string array, or a
    RecordBatch/Table with a ``value`` column and an optional ``key``
    column; Arrow input is cut and encoded without a Python loop per record.

    Raises:
        ValueError: the keys do not match the values, or a record does not
            fit in a block of ``limit`` bytes.
        TypeError: ``values`` is none of those.
    """
    if isinstance(values, list | tuple):
        return _encode_lists(values, cast("Sequence[bytes | None] | None", keys), limit)
    values, keys = send_many_columns(values, keys)
    return _encode_arrow(values, keys, limit)


def send_many_columns(values: Any, keys: Any) -> tuple[Any, Any]:
    """A ``send_many`` call's values and keys as lists, or as pyarrow Arrays.

    The one reading of what ``send_many`` takes, for the producer of one
    gateway and for a fleet's: lists of bytes (keys made a list), or a
    pyarrow Array, ChunkedArray, RecordBatch or Table (a 'value' and an
    optional 'key' column).

    Raises:
        ValueError: keys passed beside a RecordBatch, or no 'value' column.
        TypeError: ``values`` is none of those.
    """
    if isinstance(values, list | tuple):
        if keys is not None and not isinstance(keys, list | tuple):
            keys = list(keys)
        return values, keys
    import pyarrow as pa

    if isinstance(values, pa.RecordBatch | pa.Table):
        if keys is not None:
            raise ValueError("pass keys as the 'key' column of the RecordBatch, not keys=")
        names = values.schema.names
        if "value" not in names:
            raise ValueError(f"a RecordBatch needs a 'value' column; it has {names}")
        keys = values.column("key") if "key" in names else None
        values = values.column("value")
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if isinstance(keys, pa.ChunkedArray):
        keys = keys.combine_chunks()
    if not isinstance(values, pa.Array):
        raise TypeError(
            "values must be a list of bytes or a pyarrow Array, RecordBatch or Table, "
            f"not {type(values).__name__}"
        )
    if keys is not None and not isinstance(keys, pa.Array):
        keys = pa.array(keys, type=pa.binary())
    return values, keys


def split_block(block: bytes, limit: int) -> list[Block]:
    """Cut an encoded block into blocks of at most ``limit`` bytes, records in order.

    Raises:
        ValueError: one of its records alone does not fit in ``limit`` bytes.
    """
    values, keys = decode_records(block).to_lists()
    return _encode_lists(values, keys, limit)


def without_first(block: bytes, skip: int) -> bytes:
    """The block of the records of ``block`` after its first ``skip``, in order."""
    values, keys = decode_records(block).to_lists()
    return encode_records(values[skip:], None if keys is None else keys[skip:])


def _encode_lists(
    values: Sequence[bytes], keys: Sequence[bytes | None] | None, limit: int
) -> list[Block]:
    if keys is not None and len(keys) != len(values):
        raise ValueError(f"{len(keys)} keys for {len(values)} values")
    if keys is None:
        costs = [record_cost(len(v), None, keyed=False) for v in values]
        budget = limit - BLOCK_BASE
    else:
        costs = [
            record_cost(len(v), None if k is None else len(k), keyed=True)
            for v, k in zip(values, keys, strict=True)
        ]
        budget = limit - KEYED_BLOCK_BASE
    cumulative = list(accumulate(costs))
    blocks: list[Block] = []
    start = 0
    while start < len(values):
        before = cumulative[start - 1] if start else 0
        end = bisect.bisect_right(cumulative, before + budget, lo=start)
        if end == start:
            raise ValueError(f"record {start} does not fit in a batch of {limit} bytes")
        chunk_keys = None if keys is None else list(keys[start:end])
        blocks.append((encode_records(list(values[start:end]), chunk_keys), end - start))
        start = end
    return blocks


def _encode_arrow(values: pa.Array, keys: pa.Array | None, limit: int) -> list[Block]:
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    count = len(values)
    if keys is not None and len(keys) != count:
        raise ValueError(f"{len(keys)} keys for {count} values")
    if count == 0:
        return []
    if not pa.types.is_binary(values.type):
        # encode_arrow accepts these too; lengths are measured on the same bytes.
        values = values.cast(pa.binary())
    # record_cost's rule, over whole columns: the value, the key if any, and
    # the per-record overhead of the block's layout.
    costs = pc.binary_length(values).to_numpy(zero_copy_only=False).astype(np.int64)
    if keys is None:
        costs += RECORD_OVERHEAD
        budget = limit - BLOCK_BASE
    else:
        if not pa.types.is_binary(keys.type):
            keys = keys.cast(pa.binary())
        key_lengths = pc.fill_null(pc.binary_length(keys), 0)
        costs += key_lengths.to_numpy(zero_copy_only=False).astype(np.int64)
        costs += KEYED_RECORD_OVERHEAD
        budget = limit - KEYED_BLOCK_BASE
    cumulative = np.cumsum(costs)
    blocks: list[Block] = []
    start = 0
    while start < count:
        before = int(cumulative[start - 1]) if start else 0
        end = int(np.searchsorted(cumulative, before + budget, side="right"))
        if end <= start:
            raise ValueError(f"record {start} does not fit in a batch of {limit} bytes")
        length = end - start
        chunk_keys = None if keys is None else keys.slice(start, length)
        blocks.append((encode_arrow(values.slice(start, length), chunk_keys), length))
        start = end
    return blocks
