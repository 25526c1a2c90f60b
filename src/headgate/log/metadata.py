"""The metadata page: a stream log's settings and its three positions, in one mapped page.

The file ``meta`` is one 4096-byte page, little-endian::

       0                   1                   2                   3
       0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
      +---------------------------------------------------------------+
    0 |                   Magic "HGSTLOG\\0" (8 bytes)                 |
      |                                                               |
      +---------------------------------------------------------------+
    8 |                    Layout Version (u32)                       |
      +---------------------------------------------------------------+
   12 |                  Frame Header Length (u32)                    |
      +---------------------------------------------------------------+
   16 |                      Term Length (u64)                        |
      |                                                               |
      +---------------------------------------------------------------+
   24 |                        Capacity (u64)                         |
      |                                                               |
      +---------------------------------------------------------------+
   32 |               Settings Checksum (CRC-32 of 0..32)             |
      +---------------------------------------------------------------+
   36 |                      zero up to byte 64                       |
      +---------------------------------------------------------------+
   64 |                   Published Position (i64)                    |
      |                                                               |
      +---------------------------------------------------------------+
   72 |                      zero up to byte 128                      |
      +---------------------------------------------------------------+
  128 |                    Durable Position (i64)                     |
      |                                                               |
      +---------------------------------------------------------------+
  136 |                    Release Position (i64)                     |
      |                                                               |
      +---------------------------------------------------------------+
  144 |              Positions Checksum (CRC-32 of 128..144)          |
      +---------------------------------------------------------------+
  148 |                      zero up to byte 4096                     |
      +---------------------------------------------------------------+

The settings never change after creation. The published position is rewritten
after every append, so it lives apart and carries no checksum (an append must
not pay for one); readers treat it as a hint that frame checksums confirm. The
durable and release positions change at group commit and release, together,
under a checksum, so a reader or recovery can tell a torn or damaged pair
from a real one.

Everything here is a hint for speed: recovery believes the positions only as
far as the frames on disk agree with them (see LOG.md).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import time
import zlib
from pathlib import Path
from typing import Final, NamedTuple

from headgate.log.errors import LogCorruptError, LogError
from headgate.log.term import fsync_directory

META_FILE_NAME: Final = "meta"
META_LENGTH: Final = 4096
MAGIC: Final = b"HGSTLOG\x00"
LAYOUT_VERSION: Final = 1

SETTINGS_OFFSET: Final = 0
SETTINGS: Final = struct.Struct("<8sIIQQ")
SETTINGS_CHECKSUM_OFFSET: Final = 32
PUBLISHED_POSITION_OFFSET: Final = 64
PUBLISHED_WORD: Final = PUBLISHED_POSITION_OFFSET // 8
"""Index of the published position in :attr:`MetadataPage.words`."""
POSITIONS_OFFSET: Final = 128
POSITIONS: Final = struct.Struct("<qq")
POSITIONS_CHECKSUM_OFFSET: Final = 144

I64: Final = struct.Struct("<q")
U32: Final = struct.Struct("<I")

# A reader that finds the positions checksum wrong is most likely looking at a
# pair the writer is halfway through storing; it retries this many times.
_POSITION_READ_ATTEMPTS: Final = 100


class Settings(NamedTuple):
    """The fixed settings of a log, stored at creation."""

    term_length: int
    capacity: int


class Positions(NamedTuple):
    """The durable and release positions, as stored together under one checksum."""

    durable: int
    release: int


class MetadataPage:
    """The mapped ``meta`` file of one log: settings, published position, durable/release pair."""

    __slots__ = ("buffer", "fd", "path", "settings", "words")

    def __init__(self, path: Path, fd: int, buffer: mmap.mmap, settings: Settings) -> None:
        self.path = path
        self.fd = fd
        #: The mapped page; the writer stores the published position straight into it.
        self.buffer = buffer
        #: The page as native signed 64-bit words; ``words[PUBLISHED_WORD]``
        #: is the published position, stored by the writer with one aligned
        #: 8-byte store per publish.
        self.words = memoryview(buffer).cast("q")
        self.settings = settings

    @classmethod
    def create(cls, directory: Path, settings: Settings, header_length: int) -> MetadataPage:
        """Write a new metadata page atomically (temporary file, fsync, rename) and open it."""
        page = bytearray(META_LENGTH)
        SETTINGS.pack_into(
            page,
            SETTINGS_OFFSET,
            MAGIC,
            LAYOUT_VERSION,
            header_length,
            settings.term_length,
            settings.capacity,
        )
        U32.pack_into(page, SETTINGS_CHECKSUM_OFFSET, zlib.crc32(page[:SETTINGS_CHECKSUM_OFFSET]))
        POSITIONS.pack_into(page, POSITIONS_OFFSET, 0, 0)
        U32.pack_into(page, POSITIONS_CHECKSUM_OFFSET, _positions_checksum(0, 0))
        temp = directory / (META_FILE_NAME + ".creating")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, page)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temp, directory / META_FILE_NAME)
        fsync_directory(directory)
        return cls.open(directory, header_length, writable=True)

    @classmethod
    def open(cls, directory: Path, header_length: int, *, writable: bool) -> MetadataPage:
        """Open and check an existing metadata page; damage is a :class:`LogCorruptError`."""
        path = directory / META_FILE_NAME
        flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            raise LogError(f"{directory} is not a stream log (no {META_FILE_NAME} file)") from None
        try:
            size = os.fstat(fd).st_size
            if size != META_LENGTH:
                raise LogCorruptError(
                    path,
                    min(size, META_LENGTH),
                    f"metadata is {size} bytes, expected {META_LENGTH}",
                )
            access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
            buffer = mmap.mmap(fd, META_LENGTH, access=access)
        except BaseException:
            os.close(fd)
            raise
        try:
            settings = _check_settings(path, buffer, header_length)
        except BaseException:
            buffer.close()
            os.close(fd)
            raise
        return cls(path, fd, buffer, settings)

    @property
    def published(self) -> int:
        """The published position as last stored (readers confirm it frame by frame)."""
        return int(I64.unpack_from(self.buffer, PUBLISHED_POSITION_OFFSET)[0])

    def store_published(self, position: int) -> None:
        """Store the published position (after the frames below it are committed)."""
        # One word store, never pack_into (which zero-fills first, visibly to readers).
        self.words[PUBLISHED_WORD] = position

    def stored_positions(self) -> Positions | None:
        """The durable/release pair if its checksum holds, else ``None`` (one attempt)."""
        raw = self.buffer[POSITIONS_OFFSET : POSITIONS_CHECKSUM_OFFSET + 4]
        durable, release = POSITIONS.unpack_from(raw, 0)
        (checksum,) = U32.unpack_from(raw, POSITIONS.size)
        if checksum != _positions_checksum(durable, release):
            return None
        return Positions(durable, release)

    def read_positions(self) -> Positions:
        """The durable/release pair, retrying while a concurrent store may be half done."""
        for attempt in range(_POSITION_READ_ATTEMPTS):
            positions = self.stored_positions()
            if positions is not None:
                return positions
            time.sleep(0 if attempt < 10 else 0.001)
        raise LogCorruptError(
            self.path, POSITIONS_OFFSET, "durable/release positions fail their checksum"
        )

    def store_positions(self, durable: int, release: int) -> None:
        """Store the durable/release pair with its checksum (the caller serialises stores)."""
        POSITIONS.pack_into(self.buffer, POSITIONS_OFFSET, durable, release)
        U32.pack_into(self.buffer, POSITIONS_CHECKSUM_OFFSET, _positions_checksum(durable, release))

    def sync(self) -> None:
        """Make the page durable."""
        os.fdatasync(self.fd)

    def close(self) -> None:
        """Unmap and close the page."""
        self.words.release()
        with contextlib.suppress(BufferError):
            self.buffer.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _positions_checksum(durable: int, release: int) -> int:
    return zlib.crc32(POSITIONS.pack(durable, release))


def _check_settings(path: Path, buffer: mmap.mmap, header_length: int) -> Settings:
    magic, version, stored_header, term_length, capacity = SETTINGS.unpack_from(buffer, 0)
    if magic != MAGIC:
        raise LogCorruptError(path, 0, f"not a headgate stream log (magic {magic!r})")
    (checksum,) = U32.unpack_from(buffer, SETTINGS_CHECKSUM_OFFSET)
    if checksum != zlib.crc32(buffer[:SETTINGS_CHECKSUM_OFFSET]):
        raise LogCorruptError(path, SETTINGS_CHECKSUM_OFFSET, "settings fail their checksum")
    if version != LAYOUT_VERSION:
        raise LogError(f"{path}: layout version {version}, this headgate reads {LAYOUT_VERSION}")
    if stored_header != header_length:
        raise LogError(f"{path}: frame header of {stored_header} bytes, expected {header_length}")
    return Settings(term_length, capacity)
