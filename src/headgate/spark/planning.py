"""Driver side: which streams exist, where they end, and how a range is cut up.

An *offset* is a dict from stream name to log position, in sorted name order
(Spark compares offsets as JSON strings). Positions are frame boundaries; a
query that starts at a record inside a frame holds that record's address
text (``"4096:2"``) for its stream until it reads the frame.

Two pieces of policy live here:

* **Admission** (:func:`admit`): with ``maxRecordsPerTrigger`` or
  ``maxBytesPerTrigger``, frames are taken oldest first (by frame timestamp,
  across all streams, ties by stream name) while the batch stays within both
  limits. Frames are never split, so a batch holds at most the limit, except
  that a batch whose oldest frame alone exceeds the limit holds that one frame
  (otherwise the query could not progress). Oldest-first means a stream whose
  frames are too big for what is left waits only until its frame is the oldest.
* **Splitting** (:func:`plan_slices`): a stream range larger than the target
  bytes per partition is cut at frame boundaries into equal-ish pieces; small
  pieces of different streams then share a partition, up to the target.
"""

from __future__ import annotations

import heapq
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from headgate.log.address import ADDRESS_FORM, AddressError, RecordAddress
from headgate.spark.decode import SourceError, StreamSlice, check_retained, stream_directory

#: Bytes of frames the driver reads per call when it scans frame headers.
SCAN_PAGE_BYTES = 4 * 1024 * 1024

#: A stream's value in an offset: the log position to read from (a frame
#: boundary), or the text ``"POSITION:INDEX"`` of a record address
#: (:mod:`headgate.log.address`) when a query starts inside a frame
#: (``startingOffsets``); Spark keeps that text until the query reads the frame.
OffsetValue = int | str
Offset = dict[str, OffsetValue]

#: The values of the source's option ``missingStreams`` (the pipeline file's
#: ``missing_streams``): refuse a named stream that does not exist when the
#: query starts, or read it once it appears.
MISSING_STREAMS = ("fail", "wait")


def sorted_offset(positions: Mapping[str, OffsetValue]) -> Offset:
    """An offset with its keys in the fixed (sorted) order Spark needs."""
    return {name: offset_value(offset_address(positions[name])) for name in sorted(positions)}


def offset_address(value: object) -> RecordAddress:
    """The record address an offset's value stands for; AddressError if it is none.

    Offsets come back from Spark's checkpoint as JSON: a position is a
    number, an address inside a frame is its text.
    """
    if isinstance(value, bool):
        raise AddressError(f"{value!r} is not a record address")
    if isinstance(value, int):
        return RecordAddress(value)
    if isinstance(value, str):
        return RecordAddress.parse(value)
    raise AddressError(f"{value!r} is not a record address ({ADDRESS_FORM})")


def offset_value(address: RecordAddress) -> OffsetValue:
    """How an offset holds ``address``: a number for the start of a frame, else its text."""
    return str(address) if address.index else address.position


def offset_position(value: OffsetValue) -> int:
    """The log position an offset's value reads from (its frame's, for an address)."""
    return offset_address(value).position


@dataclass(frozen=True, slots=True)
class StreamSelection:
    """Which streams a query reads: a fixed list, a pattern, or all of them."""

    #: Exactly these streams (``streams`` option), or ``None``.
    names: tuple[str, ...] | None = None
    #: Streams whose whole name matches this regex (``streamPattern``), or ``None``.
    pattern: str | None = None

    def matches(self, name: str) -> bool:
        if self.names is not None:
            return name in self.names
        if self.pattern is not None:
            return re.fullmatch(self.pattern, name) is not None
        return True


