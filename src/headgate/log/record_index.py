"""Cumulative record counts by log position: lag and skipped data in records, cheaply.

A consumer's lag in bytes is a subtraction of positions; its lag in records
needs to know how many records lie between two positions. The frame headers
say it, but reading every header between a slow consumer and the tail costs
as much as the lag. So the gateway keeps, per stream, the *count* ``C(p)``:
the records in the data frames that end at or before position ``p``, counted
from the index's origin (the first position it saw). Records in ``[a, b)``
are ``C(b) - C(a)``.

``C`` is known exactly at *marks*: a mark is taken at the first frame end at
or after every ``stride`` bytes of log, as batches are appended (the gateway
knows each batch's record count: one addition and one comparison per batch,
:meth:`RecordIndex.appended`), plus two moving points, the tail
(``C(tail)``, the running total) and the log's release position (stored
when the log frees). Between marks, ``C(p)`` is the nearest held mark plus
the record counts of at most ``stride`` bytes of frame headers
(:meth:`Marks.count_at`, the one rule, used by the gateway and by a local
Spark read alike).

Freed data: a mark outlives the frames it counts, so records in a freed range
stay countable between marks, and between positions whose count was taken
while they were held (the gateway stores it for each non-blocking consumer's
committed position; the Spark source remembers it for the ends it planned).

Memory: at most :data:`MAX_HELD_MARKS` marks over what the log holds (the
stride grows with the log's capacity) plus :data:`MAX_FREED_MARKS` behind
its release position, 16 bytes each: at most 256 KiB per stream (the
stride is fixed when the stream opens: a reload that raises its capacity
raises the held marks in proportion until the next start).

The marks are stored in ``<data_dir>/state/<stream>.records`` (little-endian)::

     0        4        8                16                24                32
    +--------+--------+----------------+----------------+----------------+
    | "HGRC" |version | epoch          | release pos.   | C(release)     |  header
    +--------+--------+----------------+----------------+----------------+
    | position (u64)  | C(position)    |  ... one 16-byte entry per mark, ascending
    +-----------------+----------------+

Crash rules: a mark is appended only once the log is durable up to it, so
a mark never names a frame a crash can take away; the header's release
point is rewritten in place before the log frees (no fsync: a SIGKILL keeps
the page cache). At open, marks beyond the recovered tail are dropped, and
``C`` at the log's release position is derived from the release point or
the first mark after it. If nothing can give it (a power loss lost the file's
last writes, or the file is gone while the log freed data), the index starts
a new *epoch* (the old one plus one; a new or replaced file takes the
clock's microseconds): counts taken in another epoch are not compared with
the new ones (a count across them is unknown, never wrong).
"""

from __future__ import annotations

import bisect
import logging
import os
import struct
import sys
import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = [
    "MAX_FREED_MARKS",
    "MAX_HELD_MARKS",
    "MIN_STRIDE",
    "Marks",
    "RecordIndex",
    "ScanRecords",
    "read_marks",
    "record_index_file",
    "stride_for",
]

log = logging.getLogger("headgate.log")

#: ``(end_position, record_count)`` of the data frames in ``[start, end)``
#: (both frame boundaries), in log order: a scan of their headers.
ScanRecords = Callable[[int, int], Iterable[tuple[int, int]]]

MAGIC: Final = b"HGRC"
VERSION: Final = 1
HEADER: Final = struct.Struct("<4sIQQQ")
RELEASE_POINT: Final = struct.Struct("<QQ")
RELEASE_OFFSET: Final = 16
ENTRY: Final = struct.Struct("<QQ")
#: The smallest stride: a count between marks reads at most this many bytes
#: of frame headers (about 1,400 headers of the smallest frames).
MIN_STRIDE: Final = 64 * 1024
#: Most marks over the bytes a log holds: the stride grows with its capacity.
MAX_HELD_MARKS: Final = 8192
#: Most marks kept behind the release position (for counting freed ranges).
MAX_FREED_MARKS: Final = 8192


def record_index_file(data_dir: Path, stream: str) -> Path:
    """Where the record marks of ``stream`` are stored in a data directory."""
    return data_dir / "state" / f"{stream}.records"


