"""Damaged, truncated and missing files: a clear LogError, or a repaired tail, never anything else.

Two kinds of damage, two outcomes. Damage after the durable position is what
a crash leaves (a frame begun but not committed, a torn frame, a term created
but empty, a term lost): recovery cuts it off and the log continues. Damage
to history reported durable cannot be repaired: :class:`LogCorruptError`,
naming the file and the byte offset, at open if it lies where recovery looks,
or at read otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from headgate.log import LogCorruptError, LogError, LogReader, StreamLog
from tests.log import _frames

TERM = 4096
SCRIPTED = Path(__file__).with_name("_scripted_writer.py")


def term_path(directory: Path, term_id: int) -> Path:
    return directory / f"{term_id:016x}.term"


def flip(path: Path, offset: int, mask: int = 0x01) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


def build(directory: Path, count: int = 60) -> list[tuple[int, int, int]]:
    """A cleanly closed log of ``count`` frames over several terms; returns (pos, end, seq)."""
    with StreamLog.open(directory, term_length=TERM, capacity=256 * TERM) as log:
        results, _ = _frames.append_many(log, count)
        frames = log.read(0)
        assert [f.position for f in frames] == [r.position for r in results]
        return [(f.position, f.end_position, f.first_sequence) for f in frames]


def crash(directory: Path, synced: int, unsynced: int) -> tuple[int, int]:
    """Run a writer that group-commits ``synced`` frames, appends more, and is SIGKILLed."""
    done = subprocess.run(
        [sys.executable, str(SCRIPTED), str(directory), str(TERM), str(synced), str(unsynced)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == -9, done.stderr
    durable, tail = map(int, done.stdout.split())
    return durable, tail


def read_all(directory: Path) -> list[tuple[int, int, int]]:
    with StreamLog.open(directory) as log:
        frames = log.read(log.release_position)
        for frame in frames:
            _frames.check_frame(frame)
        _frames.check_contiguous(frames, TERM)
        return [(f.position, f.end_position, f.first_sequence) for f in frames]


# --- damage that a crash leaves: repaired -------------------------------------------


def test_a_crash_between_group_commits_keeps_every_committed_frame(tmp_path: Path) -> None:
    durable, tail = crash(tmp_path, synced=30, unsynced=30)
    assert durable < tail
    # A killed process leaves the page cache behind: even frames that were
    # not yet durable are whole, and recovery keeps them.
    with StreamLog.open(tmp_path) as log:
        assert log.recovery is not None and log.recovery.cut is None
        assert log.tail_position == log.durable_position == tail
    assert len(read_all(tmp_path)) == 60


def test_a_frame_begun_but_not_committed_is_zeroed(tmp_path: Path) -> None:
    frames = build(tmp_path)
    tail = frames[-1][1]
    # What a writer killed mid-append leaves: header and payload, no commit word.
    with term_path(tmp_path, tail // TERM).open("r+b") as f:
        f.seek(tail % TERM + 8)
        f.write(b"\x01\x00\x00\x01" + b"\xab" * 60)
    with StreamLog.open(tmp_path) as log:
        assert log.recovery is not None
        assert log.recovery.zeroed_bytes == 62  # the non-zero bytes written
        assert log.tail_position == tail
        assert _frames.append(log, 10**6).position == tail
    with term_path(tmp_path, tail // TERM).open("rb") as f:
        f.seek(tail % TERM + 48 + 100)
        assert f.read(64) == bytes(64)


def test_a_torn_frame_after_the_durable_position_is_cut_off(tmp_path: Path) -> None:
    durable, _ = crash(tmp_path, synced=30, unsynced=30)
    with StreamLog.open(tmp_path, create=False) as probe:
        frames = probe.read(durable)
    probe_positions = [(f.position, f.end_position) for f in frames]
    # Power loss: the last frame's commit word reached the disk, part of its
    # payload did not.
    victim_position, _ = probe_positions[-5]
    flip(term_path(tmp_path, victim_position // TERM), victim_position % TERM + 40)
    # Make the stored durable position the one the crash left (the probe's
    # clean close advanced it).
    _store_positions(tmp_path, durable, 0)
    with StreamLog.open(tmp_path) as log:
        assert log.recovery is not None
        assert log.recovery.cut == "checksum mismatch"
        assert log.tail_position == victim_position
        assert log.recovery.zeroed_bytes > 0
    assert read_all(tmp_path)[-1][1] == victim_position


def test_a_lost_term_after_the_durable_position_is_cut_off(tmp_path: Path) -> None:
    durable, tail = crash(tmp_path, synced=10, unsynced=60)
    assert tail // TERM > durable // TERM + 1
    newest = max(int(p.name[:16], 16) for p in tmp_path.glob("*.term"))
    lost = durable // TERM + 1
    os.unlink(term_path(tmp_path, lost))
    with StreamLog.open(tmp_path) as log:
        assert log.tail_position == lost * TERM
        assert log.recovery is not None and log.recovery.cut == "term file is missing"
    assert not term_path(tmp_path, newest).exists() or newest == lost
    frames = read_all(tmp_path)
    assert frames[-1][1] <= lost * TERM


def test_a_term_created_but_empty_is_repaired(tmp_path: Path) -> None:
    frames = build(tmp_path)
    tail = frames[-1][1]
    # The crash hit between creating the next term and reserving its blocks.
    empty = term_path(tmp_path, tail // TERM + 1)
    empty.unlink(missing_ok=True)
    empty.touch()
    with StreamLog.open(tmp_path) as log:
        assert log.tail_position == tail
        # Fill up to and across the empty term.
        _frames.append_many(log, 30, 10**6)
    assert os.path.getsize(empty) == TERM


def test_a_half_written_term_after_the_durable_position_is_cut_off(tmp_path: Path) -> None:
    durable, tail = crash(tmp_path, synced=10, unsynced=8)
    assert tail // TERM == durable // TERM + 1
    # Power loss: the new term's name reached the disk, none of its blocks did.
    os.truncate(term_path(tmp_path, tail // TERM), 0)
    with StreamLog.open(tmp_path) as log:
        assert log.tail_position == tail // TERM * TERM
        assert log.recovery is not None and log.recovery.cut is not None
        assert "ends at byte 0" in log.recovery.cut
    assert os.path.getsize(term_path(tmp_path, tail // TERM)) == TERM
    assert read_all(tmp_path)[-1][1] <= tail // TERM * TERM


def test_garbage_in_the_positions_falls_back_to_scanning_every_term(tmp_path: Path) -> None:
    frames = build(tmp_path)
    with (tmp_path / "meta").open("r+b") as f:
        f.seek(128)
        f.write(os.urandom(20))
    with StreamLog.open(tmp_path) as log:
        assert log.recovery is not None
        assert not log.recovery.positions_trusted
        assert log.tail_position == frames[-1][1]
    assert read_all(tmp_path) == frames


def test_stale_metadata_is_only_a_slower_start(tmp_path: Path) -> None:
    with StreamLog.open(tmp_path, term_length=TERM, capacity=256 * TERM) as log:
        _, seq = _frames.append_many(log, 20)
        log.sync()
        stale = (tmp_path / "meta").read_bytes()
        _frames.append_many(log, 40, seq)
        tail = log.tail_position
    (tmp_path / "meta").write_bytes(stale)
    with StreamLog.open(tmp_path) as log:
        assert log.tail_position == tail
    assert len(read_all(tmp_path)) == 60


# --- damage to durable history: LogCorruptError, naming file and offset --------------


def test_a_flipped_byte_in_old_history_is_reported_at_read(tmp_path: Path) -> None:
    frames = build(tmp_path)
    position, _, _ = frames[3]
    flip(term_path(tmp_path, 0), position + 40)
    with StreamLog.open(tmp_path) as log:  # recovery looks only at the last term
        with pytest.raises(LogCorruptError) as caught:
            log.read(0)
        assert caught.value.path == str(term_path(tmp_path, 0))
        assert caught.value.offset == position
        assert "checksum mismatch" in str(caught.value)
        assert len(log.read(0, position)) == 3
        with pytest.raises(LogCorruptError):
            list(log.scan_headers(0))


def test_a_flipped_byte_in_the_durable_term_is_reported_at_read_and_left_alone(
    tmp_path: Path,
) -> None:
    # Recovery reads only after the durable position (restart work must not
    # grow with what is stored), so damage to durable history in the last
    # term, as in older terms, shows when it is read; recovery neither cuts
    # nor zeroes it.
    frames = build(tmp_path)
    tail = frames[-1][1]
    tail_term = tail // TERM
    position = next(p for p, _, _ in frames if p // TERM == tail_term)
    term = term_path(tmp_path, tail_term)
    flip(term, position % TERM + 40)
    damaged = term.read_bytes()
    with StreamLog.open(tmp_path) as log:
        assert log.recovery is not None
        assert log.recovery.scanned_from == tail
        assert log.tail_position == tail
        with pytest.raises(LogCorruptError) as caught:
            log.read(0)
        assert caught.value.path == str(term)
        assert caught.value.offset == position % TERM
        assert "checksum mismatch" in str(caught.value)
    assert term.read_bytes() == damaged


def test_a_truncated_term_is_reported(tmp_path: Path) -> None:
    build(tmp_path)
    os.truncate(term_path(tmp_path, 1), 1000)
    with pytest.raises(LogCorruptError, match="truncated to 1000 bytes") as caught:
        StreamLog.open(tmp_path)
    assert caught.value.path == str(term_path(tmp_path, 1))
    assert caught.value.offset == 1000


def test_a_truncated_last_term_is_reported(tmp_path: Path) -> None:
    frames = build(tmp_path)
    tail = frames[-1][1]
    os.truncate(term_path(tmp_path, tail // TERM), tail % TERM - 100)
    with pytest.raises(LogCorruptError, match="reported durable"):
        StreamLog.open(tmp_path)


def test_a_missing_term_is_reported(tmp_path: Path) -> None:
    build(tmp_path)
    os.unlink(term_path(tmp_path, 2))
    with pytest.raises(LogCorruptError, match="missing") as caught:
        StreamLog.open(tmp_path)
    assert caught.value.path == str(term_path(tmp_path, 2))


def test_a_misnamed_term_is_reported(tmp_path: Path) -> None:
    frames = build(tmp_path)
    last = frames[-1][0] // TERM
    os.replace(term_path(tmp_path, 1), term_path(tmp_path, 2))
    shutil.copy(term_path(tmp_path, 0), term_path(tmp_path, 1))
    assert last > 2
    with StreamLog.open(tmp_path) as log, pytest.raises(LogCorruptError, match="checksum"):
        log.read(0)


def test_a_zero_length_term_in_history_is_reported(tmp_path: Path) -> None:
    build(tmp_path)
    os.truncate(term_path(tmp_path, 1), 0)
    with pytest.raises(LogCorruptError, match="truncated to 0 bytes"):
        StreamLog.open(tmp_path)


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda meta: meta.write_bytes(os.urandom(4096)), "not a headgate stream log"),
        (lambda meta: meta.write_bytes(meta.read_bytes()[:10]), "metadata is 10 bytes"),
        (lambda meta: flip(meta, 20), "settings fail their checksum"),
        (lambda meta: meta.unlink(), "metadata file is missing"),
    ],
)
def test_damaged_metadata_is_reported(tmp_path: Path, damage: object, match: str) -> None:
    build(tmp_path)
    damage(tmp_path / "meta")  # type: ignore[operator]
    with pytest.raises(LogCorruptError, match=match):
        StreamLog.open(tmp_path)
    if (tmp_path / "meta").exists():
        with pytest.raises(LogCorruptError, match=match):
            LogReader.open(tmp_path)


# --- anything at all: never an exception other than LogError, never wrong data ------

damage = st.lists(
    st.tuples(
        st.sampled_from(["flip", "truncate", "zero", "garbage"]),
        st.integers(0, 2**32),
        st.integers(0, 2**32),
    ),
    min_size=1,
    max_size=3,
)


@pytest.fixture(scope="module")
def pristine() -> Iterator[tuple[Path, list[tuple[int, int, bytes]]]]:
    """One cleanly closed log, built once; each example damages its own copy."""
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name) / "log"
        with StreamLog.open(directory, term_length=TERM, capacity=64 * TERM) as log:
            _frames.append_many(log, 25)
            original = [(f.position, f.end_position, bytes(f.payload)) for f in log.read(0)]
        yield directory, original


@given(damage=damage)
def test_any_damage_gives_a_log_error_or_the_original_frames(
    pristine: tuple[Path, list[tuple[int, int, bytes]]],
    damage: list[tuple[str, int, int]],
) -> None:
    source, original = pristine
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name) / "log"
        shutil.copytree(source, directory)
        files = sorted(p for p in directory.iterdir() if p.name != "writer.lock")
        for kind, which, where in damage:
            path = files[which % len(files)]
            size = path.stat().st_size
            if kind == "flip" and size:
                flip(path, where % size, 1 << (where % 8))
            elif kind == "truncate":
                os.truncate(path, where % (size + 1))
            elif kind == "zero" and size:
                offset = where % size
                with path.open("r+b") as f:
                    f.seek(offset)
                    f.write(bytes(min(64, size - offset)))
            elif kind == "garbage" and size:
                offset = where % size
                with path.open("r+b") as f:
                    f.seek(offset)
                    f.write(os.urandom(min(16, size - offset)))
        try:
            with StreamLog.open(directory) as log:
                assert log.recovery is not None
                trusted = log.recovery.positions_trusted
                frames = log.read(log.release_position)
                got = [(f.position, f.end_position, bytes(f.payload)) for f in frames]
        except LogError:
            return
        if trusted:
            # Everything was durable: all of it is there, or there was an error.
            assert got == original
        else:
            # The durable position itself was lost with the damage: what
            # survives is what was written, up to the first damaged frame.
            assert got == original[: len(got)]


def _store_positions(directory: Path, durable: int, release: int) -> None:
    """Rewrite the durable/release pair with a valid checksum (a crash's stale pair)."""
    import struct
    import zlib

    pair = struct.pack("<qq", durable, release)
    with (directory / "meta").open("r+b") as f:
        f.seek(128)
        f.write(pair + struct.pack("<I", zlib.crc32(pair)))


def test_bytes_anywhere_after_the_tail_are_zeroed_in_the_page_cache_or_on_disk(
    tmp_path: Path,
) -> None:
    # Recovery reads only what the file system reports as data after the
    # tail; bytes a killed writer left far away (in the page cache only, or
    # written back) must still be found, whatever lies in between.
    term_length = 1024 * 1024
    with StreamLog.open(tmp_path, term_length=term_length, capacity=4 * term_length) as log:
        tail = log.append(
            b"x" * 100, producer_id=1, first_sequence=0, record_count=1, timestamp_us=0
        )
        tail_position = log.tail_position
        log.sync()
    path = term_path(tmp_path, 0)
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, b"\x07" * 16, 300 * 1024)  # page cache only: never synced
        os.pwrite(fd, b"\x09" * 8, term_length - 8)  # the term's last word, written back
        os.fsync(fd)
        os.posix_fadvise(fd, term_length - 4096, 4096, os.POSIX_FADV_DONTNEED)
        os.pwrite(fd, b"\x05" * 3, 700 * 1024 + 1)  # and once more in the page cache
    finally:
        os.close(fd)
    with StreamLog.open(tmp_path, term_length=term_length, capacity=4 * term_length) as log:
        assert log.recovery is not None
        assert log.tail_position == tail_position == tail.end_position
        assert log.recovery.zeroed_bytes == 16 + 8 + 3
    rest = path.read_bytes()[tail_position:]
    assert rest == bytes(len(rest))


def test_recovery_checks_only_the_frames_after_the_durable_position(tmp_path: Path) -> None:
    # Restart work follows what changed since the last group commit, not
    # what is stored: the frames before the durable position were fsynced.
    durable, tail = crash(tmp_path, synced=30, unsynced=30)
    assert durable % TERM != 0  # inside a term, whose start the scan no longer starts from
    with StreamLog.open(tmp_path) as log:
        assert log.recovery is not None
        assert log.recovery.scanned_from == durable
        assert log.tail_position == tail
    # A clean close leaves nothing to check.
    with StreamLog.open(tmp_path) as log:
        assert log.recovery is not None
        assert log.recovery.scanned_from == log.tail_position == tail