class Logs(Protocol):
    """What planning needs of the logs: local files (:class:`StreamLogs`) or a
    gateway (:class:`~headgate.spark.remote.GatewayLogs`)."""

    def discover(self) -> list[str]: ...
    def names(self) -> list[str]: ...
    def where(self) -> str: ...
    def earliest(self, stream: str) -> int: ...
    def latest(self, stream: str, *, read_up_to: int | None = None) -> int: ...
    def term_length(self, stream: str) -> int: ...
    def check_retained(self, stream: str, start: int, end: int) -> None: ...
    def frames(self, stream: str, start: int, end: int) -> Iterator[Any]: ...
    def close(self) -> None: ...


class StreamLogs:
    """The driver's open log readers, one per stream, for one data directory.

    Readers stay open between triggers (opening maps the terms). Not picklable
    on purpose: only the driver holds one; executors open their own.
    """

    def __init__(self, data_dir: str, selection: StreamSelection) -> None:
        self.data_dir = data_dir
        self.selection = selection
        self._readers: dict[str, Any] = {}

    def discover(self) -> list[str]:
        """The selected streams whose logs exist now, sorted.

        A directory that is not (yet) a stream log, such as one the gateway is
        still creating, is not a stream; a damaged log is an error.
        """
        from headgate.log import LogCorruptError, LogError, LogReader

        root = os.path.join(self.data_dir, "streams")
        if not os.path.isdir(self.data_dir):
            raise SourceError(f"data directory {self.data_dir} does not exist")
        try:
            entries = list(os.scandir(root))
        except FileNotFoundError:
            return []
        found = []
        for entry in entries:
            if not entry.is_dir() or not self.selection.matches(entry.name):
                continue
            if entry.name not in self._readers:
                try:
                    self._readers[entry.name] = LogReader.open(entry.path)
                except LogCorruptError as error:
                    raise SourceError(
                        f"stream {entry.name!r}: cannot open its log ({error})"
                    ) from error
                except LogError:
                    continue
            found.append(entry.name)
        return sorted(found)

    def names(self) -> list[str]:
        """Every stream log, selected or not, sorted: for messages (none is opened).

        A log is a directory with its metadata file, written last when a
        stream is created.
        """
        from headgate.log.metadata import META_FILE_NAME

        try:
            entries = list(os.scandir(os.path.join(self.data_dir, "streams")))
        except OSError:
            return []
        return sorted(
            e.name
            for e in entries
            if e.is_dir() and os.path.exists(os.path.join(e.path, META_FILE_NAME))
        )

    def where(self) -> str:
        """Where the logs are, for messages."""
        return f"data directory {self.data_dir}"

    def reader(self, stream: str, *, read_up_to: int | None = None) -> Any:
        """The open reader of ``stream``; :class:`SourceError` if its log is gone.

        ``read_up_to`` is where the query has read the stream to, for the message.
        """
        from headgate.log import LogError, LogReader

        directory = stream_directory(self.data_dir, stream)
        if not os.path.isdir(directory):
            self._drop(stream)
            where = "" if read_up_to is None else f" (the query has read it up to {read_up_to})"
            raise SourceError(f"stream {stream!r}: its log directory {directory} is gone{where}")
        reader = self._readers.get(stream)
        if reader is None:
            try:
                reader = LogReader.open(directory)
            except LogError as error:
                raise SourceError(f"stream {stream!r}: cannot open its log ({error})") from error
            self._readers[stream] = reader
        return reader

    def earliest(self, stream: str) -> int:
        return int(self.reader(stream).start_position())

    def latest(self, stream: str, *, read_up_to: int | None = None) -> int:
        """The stream's durable position: Spark never reads a frame that a power
        failure could still take away (and its producer then send again)."""
        return int(self.reader(stream, read_up_to=read_up_to).durable_position())

    def term_length(self, stream: str) -> int:
        return int(self.reader(stream).term_length)

    def check_retained(self, stream: str, start: int, end: int) -> None:
        check_retained(stream, self.reader(stream), start, end)

    def frames(self, stream: str, start: int, end: int) -> Iterator[Any]:
        """Frame headers in ``[start, end)``, read a page at a time."""
        from headgate.log import LogError

        reader = self.reader(stream)
        position = start
        while position < end:
            try:
                page = reader.read(position, end, max_bytes=SCAN_PAGE_BYTES)
            except LogError as error:
                raise SourceError(
                    f"stream {stream!r}: reading frames from position {position} failed ({error})"
                ) from error
            if not page:
                return  # only padding is left before ``end``
            yield from page
            position = page[-1].end_position

    def _drop(self, stream: str) -> None:
        reader = self._readers.pop(stream, None)
        if reader is not None:
            reader.close()

    def close(self) -> None:
        for stream in list(self._readers):
            self._drop(stream)


