"""Executor side: log frames in, Arrow record batches of the source's schema out.

Everything here runs inside Spark's Python workers, from a pickled reader, so
it takes all it needs from its arguments (an :class:`ReadTask`) and imports
pyarrow and numpy only when called. Work is per frame, never per record:
each frame's records block is viewed in place as Arrow arrays
(:meth:`~headgate.protocol.records.RecordsView.to_arrow`), a page of frames is
concatenated (which copies the bytes out of the log's memory map), and the
per-record columns that repeat a frame's header are built with ``numpy.repeat``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa

    from headgate.log import LogFrame

#: Log bytes decoded at a time (more if one frame is larger): whole frames.
PAGE_LOG_BYTES = 4 * 1024 * 1024

#: Records per Arrow batch handed to Spark, as Spark's own Arrow batches
#: (``spark.sql.execution.arrow.maxRecordsPerBatch``); a page is sliced, not copied.
BATCH_RECORDS = 10_000

_INT64_MAX = 2**63 - 1


class SourceError(RuntimeError):
    """The logs cannot give Spark what it asked for; the message names stream and position."""


@dataclass(frozen=True, slots=True)
class StreamSlice:
    """One stream's frames in ``[start, end)``: part of a micro-batch."""

    #: The stream's name (its directory under ``<data dir>/streams``).
    stream: str
    #: Log position of the first frame to read (a frame boundary).
    start: int
    #: Log position just after the last frame to read (a frame boundary).
    end: int
    #: Records of the frame at ``start`` that are not read: a query that
    #: starts at a record address inside that frame (``startingOffsets``).
    skip: int = 0


def stream_directory(data_dir: str, stream: str) -> str:
    """Where a stream's log lives inside a gateway's data directory."""
    return os.path.join(data_dir, "streams", stream)


def arrow_schema() -> pa.Schema:
    """The Arrow schema of every batch: the source's Spark schema, exactly."""
    import pyarrow as pa

    return pa.schema(
        [
            pa.field("stream", pa.string()),
            pa.field("position", pa.int64()),
            pa.field("index", pa.int64()),
            pa.field("producer", pa.int64()),
            pa.field("sequence", pa.int64()),
            pa.field("ingest_time", pa.timestamp("us", tz="UTC")),
            pa.field("key", pa.binary()),
            pa.field("value", pa.binary()),
        ]
    )


def frames_to_batch(
    stream: str, frames: Sequence[LogFrame], schema: pa.Schema, *, skip: int = 0
) -> pa.RecordBatch:
    """Decode frames of one stream into one record batch that owns its memory.

    ``skip``: leave out the first records of the first frame (a query that
    starts at a record address inside it).

    Raises:
        SourceError: a frame's payload is not a valid records block, or its
            header disagrees with it, or an id does not fit Spark's ``long``.
    """
    import numpy as np
    import pyarrow as pa

    from headgate.protocol.errors import MessageError
    from headgate.protocol.records import decode_records

    value_parts: list[Any] = []
    key_parts: list[Any] = []
    any_keys = False
    for frame in frames:
        try:
            values, keys = decode_records(frame.payload).to_arrow()
        except MessageError as error:
            raise SourceError(
                f"stream {stream!r}: the frame at position {frame.position} "
                f"does not hold a valid records block ({error})"
            ) from error
        if len(values) != frame.record_count:
            raise SourceError(
                f"stream {stream!r}: the frame at position {frame.position} says "
                f"{frame.record_count} records but its block holds {len(values)}"
            )
        value_parts.append(values)
        if keys is None:
            keys = pa.nulls(len(values), pa.binary())
        else:
            any_keys = True
        key_parts.append(keys)

    if skip and (not frames or skip >= frames[0].record_count):
        at = frames[0].position if frames else "the start"
        raise SourceError(
            f"stream {stream!r}: the batch at position {at} has no record at index {skip}"
        )
    counts = np.fromiter((f.record_count for f in frames), np.int64, len(frames))
    total = int(counts.sum())
    producers = _int64_column(stream, frames, [f.producer_id for f in frames], "producer id")
    lasts = [f.first_sequence + max(f.record_count - 1, 0) for f in frames]
    _int64_column(stream, frames, lasts, "record sequence number")
    firsts = np.array([f.first_sequence for f in frames], dtype=np.int64)
    # Sequence of record i of a frame = first_sequence + i, for all frames at once.
    frame_starts = np.cumsum(counts) - counts
    sequences = np.repeat(firsts - frame_starts, counts) + np.arange(total, dtype=np.int64)
    # Index of record i of a frame in that frame: its row minus the frame's first row.
    indexes = np.arange(total, dtype=np.int64) - np.repeat(frame_starts, counts)
    positions = np.array([f.position for f in frames], dtype=np.int64)
    timestamps = np.array([f.timestamp_us for f in frames], dtype=np.int64)

    # concat_arrays allocates new buffers even for one array: the batch no
    # longer points into the log's memory map once this returns.
    values_column = pa.concat_arrays(value_parts) if value_parts else pa.array([], pa.binary())
    keys_column = pa.concat_arrays(key_parts) if any_keys else pa.nulls(total, pa.binary())
    batch = pa.RecordBatch.from_arrays(
        [
            pa.repeat(pa.scalar(stream, pa.string()), total),
            pa.array(np.repeat(positions, counts), pa.int64()),
            pa.array(indexes, pa.int64()),
            pa.array(np.repeat(producers, counts), pa.int64()),
            pa.array(sequences, pa.int64()),
            pa.array(np.repeat(timestamps, counts), pa.int64()).view(
                schema.field("ingest_time").type
            ),
            keys_column,
            values_column,
        ],
        schema=schema,
    )
    return batch.slice(skip) if skip else batch


