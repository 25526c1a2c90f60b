"""A producer's local spool: numbered batches on disk until the gateway acknowledges them.

Without a spool, a producer's unacknowledged records live only in its
memory: an application that crashes loses them, and one that resends them
under a new producer id may store twice what the gateway had stored but not
yet acknowledged. With a spool, every batch is written here, with the
sequence it was numbered under, and made durable *before* its bytes go on
the wire. A producer created later on the same directory takes the same
producer id (and secret) and sends the spooled batches again under their
sequences; the gateway's initial Ack says where its copy ends, and the
gateway drops anything it already has. So each record the spool holds is
stored once, across crashes of the application and outages of any length.

Layout of the directory::

    lock               flock'ed while a producer uses the spool
    identity           {"producer_id": N, "producer_secret": "hex"}, replaced atomically
    0000000001.seg     segments, one stream each, numbered in creation order
    0000000002.seg     ...

A segment starts with a header naming its stream, then holds entries::

    segment header                      entry (one sealed batch)
    +--------------------+              +--------------------+
    | magic "HGSPOOL1" 8 |              | magic 0x48475345 4 |
    | flags            1 |              | block length     4 |
    | reserved         3 |              | first sequence   8 |  2**64-1: never numbered
    | name length      4 |              | record count     4 |
    | crc32 (flags..name) 4             | crc32 (seq..block) 4 |
    | stream name (utf-8)|              | records block      |
    +--------------------+              +--------------------+

Flag 1 (RESTART) means the segment replaces every earlier segment of its
stream: it is written when batches are numbered afresh (a gap after a
damaged entry, batches spooled before their stream's sequence was known),
made durable, and only then are the older segments deleted, so a crash in
between never leaves two numberings of the same records.

A stream's batches are acknowledged in order, so a segment whose last
sequence is acknowledged holds nothing needed and is deleted; the bound
(``max_bytes``) counts the segments' bytes on disk.

Damage: an entry cut short at the end of a file is the tail of a write that
never finished, so never sent; it is dropped and counted
(:attr:`Spool.torn_entries`). An entry that is whole but fails its checksum,
or a segment whose header is damaged, is reported by a warning that names
the file (:attr:`Spool.problems`); its records are lost, the intact entries
are still sent, and the producer numbers afresh whatever comes after a gap.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from headgate.log.lock import DirectoryInUse, DirectoryLock

__all__ = ["Spool", "SpoolError", "SpooledBatch"]

log = logging.getLogger("headgate.spool")

_SEGMENT_MAGIC: Final = b"HGSPOOL1"
_SEGMENT_HEADER: Final = struct.Struct("<8sB3xII")  # magic, flags, name length, crc
_ENTRY_MAGIC: Final = 0x48475345
_ENTRY_HEADER: Final = struct.Struct("<IIQII")  # magic, length, first sequence, count, crc
_UNNUMBERED: Final = (1 << 64) - 1
_RESTART: Final = 1
_SUFFIX: Final = ".seg"

#: Bytes an entry takes beyond its records block.
ENTRY_OVERHEAD: Final = _ENTRY_HEADER.size


class SpoolError(Exception):
    """The spool cannot be used as asked: in use, another producer's, unreadable."""


@dataclass(frozen=True, slots=True)
class SpooledBatch:
    """A batch read back from the spool."""

    #: Its sequence, or None if it was spooled before its stream's sequence was known.
    first_sequence: int | None
    #: How many records.
    record_count: int
    #: The records block.
    block: bytes


class _Segment:
    __slots__ = ("end_sequence", "fd", "number", "path", "size")

    def __init__(self, number: int, path: Path, size: int) -> None:
        self.number = number
        self.path = path
        self.size = size
        # Open for appends while this is its stream's newest segment.
        self.fd: int | None = None
        # The end of the last numbered entry's sequence; -1: none numbered
        # (kept until a restart replaces it).
        self.end_sequence = -1