@dataclass(frozen=True, slots=True)
class _Admitted:
    timestamp_us: int
    stream: str
    end_position: int
    record_count: int
    log_bytes: int


def admit(
    logs: Logs,
    ranges: Mapping[str, tuple[int, int]],
    *,
    max_records: int | None,
    max_bytes: int | None,
) -> Offset:
    """How far each stream's range ``(start, end)`` may go in this batch.

    See the module docstring for the rule. Reads only the frame headers it
    admits (plus one per stream), so its cost follows the limit, not the backlog.
    """

    def headers(stream: str, start: int, end: int) -> Iterator[_Admitted]:
        for frame in logs.frames(stream, start, end):
            yield _Admitted(
                frame.timestamp_us,
                stream,
                frame.end_position,
                frame.record_count,
                frame.end_position - frame.position,
            )

    ends = {stream: start for stream, (start, _) in ranges.items()}
    merged = heapq.merge(
        *(headers(s, start, end) for s, (start, end) in sorted(ranges.items()) if end > start),
        key=lambda f: (f.timestamp_us, f.stream),
    )
    records = log_bytes = 0
    for taken, frame in enumerate(merged):
        records += frame.record_count
        log_bytes += frame.log_bytes
        over = (max_records is not None and records > max_records) or (
            max_bytes is not None and log_bytes > max_bytes
        )
        if over and taken:
            break
        ends[frame.stream] = frame.end_position
        if over:
            break
    return sorted_offset(ends)


def plan_slices(
    logs: Logs,
    ranges: Mapping[str, tuple[int, int]],
    target_bytes: int,
) -> list[list[StreamSlice]]:
    """Cut the ranges into partitions of about ``target_bytes`` of log each."""
    pieces: list[StreamSlice] = []
    for stream, (start, end) in sorted(ranges.items()):
        if end <= start:
            continue
        logs.check_retained(stream, start, end)
        pieces.extend(_split(logs, stream, start, end, target_bytes))
    partitions: list[list[StreamSlice]] = []
    size = 0
    for piece in pieces:
        length = piece.end - piece.start
        if not partitions or size + length > target_bytes:
            partitions.append([])
            size = 0
        partitions[-1].append(piece)
        size += length
    return partitions


def _split(
    logs: Logs, stream: str, start: int, end: int, target_bytes: int
) -> Iterable[StreamSlice]:
    count = -(-(end - start) // target_bytes)
    if count <= 1:
        return [StreamSlice(stream, start, end)]
    # Aim at equal shares, so that the last piece is not a sliver. Every term
    # start is a frame boundary (frames never cross terms), so when terms are
    # smaller than a share the cuts need no scan at all.
    share = -(-(end - start) // count)
    term_length = logs.term_length(stream)
    boundaries: Iterable[int]
    if term_length <= share:
        first_term = (start // term_length + 1) * term_length
        boundaries = range(first_term, end, term_length)
    else:
        boundaries = (frame.end_position for frame in logs.frames(stream, start, end))
    slices: list[StreamSlice] = []
    piece_start = start
    for boundary in boundaries:
        if boundary - piece_start >= share and boundary < end:
            slices.append(StreamSlice(stream, piece_start, boundary))
            piece_start = boundary
    slices.append(StreamSlice(stream, piece_start, end))
    return slices