def _int64_column(stream: str, frames: Sequence[LogFrame], ids: list[int], what: str) -> Any:
    import numpy as np

    column = np.array(ids, dtype=np.uint64)
    if len(column) and int(column.max()) > _INT64_MAX:
        at = frames[int(column.argmax())].position
        raise SourceError(
            f"stream {stream!r}: the frame at position {at} has a {what} above 2**63 - 1, "
            "which Spark's long cannot hold"
        )
    return column.astype(np.int64)


def read_slice(
    data_dir: str, piece: StreamSlice, schema: pa.Schema, *, page_bytes: int = PAGE_LOG_BYTES
) -> Iterator[pa.RecordBatch]:
    """Yield the records of one stream slice, in batches of at most :data:`BATCH_RECORDS`."""
    from headgate.log import LogError, LogReader

    directory = stream_directory(data_dir, piece.stream)
    if not os.path.isdir(directory):
        raise SourceError(
            f"stream {piece.stream!r}: its log directory {directory} is gone; "
            f"positions {piece.start} to {piece.end} cannot be read"
        )
    try:
        reader = LogReader.open(directory)
    except LogError as error:
        raise SourceError(
            f"stream {piece.stream!r}: cannot open its log to read from position "
            f"{piece.start} ({error})"
        ) from error
    try:
        check_retained(piece.stream, reader, piece.start, piece.end)
        position = piece.start
        while position < piece.end:
            batch, position = _read_page(reader, piece, position, schema, page_bytes)
            if batch is None:
                break  # only padding is left before the end
            for first in range(0, batch.num_rows, BATCH_RECORDS):
                yield batch.slice(first, BATCH_RECORDS)
    finally:
        reader.close()


def _read_page(
    reader: Any, piece: StreamSlice, position: int, schema: pa.Schema, page_bytes: int
) -> tuple[pa.RecordBatch | None, int]:
    # A separate function so that the frames (views into the map) are dropped
    # before the caller yields, and before it closes the reader.
    from headgate.log import LogError

    try:
        frames = reader.read(position, piece.end, max_bytes=page_bytes)
    except LogError as error:
        raise SourceError(
            f"stream {piece.stream!r}: reading from position {position} failed ({error})"
        ) from error
    if not frames:
        return None, piece.end
    skip = piece.skip if position == piece.start else 0
    batch = frames_to_batch(piece.stream, frames, schema, skip=skip)
    # The frames are views into the mapped terms until frames_to_batch copies
    # them out; a term freed meanwhile may be recycled (cleared and reused,
    # headgate.log.term), so the copy counts only if the log still held the
    # page once it was taken. (LogReader.read checks the same before it
    # returns; this covers the decoding after it.)
    oldest = reader.start_position()
    if oldest > position:
        raise SourceError(
            f"stream {piece.stream!r}: positions from {position} were released while "
            f"being read; the oldest position the log retains is now {oldest}"
        )
    return batch, frames[-1].end_position


def check_retained(stream: str, reader: Any, start: int, end: int) -> None:
    """Raise :class:`SourceError` unless the log still holds ``[start, end)``."""
    oldest = reader.start_position()
    if start < oldest:
        raise SourceError(
            f"stream {stream!r}: position {start} was already released; the oldest "
            f"position the log retains is {oldest}"
        )
    published = reader.published_position()
    if end > published:
        raise SourceError(
            f"stream {stream!r}: position {end} is past the end of the log ({published}); "
            "was the log recreated, or the checkpoint taken against another data directory?"
        )
