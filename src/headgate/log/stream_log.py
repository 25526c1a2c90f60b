"""StreamLog: the single writer of one stream's log.

The gateway owns one ``StreamLog`` per stream. Its event-loop thread (the
*owner*) appends batches as they arrive and releases space as Spark commits;
a worker thread runs :meth:`StreamLog.sync`, the group commit, every few
milliseconds; Spark executors in other processes read the same files through
:class:`~headgate.log.reader.LogReader`.

What is locked, exactly:

* ``_sync_lock`` serialises group commits (and ``close``), so two ``sync``
  calls never interleave their fsyncs and durable-position updates.
* ``_lock`` guards the term table, the durable and release positions and the
  durable/release pair in the metadata page. The owner takes it only to
  create a term the preparer has not written yet, and to release; ``sync``
  takes it twice, briefly, to snapshot what to fsync and to publish the new
  durable position; the term preparer takes it to hand over a term. The
  fsyncs themselves run with no lock held (and without the GIL), so appends
  never wait for the disk.
* Appends take no lock. They write a frame and its commit word (length and
  checksum), with one ``pwritev`` on the term file's descriptor from
  :data:`WRITE_FROM` bytes of payload, or stores into the mapped term, commit
  word last, below it (readers map the same page cache; see LOG.md, "Writing
  through the descriptor"), then the tail and the published position. ``sync``
  reads the tail once (an int attribute read is atomic under the GIL); every
  frame below that tail is already whole in the page cache, so the fsync
  that follows covers it.

Only the owner thread may call ``append``, ``release``, ``read`` and
``scan_headers``; ``sync``, ``wait_durable`` and the position properties may be
used from any thread.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import struct
import sys
import threading
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Final, Protocol, overload

from headgate.log.deleter import TermDeleter
from headgate.log.errors import LogCorruptError, LogError, LogFullError, storage_error
from headgate.log.frame import (
    DATA_FRAME,
    FORMAT_VERSION,
    FRAME_ALIGNMENT,
    HEADER_BODY,
    HEADER_LENGTH,
    MAX_U32,
    TYPE_OFFSET,
    AppendResult,
    FrameHeader,
    LogFrame,
    frame_cost,
    padding_body,
    padding_checksum,
)
from headgate.log.lock import try_lock
from headgate.log.metadata import (
    META_FILE_NAME,
    PUBLISHED_POSITION_OFFSET,
    PUBLISHED_WORD,
    MetadataPage,
    Settings,
)
from headgate.log.position import (
    MAX_TERM_LENGTH,
    MIN_TERM_LENGTH,
    normalize_position,
    term_id_of,
    term_offset_of,
    term_start,
)
from headgate.log.preparer import MIN_PREPARED_TERM_LENGTH, TermPreparer
from headgate.log.recovery import LogRecovery, RecoveryReport
from headgate.log.scanner import FrameProblem, FrameScanner
from headgate.log.term import TermFile, fsync_directory, list_term_files

DEFAULT_TERM_LENGTH: Final = 16 * 1024 * 1024
"""Term length of a new log when none is given."""

DEFAULT_TERMS_PER_CAPACITY: Final = 4
"""A new log's capacity, when none is given, is this many terms."""

LOCK_FILE_NAME: Final = "writer.lock"

_PADDING_BODY: Final = padding_body()
_new_result = tuple.__new__  # skips NamedTuple.__new__'s Python frame on the hot path
_pack_body = HEADER_BODY.pack_into  # bound once: the hot path looks up one global
_crc32 = zlib.crc32

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError(
        "headgate.log stores each frame's commit word (length, then checksum, "
        "little-endian) as one native 64-bit word, which needs a little-endian host"
    )

_Buffer = mmap.mmap | bytearray | memoryview


class WriteFrame(Protocol):
    """The signature of :func:`headgate.log._frame_writer.write_frame` (see its stub)."""

    @overload
    def __call__(
        self,
        term: int | _Buffer,
        term_size: int,
        offset: int,
        position: int,
        limit: int,
        payload: bytes | bytearray | memoryview,
        producer_id: int,
        first_sequence: int,
        record_count: int,
        timestamp_us: int,
        meta: _Buffer | None,
        published_offset: int,
        result_type: None,
        /,
    ) -> int: ...

    @overload
    def __call__(
        self,
        term: int | _Buffer,
        term_size: int,
        offset: int,
        position: int,
        limit: int,
        payload: bytes | bytearray | memoryview,
        producer_id: int,
        first_sequence: int,
        record_count: int,
        timestamp_us: int,
        meta: _Buffer | None,
        published_offset: int,
        result_type: type[AppendResult],
        /,
    ) -> AppendResult | None: ...


PURE_PYTHON_ENV: Final = "HEADGATE_PURE_PYTHON_LOG"
"""Set to anything but empty or ``0`` to write frames in Python although the C writer is built."""


def _load_frame_writer() -> WriteFrame | None:
    """The C frame writer, or ``None`` if it is not built or :data:`PURE_PYTHON_ENV` is set."""
    if os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0"):
        return None
    try:
        from headgate.log._frame_writer import write_frame
    except ImportError:
        return None
    return write_frame