class Spool:
    """One producer's spool directory, locked for as long as the object is open.

    Args:
        directory: the spool's directory (created if absent).
        max_bytes: the most bytes its segments may take on disk; see :meth:`fits`.
    """

    def __init__(self, directory: Path, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"spool_max_bytes must be positive, got {max_bytes}")
        self.directory = directory
        self.max_bytes = max_bytes
        self._segment_bytes = max(64 * 1024, min(16 * 1024 * 1024, max_bytes // 8))
        try:
            self._lock = DirectoryLock.acquire(directory, "lock")
        except DirectoryInUse as exc:
            raise SpoolError(f"the spool {directory} is in use by another producer") from exc
        except OSError as exc:
            raise SpoolError(f"cannot use {directory} as a spool: {exc}") from exc
        #: The producer id and secret the spool belongs to, or None for a new spool.
        self.producer_id: int | None = None
        self.producer_secret: bytes = b""
        #: Entries dropped because a crash cut them short (never sent).
        self.torn_entries = 0
        #: One line per damaged file or entry found on opening.
        self.problems: list[str] = []
        #: What the spool held on opening, per stream, in sequence order.
        self.recovered: dict[str, list[SpooledBatch]] = {}
        self._segments: dict[str, list[_Segment]] = {}
        self._next_number = 1
        self._bytes = 0
        self._dirty: set[int] = set()
        self._new_files = False
        try:
            self._read_identity()
            self._load()
        except BaseException:
            self.close()
            raise

    # -- identity -------------------------------------------------------------------

    def _read_identity(self) -> None:
        path = self.directory / "identity"
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return
        try:
            data = json.loads(text)
            producer_id = int(data["producer_id"])
            secret = bytes.fromhex(data.get("producer_secret", ""))
        except (ValueError, KeyError, TypeError) as exc:
            raise SpoolError(f"{path} is damaged ({exc}); the spool cannot be resumed") from None
        self.producer_id = producer_id
        self.producer_secret = secret

    def write_identity(self, producer_id: int, secret: bytes) -> None:
        """Record who the spool belongs to, durably, before any batch of theirs is spooled."""
        if producer_id == self.producer_id and secret == self.producer_secret:
            return
        text = json.dumps({"producer_id": producer_id, "producer_secret": secret.hex()})
        temporary = self.directory / "identity.tmp"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, text.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, self.directory / "identity")
        self._sync_directory()
        self.producer_id = producer_id
        self.producer_secret = secret

    # -- reading back -----------------------------------------------------------------

    def _load(self) -> None:
        numbered: list[tuple[int, Path]] = []
        for path in self.directory.glob(f"*{_SUFFIX}"):
            stem = path.name[: -len(_SUFFIX)]
            if stem.isdigit():
                numbered.append((int(stem), path))
        numbered.sort()
        entries: dict[str, list[tuple[_Segment, SpooledBatch]]] = {}
        for number, path in numbered:
            self._next_number = max(self._next_number, number + 1)
            data = path.read_bytes()
            header = self._read_header(path, data)
            if header is None:
                continue
            stream, flags, offset = header
            segment = _Segment(number, path, len(data))
            if flags & _RESTART:
                entries.pop(stream, None)
                for old in self._segments.pop(stream, []):
                    self._delete(old)
            problems = len(self.problems)
            read = self._read_entries(path, data, offset)
            if not read:
                if len(self.problems) > problems:
                    # Nothing left to send from it: kept aside for a person to look at.
                    path.rename(path.with_suffix(".damaged"))
                else:
                    path.unlink()
                continue
            batches = entries.setdefault(stream, [])
            for batch in read:
                batches.append((segment, batch))
                if batch.first_sequence is not None:
                    segment.end_sequence = batch.first_sequence + batch.record_count
            self._segments.setdefault(stream, []).append(segment)
            self._bytes += segment.size
        for stream, pairs in entries.items():
            if pairs:
                self.recovered[stream] = [batch for _, batch in pairs]
        for problem in self.problems:
            log.warning("%s", problem)

    def _read_header(self, path: Path, data: bytes) -> tuple[str, int, int] | None:
        size = _SEGMENT_HEADER.size
        if len(data) < size:
            # Created by a producer that died before its first entry was durable.
            self.torn_entries += 1
            path.unlink(missing_ok=True)
            return None
        magic, flags, name_length, crc = _SEGMENT_HEADER.unpack_from(data)
        name_bytes = data[size : size + name_length]
        checked = data[8:9] + struct.pack("<I", name_length) + name_bytes
        if magic != _SEGMENT_MAGIC or len(name_bytes) != name_length:
            if magic == _SEGMENT_MAGIC and size + name_length > len(data):
                self.torn_entries += 1
                path.unlink(missing_ok=True)
                return None
            self.problems.append(
                f"spool file {path} is damaged: not a spool segment; its records are lost"
            )
            path.rename(path.with_suffix(".damaged"))
            return None
        if zlib.crc32(checked) != crc:
            self.problems.append(
                f"spool file {path} is damaged: its header fails its checksum; its records are lost"
            )
            path.rename(path.with_suffix(".damaged"))
            return None
        return name_bytes.decode("utf-8", errors="replace"), flags, size + name_length

    def _read_entries(self, path: Path, data: bytes, offset: int) -> list[SpooledBatch]:
        batches: list[SpooledBatch] = []
        header = _ENTRY_HEADER.size
        end = len(data)
        while offset < end:
            if end - offset < header:
                self.torn_entries += 1
                break
            magic, length, first, count, crc = _ENTRY_HEADER.unpack_from(data, offset)
            if magic != _ENTRY_MAGIC:
                self.problems.append(
                    f"spool file {path} is damaged at byte {offset}: the {end - offset} bytes "
                    "from there on cannot be read, and their records are lost"
                )
                break
            body_end = offset + header + length
            if body_end > end:
                self.torn_entries += 1  # a write the crash cut short: never sent
                break
            block = data[offset + header : body_end]
            if zlib.crc32(data[offset + 8 : offset + 20] + block) != crc:
                self.problems.append(
                    f"spool file {path} is damaged at byte {offset}: an entry of {count} "
                    "records fails its checksum and is lost; the entries after it are kept"
                )
            else:
                batches.append(SpooledBatch(None if first == _UNNUMBERED else first, count, block))
            offset = body_end
        return batches

    # -- writing ----------------------------------------------------------------------

    @property
    def bytes_used(self) -> int:
        """Bytes the segments take on disk."""
        return self._bytes

    def fits(self, block_length: int) -> bool:
        """Whether an entry for a block this long stays within ``max_bytes``.

        An empty spool takes any entry, so that a batch larger than the
        bound still goes, alone.
        """
        return self._bytes == 0 or self._bytes + block_length + 2 * ENTRY_OVERHEAD + 256 <= (
            self.max_bytes
        )

    def append(self, stream: str, first_sequence: int | None, count: int, block: bytes) -> None:
        """Write one batch; durable at the next :meth:`sync`, which must come before it is sent."""
        segments = self._segments.setdefault(stream, [])
        segment = segments[-1] if segments else None
        if segment is None or segment.fd is None or segment.size >= self._segment_bytes:
            segment = self._new_segment(stream, 0)
            segments.append(segment)
        self._write_entry(segment, first_sequence, count, block)

    def restart(self, stream: str, batches: list[tuple[int | None, int, bytes]]) -> None:
        """Replace every segment of ``stream`` by one holding ``batches``, durably.

        For batches numbered afresh: the new segment is on disk before the
        old ones go, and its RESTART flag makes a reader ignore them if a
        crash comes in between.
        """
        segment = self._new_segment(stream, _RESTART)
        for first, count, block in batches:
            self._write_entry(segment, first, count, block)
        self.sync()
        for old in self._segments.get(stream, []):
            self._delete(old)
        self._segments[stream] = [segment]

    def acked(self, stream: str, next_sequence: int) -> bool:
        """The gateway holds ``stream`` up to ``next_sequence``: delete segments it covers.

        The segment open for appends stays unless it is full (a file per
        acknowledgement would cost a create and a directory sync each);
        True if bytes were freed.
        """
        segments = self._segments.get(stream)
        if not segments:
            return False
        freed = False
        keep: list[_Segment] = []
        for segment in segments:
            done = 0 <= segment.end_sequence <= next_sequence
            appending = segment.fd is not None
            if done and (not appending or segment.size >= self._segment_bytes):
                self._delete(segment)
                freed = True
            else:
                keep.append(segment)
        self._segments[stream] = keep
        return freed

    def reclaim(self, acked: dict[str, int]) -> bool:
        """Delete every segment wholly acknowledged, newest ones too; True if bytes were freed.

        ``acked`` is, per stream, where the gateway's acknowledged copy ends.
        """
        freed = False
        for stream, segments in self._segments.items():
            end = acked.get(stream)
            if end is None:
                continue
            keep = []
            for segment in segments:
                if 0 <= segment.end_sequence <= end:
                    self._delete(segment)
                    freed = True
                else:
                    keep.append(segment)
            self._segments[stream] = keep
        return freed

    def sync(self) -> None:
        """Make every entry written so far durable (and new files' names)."""
        for fd in self._dirty:
            os.fsync(fd)
        self._dirty.clear()
        if self._new_files:
            self._sync_directory()
            self._new_files = False

    def take_sync(self) -> Callable[[], None]:
        """What :meth:`sync` would do, as a function to run in another thread.

        It owns duplicates of the files' descriptors (so that a segment
        closed or deleted meanwhile cannot pull one from under it) and
        covers the entries written before this call; later ones wait for
        the next.
        """
        fds = [os.dup(fd) for fd in self._dirty]
        self._dirty.clear()
        directory = self.directory if self._new_files else None
        self._new_files = False

        def sync() -> None:
            try:
                for fd in fds:
                    os.fsync(fd)
                if directory is not None:
                    _sync_directory(directory)
            finally:
                for fd in fds:
                    os.close(fd)

        return sync

    @property
    def needs_sync(self) -> bool:
        """Whether entries were written since the last :meth:`sync`."""
        return bool(self._dirty) or self._new_files

    def clear(self) -> None:
        """Delete every segment: the gateway acknowledged everything."""
        for segments in self._segments.values():
            for segment in segments:
                self._delete(segment)
        self._segments.clear()

    def close(self) -> None:
        """Close the files and give the lock back; the segments stay for the next producer."""
        for segments in self._segments.values():
            for segment in segments:
                self._close_file(segment)
        self._dirty.clear()
        self._lock.release()

    # -- files ----------------------------------------------------------------------

    def _new_segment(self, stream: str, flags: int) -> _Segment:
        segments = self._segments.get(stream)
        if segments:
            self._close_file(segments[-1])
        number = self._next_number
        self._next_number += 1
        path = self.directory / f"{number:010d}{_SUFFIX}"
        name = stream.encode()
        checked = bytes([flags]) + struct.pack("<I", len(name)) + name
        header = _SEGMENT_HEADER.pack(_SEGMENT_MAGIC, flags, len(name), zlib.crc32(checked))
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC
        fd = os.open(path, flags, 0o600)  # records, like the identity's secret
        os.write(fd, header + name)
        segment = _Segment(number, path, len(header) + len(name))
        segment.fd = fd
        self._bytes += segment.size
        self._dirty.add(fd)
        self._new_files = True
        return segment

    def _write_entry(
        self, segment: _Segment, first_sequence: int | None, count: int, block: bytes
    ) -> None:
        assert segment.fd is not None
        first = _UNNUMBERED if first_sequence is None else first_sequence
        middle = struct.pack("<QI", first, count)
        crc = zlib.crc32(middle + block)
        header = _ENTRY_HEADER.pack(_ENTRY_MAGIC, len(block), first, count, crc)
        os.write(segment.fd, header + block)
        size = len(header) + len(block)
        segment.size += size
        self._bytes += size
        if first_sequence is not None:
            segment.end_sequence = first_sequence + count
        self._dirty.add(segment.fd)

    def _delete(self, segment: _Segment) -> None:
        # No directory fsync: a deletion a crash undoes brings back entries
        # the gateway holds already, which it drops as duplicates.
        self._close_file(segment, sync=False)
        segment.path.unlink(missing_ok=True)
        self._bytes -= segment.size

    def _close_file(self, segment: _Segment, *, sync: bool = True) -> None:
        fd = segment.fd
        if fd is not None:
            if fd in self._dirty:
                self._dirty.discard(fd)
                if sync:
                    os.fsync(fd)  # its entries may be sent before the next sync()
            os.close(fd)
            segment.fd = None

    def _sync_directory(self) -> None:
        _sync_directory(self.directory)


def _sync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
