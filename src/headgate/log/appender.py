"""The appender: the one loop that writes frames at a log's tail.

:class:`Appender` is the write side of a
:class:`~headgate.log.stream_log.StreamLog`: the tail, the release position
and the capacity (the books of free space), the active term, and
:meth:`Appender._write_frames`, the single loop through which every frame
goes, whether it came from ``append`` (one frame) or ``append_many``
(several). The loop hands each frame to the frame writer
(:func:`headgate.log._frame_writer.write_frame` in C when it is built, or
:func:`_write_frame_py`, which keeps the same contract) with a bound the
frame must end before. Most frames fit; one that does not goes back through
the same call after :meth:`Appender._make_room` has padded to the next term,
created the term after it, or refused with :class:`LogFullError`. Each frame
is one :data:`FrameSpec` record; the writers take their 13 (C) or 10
(Python) arguments at these two places only, and at ``append``'s one-call
shortcut for the C writer.

Only the owner thread writes. Appends take no lock: the term preparer and the
group commit meet the appender only in the :class:`TermTable` (under its
lock) and in the tail position, an int that the commit reads once (see
:mod:`headgate.log.group_commit`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import sys
import zlib
from collections.abc import Iterable
from typing import Final, Protocol, overload

from headgate.log.errors import LogError, LogFullError, storage_error
from headgate.log.frame import (
    DATA_FRAME,
    FORMAT_VERSION,
    FRAME_ALIGNMENT,
    HEADER_BODY,
    HEADER_LENGTH,
    MAX_U32,
    TYPE_OFFSET,
    AppendResult,
    frame_cost,
    padding_body,
    padding_checksum,
)
from headgate.log.metadata import PUBLISHED_POSITION_OFFSET, PUBLISHED_WORD, MetadataPage
from headgate.log.position import align, normalize_position, term_id_of, term_offset_of, term_start
from headgate.log.preparer import TermPreparer
from headgate.log.term import TermFile, pwrite_all
from headgate.log.term_table import TermTable

__all__ = [
    "PURE_PYTHON_ENV",
    "WRITE_FROM",
    "Appender",
    "FrameSpec",
    "WriteFrame",
    "check_capacity",
    "frame_writer",
]

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError(
        "headgate.log stores each frame's commit word (length, then checksum, "
        "little-endian) as one native 64-bit word, which needs a little-endian host"
    )

FrameSpec = tuple[bytes | bytearray | memoryview, int, int, int, int]
"""One frame for :meth:`Appender.append_many`: payload, producer id, first sequence,
record count, timestamp (microseconds)."""

WRITE_FROM: Final = 1024
"""Payload bytes from which a frame goes to the term file with ``pwritev``;
smaller frames are stored into the mapped term (see LOG.md, "Writing
through the descriptor")."""

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


# Looked up on every write, so that tests can switch paths in one process.
_write_frame: WriteFrame | None = _load_frame_writer()


def frame_writer() -> str:
    """Which frame writer appends use: ``"C"`` or ``"Python"`` (see LOG.md)."""
    return "Python" if _write_frame is None else "C"


_new_result = tuple.__new__  # skips NamedTuple.__new__'s Python frame on the hot path
_pack_body = HEADER_BODY.pack_into  # bound once: the hot path looks up one global
_pack_commit = struct.Struct("<Q").pack_into
_crc32 = zlib.crc32
_ALIGNMENT_ZEROS: Final = bytes(FRAME_ALIGNMENT)
_PADDING_BODY: Final = padding_body()


def _write_frame_py(
    term: TermFile,
    buffer: mmap.mmap,
    offset: int,
    position: int,
    limit: int,
    payload: bytes | bytearray | memoryview,
    producer_id: int,
    first_sequence: int,
    record_count: int,
    timestamp_us: int,
) -> int:
    """The pure-Python frame write (the C writer's fallback, with its contract); publishes nothing.

    Returns the frame's end (its position plus its aligned length), or 0,
    having written nothing, if that end would be past ``limit``.

    A payload under :data:`WRITE_FROM` bytes is stored into ``buffer``, the
    mapped term (with the term's ``view`` and ``words``): the body first
    (header fields after the checksum, then the payload), the commit word
    (length and checksum) last, as one aligned 8-byte store. A larger one
    goes to the term file through its descriptor, in one ``pwritev`` of the
    whole frame: the commit word, header bytes 8..40, the payload and zeros
    up to the next multiple of 8 (see LOG.md, "Ordering"); a failed write
    raises ``OSError``, and the caller scrubs what may have been written.
    """
    length = HEADER_LENGTH + len(payload)
    # align(length, FRAME_ALIGNMENT), inline (see Appender._write_frames).
    end = position + ((length + FRAME_ALIGNMENT - 1) & -FRAME_ALIGNMENT)
    if end > limit:
        return 0
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
        term.words[offset >> 3] = (
            length | _crc32(term.view[offset + TYPE_OFFSET : offset + length], seed) << 32
        )
        return end
    frame = memoryview(header)
    checksum = _crc32(payload, _crc32(frame[TYPE_OFFSET:HEADER_LENGTH], seed))
    _pack_commit(header, 0, length | checksum << 32)
    pad = -length & (FRAME_ALIGNMENT - 1)
    pwrite_all(term.fd, [frame[:HEADER_LENGTH], payload, _ALIGNMENT_ZEROS[:pad]], offset)
    return end


class Appender:
    """The write side of one log: the tail, the space books and the one write loop.

    The tail is where the next frame goes; the release position is where the
    consumer's unfinished history begins, and the capacity how many bytes
    may lie between the two. ``_fast_end`` folds the rules a frame must
    keep (fit the free capacity, leave at least a header's room in the term,
    so no rotation, no implicit padding and no new term) into one bound that
    the frame writer checks; a frame past it takes :meth:`_make_room`.

    :class:`~headgate.log.stream_log.StreamLog` is an ``Appender``, so that
    its ``append`` is this one with no call in between: a delegating call
    cost 50 to 100 ns, 8 to 15% of a small append.
    """

    __slots__ = (
        "_base",
        "_buffer",
        "_capacity",
        "_fast_end",
        "_fd",
        "_meta_page",
        "_meta_words",
        "_preparer",
        "_release",
        "_shift",
        "_table",
        "_tail",
        "_term",
        "_term_length",
    )

    def __init__(
        self,
        table: TermTable,
        meta: MetadataPage,
        preparer: TermPreparer,
        *,
        tail: int,
        release: int,
        capacity: int,
    ) -> None:
        self._table = table
        self._term_length = table.term_length
        self._shift = table.shift
        self._meta_words = meta.words
        self._meta_page = meta.buffer
        self._preparer = preparer
        self._tail = tail
        self._release = release
        self._capacity = capacity
        self._fast_end = 0
        self._enter_term(term_id_of(tail, self._shift))

    # --- the space books ------------------------------------------------------

    @property
    def tail_position(self) -> int:
        """Where the next frame goes (or the padding before it)."""
        return self._tail

    @property
    def release_position(self) -> int:
        """The consumer is done with everything before this position."""
        return self._release

    @property
    def capacity(self) -> int:
        """Most bytes the log holds between the release position and the tail."""
        return self._capacity

    @property
    def max_payload(self) -> int:
        """Largest payload an append can ever take: a whole term, or the capacity, less a header."""
        return min(self._term_length, self._capacity) - HEADER_LENGTH

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
        self._table.check_open()
        check_capacity(capacity)
        self._capacity = capacity
        self._refresh_fast_end()

    def _move_release(self, position: int) -> None:
        """The consumer released up to ``position`` (checked by the caller): the space is free."""
        self._release = position
        self._refresh_fast_end()

    def _stop(self) -> None:
        """The log is closing: every later write takes the slow path, which checks for close."""
        self._fast_end = -1

    def append_cost(self, payload_length: int) -> int:
        """How far an append of ``payload_length`` bytes would move the tail right now.

        ``frame_cost(payload_length)``, plus the rest of the term if the frame
        does not fit in it (padding), plus the last few bytes of a term if the
        frame would leave less than a header there (implicit padding).
        """
        cost = frame_cost(payload_length)
        offset = term_offset_of(self._tail, self._term_length)
        start = self._tail
        if offset + cost > self._term_length:
            start += self._term_length - offset
        end = normalize_position(start + cost, self._term_length, HEADER_LENGTH)
        return end - self._tail

    # --- writing ----------------------------------------------------------------

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

        With the C writer, the frame first tries the one call that also
        publishes and builds the result (the loop cannot: it publishes once
        per call). Through :meth:`_write_frames` alone, a small append cost
        about 430 ns more (+65%, 100-byte payloads). Past the fast bound, and
        on the pure-Python path, the loop does it: there it costs about 300 ns
        (+20%) more than a call of its own would, which is not worth two more
        places that call a frame writer.
        """
        write = _write_frame
        if write is not None:
            tail = self._tail
            # tail - base is term_offset_of, inline: see _write_frames for the cost.
            try:
                result = write(
                    self._fd if len(payload) >= WRITE_FROM else self._buffer,
                    self._term_length,
                    tail - self._base,
                    tail,
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
                raise self._write_failed(exc, tail - self._base, payload) from exc
            if result is not None:
                self._tail = result[1]
                return result
        frame = (payload, producer_id, first_sequence, record_count, timestamp_us)
        start = self._write_frames((frame,))
        return _new_result(AppendResult, (start, self._tail))

    def append_many(self, frames: Iterable[FrameSpec], ends: list[int] | None = None) -> int:
        """Append several batches, one frame each, in order, and publish once; return the tail.

        Each item is ``(payload, producer_id, first_sequence, record_count,
        timestamp_us)``, with the meaning of :meth:`append`'s arguments. The
        frames become visible to readers in other processes together, when
        the published position moves past the last one; a group commit
        covers them once it has started after this call returned.

        For several batches of one stream at hand at once: per frame it
        costs the header, the copy and the checksum, but not a method call,
        an :class:`AppendResult` or a store of the published position. Each
        frame's position is the previous one's end (or the start of the next
        term, after padding).

        If one frame fails (:class:`LogFullError`, a header field out of
        range, or :class:`StorageFull`), the frames before it stay appended
        and published, and the error propagates: :attr:`tail_position` then
        says how far the call got.

        With ``ends``, each appended frame's end position is appended to that
        list as it commits (its start is the previous end, or the start of a
        term after padding), so that a caller keeping per-batch books knows
        each frame's place, and which frames went in before an error.
        """
        self._write_frames(frames, ends)
        return self._tail

    def _write_frames(self, frames: Iterable[FrameSpec], ends: list[int] | None = None) -> int:
        """Write ``frames`` in order, publish once; return the last one's position.

        The write loop of :meth:`append` and :meth:`append_many` (see there
        for what a caller sees). With no frame, the tail is returned.
        If a frame fails, the frames before it stay written and published, and
        the error propagates. Each frame's end goes to ``ends`` as it commits.

        The locals below are the attributes the loop reads per frame, loaded
        once per call and again only after the slow path moved them. The fast
        path does its position arithmetic inline (``tail - base`` is
        :func:`~headgate.log.position.term_offset_of`, and the writers align
        inline): a call of one of those pure functions costs 35 to 50 ns more
        (measured here), 6 to 8% of a small append; the slow path calls them.
        """
        write = _write_frame
        record = None if ends is None else ends.append
        tail = published = start = self._tail
        fast_end = self._fast_end
        term_length = self._term_length
        term = self._term
        fd = self._fd
        buffer = self._buffer
        base = self._base
        try:
            for payload, producer_id, first_sequence, record_count, timestamp_us in frames:
                limit = fast_end
                slow = False
                while True:
                    try:
                        if write is None:
                            end = _write_frame_py(
                                term,
                                buffer,
                                tail - base,
                                tail,
                                limit,
                                payload,
                                producer_id,
                                first_sequence,
                                record_count,
                                timestamp_us,
                            )
                        else:
                            end = write(
                                fd if len(payload) >= WRITE_FROM else buffer,
                                term_length,
                                tail - base,
                                tail,
                                limit,
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
                        raise self._write_failed(exc, tail - base, payload) from exc
                    if end or slow:
                        break
                    # Past the fast bound: make room, then the same write
                    # again, bounded by this frame's own end.
                    self._tail = tail
                    try:
                        limit = self._make_room(len(payload))
                    finally:
                        # Padding moved (and published) the tail, also when
                        # the frame then did not fit.
                        tail = self._tail
                    slow = True
                    term = self._term
                    fd = self._fd
                    buffer = self._buffer
                    base = self._base
                if slow:
                    if not end:  # len() counted items, not bytes: nothing was written
                        raise LogError("the payload must be bytes (a memoryview must be of bytes)")
                    end = normalize_position(end, term_length, HEADER_LENGTH)
                    self._advance_tail(end)
                    published = end
                    fast_end = self._fast_end
                    term = self._term
                    fd = self._fd
                    buffer = self._buffer
                    base = self._base
                start = tail
                tail = end
                if record is not None:
                    record(end)
        finally:
            # Whatever was committed is published, also when a frame failed.
            if tail != published:
                self._tail = tail
                self._meta_words[PUBLISHED_WORD] = tail
        return start

    def _make_room(self, payload_length: int) -> int:
        """Room for a frame past the fast bound; return where that frame ends.

        Pads the rest of the term if the frame does not fit in it, refuses
        with :class:`LogFullError` if the frame does not fit the free
        capacity (the padding is written even then, so that the frame fits
        once the consumer releases up to the new term), and creates the next
        term if the frame ends this one: the next term must exist before the
        tail points into it (readers, sync and recovery rely on that), and
        before the frame commits, so that a failure to create it leaves no
        committed frame behind an append that raised.
        """
        self._table.check_open()
        if payload_length > self.max_payload:
            raise LogFullError(
                f"a payload of {payload_length} bytes can never fit this log "
                f"(max_payload is {self.max_payload})"
            )
        cost = frame_cost(payload_length)
        term_length = self._term_length
        offset = term_offset_of(self._tail, term_length)
        if offset + cost > term_length:
            padding = term_length - offset
            if padding > self.free_capacity:
                raise self._full(padding + cost)
            self._pad_to_next_term()
        end = normalize_position(self._tail + cost, term_length, HEADER_LENGTH)
        if end - self._tail > self.free_capacity:
            raise self._full(end - self._tail)
        if term_offset_of(end, term_length) == 0:
            self._table.ensure(term_id_of(end, self._shift))
        return self._tail + cost

    def _pad_to_next_term(self) -> None:
        """Fill the rest of the active term with a padding frame and move to the next term."""
        position = self._tail
        offset = term_offset_of(position, self._term_length)
        end = term_start(term_id_of(position, self._shift) + 1, self._shift)
        self._table.ensure(term_id_of(end, self._shift))
        header = bytearray(HEADER_LENGTH)
        header[TYPE_OFFSET:] = _PADDING_BODY
        checksum = padding_checksum(_PADDING_BODY, position)
        _pack_commit(header, 0, (end - position) | checksum << 32)
        try:
            pwrite_all(self._fd, [header], offset)
        except OSError as exc:
            raise self._write_failed(exc, offset, b"") from exc
        self._advance_tail(end)

    def ensure_next_term(self) -> None:
        """Create the term after the active one now, if it does not exist yet.

        An append that rotates needs it; creating it is what fails on a full
        file system (:class:`StorageFull`). After such a failure, calling this
        until it succeeds is how a caller learns that space has returned,
        without attempting an append. Owner thread only.
        """
        self._table.check_open()
        self._table.ensure(self._term.term_id + 1)

    def _advance_tail(self, end: int) -> None:
        """Move the tail and the published position to ``end`` (frames before it are committed)."""
        term_id = term_id_of(end, self._shift)
        if term_id != self._term.term_id:
            self._enter_term(term_id)
        self._tail = end
        self._meta_words[PUBLISHED_WORD] = end

    def _enter_term(self, term_id: int) -> None:
        """Write into term ``term_id`` from now on, and have the one after it prepared."""
        term = self._table.files[term_id]
        self._term = term
        self._fd = term.fd
        self._buffer = term.mapped
        self._base = term_start(term_id, self._shift)
        self._refresh_fast_end()
        if term_id + 1 not in self._table.files:
            self._preparer.request(term_id + 1)

    def _refresh_fast_end(self) -> None:
        # A frame ending at or before this position fits the free capacity and
        # leaves at least a header's room in the term: no rotation, no
        # implicit padding, no new term. One comparison on the hot path.
        self._fast_end = min(
            self._base + self._term_length - HEADER_LENGTH, self._release + self._capacity
        )

    def _full(self, needed: int) -> LogFullError:
        return LogFullError(
            f"append needs {needed} bytes of log, {self.free_capacity} free "
            f"(capacity {self._capacity}, tail {self._tail}, release {self._release})"
        )

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
        span = min(align(size, FRAME_ALIGNMENT), self._term_length - offset)
        with contextlib.suppress(OSError):
            pwrite_all(self._fd, [bytes(span)], offset)
        path = self._term.path
        return storage_error(f"cannot write to term file {path}", path, exc)


def check_capacity(capacity: int) -> None:
    """Refuse a capacity that is not a multiple of the frame alignment of at least a header."""
    if capacity < HEADER_LENGTH or capacity % FRAME_ALIGNMENT:
        raise LogError(
            f"capacity must be a multiple of {FRAME_ALIGNMENT} of at least {HEADER_LENGTH}, "
            f"got {capacity}"
        )