# Looked up on every append, so that tests can switch paths in one process.
_write_frame: WriteFrame | None = _load_frame_writer()


def frame_writer() -> str:
    """Which frame writer appends use: ``"C"`` or ``"Python"`` (see LOG.md)."""
    return "Python" if _write_frame is None else "C"


FrameSpec = tuple[bytes | bytearray | memoryview, int, int, int, int]
"""One frame for :meth:`StreamLog.append_many`: payload, producer id, first
sequence, record count, timestamp (microseconds)."""


def _pwrite_all(fd: int, buffers: list[bytes | bytearray | memoryview], at: int) -> None:
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


WRITE_FROM: Final = 1024
"""Payload bytes from which a frame goes to the term file with ``pwritev``;
smaller frames are stored into the mapped term (see LOG.md, "Writing
through the descriptor")."""

_ALIGNMENT_ZEROS: Final = bytes(FRAME_ALIGNMENT)
_pack_commit = struct.Struct("<Q").pack_into


def _write_frame_py(
    fd: int,
    buffer: mmap.mmap,
    view: memoryview,
    words: memoryview,
    offset: int,
    position: int,
    length: int,
    payload: bytes | bytearray | memoryview,
    producer_id: int,
    first_sequence: int,
    record_count: int,
    timestamp_us: int,
) -> None:
    """The pure-Python frame write (the C writer's fallback); publishes nothing.

    A payload under :data:`WRITE_FROM` bytes is stored into the mapped term
    (``buffer``, ``view`` and ``words``): the body first (header fields
    after the checksum, then the payload), the commit word (length and
    checksum) last, as one aligned 8-byte store. A larger one goes to the
    term file through ``fd``, in one ``pwritev`` of the whole frame: the
    commit word, header bytes 8..40, the payload and zeros up to the next
    multiple of 8 (see LOG.md, "Ordering"); a failed write raises
    ``OSError``, and the caller scrubs what may have been written.
    """
    small = length - HEADER_LENGTH < WRITE_FROM
    if not small and type(payload) is memoryview and payload.nbytes != length - HEADER_LENGTH:
        raise LogError("the payload must be bytes (a memoryview must be of bytes)")
    header = buffer if small else bytearray(HEADER_LENGTH)
    try:
        _pack_body(
            header,
            (offset if small else 0) + TYPE_OFFSET,
            DATA_FRAME,
            0,
            FORMAT_VERSION,
            record_count,
            producer_id,
            first_sequence,
            timestamp_us,
        )
    except struct.error as exc:
        raise LogError(f"frame header field out of range: {exc}") from None
    seed = (position ^ (position >> 32)) & MAX_U32
    if small:
        buffer[offset + HEADER_LENGTH : offset + length] = payload
        # The length in the low half, the checksum in the high half: on a
        # little-endian host, the layout of bytes 0..8.
        words[offset >> 3] = (
            length | _crc32(view[offset + TYPE_OFFSET : offset + length], seed) << 32
        )
        return
    frame = memoryview(header)
    checksum = _crc32(payload, _crc32(frame[TYPE_OFFSET:HEADER_LENGTH], seed))
    _pack_commit(header, 0, length | checksum << 32)
    pad = -length & (FRAME_ALIGNMENT - 1)
    _pwrite_all(fd, [frame[:HEADER_LENGTH], payload, _ALIGNMENT_ZEROS[:pad]], offset)


