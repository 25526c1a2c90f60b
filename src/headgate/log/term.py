"""Term files: fixed-size, memory-mapped pieces of a stream's history.

A term file is named after its term id (``000000000000002a.term``, sixteen hex
digits, so names sort by id) and is exactly ``term_length`` bytes long. The
writer creates it under a temporary name, reserves its blocks, and renames it
into place, so a reader never meets a half-sized term; only a crash at an
unlucky moment can leave one, and recovery deals with it.

Blocks are reserved with ``posix_fallocate`` because writing through a mapping
into a sparse file on a full disk kills the process with SIGBUS. With the
blocks reserved, a full disk shows up as a
:class:`~headgate.log.errors.StorageFull` when a term is created, before
anything is written, where the gateway can hold a stream instead of dying.
Nothing else in the log allocates disk space.

A freed term's file is recycled rather than deleted when it can be
(:class:`TermSpares`, :meth:`TermFile.prepare` with a spare): renamed to the
new term's temporary name and cleared with ``fallocate(FALLOC_FL_ZERO_RANGE |
FALLOC_FL_KEEP_SIZE)``, which turns its blocks into unwritten extents that
read as zeros, writing no data and freeing nothing. Deleting a 16 MiB term on
this machine's ext4, mounted with ``discard`` and without a journal, made the
file system trim its blocks as it deleted them, and every group commit's
``fdatasync`` waited behind the trims on the disk: a 30 to 40 ms stall at each release
that freed a term (gone with ``nodiscard``; BENCHMARKS.md, Ingest, "Tenth
session"). With pwrite at 350 MB/s and fdatasync every 2 ms, recycling gave a
p99 of 1.35 to 2.1 ms against 4 to 7 ms for batched unlinks, max 4.5 to 8
against 9 to 14 ms. Where ``FALLOC_FL_ZERO_RANGE`` is refused (tmpfs, other
file systems) or libc cannot be loaded, the spare is deleted and a new file
created, as before, and no spare is kept from then on.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from headgate.log.errors import LogError, storage_error

_log = logging.getLogger(__name__)

TERM_SUFFIX = ".term"
_CREATING_SUFFIX = ".term.creating"
_PREPARING_SUFFIX = ".term.preparing"
_SPARE_SUFFIX = ".term.spare"


def term_file_name(term_id: int) -> str:
    """The file name of term ``term_id``."""
    return f"{term_id:016x}{TERM_SUFFIX}"


def parse_term_file_name(name: str) -> int | None:
    """The term id a file name stands for, or ``None`` if it is not a term file name."""
    stem = name.removesuffix(TERM_SUFFIX)
    if len(name) != 16 + len(TERM_SUFFIX) or stem == name:
        return None
    try:
        return int(stem, 16)
    except ValueError:
        return None


def list_term_files(directory: Path) -> dict[int, Path]:
    """Every term file in ``directory`` by id; leftovers of interrupted creations are removed."""
    found: dict[int, Path] = {}
    for entry in os.scandir(directory):
        if entry.name.endswith((_CREATING_SUFFIX, _PREPARING_SUFFIX, _SPARE_SUFFIX)):
            # Creation was interrupted before the rename (the file never held
            # data), or a freed term was kept for reuse (its release durable).
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
            continue
        term_id = parse_term_file_name(entry.name)
        if term_id is not None:
            found[term_id] = Path(entry.path)
    return found


def fsync_directory(directory: Path) -> None:
    """Make creations, renames and removals of files in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class TermFile:
    """One open, mapped term file.

    ``size`` is the file's length; it equals the term length except while
    recovery looks at a term a crash left short. Bytes past ``size`` read as
    "nothing committed".
    """

    __slots__ = ("buffer", "fd", "path", "size", "term_id", "view", "words", "writable")

    def __init__(self, term_id: int, path: Path, fd: int, size: int, writable: bool) -> None:
        self.term_id = term_id
        self.path = path
        self.fd = fd
        self.size = size
        self.writable = writable
        self.buffer: mmap.mmap | None = None
        self.view = memoryview(b"")
        #: The map as native unsigned 64-bit words: the writer stores a
        #: frame's commit word with one item assignment (see StreamLog.append).
        self.words = self.view.cast("Q")
        if size:
            self._map(mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)

    @classmethod
    def create(cls, directory: Path, term_id: int, term_length: int) -> TermFile:
        """Create term ``term_id`` full of zeros, with its blocks reserved, and map it.

        Quick (nothing is written), for the writer when it needs a term that
        the preparer has not made; :meth:`prepare` also makes it durable.
        """
        term = cls._new(directory, term_id, term_length, _CREATING_SUFFIX, sync=False)
        term.install()
        return term

    @classmethod
    def prepare(
        cls, directory: Path, term_id: int, term_length: int, spare: Path | None = None
    ) -> TermFile:
        """Create term ``term_id`` under a temporary name, reserved and durable.

        The blocks are reserved with ``posix_fallocate`` (no data is written:
        the file system records them as allocated but unwritten, which reads
        as zeros), then ``fdatasync`` puts the allocation and the length on
        disk, which writes only file-system metadata. A helper thread does
        this ahead of need (:mod:`headgate.log.preparer`); every call here
        releases the GIL. The file is not read to warm the page cache: the
        writer writes through the descriptor, which needs no cached page
        beforehand, and reading 16 MiB per term made the concurrent group
        commits' ``fdatasync`` slower (p99 5 to 10 times, measured with
        pwrite and fdatasync every 2 ms beside a preparer, on this machine).
        :meth:`install` gives the term its real name; :meth:`discard` throws
        it away.

        With ``spare`` (a freed term's file, whose release is durable, from
        :class:`TermSpares`), that file becomes the new term instead: renamed
        to the temporary name, cleared with ``FALLOC_FL_ZERO_RANGE`` (its
        blocks stay allocated and read as zeros: nothing written, nothing
        discarded), then fdatasynced, all before the writer or any reader can
        see it under the new name, so "length 0 ends the log" holds in it as
        in a new term. A crash leaves either the freed file under its old name
        (behind the release: recovery deletes it) or the temporary name
        (deleted on open). If the spare cannot be cleared so, it is deleted
        and a new file created.
        """
        if spare is not None:
            term = cls._recycle(directory, term_id, term_length, spare)
            if term is not None:
                return term
        return cls._new(directory, term_id, term_length, _PREPARING_SUFFIX, sync=True)

    @classmethod
    def _recycle(
        cls, directory: Path, term_id: int, term_length: int, spare: Path
    ) -> TermFile | None:
        """``spare`` cleared and fdatasynced as term ``term_id`` (temporary name), or None."""
        temp = directory / f"{term_id:016x}{_PREPARING_SUFFIX}"
        try:
            os.rename(spare, temp)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(spare)
            return None
        try:
            fd = os.open(temp, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            return None
        try:
            if os.fstat(fd).st_size == term_length and clear_blocks(fd, term_length):
                os.fdatasync(fd)
                return cls(term_id, temp, fd, term_length, writable=True)
        except OSError:
            pass
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(temp)
        return None

    @classmethod
    def _new(
        cls, directory: Path, term_id: int, term_length: int, suffix: str, *, sync: bool
    ) -> TermFile:
        temp = directory / f"{term_id:016x}{suffix}"
        try:
            # O_TRUNC: whatever an interrupted earlier attempt left under this
            # name is gone, so the term starts as zeros whatever was here.
            fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise storage_error(f"cannot create term file {temp}", temp, exc) from exc
        try:
            reserve(fd, term_length, temp)
            if sync:
                try:
                    os.fdatasync(fd)
                except OSError as exc:
                    raise storage_error(f"cannot make term file {temp} durable", temp, exc) from exc
            return cls(term_id, temp, fd, term_length, writable=True)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise

    def install(self) -> None:
        """Give a created or prepared term its real name (atomically, by rename)."""
        final = self.path.parent / term_file_name(self.term_id)
        os.rename(self.path, final)
        self.path = final

    def discard(self) -> None:
        """Close and remove a prepared term that is not needed after all."""
        self.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    @classmethod
    def open(cls, path: Path, term_id: int, *, writable: bool) -> TermFile:
        """Open and map an existing term file at whatever size it has."""
        flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC
        fd = os.open(path, flags)
        try:
            size = os.fstat(fd).st_size
            return cls(term_id, path, fd, size, writable)
        except BaseException:
            os.close(fd)
            raise

    @property
    def mapped(self) -> mmap.mmap:
        """The mapping of a full term (the writer's active term always has one)."""
        if self.buffer is None:
            raise LogError(f"term file {self.path} is not mapped")
        return self.buffer

    def extend(self, term_length: int) -> None:
        """Grow a short term (left by a crash) to its full length; the new bytes are zero."""
        if self.size >= term_length:
            return
        self._unmap()
        reserve(self.fd, term_length, self.path)
        self.size = term_length
        self._map(mmap.ACCESS_WRITE)

    def _map(self, access: int) -> None:
        self.buffer = mmap.mmap(self.fd, self.size, access=access)
        self.view = memoryview(self.buffer)
        # A term shorter than a word (only a damaged one) gets no words.
        self.words = self.view[: self.size & -8].cast("Q")

    def sync(self) -> None:
        """Write the term's dirty pages to the device and wait for them.

        On Linux the page cache is shared by ``write`` and ``MAP_SHARED``
        mappings, so ``fdatasync`` on the file descriptor writes back pages
        dirtied through the map; unlike ``mmap.flush`` it releases the GIL
        while it waits, so the owner thread keeps appending.
        """
        os.fdatasync(self.fd)

    def drop_pages(self) -> None:
        """Unmap the pages of this (full, durable) term from the process; keep the map.

        The bytes stay in the page cache and on disk, and a later read faults
        them back in. Without this, every term the writer ever filled stays
        resident in the gateway until Spark releases it: gigabytes of mapped
        pages that the kernel must unmap page by page before it can reuse
        them, which stalls the appends and fsyncs of every stream.
        """
        if self.buffer is not None:
            self.buffer.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        """Unmap and close. Payload views handed out keep the mapping alive until dropped."""
        self._unmap()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _unmap(self) -> None:
        self.words.release()
        self.view.release()
        self.view = memoryview(b"")
        self.words = self.view.cast("Q")
        if self.buffer is not None:
            # A LogFrame payload still exported from this map makes close()
            # raise BufferError; dropping our reference lets the map go when
            # the last view does.
            with contextlib.suppress(BufferError):
                self.buffer.close()
            self.buffer = None


class TermSpares:
    """Freed term files of one log kept for reuse (at most :data:`MAX_SPARE_TERMS`).

    The group commit (or its deleter thread) offers each freed term through
    :meth:`retire` once the release that freed it is durable; the preparer
    takes one with :meth:`take`. A spare is renamed ``<id>.term.spare``, a
    name that is no term's: a crash leaves it either under its old name,
    behind the durable release, or under the spare name, and recovery
    deletes both. It never looks like history (recovery that cannot trust
    the stored positions starts at the oldest term file). Thread-safe.
    """

    __slots__ = ("_limit", "_live", "_lock", "_most_files", "_paths", "_renaming", "_term_length")

    def __init__(
        self,
        term_length: int,
        limit: int,
        most_files: int | None = None,
        live: Callable[[], int] | None = None,
    ) -> None:
        """``limit`` spares at most; with ``live`` (how many term files the log
        has open), spares and live terms together at most ``most_files``."""
        self._term_length = term_length
        self._limit = limit
        self._most_files = most_files
        self._live = live
        self._lock = threading.Lock()
        self._paths: list[Path] = []
        #: Slots taken by spares being renamed (outside the lock).
        self._renaming = 0

    def retire(self, terms: list[TermFile], *, gradually: bool = False) -> None:
        """Close ``terms`` (freed, their release durable); keep some as spares, delete the rest.

        Once clearing a spare has been refused, spares kept before are deleted too.
        ``gradually``: each deletion is paced (:func:`delete_gradually`); for a
        helper thread, never for a caller that others wait on.
        """
        if not zero_range_usable():
            self.close()
        for term in terms:
            size = term.size
            term.close()
            with self._lock:
                keep = size == self._term_length and self._has_room() and zero_range_usable()
                self._renaming += keep
            if keep:
                spare = term.path.with_name(f"{term.term_id:016x}{_SPARE_SUFFIX}")
                try:
                    os.rename(term.path, spare)
                except OSError:
                    keep = False
                with self._lock:
                    self._renaming -= 1
                    if keep:
                        self._paths.append(spare)
            if not keep:
                if gradually:
                    delete_gradually(term.path)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(term.path)

    def _has_room(self) -> bool:
        """Whether one more spare fits; the caller holds the lock."""
        kept = len(self._paths) + self._renaming
        if kept >= self._limit:
            return False
        if self._live is None or self._most_files is None:
            return True
        return self._live() + kept < self._most_files

    def take(self) -> Path | None:
        """A spare's path to recycle, oldest first, or None (and none kept once refused)."""
        if not zero_range_usable():
            self.close()
            return None
        with self._lock:
            return self._paths.pop(0) if self._paths else None

    def __len__(self) -> int:
        with self._lock:
            return len(self._paths)

    def close(self) -> None:
        """Delete every spare (the log is closing)."""
        with self._lock:
            paths, self._paths = self._paths, []
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


#: How much of a file :func:`delete_gradually` frees at a time, and how long it
#: waits between two cuts.
DELETE_STEP = 4 << 20
DELETE_PAUSE_SECONDS = 0.002


def delete_gradually(path: Path) -> None:
    """Unlink ``path`` after freeing its blocks :data:`DELETE_STEP` at a time.

    On a file system mounted with ``discard`` the blocks a deletion frees are
    trimmed as it happens (ext4 without a journal, as here: in the deleting
    thread), and the disk serves the group commit's fdatasync behind the
    trim. Forty-eight 16 MiB terms unlinked at once (a consumer that catches
    up releases that much at a time) held fdatasyncs every 2 ms to a p99 of
    6.3-8.9 ms (at most 10.7-14.4); freed 4 MiB at a time, 2 ms apart, p99
    1.6-2.5 ms (``bench/discard.py``), at the cost of about 10 ms more per
    term on the deleter's thread.

    The blocks are freed by punching holes (``FALLOC_FL_PUNCH_HOLE |
    FALLOC_FL_KEEP_SIZE``), never by truncating: the size stays, so a reader
    that still maps the file (a Spark task, a view the gateway handed out)
    reads zeros there, as in a recycled term, instead of taking a SIGBUS.
    Where holes cannot be punched the file is unlinked at once, as before.
    Errors are left to the unlink (a file that is gone already is fine).
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        fd = -1
    if fd >= 0:
        try:
            size = os.fstat(fd).st_size
            for offset in range(0, size, DELETE_STEP):
                _punch_hole(fd, offset, min(DELETE_STEP, size - offset))
                time.sleep(DELETE_PAUSE_SECONDS)
        except OSError:
            pass  # unlinked below all the same
        finally:
            os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


#: Spares kept per log at most. A release frees every term behind it at once
#: (the gateway's releaser runs every 250 ms in ``bench/ingest.py``: at
#: 350 MB/s, five 16 MiB terms), and each one not kept is a deletion, hence a
#: discard stall; the preparer then takes them one per rotation. Besides,
#: spares and live terms together stay within what a full log holds
#: (:func:`most_term_files`), so recycling needs no disk a full log would not.
MAX_SPARE_TERMS = 8


def most_term_files(capacity: int, term_length: int) -> int:
    """The most term files a log of ``capacity`` has: its capacity's terms, the tail's
    partial one at each end, and the one prepared ahead."""
    return -(-capacity // term_length) + 2


_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_FALLOC_FL_ZERO_RANGE = 0x10

_fallocate: Callable[[int, int, int, int], int] | None = None
_zero_range_state: bool | None = None  # None: not tried yet
_state_lock = threading.Lock()


def _load_fallocate() -> Callable[[int, int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        func = getattr(libc, "fallocate64", None) or libc.fallocate
    except (OSError, AttributeError):
        return None
    func.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    func.restype = ctypes.c_int
    result: Callable[[int, int, int, int], int] = func
    return result


def _fallocate_mode(fd: int, mode: int, offset: int, length: int) -> None:
    """``fallocate(fd, mode, offset, length)`` through libc; OSError if refused."""
    global _fallocate
    if _fallocate is None:
        _fallocate = _load_fallocate()
        if _fallocate is None:
            raise OSError(errno.ENOSYS, "fallocate is not available through libc")
    if _fallocate(fd, mode, offset, length) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def _zero_range(fd: int, length: int) -> None:
    """``fallocate(fd, ZERO_RANGE | KEEP_SIZE, 0, length)``; OSError if refused."""
    _fallocate_mode(fd, _FALLOC_FL_ZERO_RANGE | _FALLOC_FL_KEEP_SIZE, 0, length)


def _punch_hole(fd: int, offset: int, length: int) -> None:
    """Free the blocks of ``length`` bytes at ``offset``, keeping the size (they read as zeros)."""
    _fallocate_mode(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length)


def zero_range_usable() -> bool:
    """Whether freed terms are worth keeping: not once clearing one was refused."""
    return _zero_range_state is not False


def clear_blocks(fd: int, length: int) -> bool:
    """Make the first ``length`` bytes of ``fd`` read as zeros, keeping their blocks.

    False (and, the first time, a warning) if the file system or libc cannot
    do it; the caller then makes a new file. Other errors raise OSError.
    """
    global _zero_range_state
    try:
        _zero_range(fd, length)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        with _state_lock:
            first = _zero_range_state is None
            _zero_range_state = False
        if first:
            _log.warning(
                "cannot clear freed term files in place (%s): they are deleted and new "
                "ones created instead",
                exc,
            )
        return False
    _zero_range_state = True
    return True


def reserve(fd: int, length: int, path: Path) -> None:
    """Make the file ``length`` bytes long with every block allocated (reading as zeros).

    A full file system (``ENOSPC``, ``EDQUOT``, ``EFBIG``) is a
    :class:`StorageFull`; any other refusal a :class:`StorageError`.
    """
    try:
        os.posix_fallocate(fd, 0, length)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise storage_error(f"cannot reserve {length} bytes for {path}", path, exc) from exc
        # A file system without fallocate: a sparse file still works, at the
        # cost of SIGBUS instead of an error when the disk fills up.
        try:
            os.ftruncate(fd, length)
        except OSError as exc2:
            raise storage_error(f"cannot size {path} to {length} bytes", path, exc2) from exc2


def pwrite_all(fd: int, buffers: list[bytes | bytearray | memoryview], at: int) -> None:
    """Write every byte of ``buffers`` at file offset ``at`` (short writes resumed)."""
    total = sum(memoryview(b).nbytes for b in buffers)
    done = os.pwritev(fd, buffers, at)
    if done < total:  # pragma: no cover - regular files take whole writes in practice
        rest = memoryview(b"".join(buffers))[done:]
        while rest:
            written = os.pwrite(fd, rest, at + done)
            if written <= 0:
                raise OSError(errno.EIO, "a write to the term file made no progress")
            rest = rest[written:]
            done += written
