"""The C frame writer: the same bytes as the Python path, and hostile arguments refused cleanly."""

from __future__ import annotations

import mmap
import os
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest

from headgate.log import AppendResult, LogError, StreamLog
from headgate.log import appender as appender_module
from headgate.log.appender import FrameSpec, WriteFrame
from headgate.log.frame import HEADER, HEADER_LENGTH, frame_cost
from headgate.log.metadata import META_FILE_NAME, PUBLISHED_POSITION_OFFSET
from headgate.log.term import list_term_files
from tests.log import _frames

TERM = 4096
BUILT = appender_module._load_frame_writer()
needs_c = pytest.mark.skipif(BUILT is None, reason="the C frame writer is not built")

# Header fields at and near their limits, cycled through the frames.
PRODUCERS = [0, 2**64 - 1, 7, 2**63]
SEQUENCES = [2**64 - 1, 0, 1, 2**32]
COUNTS = [0, 2**32 - 1, 1, 5]
TIMESTAMPS = [-(2**63), 2**63 - 1, 0, -1]


def spec(i: int, payload: bytes | bytearray | memoryview) -> FrameSpec:
    return (payload, PRODUCERS[i % 4], SEQUENCES[(i // 4) % 4], COUNTS[i % 3], TIMESTAMPS[i % 4])


def room_left(log: StreamLog) -> int:
    return TERM - log.tail_position % TERM


def scenario(directory: Path) -> dict[str, bytes]:
    """Appends of every kind (one by one and in groups, rotations, padding, exact term ends,
    implicit padding, extreme fields, three payload types); returns every file's bytes."""
    files: dict[str, bytes] = {}
    with StreamLog.open(directory, term_length=TERM, capacity=64 * TERM) as log:
        i = 0
        for round_number in range(12):
            for seq in range(25):
                raw = _frames.payload(seq * 13 + round_number)
                payload: bytes | bytearray | memoryview = (raw, bytearray(raw), memoryview(raw))[
                    i % 3
                ]
                payload_, producer, first, count, stamp = spec(i, payload)
                log.append(
                    payload_,
                    producer_id=producer,
                    first_sequence=first,
                    record_count=count,
                    timestamp_us=stamp,
                )
                i += 1
            # A frame that ends the term exactly, then one that leaves 16 bytes
            # (implicit padding), then a group that rotates in the middle.
            log.append(bytes(room_left(log) - HEADER_LENGTH), **fields(i))
            i += 1
            log.append(b"\xab" * (room_left(log) - HEADER_LENGTH - 16), **fields(i))
            i += 1
            group = [spec(i + k, _frames.payload(k * 31 + round_number)) for k in range(9)]
            log.append_many(group)
            i += 9
            if round_number % 3 == 2:
                log.sync()
                files.update(snapshot(directory))  # before the release deletes terms
                log.release(log.durable_position)
        log.append(b"", **fields(i))
        log.sync()
    files.update(snapshot(directory))
    files[META_FILE_NAME] = (directory / META_FILE_NAME).read_bytes()
    return files


def large_frames(directory: Path) -> dict[str, bytes]:
    """Payloads around the C writer's GIL threshold (4 KiB) and far above, in 64 KiB terms."""
    with StreamLog.open(directory, term_length=64 * 1024, capacity=64 * 64 * 1024) as log:
        for i in range(60):
            size = (4095, 4096, 4097, 20_000, 60_000, 9_999)[i % 6]
            log.append(bytes([i]) * size, **fields(i))
        log.append_many([spec(i, bytes([i]) * (3000 + 997 * i)) for i in range(20)])
    # The term preparer may or may not have written the next, empty term
    # before the close: only terms with frames are compared.
    files = {name: data for name, data in snapshot(directory).items() if any(data)}
    files[META_FILE_NAME] = (directory / META_FILE_NAME).read_bytes()
    return files


def snapshot(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in list_term_files(directory).values()}


def fields(i: int) -> dict[str, int]:
    _, producer, first, count, stamp = spec(i, b"")
    return {
        "producer_id": producer,
        "first_sequence": first,
        "record_count": count,
        "timestamp_us": stamp,
    }


@needs_c
def test_c_and_python_write_identical_files(
    tmp_path: Path, frame_writer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if frame_writer != "C":
        pytest.skip("compares both paths itself; runs once")
    monkeypatch.setattr(appender_module, "_write_frame", BUILT)
    with_c = scenario(tmp_path / "c")
    monkeypatch.setattr(appender_module, "_write_frame", None)
    with_python = scenario(tmp_path / "python")
    assert with_c.keys() == with_python.keys()
    assert len(with_c) > 20  # dozens of terms, and the metadata page
    for name, data in with_c.items():
        assert data == with_python[name], f"{name} differs between the C and Python writers"
    monkeypatch.setattr(appender_module, "_write_frame", BUILT)
    large_c = large_frames(tmp_path / "large-c")
    monkeypatch.setattr(appender_module, "_write_frame", None)
    large_python = large_frames(tmp_path / "large-python")
    assert large_c.keys() == large_python.keys()
    assert len(large_c) > 10
    for name, data in large_c.items():
        assert data == large_python[name], f"{name} differs between the C and Python writers"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("producer_id", -1),
        ("producer_id", 2**64),
        ("first_sequence", -1),
        ("first_sequence", 2**64),
        ("record_count", -1),
        ("record_count", 2**32),
        ("timestamp_us", 2**63),
        ("timestamp_us", -(2**63) - 1),
        ("record_count", 1.5),
        ("producer_id", "7"),
    ],
)
def test_append_refuses_fields_out_of_range_without_writing(
    tmp_path: Path, frame_writer: str, field: str, value: object
) -> None:
    with StreamLog.open(tmp_path, term_length=TERM, capacity=8 * TERM) as log:
        _frames.append(log, 0)
        tail = log.tail_position
        before = list_term_files(tmp_path)[0].read_bytes()
        arguments: dict[str, object] = {**fields(0), field: value}
        with pytest.raises(LogError, match="out of range"):
            log.append(b"x" * 100, **arguments)  # type: ignore[arg-type]
        with pytest.raises(LogError, match="out of range"):
            log.append_many([(b"y" * 50, *arguments.values())])  # type: ignore[list-item]
        assert log.tail_position == tail
        after = list_term_files(tmp_path)[0].read_bytes()
        # Nothing committed: history as it was, and no commit word at the tail.
        assert after[:tail] == before[:tail]
        assert after[tail : tail + 8] == bytes(8)
        if frame_writer == "C":
            # The C writer checks every field before its first store. (Python's
            # struct.pack_into stores the fields before the bad one, beyond
            # the tail, where nothing is committed.)
            assert after == before
        # The log goes on as if nothing happened.
        _frames.append(log, 1)
        assert [f.first_sequence for f in log.read(0)] == [0, 1]


def _write(
    write: WriteFrame,
    fd: object,
    offset: int = 0,
    *,
    term_size: object = TERM,
    position: int = 0,
    limit: int = 1 << 40,
    payload: object = b"hello",
    meta: object = None,
    published_offset: int = 0,
) -> int:
    # Hostile arguments on purpose: the call is untyped.
    untyped: Any = write
    return int(
        untyped(
            fd,
            term_size,
            offset,
            position,
            limit,
            payload,
            1,
            2,
            3,
            4,
            meta,
            published_offset,
            None,
        )
    )


def _term_file(path: Path) -> int:
    """A zeroed term file of TERM bytes, open for writing; the caller closes the fd."""
    path.write_bytes(bytes(TERM))
    return os.open(path, os.O_RDWR)


@needs_c
def test_write_frame_writes_a_checkable_frame_and_publishes(tmp_path: Path) -> None:
    assert BUILT is not None
    fd = _term_file(tmp_path / "term")
    term = mmap.mmap(fd, TERM)  # what readers see: the same page cache
    meta = mmap.mmap(-1, 4096)
    try:
        end = _write(
            BUILT,
            fd,
            64,
            position=8192 + 64,
            payload=b"abc",
            meta=meta,
            published_offset=PUBLISHED_POSITION_OFFSET,
        )
        assert end == 8192 + 64 + frame_cost(3)
        length, checksum, kind, flags, version, count, producer, first, stamp = HEADER.unpack_from(
            term, 64
        )
        assert (length, kind, flags, version, count, producer, first, stamp) == (
            43,
            1,
            0,
            1,
            3,
            1,
            2,
            4,
        )
        position = 8192 + 64
        assert checksum == zlib.crc32(term[72:107], (position ^ position >> 32) & 0xFFFFFFFF)
        assert term[104:107] == b"abc"
        published = meta[PUBLISHED_POSITION_OFFSET : PUBLISHED_POSITION_OFFSET + 8]
        assert int.from_bytes(published, "little") == end
        # An empty payload: the checksum covers the header body alone.
        assert _write(BUILT, fd, 256, position=256, payload=b"") == 256 + 40
        (length, checksum) = HEADER.unpack_from(term, 256)[:2]
        assert (length, checksum) == (40, zlib.crc32(term[264:296], 256))
        # Past the limit: nothing written, 0 returned.
        snapshot = bytes(term)
        assert _write(BUILT, fd, 512, position=512, limit=512 + 47, payload=b"x" * 8) == 0
        assert bytes(term) == snapshot
        # With a result type: an AppendResult, or None past the limit.
        args = (b"xyz", 1, 2, 3, 4, None, 0)
        result = BUILT(fd, TERM, 1024, 1024, 1 << 40, *args, AppendResult)
        assert type(result) is AppendResult
        assert result == (1024, 1024 + frame_cost(3))
        assert result.end_position == 1024 + frame_cost(3)
        assert BUILT(fd, TERM, 2048, 2048, 2048, *args, AppendResult) is None
        snapshot = bytes(term)
        untyped: Any = BUILT
        for bad in (int, list, "AppendResult", 0):
            with pytest.raises(TypeError, match="result_type"):
                untyped(fd, TERM, 4096 - 64, 0, 1 << 40, *args, bad)
        assert bytes(term) == snapshot
    finally:
        term.close()
        os.close(fd)


@needs_c
@pytest.mark.parametrize(
    ("case", "error"),
    [
        ({"offset": TERM}, ValueError),
        ({"offset": TERM - 40}, ValueError),  # the header fits, the payload does not
        ({"offset": -8}, ValueError),
        ({"offset": 4}, ValueError),
        ({"offset": 2**70}, ValueError),
        ({"term_size": 40}, ValueError),
        ({"term_size": -1}, ValueError),
        ({"term_size": 4.0}, TypeError),
        ({"position": -8}, ValueError),
        ({"position": 3}, ValueError),
        ({"position": 2**63 - 16}, ValueError),
        ({"meta": "page", "published_offset": 4096}, ValueError),
        ({"meta": "page", "published_offset": 4}, ValueError),
        ({"meta": "page", "published_offset": -8}, ValueError),
        ({"meta": "readonly"}, ValueError),
        ({"fd": "readonly"}, OSError),  # EBADF at the first write: nothing written
        ({"fd": "closed"}, OSError),
        ({"fd": -1}, ValueError),
        ({"fd": 2**40}, ValueError),
        ({"fd": "bytes"}, ValueError),  # neither a descriptor nor a writable buffer
        ({"fd": "readonly_map"}, ValueError),
        ({"fd": "map", "term_size": 2 * TERM}, ValueError),  # the map is shorter
        ({"fd": "map", "offset": 4}, ValueError),
        ({"fd": "map", "offset": TERM - 40}, ValueError),
        ({"payload": "text"}, TypeError),
        ({"payload": 5}, TypeError),
        ({"offset": 8.0}, TypeError),
    ],
)
def test_write_frame_refuses_hostile_arguments_without_writing(
    tmp_path: Path, case: dict[str, object], error: type[Exception]
) -> None:
    assert BUILT is not None
    fd = _term_file(tmp_path / "term")
    page = mmap.mmap(-1, 4096)
    path = tmp_path / "readonly"
    path.write_bytes(bytes(TERM))
    readonly_fd = os.open(path, os.O_RDONLY)
    readonly = mmap.mmap(readonly_fd, TERM, access=mmap.ACCESS_READ)
    mapped = mmap.mmap(fd, TERM)  # before the closed fd: mmap dups a descriptor
    closed = os.open(tmp_path / "term", os.O_RDWR)
    os.close(closed)
    stand_ins: dict[object, object] = {
        "page": page,
        "readonly": readonly_fd if case.get("fd") == "readonly" else readonly,
        "closed": closed,
        "bytes": bytes(TERM),
        "readonly_map": readonly,
        "map": mapped,
        "text": "a string is no buffer",
    }
    arguments = {key: stand_ins.get(value, value) for key, value in case.items()}
    target = arguments.pop("fd", fd)
    try:
        with pytest.raises(error):
            _write(BUILT, target, **arguments)  # type: ignore[arg-type]
        assert (tmp_path / "term").read_bytes() == bytes(TERM)
        assert path.read_bytes() == bytes(TERM)
        assert bytes(page) == bytes(4096)
        with pytest.raises(TypeError, match="13 arguments"):
            BUILT(fd, 0)  # type: ignore[call-overload]
        # No buffer is left exported: the maps can be closed.
        page.close()
        readonly.close()
        mapped.close()
    finally:
        os.close(fd)
        os.close(readonly_fd)


@needs_c
def test_pure_python_env_selects_the_python_writer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(appender_module.PURE_PYTHON_ENV, "1")
    assert appender_module._load_frame_writer() is None
    monkeypatch.setenv(appender_module.PURE_PYTHON_ENV, "0")
    assert appender_module._load_frame_writer() is BUILT
    assert os.environ[appender_module.PURE_PYTHON_ENV] == "0"


def test_a_missing_extension_falls_back_to_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(appender_module.PURE_PYTHON_ENV, raising=False)
    # None in sys.modules makes the import raise ImportError, as a missing .so does.
    monkeypatch.setitem(sys.modules, "headgate.log._frame_writer", None)
    writer = appender_module._load_frame_writer()
    assert writer is None
    monkeypatch.setattr(appender_module, "_write_frame", writer)
    assert appender_module.frame_writer() == "Python"
    with StreamLog.open(tmp_path, term_length=TERM, capacity=8 * TERM) as log:
        for seq in range(40):
            _frames.append(log, seq)
        frames = log.read(0)
    assert [f.first_sequence for f in frames] == list(range(40))
    for frame in frames:
        _frames.check_frame(frame)