class StreamLog:
    """The single writer of one stream's log: append, group commit, release, read back.

    Open one with :meth:`open`. Appends write to the term files' page cache
    (``pwritev`` for large frames, stores into the map for small ones; reads
    go through memory maps of the same files) and never wait for the disk;
    :meth:`sync` makes them durable in groups; :meth:`release` frees the
    space a consumer is done with. Positions are byte offsets into the
    stream's whole history (see LOG.md).
    """

    def __init__(
        self,
        directory: Path,
        lock_fd: int,
        meta: MetadataPage,
        terms: dict[int, TermFile],
        tail: int,
        release: int,
    ) -> None:
        settings = meta.settings
        self._directory = directory
        self._lock_fd = lock_fd
        self._meta = meta
        self._meta_words = meta.words
        self._meta_page = meta.buffer
        self._term_length = settings.term_length
        self._shift = settings.term_length.bit_length() - 1
        self._capacity = settings.capacity
        self._terms = terms
        self._tail = tail
        self._release = release
        self._durable = tail
        self._directory_dirty = False
        # Bumped whenever the directory becomes dirty: the term preparer's own
        # directory fsync counts only if nothing changed the directory since.
        self._directory_changes = 0
        self._closed = False
        self._recovery: RecoveryReport | None = None
        # Whether the stored durable/release pair changed since the page was last fsynced.
        self._meta_dirty = False
        # After a failed fsync, where the bytes that may not have reached the
        # disk begin (see _sync_locked); None while every fsync succeeded.
        self._redirty_from: int | None = None
        self._lock = threading.Lock()
        self._durable_changed = threading.Condition(self._lock)
        self._sync_lock = threading.Lock()
        # Terms below this id have had their pages dropped (see TermFile.drop_pages).
        self._pages_dropped_below = min(terms, default=0)
        self._scanner = FrameScanner(directory, settings.term_length, self._terms.get)
        active = terms[term_id_of(tail, self._shift)]
        self._active = active
        self._fd = active.fd
        self._buffer = active.mapped
        self._view = active.view
        self._words = active.words
        self._term_base = term_start(active.term_id, self._shift)
        self._fast_end = 0
        self._refresh_fast_end()
        self._preparer = TermPreparer(directory, settings.term_length, self._install_prepared)
        # Set by delete_in_background: freed terms are deleted off the commit's path.
        self._deleter: TermDeleter | None = None
        if active.term_id + 1 not in terms:
            self._preparer.request(active.term_id + 1)

    # --- opening and closing ------------------------------------------------

    @classmethod
    def open(
        cls,
        directory: str | os.PathLike[str],
        *,
        term_length: int | None = None,
        capacity: int | None = None,
        create: bool = True,
    ) -> StreamLog:
        """Open the log in ``directory``, creating it or recovering it as needed.

        Args:
            directory: One directory per stream; created if missing and ``create``.
            term_length: Bytes per term file, a power of two from 4 KiB to
                1 GiB (64 KiB or more outside tests). Default 16 MiB for a new
                log; an existing log keeps its own, and a different value
                given here is a :class:`LogError`.
            capacity: Most bytes between the release position and the tail,
                a multiple of 8 of at least a header. Default four terms. An
                existing log keeps its stored capacity.
            create: If false, a missing log is a :class:`LogError`.

        Reopening after a crash cuts off a torn tail and continues exactly
        after the last whole frame (see LOG.md, "Recovery"). A second writer
        on the same directory, in any process, gets a :class:`LogError`.
        """
        path = Path(directory)
        try:
            if not path.is_dir():
                if not create:
                    raise LogError(f"no stream log at {path}")
                path.mkdir(parents=True, exist_ok=True)
            lock_fd = _lock_directory(path)
        except OSError as exc:
            raise storage_error(f"cannot open the stream log at {path}", path, exc) from exc
        try:
            return cls._open_locked(path, lock_fd, term_length, capacity, create)
        except OSError as exc:
            os.close(lock_fd)
            raise storage_error(f"cannot open the stream log at {path}", path, exc) from exc
        except BaseException:
            os.close(lock_fd)
            raise

    @classmethod
    def _open_locked(
        cls,
        path: Path,
        lock_fd: int,
        term_length: int | None,
        capacity: int | None,
        create: bool,
    ) -> StreamLog:
        if term_length is not None:
            _check_term_length(term_length)
        if not (path / META_FILE_NAME).exists():
            if list_term_files(path):
                raise LogCorruptError(
                    path / META_FILE_NAME, 0, "metadata file is missing but term files exist"
                )
            if not create:
                raise LogError(f"no stream log at {path}")
            length = DEFAULT_TERM_LENGTH if term_length is None else term_length
            size = DEFAULT_TERMS_PER_CAPACITY * length if capacity is None else capacity
            _check_capacity(size)
            meta = MetadataPage.create(path, Settings(length, size), HEADER_LENGTH)
            try:
                # Written ahead like every later term, so that the first
                # appends do not pay for block allocation either.
                if length >= MIN_PREPARED_TERM_LENGTH:
                    first = TermFile.prepare(path, 0, length)
                    first.install()
                else:
                    first = TermFile.create(path, 0, length)
            except BaseException:
                meta.close()
                raise
            log = cls(path, lock_fd, meta, {0: first}, tail=0, release=0)
            # Term 0's name reaches the disk with the first group commit. Should
            # it be lost before that, recovery recreates it: nothing was durable.
            log._directory_dirty = True
            log._directory_changes += 1
            return log

        meta = MetadataPage.open(path, HEADER_LENGTH, writable=True)
        try:
            stored = meta.settings
            try:
                _check_term_length(stored.term_length)
                _check_capacity(stored.capacity)
            except LogError as exc:
                raise LogCorruptError(
                    meta.path, 16, f"stored settings are invalid: {exc}"
                ) from None
            if term_length is not None and term_length != stored.term_length:
                raise LogError(
                    f"{path} has term_length {stored.term_length}, not {term_length}; "
                    "the term length of an existing log cannot change"
                )
            recovered = LogRecovery(path, meta).run()
        except BaseException:
            meta.close()
            raise
        log = cls(path, lock_fd, meta, recovered.terms, recovered.tail, recovered.release)
        log._recovery = recovered.report
        return log

    def close(self) -> None:
        """Make everything appended durable, then close every file. Idempotent."""
        with self._sync_lock:
            if self._closed:
                return
            try:
                self._sync_locked()
                if self._meta_dirty:
                    self._meta.sync()
            finally:
                with self._lock:
                    self._closed = True
                    # Sends every append down the slow path, which checks for close.
                    self._fast_end = -1
                    self._durable_changed.notify_all()
                    for term in self._terms.values():
                        term.close()
                    self._terms.clear()
                self._preparer.close()
                if self._deleter is not None:
                    self._deleter.close()
                self._meta.close()
                os.close(self._lock_fd)

    def __enter__(self) -> StreamLog:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # --- positions and capacity ---------------------------------------------

    @property
    def directory(self) -> Path:
        """The log's directory."""
        return self._directory

    @property
    def term_length(self) -> int:
        """Bytes per term file."""
        return self._term_length

    @property
    def recovery(self) -> RecoveryReport | None:
        """What recovery found when this existing log was opened; ``None`` for a new log."""
        return self._recovery

    @property
    def capacity(self) -> int:
        """Most bytes the log holds between the release position and the tail."""
        return self._capacity

    @property
    def max_payload(self) -> int:
        """Largest payload an append can ever take: a whole term, or the capacity, less a header."""
        return min(self._term_length, self._capacity) - HEADER_LENGTH

    @property
    def tail_position(self) -> int:
        """Where the next frame goes (or the padding before it)."""
        return self._tail

    @property
    def published_position(self) -> int:
        """What readers in other processes may read: every frame before it is committed.

        The writer publishes after every append, so this equals the tail; it is
        a separate name because readers see it through the metadata page.
        """
        return self._tail

    @property
    def durable_position(self) -> int:
        """Every frame before this position is on the device (fsynced)."""
        return self._durable

    @property
    def release_position(self) -> int:
        """The consumer is done with everything before this position."""
        return self._release

    @property
    def free_capacity(self) -> int:
        """``capacity - (tail_position - release_position)``: padding counts as used.

        Never negative: after :meth:`set_capacity` lowers the capacity below
        what is already unreleased, the log is simply full until releases
        catch up.
        """
        return max(0, self._capacity - (self._tail - self._release))

    def set_capacity(self, capacity: int) -> None:
        """Change the capacity while the log is open (the operator resized the stream).

        Frames already appended stay; a lower capacity only refuses appends
        until releases bring the unreleased bytes under it. The capacity
        stored at creation is not rewritten: whoever opens the log states
        the capacity it wants (the gateway takes it from its configuration).
        """
        self._check_open()
        _check_capacity(capacity)
        self._capacity = capacity
        self._refresh_fast_end()

    def append_cost(self, payload_length: int) -> int:
        """How far an append of ``payload_length`` bytes would move the tail right now.

        ``frame_cost(payload_length)``, plus the rest of the term if the frame
        does not fit in it (padding), plus the last few bytes of a term if the
        frame would leave less than a header there (implicit padding).
        """
        cost = frame_cost(payload_length)
        offset = self._tail - self._term_base
        start = self._tail
        if offset + cost > self._term_length:
            start += self._term_length - offset
        end = normalize_position(start + cost, self._term_length, HEADER_LENGTH)
        return end - self._tail

    # --- appending ------------------------------------------------------------

    def append(
        self,
        payload: bytes | bytearray | memoryview,
        *,
        producer_id: int,
        first_sequence: int,
        record_count: int,
        timestamp_us: int,
    ) -> AppendResult:
        """Append one batch as one frame; return where it went. Never waits for the disk.

        Args:
            payload: The batch bytes (a memoryview must be of bytes).
            producer_id: Unsigned 64-bit id of the producer.
            first_sequence: Unsigned 64-bit sequence number of the first record.
            record_count: Unsigned 32-bit count of records in the batch.
            timestamp_us: Signed 64-bit time of acceptance, microseconds.

        Raises :class:`LogFullError` if :meth:`append_cost` exceeds
        :attr:`free_capacity`, or if the payload exceeds :attr:`max_payload`.
        When the frame does not fit in the rest of the term but padding does,
        the padding is written even if the frame then does not fit, so that
        the frame fits once the consumer releases up to the new term.
        """
        write = _write_frame
        if write is not None:
            # The C writer does the whole frame and the publish and builds
            # the AppendResult, or writes nothing and returns None if the
            # frame would end past _fast_end.
            position = self._tail
            try:
                result = write(
                    self._fd if len(payload) >= WRITE_FROM else self._buffer,
                    self._term_length,
                    position - self._term_base,
                    position,
                    self._fast_end,
                    payload,
                    producer_id,
                    first_sequence,
                    record_count,
                    timestamp_us,
                    self._meta_page,
                    PUBLISHED_POSITION_OFFSET,
                    AppendResult,
                )
            except OSError as exc:
                raise self._write_failed(exc, position - self._term_base, payload) from exc
            if result is not None:
                self._tail = result[1]
                return result
            return self._append_slowly(
                payload, producer_id, first_sequence, record_count, timestamp_us
            )
        length = HEADER_LENGTH + len(payload)
        position = self._tail
        end = position + ((length + FRAME_ALIGNMENT - 1) & -FRAME_ALIGNMENT)
        if end > self._fast_end:
            return self._append_slowly(
                payload, producer_id, first_sequence, record_count, timestamp_us
            )
        try:
            _write_frame_py(
                self._fd,
                self._buffer,
                self._view,
                self._words,
                position - self._term_base,
                position,
                length,
                payload,
                producer_id,
                first_sequence,
                record_count,
                timestamp_us,
            )
        except OSError as exc:
            raise self._write_failed(exc, position - self._term_base, payload) from exc
        self._tail = end
        self._meta_words[PUBLISHED_WORD] = end
        return _new_result(AppendResult, (position, end))

    def append_many(self, frames: Iterable[FrameSpec], ends: list[int] | None = None) -> int:
        """Append several batches, one frame each, in order, and publish once; return the tail.

        Each item is ``(payload, producer_id, first_sequence, record_count,
        timestamp_us)``, with the meaning of :meth:`append`'s arguments. The
        frames become visible to readers in other processes together, when
        the published position moves past the last one; a group commit
        covers them once it has started after this call returned.

        This is the gateway's path for several batches of one stream that
        arrived in one socket read: per frame it costs the header, the copy
        and the checksum, but not a method call, an :class:`AppendResult` or
        a store of the published position. Each frame's position is the
        previous one's end (or the start of the next term, after padding).

        If one frame fails (:class:`LogFullError`, a header field out of
        range, or :class:`StorageFull`), the frames before it stay appended
        and published, and the error propagates: :attr:`tail_position` then
        says how far the call got.

        With ``ends``, each appended frame's end position is appended to that
        list as it commits (its start is the previous end, or the start of a
        term after padding), so that a caller keeping per-batch books knows
        each frame's place, and which frames went in before an error.
        """
        write = _write_frame
        if write is not None:
            return self._append_many_c(write, frames, ends)
        record = None if ends is None else ends.append
        tail = published = self._tail
        fast_end = self._fast_end
        fd = self._fd
        buffer = self._buffer
        view = self._view
        words = self._words
        base = self._term_base
        try:
            for payload, producer_id, first_sequence, record_count, timestamp_us in frames:
                length = HEADER_LENGTH + len(payload)
                end = tail + ((length + FRAME_ALIGNMENT - 1) & -FRAME_ALIGNMENT)
                if end > fast_end:
                    self._tail = tail
                    self._append_slowly(
                        payload, producer_id, first_sequence, record_count, timestamp_us
                    )
                    tail = published = self._tail
                    fast_end = self._fast_end
                    fd = self._fd
                    buffer = self._buffer
                    view = self._view
                    words = self._words
                    base = self._term_base
                    if record is not None:
                        record(tail)
                    continue
                _write_frame_py(
                    fd,
                    buffer,
                    view,
                    words,
                    tail - base,
                    tail,
                    length,
                    payload,
                    producer_id,
                    first_sequence,
                    record_count,
                    timestamp_us,
                )
                tail = end
                if record is not None:
                    record(end)
        except OSError as exc:
            raise self._write_failed(exc, tail - base, payload) from exc
        finally:
            # Whatever was committed is published, also when a frame failed.
            if tail != published:
                self._tail = tail
                self._meta_words[PUBLISHED_WORD] = tail
        return tail

    def _append_many_c(
        self, write: WriteFrame, frames: Iterable[FrameSpec], ends: list[int] | None
    ) -> int:
        """:meth:`append_many` with the C frame writer: one publish at the end."""
        record = None if ends is None else ends.append
        tail = published = self._tail
        fast_end = self._fast_end
        fd = self._fd
        buffer = self._buffer
        term_length = self._term_length
        base = self._term_base
        try:
            for payload, producer_id, first_sequence, record_count, timestamp_us in frames:
                end = write(
                    fd if len(payload) >= WRITE_FROM else buffer,
                    term_length,
                    tail - base,
                    tail,
                    fast_end,
                    payload,
                    producer_id,
                    first_sequence,
                    record_count,
                    timestamp_us,
                    None,
                    0,
                    None,
                )
                if not end:
                    self._tail = tail
                    self._append_slowly(
                        payload, producer_id, first_sequence, record_count, timestamp_us
                    )
                    end = published = self._tail
                    fast_end = self._fast_end
                    fd = self._fd
                    buffer = self._buffer
                    base = self._term_base
                tail = end
                if record is not None:
                    record(end)
        except OSError as exc:
            raise self._write_failed(exc, tail - base, payload) from exc
        finally:
            # Whatever was committed is published, also when a frame failed.
            if tail != published:
                self._tail = tail
                self._meta_words[PUBLISHED_WORD] = tail
        return tail

    def _append_slowly(
        self,
        payload: bytes | bytearray | memoryview,
        producer_id: int,
        first_sequence: int,
        record_count: int,
        timestamp_us: int,
    ) -> AppendResult:
        """Appends that rotate, leave implicit padding, end a term exactly, or do not fit."""
        self._check_open()
        payload_length = len(payload)
        if payload_length > self.max_payload:
            raise LogFullError(
                f"a payload of {payload_length} bytes can never fit this log "
                f"(max_payload is {self.max_payload})"
            )
        cost = frame_cost(payload_length)
        term_length = self._term_length
        if self._tail - self._term_base + cost > term_length:
            padding = term_length - (self._tail - self._term_base)
            if padding > self.free_capacity:
                raise self._full(padding + cost)
            self._pad_to_next_term()
        end = normalize_position(self._tail + cost, term_length, HEADER_LENGTH)
        if end - self._tail > self.free_capacity:
            raise self._full(end - self._tail)
        if term_offset_of(end, term_length) == 0:
            # The frame ends the term. The next term must exist before the
            # tail points into it (readers, sync and recovery rely on that),
            # and before the frame commits, so that a failure to create it
            # leaves no committed frame behind an append that raised.
            self._ensure_term(term_id_of(end, self._shift))
        position = self._tail
        offset = position - self._term_base
        length = HEADER_LENGTH + payload_length
        write = _write_frame
        if write is not None:
            # Publishing is left to _advance_tail, which also moves to the next term.
            try:
                written = write(
                    self._fd if payload_length >= WRITE_FROM else self._buffer,
                    term_length,
                    offset,
                    position,
                    position + cost,
                    payload,
                    producer_id,
                    first_sequence,
                    record_count,
                    timestamp_us,
                    None,
                    0,
                    None,
                )
            except OSError as exc:
                raise self._write_failed(exc, offset, payload) from exc
            if not written:  # len() counted items, not bytes: nothing was written
                raise LogError("the payload must be bytes (a memoryview must be of bytes)")
            self._advance_tail(end)
            return AppendResult(position, end)
        try:
            _write_frame_py(
                self._fd,
                self._buffer,
                self._view,
                self._words,
                offset,
                position,
                length,
                payload,
                producer_id,
                first_sequence,
                record_count,
                timestamp_us,
            )
        except OSError as exc:
            raise self._write_failed(exc, offset, payload) from exc
        self._advance_tail(end)
        return AppendResult(position, end)

    def _pad_to_next_term(self) -> None:
        """Fill the rest of the active term with a padding frame and move to the next term."""
        position = self._tail
        offset = position - self._term_base
        end = position + self._term_length - offset
        self._ensure_term(term_id_of(end, self._shift))
        header = bytearray(HEADER_LENGTH)
        header[TYPE_OFFSET:] = _PADDING_BODY
        checksum = padding_checksum(_PADDING_BODY, position)
        _pack_commit(header, 0, (self._term_length - offset) | checksum << 32)
        try:
            _pwrite_all(self._fd, [header], offset)
        except OSError as exc:
            raise self._write_failed(exc, offset, b"") from exc
        self._advance_tail(end)

    def _write_failed(
        self, exc: OSError, offset: int, payload: bytes | bytearray | memoryview
    ) -> LogError:
        """The error for a frame write the file system refused; nothing was appended.

        Part of the frame may have reached the page cache, beyond the tail
        where no reader looks. It is overwritten with zeros, if the file
        system lets us, so that no byte of a frame that was never appended
        (the payload is the producer's) can pass for a frame in recovery's
        scan after a crash. Whatever happens, the error is the write's.
        """
        size = HEADER_LENGTH + memoryview(payload).nbytes
        span = min(size + FRAME_ALIGNMENT - 1 & -FRAME_ALIGNMENT, self._term_length - offset)
        with contextlib.suppress(OSError):
            _pwrite_all(self._fd, [bytes(span)], offset)
        path = self._active.path
        return storage_error(f"cannot write to term file {path}", path, exc)

    def _ensure_term(self, term_id: int) -> None:
        """Make term ``term_id`` exist: usually the preparer has written it already."""
        if term_id in self._terms:
            return
        # Under the lock, so that a term the preparer finishes meanwhile
        # cannot be renamed over this one.
        with self._lock:
            if term_id not in self._terms:
                self._terms[term_id] = TermFile.create(self._directory, term_id, self._term_length)
                self._directory_dirty = True
                self._directory_changes += 1

    def _install_prepared(self, term: TermFile) -> bool:
        """Take a term the preparer wrote ahead (called on its thread).

        The preparer also makes the term's name durable (fsyncs the
        directory), here, ahead of need: otherwise the group commit that
        first syncs the new term would fsync the directory too, on top of
        two terms' fdatasyncs, and its acks would wait for all three (a
        commit entering a term took 4 to 5 times the others' time at the
        median, ``bench/termsync.py``). If the directory changed meanwhile,
        or the fsync fails, the next group commit syncs it as before.
        """
        with self._lock:
            if term.term_id in self._terms or self._closed:
                return False
            term.install()
            self._terms[term.term_id] = term
            self._directory_dirty = True
            self._directory_changes += 1
            changes = self._directory_changes
        try:
            fsync_directory(self._directory)
        except OSError:
            return True  # the group commit syncs the directory (and reports its failure)
        with self._lock:
            if self._directory_changes == changes:
                self._directory_dirty = False
        return True

    def _advance_tail(self, end: int) -> None:
        """Move the tail and the published position to ``end`` (frames before it are committed)."""
        term_id = term_id_of(end, self._shift)
        if term_id != self._active.term_id:
            term = self._terms[term_id]
            self._active = term
            self._fd = term.fd
            self._buffer = term.mapped
            self._view = term.view
            self._words = term.words
            self._term_base = term_start(term_id, self._shift)
            self._refresh_fast_end()
            if term_id + 1 not in self._terms:
                self._preparer.request(term_id + 1)
        self._tail = end
        self._meta_words[PUBLISHED_WORD] = end

    def _refresh_fast_end(self) -> None:
        # A frame ending at or before this position fits the free capacity and
        # leaves at least a header's room in the term: no rotation, no
        # implicit padding, no new term. One comparison on the hot path.
        self._fast_end = min(
            self._term_base + self._term_length - HEADER_LENGTH, self._release + self._capacity
        )

    def _full(self, needed: int) -> LogFullError:
        return LogFullError(
            f"append needs {needed} bytes of log, {self.free_capacity} free "
            f"(capacity {self._capacity}, tail {self._tail}, release {self._release})"
        )

    # --- durability -------------------------------------------------------------

    def sync(self) -> int:
        """Group commit: fsync what was appended, advance and store the durable position.

        Safe to call from a worker thread while the owner appends (see the
        module docstring for what is locked). Returns the new durable position.
        One chore rides along, after the durable position is out: term files
        that a release has freed are deleted, once that release is on disk.
        """
        with self._sync_lock:
            self._check_open()
            return self._sync_locked()

    def _sync_locked(self) -> int:
        with self._lock:
            target = self._tail
            durable = self._durable
            directory_dirty = self._directory_dirty
            self._directory_dirty = False
            redirty_from = self._redirty_from
            first = term_id_of(durable if redirty_from is None else redirty_from, self._shift)
            last = term_id_of(target, self._shift)
            dirty = [self._terms[t] for t in range(first, last + 1) if t in self._terms]
        if target > durable or directory_dirty or redirty_from is not None:
            try:
                if redirty_from is not None:
                    self._redirty(dirty, redirty_from, target)
                for term in dirty:
                    term.sync()
                if directory_dirty:
                    fsync_directory(self._directory)
            except OSError as exc:
                with self._lock:
                    self._directory_dirty |= directory_dirty
                    self._directory_changes += 1
                    # Linux may mark the pages of a failed write-back clean,
                    # so a later fsync would "succeed" without them: the next
                    # commit first rewrites everything since the last good one.
                    self._redirty_from = durable if redirty_from is None else redirty_from
                raise storage_error(
                    f"group commit of {self._directory} failed",
                    exc.filename or self._directory,
                    exc,
                ) from exc
            self._redirty_from = None
        with self._lock:
            if target > self._durable:
                self._durable = target
                self._meta.store_positions(self._durable, self._release)
                self._meta_dirty = True
                self._durable_changed.notify_all()
            release_term = term_id_of(self._release, self._shift)
            freed = [t for t in self._terms if t < release_term]
            # Terms wholly durable and behind the writer: their pages leave
            # the process (each term once).
            done_below = term_id_of(self._durable, self._shift)
            finished = [
                self._terms[t]
                for t in range(self._pages_dropped_below, done_below)
                if t in self._terms and t >= release_term
            ]
            self._pages_dropped_below = max(self._pages_dropped_below, done_below)
        for term in finished:
            term.drop_pages()
        if freed:
            # The release that frees these terms must reach the disk before
            # they leave it, or recovery would find history missing.
            try:
                self._meta.sync()
            except OSError as exc:
                raise storage_error(
                    f"cannot make the release of {self._directory} durable", self._meta.path, exc
                ) from exc
            self._meta_dirty = False
            with self._lock:
                doomed = [self._terms.pop(t) for t in freed]
            if self._deleter is not None:
                self._deleter.delete(doomed)  # off this commit's path
            else:
                for term in doomed:
                    term.close()
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(term.path)
        return self._durable

    def delete_in_background(self) -> None:
        """From now on, term files freed by a release are deleted on a helper thread.

        :meth:`sync` then returns without waiting for their deletion (see
        :mod:`headgate.log.deleter`); :meth:`close` waits for it. Without
        this, :meth:`sync` deletes them itself before it returns.
        """
        if self._deleter is None:
            self._deleter = TermDeleter()

    def _redirty(self, terms: list[TermFile], start: int, end: int) -> None:
        """Store again, unchanged, the committed bytes in ``[start, end)`` so fsync writes them.

        Those bytes are immutable history (below the tail snapshot), so
        rewriting them with their own values changes nothing a reader sees.
        """
        chunk = 1 << 20
        for term in terms:
            base = term_start(term.term_id, self._shift)
            low = max(start, base) - base
            high = min(end, base + self._term_length) - base
            view = term.view
            for offset in range(low, high, chunk):
                stop = min(offset + chunk, high)
                # Through the descriptor, as appends write (see _write_frame_py).
                _pwrite_all(term.fd, [bytes(view[offset:stop])], offset)

    def ensure_next_term(self) -> None:
        """Create the term after the active one now, if it does not exist yet.

        An append that rotates needs it; creating it is what fails on a full
        file system (:class:`StorageFull`). After such a failure, calling this
        until it succeeds is how a caller learns that space has returned,
        without attempting an append. Owner thread only.
        """
        self._check_open()
        self._ensure_term(self._active.term_id + 1)

    def wait_durable(self, position: int, timeout: float | None = None) -> bool:
        """Block until ``position`` is durable; ``False`` on timeout or close.

        This only waits: some thread must be calling :meth:`sync`.
        """
        with self._durable_changed:
            self._durable_changed.wait_for(
                lambda: self._durable >= position or self._closed, timeout
            )
            return self._durable >= position

    # --- releasing ----------------------------------------------------------------

    def release(self, position: int) -> None:
        """Tell the log the consumer is done with everything before ``position``.

        ``position`` must be a frame boundary (a frame's ``position`` or
        ``end_position``, or the tail) from the release position to the
        durable position. The space is free at once; term files wholly before
        it are deleted at the next :meth:`sync`, after the new release
        position is on disk.
        """
        self._check_open()
        if not self._release <= position <= self._durable:
            raise LogError(
                f"cannot release to {position}: it must lie between the release position "
                f"{self._release} and the durable position {self._durable}"
            )
        if position != self._tail and term_offset_of(position, self._term_length) != 0:
            problem = self._scanner.check_frame(position)
            if problem is not None:
                raise LogError(
                    f"cannot release to {position}: not a frame boundary ({problem.reason})"
                )
        with self._lock:
            self._release = position
            self._meta.store_positions(self._durable, position)
            self._meta_dirty = True
        self._refresh_fast_end()

    def boundary_problem(self, position: int) -> str | None:
        """Why ``position`` is not a frame boundary of the log, or None if it is one.

        For a position from the release position to the durable position
        (what :meth:`release` accepts); the gateway checks a consumer's
        Release with it before anything moves.
        """
        self._check_open()
        if not self._release <= position <= self._durable:
            return f"outside [{self._release}, {self._durable}]"
        if position == self._tail or term_offset_of(position, self._term_length) == 0:
            return None
        problem = self._scanner.check_frame(position)
        return None if problem is None else problem.reason

    # --- reading back ---------------------------------------------------------------

    def read(
        self, start: int, end: int | None = None, *, max_bytes: int | None = None
    ) -> list[LogFrame]:
        """The data frames from ``start`` up to ``end`` (default: the tail), padding skipped.

        ``start`` must be a frame boundary at or after the release position.
        With ``max_bytes``, frames stop before ``end_position - start`` of the
        last one would exceed it, but at least one frame is returned if there
        is any. Payloads are read-only views over the mapped terms.
        """
        self._check_open()
        end = self._check_range(start, end)
        frames: list[LogFrame] = []
        try:
            for position, next_position, term, offset, header in self._scanner.frames(start, end):
                if frames and max_bytes is not None and next_position - start > max_bytes:
                    break
                frames.append(
                    LogFrame(
                        position,
                        next_position,
                        header[6],
                        header[7],
                        header[5],
                        header[8],
                        term.view[offset + HEADER_LENGTH : offset + header[0]].toreadonly(),
                    )
                )
        except FrameProblem as problem:
            raise _problem_error(problem, start) from None
        except ValueError as exc:
            raise LogError(f"end {end} is not a frame boundary: {exc}") from None
        return frames

    def scan_headers(
        self, start: int, end: int | None = None, *, verify: bool = True
    ) -> Iterator[FrameHeader]:
        """Headers of the data frames from ``start`` to ``end`` (default: the tail).

        For rebuilding per-producer state (last sequence per producer) after
        a restart. With ``verify`` false, payload checksums are skipped and
        the cost is a few header fields per frame.
        """
        self._check_open()
        end = self._check_range(start, end)
        try:
            for position, next_position, _, _, header in self._scanner.frames(
                start, end, verify=verify
            ):
                yield FrameHeader(
                    position, next_position, header[6], header[7], header[5], header[8]
                )
        except FrameProblem as problem:
            raise _problem_error(problem, start) from None
        except ValueError as exc:
            raise LogError(f"end {end} is not a frame boundary: {exc}") from None

    def _check_range(self, start: int, end: int | None) -> int:
        tail = self._tail
        if end is None:
            end = tail
        if not self._release <= start <= end <= tail:
            raise LogError(
                f"cannot read [{start}, {end}): need release position {self._release} "
                f"<= start <= end <= tail {tail}"
            )
        if normalize_position(start, self._term_length, HEADER_LENGTH) != start:
            raise LogError(f"cannot read from {start}: not a frame boundary")
        return end

    def _check_open(self) -> None:
        if self._closed:
            raise LogError(f"the stream log at {self._directory} is closed")

    def __repr__(self) -> str:
        return (
            f"<StreamLog {self._directory} release={self._release} durable={self._durable} "
            f"tail={self._tail} capacity={self._capacity}>"
        )


def _problem_error(problem: FrameProblem, start: int) -> LogError:
    if problem.position == start:
        return LogError(
            f"no intact frame at position {start}: not a frame boundary, or damaged "
            f"({problem.path} at byte offset {problem.offset}: {problem.reason})"
        )
    return LogCorruptError(problem.path, problem.offset, problem.reason)


def _lock_directory(path: Path) -> int:
    fd = try_lock(path / LOCK_FILE_NAME)
    if fd is None:
        raise LogError(f"the stream log at {path} is already open by another writer")
    return fd


def _check_term_length(term_length: int) -> None:
    if (
        term_length < MIN_TERM_LENGTH
        or term_length > MAX_TERM_LENGTH
        or term_length & (term_length - 1)
    ):
        raise LogError(
            f"term_length must be a power of two from {MIN_TERM_LENGTH} to "
            f"{MAX_TERM_LENGTH}, got {term_length}"
        )


def _check_capacity(capacity: int) -> None:
    if capacity < HEADER_LENGTH or capacity % FRAME_ALIGNMENT:
        raise LogError(
            f"capacity must be a multiple of {FRAME_ALIGNMENT} of at least {HEADER_LENGTH}, "
            f"got {capacity}"
        )