def stride_for(log_capacity: int) -> int:
    """Bytes of log between marks, for a log that holds ``log_capacity`` bytes."""
    return max(MIN_STRIDE, -(-log_capacity // MAX_HELD_MARKS))


class Marks:
    """Known counts ``C(position)``, ascending, and the rule that counts between them."""

    __slots__ = ("counts", "positions")

    def __init__(self, positions: Iterable[int] = (), counts: Iterable[int] = ()) -> None:
        self.positions = array("q", positions)
        self.counts = array("q", counts)

    def __len__(self) -> int:
        return len(self.positions)

    def add(self, position: int, count: int) -> None:
        """A mark after every other one."""
        self.positions.append(position)
        self.counts.append(count)

    def drop_before(self, index: int) -> None:
        """Forget the marks before ``index``."""
        del self.positions[:index]
        del self.counts[:index]

    def count_at(
        self,
        position: int,
        earliest: int,
        scan: ScanRecords,
        points: Sequence[tuple[int, int]] = (),
    ) -> int | None:
        """``C(position)``, or None if nothing known reaches it.

        ``earliest``: the oldest position the log still holds (headers can
        be read from there on). ``points``: more known ``(position, C)``
        (the tail, the release point). A freed position is known only where
        a mark is; a held one from the nearest held known point, before it
        (adding the headers in between) or after it (taking them away), so
        at most about one stride of headers is read. ``scan`` raises what
        the log raises.
        """
        i = bisect.bisect_right(self.positions, position) - 1
        if i >= 0 and self.positions[i] == position:
            return self.counts[i]
        for at, count in points:
            if at == position:
                return count
        if position < earliest:
            return None
        before: tuple[int, int] | None = None
        after: tuple[int, int] | None = None
        if i >= 0 and self.positions[i] >= earliest:
            before = (self.positions[i], self.counts[i])
        if i + 1 < len(self.positions):
            after = (self.positions[i + 1], self.counts[i + 1])
        for at, count in points:
            if earliest <= at < position and (before is None or at > before[0]):
                before = (at, count)
            elif at > position and (after is None or at < after[0]):
                after = (at, count)
        if before is not None and (after is None or position - before[0] <= after[0] - position):
            return before[1] + sum(n for _, n in scan(before[0], position))
        if after is not None:
            return after[1] - sum(n for _, n in scan(position, after[0]))
        return None


@dataclass(frozen=True, slots=True)
class StoredMarks:
    """What a record index file holds."""

    epoch: int
    #: The release point: ``(position, C(position))`` written before the log freed to it.
    release: tuple[int, int]
    marks: Marks


def read_marks(path: Path) -> StoredMarks | None:
    """The marks stored at ``path``; None without a file.

    Raises:
        ValueError: the file is not a record index (names the file).
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    if len(data) < HEADER.size:
        raise ValueError(f"{path}: record index too short ({len(data)} bytes)")
    magic, version, epoch, release, release_count = HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise ValueError(f"{path}: not a version {VERSION} record index")
    usable = (len(data) - HEADER.size) // ENTRY.size * ENTRY.size
    body = array("q", data[HEADER.size : HEADER.size + usable])
    if body.itemsize != 8:  # pragma: no cover - every platform headgate runs on
        raise ValueError("array('q') is not 8 bytes here")
    if sys.byteorder != "little":  # pragma: no cover
        body.byteswap()
    marks = Marks(body[0::2], body[1::2])
    return StoredMarks(epoch, (release, release_count), marks)


class RecordIndex:
    """The gateway's record counts for one stream log. Create with :meth:`open`.

    Every method runs on the thread that appends (the event loop).
    """

    def __init__(
        self, path: Path, fd: int, *, stride: int, epoch: int, marks: Marks, written: int
    ) -> None:
        self.path = path
        self._fd = fd
        self.stride = stride
        self.epoch = epoch
        self.marks = marks
        #: ``C`` at the newest appended frame's end (and so at the tail).
        self.total = 0
        #: The next mark is taken at the first frame end at or after this.
        self.next_mark = 0
        #: The release point: ``(position, C(position))``.
        self.release = (0, 0)
        # Marks in the file (entries after the header).
        self._written = written
        # Marks dropped from memory since the file was last rewritten.
        self._dropped = 0

    @classmethod
    def open(
        cls,
        path: Path,
        *,
        stride: int,
        release: int,
        tail: int,
        scan: ScanRecords,
    ) -> RecordIndex:
        """The stream's index: the stored marks, checked against the log, then its newest frames.

        Reads the frame headers after the newest stored mark (after a clean
        stop: less than one stride; the whole held log for a log that had no
        index). A damaged file is replaced (WARNING), in a new epoch.
        """
        try:
            stored = read_marks(path)
        except ValueError as exc:
            log.warning("%s; rebuilt from the log", exc)
            stored = None
        # A new file (or one replacing a damaged one) may meet counts stored
        # elsewhere under an older epoch (a consumer's): a clock-made epoch
        # never equals one of them; a known one only moves up.
        epoch = time.time_ns() // 1000
        marks = Marks()
        c_release: int | None = 0
        if stored is not None:
            epoch = stored.epoch
            marks = stored.marks
            keep = bisect.bisect_right(marks.positions, tail)
            del marks.positions[keep:], marks.counts[keep:]
            point = stored.release
            c_release = marks.count_at(release, release, scan, [point] if point[0] <= tail else [])
            if c_release is None:
                log.warning(
                    "%s: no record count reaches the log's release position %d; counting "
                    "anew (counts across the freed data are unknown)",
                    path,
                    release,
                )
                epoch += 1
                marks = Marks()
                c_release = 0
        assert c_release is not None
        # Scan on from the newest mark the log holds (or the release position).
        i = bisect.bisect_right(marks.positions, tail) - 1
        start, total = release, c_release
        if i >= 0 and marks.positions[i] >= release:
            start, total = marks.positions[i], marks.counts[i]
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        index = cls(path, fd, stride=stride, epoch=epoch, marks=marks, written=0)
        index.total = total
        index.next_mark = start + stride
        index.release = (release, c_release)
        try:
            index._scan_from(start, tail, scan)
            # Recovery made the log durable to its tail: every mark can be stored.
            index._rewrite(len(index.marks))
        except BaseException:
            os.close(fd)
            raise
        return index

    def _scan_from(self, start: int, tail: int, scan: ScanRecords) -> None:
        position = start
        for end, records in scan(start, tail):
            position = end
            self.total += records
            if end >= self.next_mark:
                self.mark(end)
        assert position <= tail

    # -- the append path -------------------------------------------------------------

    def appended(self, end_position: int, record_count: int) -> None:
        """A frame of ``record_count`` records was appended, ending at ``end_position``.

        The gateway inlines these two lines on its append path; this is
        the reference (and what tests call).
        """
        self.total += record_count
        if end_position >= self.next_mark:
            self.mark(end_position)

    def mark(self, end_position: int) -> None:
        """Take a mark at ``end_position`` (the newest frame's end): ``C`` is the total."""
        self.marks.add(end_position, self.total)
        self.next_mark = end_position + self.stride

    # -- counting ----------------------------------------------------------------------

    def count_at(self, position: int, earliest: int, tail: int, scan: ScanRecords) -> int | None:
        """``C(position)`` (see :meth:`Marks.count_at`); the log holds ``[earliest, tail]``."""
        if position == tail:
            return self.total
        return self.marks.count_at(position, earliest, scan, [self.release, (tail, self.total)])

    # -- durability and freeing --------------------------------------------------------

    @classmethod
    def in_memory(cls, stride: int = MIN_STRIDE) -> RecordIndex:
        """An index with no file (a stream not opened from a data directory)."""
        return cls(Path(os.devnull), -1, stride=stride, epoch=1, marks=Marks(), written=0)

    def durable(self, position: int) -> None:
        """The log is durable up to ``position``: store the marks up to it (no fsync).

        One ``pwrite`` when a mark is due, nothing otherwise.
        """
        if self._fd < 0:
            return
        marks = self.marks
        first = self._written - self._dropped
        if first >= len(marks) or marks.positions[first] > position:
            return
        last = bisect.bisect_right(marks.positions, position, lo=first)
        body = array("q")
        for k in range(first, last):
            body.append(marks.positions[k])
            body.append(marks.counts[k])
        os.pwrite(self._fd, body.tobytes(), HEADER.size + self._written * ENTRY.size)
        self._written += last - first

    def freeing(self, position: int, count: int) -> None:
        """The log is about to free up to ``position``, where ``C`` is ``count``.

        Stores the release point first (so that after a crash the count at
        the log's release position is known), and forgets the oldest freed
        marks beyond :data:`MAX_FREED_MARKS` (the file is rewritten when
        half of it is forgotten marks).
        """
        self.release = (position, count)
        if self._fd >= 0:
            os.pwrite(self._fd, RELEASE_POINT.pack(position, count), RELEASE_OFFSET)
        freed = bisect.bisect_left(self.marks.positions, position)
        # Only marks already in the file may go from memory (the log frees
        # only what is durable, so in practice all of them are).
        extra = min(freed - MAX_FREED_MARKS, self._written - self._dropped)
        if extra > 0:
            self.marks.drop_before(extra)
            self._dropped += extra
            if self._fd >= 0 and self._dropped > max(MAX_FREED_MARKS, len(self.marks)):
                self._rewrite(self._written - self._dropped)

    def _rewrite(self, stored: int) -> None:
        """Replace the file by the first ``stored`` marks in memory (temporary file, fsync, rename).

        The marks after them wait for :meth:`durable`.
        """
        marks = self.marks
        tmp = self.path.with_suffix(".records-tmp")
        body = array("q")
        for k in range(max(0, stored)):
            body.append(marks.positions[k])
            body.append(marks.counts[k])
        release, count = self.release
        with open(tmp, "wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, self.epoch, release, count))
            f.write(body.tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        os.close(self._fd)
        self._fd = os.open(self.path, os.O_RDWR)
        self._written = max(0, stored)
        self._dropped = 0

    def close(self, durable: int | None = None) -> None:
        """Store the marks up to ``durable``, fsync, close."""
        if self._fd < 0:
            return
        try:
            if durable is not None:
                self.durable(durable)
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = -1
