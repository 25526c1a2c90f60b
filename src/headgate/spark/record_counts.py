"""Record counts for the Spark source's progress: its lag, and what ``failOnDataLoss`` skipped.

The gateway keeps each stream's cumulative record count by position (its
record index, :mod:`headgate.log.record_index`, in
``<data_dir>/state/<stream>.records``). A local read uses the same file
and the same rule (:meth:`~headgate.log.record_index.Marks.count_at`): the
nearest mark, plus at most a stride of frame headers read from the log. A
count is ``(epoch, C)``; two counts are subtracted only within one epoch.

Through a gateway (``gateway`` or ``cluster``) the driver asks it
(CountRecords, :class:`RemoteRecordCounts`): the same counts, taken by the
gateway from its index.

What the log freed is countable from a count taken while it was held: the
planner remembers the count at each end it planned (:class:`PlannedCounts`),
and the gateway stores one with a non-blocking consumer's committed position
(where a query that restarts from its checkpoint resumes).
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from headgate.log.record_index import StoredMarks, read_marks, record_index_file

__all__ = ["LocalRecordCounts", "PlannedCounts", "RecordCounter", "RemoteRecordCounts"]

#: Counts remembered per stream (the ends of the last few planned batches).
REMEMBERED = 16

Count = tuple[int, int]
"""``(epoch, C)``: the record index's count at a position, in its epoch."""


class RecordCounter(Protocol):
    """Where the planner gets counts: a data directory or a gateway."""

    def count_at(self, stream: str, position: int) -> Count | None: ...
    def consumer_count(self, stream: str, consumer: str | None, position: int) -> Count | None: ...


class PlannedCounts:
    """The counts at the positions a query planned, per stream (the newest few)."""

    def __init__(self) -> None:
        self._counts: dict[str, OrderedDict[int, Count]] = {}

    def remember(self, stream: str, position: int, count: Count) -> None:
        counts = self._counts.setdefault(stream, OrderedDict())
        counts[position] = count
        counts.move_to_end(position)
        while len(counts) > REMEMBERED:
            counts.popitem(last=False)

    def get(self, stream: str, position: int) -> Count | None:
        counts = self._counts.get(stream)
        return None if counts is None else counts.get(position)


class LocalRecordCounts:
    """Counts from a gateway's data directory, read by the driver.

    ``reader_of(stream)`` is the driver's open :class:`~headgate.log.LogReader`.
    """

    def __init__(self, data_dir: str, reader_of: Any) -> None:
        self.data_dir = Path(data_dir)
        self._reader_of = reader_of
        # stream -> ((size, mtime_ns), marks): the file is read again when it changes.
        self._marks: dict[str, tuple[tuple[int, int], StoredMarks | None]] = {}

    def _stored(self, stream: str) -> StoredMarks | None:
        path = record_index_file(self.data_dir, stream)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        key = (st.st_size, st.st_mtime_ns)
        cached = self._marks.get(stream)
        if cached is not None and cached[0] == key:
            return cached[1]
        try:
            stored = read_marks(path)
        except (OSError, ValueError):
            stored = None  # a file being replaced, or none yet: not countable now
        self._marks[stream] = (key, stored)
        return stored

    def count_at(self, stream: str, position: int) -> Count | None:
        """``(epoch, C(position))``, or None where it cannot be known now."""
        from headgate.log import LogError

        stored = self._stored(stream)
        if stored is None:
            return None
        reader = self._reader_of(stream)

        def scan(start: int, end: int) -> Iterator[tuple[int, int]]:
            for frame in reader.read(start, end):
                yield frame.end_position, frame.record_count

        try:
            count = stored.marks.count_at(position, reader.start_position(), scan, [stored.release])
        except LogError:
            return None  # freed or changing while read: unknown this time
        return None if count is None else (stored.epoch, count)

    def consumer_count(self, stream: str, consumer: str | None, position: int) -> Count | None:
        """The count the gateway stored with ``consumer``'s committed ``position``, if any."""
        if consumer is None:
            return None
        from headgate.gateway.consumers import consumers_file

        try:
            raw = json.loads(consumers_file(self.data_dir, stream).read_text())
            for entry in raw["consumers"]:
                if entry["name"] == consumer and entry["position"] == position:
                    epoch, count = entry["records"]
                    return int(epoch), int(count)
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return None


class RemoteRecordCounts:
    """Counts asked of the gateway that holds each stream (CountRecords).

    ``logs`` is the planner's :class:`~headgate.spark.remote.GatewayLogs` or
    :class:`~headgate.spark.fleet.FleetLogs`. A gateway that cannot answer
    (down, or older than CountRecords) gives no count: progress never fails
    a query.
    """

    def __init__(self, logs: Any) -> None:
        self._logs = logs

    def count_at(self, stream: str, position: int) -> Count | None:
        from headgate.spark.decode import SourceError

        try:
            epoch, counts = self._logs.count_records(stream, (position,))
        except SourceError:
            return None
        count = counts[0] if counts else None
        return None if count is None else (int(epoch), int(count))

    def consumer_count(self, stream: str, consumer: str | None, position: int) -> Count | None:
        """None: the gateway's answer to :meth:`count_at` already includes it."""
        return None
