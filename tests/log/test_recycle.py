"""Freed term files are recycled (kept as spares, cleared in place) instead of deleted.

Deleting a freed 16 MiB term on this machine's ext4 mounted with ``discard``
stalled the next group commits for 30 to 40 ms (see headgate.log.term).
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from headgate.log import LogError, LogReader, StreamLog
from headgate.log import term as term_module
from headgate.log.scanner import FrameScanner
from headgate.log.term import (
    MAX_SPARE_TERMS,
    TermFile,
    TermSpares,
    most_term_files,
    term_file_name,
)

TERM = 64 * 1024


def _fill_to(log: StreamLog, position: int, sequence: int) -> int:
    """Append 1000-byte frames until the tail passes ``position``; the next sequence."""
    for _ in range(10_000):
        if log.tail_position >= position:
            return sequence
        log.append(
            bytes([sequence % 251]) * 1000,
            producer_id=1,
            first_sequence=sequence,
            record_count=1,
            timestamp_us=0,
        )
        sequence += 1
    raise AssertionError("the tail never got there")


def _inode(path: Path) -> int:
    return os.stat(path).st_ino


def _check_all(log: StreamLog, start: int) -> int:
    frames = log.read(start)
    for frame in frames:
        assert bytes(frame.payload) == bytes([frame.first_sequence % 251]) * 1000
    return len(frames)


@pytest.fixture
def fresh_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test finds ZERO_RANGE untried (the module remembers a refusal)."""
    monkeypatch.setattr(term_module, "_zero_range_state", None)
    yield


def _rotate_into_spare(tmp_path: Path) -> tuple[StreamLog, Path, int, int]:
    """A log whose terms 0 to 3 were freed; returns it, its directory, term 0's inode, seq."""
    directory = tmp_path / "log"
    log = StreamLog.open(directory, term_length=TERM, capacity=8 * TERM)
    sequence = _fill_to(log, 4 * TERM + 100, 0)  # terms 0 to 4
    old_inode = _inode(directory / term_file_name(0))
    log.release(log.sync())
    log.sync()  # frees terms 0 to 3: the release durable, then kept as spares
    assert len(log._table.spares) == 4  # all four: below the bound and a full log's files
    return log, directory, old_inode, sequence


def test_a_recycled_term_reads_as_zeros_and_the_log_goes_on_across_it(
    tmp_path: Path, fresh_state: None
) -> None:
    log, directory, old_inode, sequence = _rotate_into_spare(tmp_path)
    try:
        start = log.release_position
        log._preparer.close()  # term 5 was prepared (new) on entering term 4
        sequence = _fill_to(log, 5 * TERM + 100, sequence)  # into term 5: term 6 requested
        log._preparer.close()
        six = directory / term_file_name(6)
        assert six.exists()
        inodes = {_inode(directory / term_file_name(t)) for t in (5, 6)}
        assert old_inode in inodes  # a freed file came back as a new term
        assert term_module._zero_range_state is True  # cleared in place, not made anew
        with open(six, "rb") as f:
            data = f.read()
        assert len(data) == TERM and data.count(0) == TERM  # cleared before it was installed
        sequence = _fill_to(log, 7 * TERM + 100, sequence)  # through terms 5, 6 and into 7
        log.sync()
        count = _check_all(log, start)
        assert count > 3 * TERM // 1100
        with LogReader.open(directory) as reader:
            assert len(reader.read(start)) == count
        tail = log.tail_position
    finally:
        log.close()
    assert not list(directory.glob("*.preparing"))
    with StreamLog.open(directory) as again:  # recovery scans across the recycled terms
        assert again.tail_position == tail
        assert _check_all(again, start) == count


def test_a_reader_that_mapped_a_recycled_term_never_reads_it_as_history(
    tmp_path: Path, fresh_state: None
) -> None:
    directory = tmp_path / "log"
    log = StreamLog.open(directory, term_length=TERM, capacity=8 * TERM)
    try:
        sequence = _fill_to(log, 4 * TERM + 100, 0)  # terms 0 to 4
        log.sync()
        with LogReader.open(directory) as reader:
            old = reader.read(0)  # maps terms 0 to 4
            old_count = len(old)
            del old
            log.release(log.durable_position)
            log.sync()  # terms 0 to 3 become spares
            log._preparer.close()
            sequence = _fill_to(log, 7 * TERM + 100, sequence)  # terms 6, 7 from spares
            log.sync()
            assert term_module._zero_range_state is True
            with pytest.raises(LogError, match="cannot read"):
                reader.read(0)  # its map of term 0 now holds other positions
            new = reader.read(reader.start_position())
            assert [f.first_sequence for f in new] == [
                f.first_sequence for f in log.read(log.release_position)
            ]
            assert all(bytes(f.payload) == bytes([f.first_sequence % 251]) * 1000 for f in new)
            assert old_count > 0
    finally:
        log.close()


def _twelve_terms_freed(directory: Path) -> StreamLog:
    """A log with a deleter thread whose terms 0 to 11 were freed, once the thread is done."""
    log = StreamLog.open(directory, term_length=TERM, capacity=16 * TERM)
    log.delete_in_background()
    _fill_to(log, 12 * TERM + 100, 0)  # terms 0 to 12
    log.release(log.sync())
    log.sync()  # frees 12 terms
    log._commit.close()  # wait for the deleter thread
    return log


def test_spares_never_exceed_the_bound_and_the_rest_are_deleted(
    tmp_path: Path, fresh_state: None
) -> None:
    directory = tmp_path / "log"
    log = _twelve_terms_freed(directory)
    try:
        assert len(log._table.spares) == MAX_SPARE_TERMS
        on_disk = sorted(int(p.name[:16], 16) for p in directory.glob("*.term"))
        assert on_disk[0] == 12  # no freed term is left under a term's name
        spare_files = sorted(p.name for p in directory.glob("*.term.spare"))
        assert len(spare_files) == MAX_SPARE_TERMS  # the spares; the other four are gone
    finally:
        log.close()
    on_disk = sorted(int(p.name[:16], 16) for p in directory.glob("*.term"))
    assert on_disk and on_disk[0] == 12
    assert not list(directory.glob("*.term.spare"))  # close deletes the spares too


def test_spares_and_live_terms_never_exceed_what_a_full_log_holds(
    tmp_path: Path, fresh_state: None
) -> None:
    live = 4
    spares = TermSpares(TERM, MAX_SPARE_TERMS, most_term_files(4 * TERM, TERM), lambda: live)
    assert most_term_files(4 * TERM, TERM) == 6
    freed = [TermFile.create(tmp_path, t, TERM) for t in range(5)]
    spares.retire(freed)
    assert len(spares) == 2  # 4 live + 2 spares: a full log's 6 files
    assert len(list(tmp_path.glob("*.term.spare"))) == 2
    assert not list(tmp_path.glob("*.term"))  # the other three deleted
    spares.close()
    assert not list(tmp_path.glob("*.term.spare"))


def test_a_spare_of_another_length_is_never_kept_nor_used(
    tmp_path: Path, fresh_state: None
) -> None:
    spares = TermSpares(TERM, MAX_SPARE_TERMS)
    short = TermFile.create(tmp_path, 0, TERM // 2)
    spares.retire([short])
    assert len(spares) == 0 and not short.path.exists()
    # And a file of the wrong length offered to prepare is deleted, not reused.
    wrong = tmp_path / "wrong"
    wrong.write_bytes(b"\x01" * (TERM // 2))
    term = TermFile.prepare(tmp_path, 3, TERM, wrong)
    try:
        assert term.size == TERM and bytes(term.view).count(0) == TERM
        assert not wrong.exists()
    finally:
        term.discard()


def test_when_zero_range_is_refused_spares_are_deleted_and_new_terms_made(
    tmp_path: Path,
    fresh_state: None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    refusals = 0

    def refused(fd: int, length: int) -> None:
        nonlocal refusals
        refusals += 1
        raise OSError(errno.EOPNOTSUPP, "not on this file system")

    monkeypatch.setattr(term_module, "_zero_range", refused)
    with caplog.at_level(logging.WARNING, logger="headgate.log.term"):
        log, directory, _, sequence = _rotate_into_spare(tmp_path)
        try:
            log._preparer.close()
            sequence = _fill_to(log, 7 * TERM + 100, sequence)  # two more rotations
            log._preparer.close()
            assert refusals == 1  # tried once; no spare offered after that
            seven = directory / term_file_name(7)
            with open(seven, "rb") as f:  # made the old way, zeros past the tail
                f.seek(log.tail_position - 7 * TERM)
                assert f.read().count(0) == 8 * TERM - log.tail_position
            start = log.release_position
            log.release(log.sync())
            log.sync()  # frees terms 4 to 6: none kept now, nor the spare left from before
            assert len(log._table.spares) == 0
            assert sorted(int(p.name[:16], 16) for p in directory.glob("*.term"))[:1] == [7]
            assert start < log.release_position
            sequence = _fill_to(log, 9 * TERM + 100, sequence)
            log.sync()
            assert _check_all(log, log.release_position) > 0
        finally:
            log.close()
    warnings = [r for r in caplog.records if "cannot clear freed term files" in r.message]
    assert len(warnings) == 1
    assert not list(directory.glob("*.preparing"))


def test_a_preparing_leftover_from_a_spare_is_removed_by_recovery(
    tmp_path: Path, fresh_state: None
) -> None:
    log, directory, _, sequence = _rotate_into_spare(tmp_path)
    tail = log.tail_position
    spare = log._table.spares.take()
    assert spare is not None
    # A crash after the rename and before the clearing: old frames under the
    # temporary name of term 9 (and the other spare under its old name).
    leftover = directory / f"{9:016x}.term.preparing"
    os.rename(spare, leftover)
    other = log._table.spares.take()
    assert other is not None and other.name.endswith(".term.spare")
    log._table.spares = TermSpares(TERM, 0)  # close must not delete what a crash leaves
    log.close()
    assert leftover.exists() and other.exists()
    with StreamLog.open(directory) as again:
        assert not leftover.exists() and not other.exists()
        assert again.tail_position == tail
        _fill_to(again, 10 * TERM + 100, sequence)  # through term 9, created anew
        again.sync()
        assert _check_all(again, again.release_position) > 0


def test_a_reader_refuses_a_range_freed_while_it_read(
    tmp_path: Path, fresh_state: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "log"
    log = StreamLog.open(directory, term_length=TERM, capacity=8 * TERM)
    try:
        _fill_to(log, 2 * TERM + 100, 0)
        log.sync()
        with LogReader.open(directory) as reader:
            start = reader.start_position()
            assert reader.read(start)  # fine while retained
            real_frames = FrameScanner.frames

            def frames_then_release(
                scanner: FrameScanner, resume: int, end: int
            ) -> Iterator[tuple[int, int, TermFile, int, tuple[int, ...]]]:
                yield from real_frames(scanner, resume, end)
                # The writer frees the first two terms as the scan finishes:
                # their files may now be cleared and refilled.
                log.release(2 * TERM)
                log.sync()

            monkeypatch.setattr(FrameScanner, "frames", frames_then_release)
            with pytest.raises(LogError, match="freed while being read"):
                reader.read(start)
            monkeypatch.undo()
            assert reader.read(reader.start_position())  # reading again from the new start works
    finally:
        log.close()


def test_the_deleter_thread_cuts_a_term_it_deletes_down_a_step_at_a_time(
    tmp_path: Path, fresh_state: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Freed terms beyond the spares are deleted by the deleter thread, their
    blocks freed DELETE_STEP at a time first (so a large release's trims never
    hold a group commit's fdatasync for long); nothing is left of them."""
    cuts: list[tuple[int, int]] = []
    real_punch = term_module._punch_hole

    def recording(fd: int, offset: int, length: int) -> None:
        cuts.append((offset, length))
        real_punch(fd, offset, length)

    monkeypatch.setattr(term_module, "DELETE_STEP", TERM // 4)
    monkeypatch.setattr(term_module, "DELETE_PAUSE_SECONDS", 0.0)
    monkeypatch.setattr(term_module, "_punch_hole", recording)
    directory = tmp_path / "log"
    _twelve_terms_freed(directory).close()  # 8 kept as spares, 4 deleted
    deleted = 12 - MAX_SPARE_TERMS
    # Each deleted term: its four quarters freed one after another.
    quarter = TERM // 4
    assert cuts == [(i * quarter, quarter) for i in range(4)] * deleted
    on_disk = sorted(int(p.name[:16], 16) for p in directory.glob("*.term"))
    assert on_disk[0] == 12, "no freed term is left under a term's name"


def test_deleting_gradually_a_file_that_is_gone_or_empty_is_fine(tmp_path: Path) -> None:
    term_module.delete_gradually(tmp_path / "never-there")
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    term_module.delete_gradually(empty)
    assert not empty.exists()


def test_a_reader_mapping_a_term_deleted_gradually_reads_zeros_not_a_bus_error(
    tmp_path: Path,
) -> None:
    """The blocks go, the size stays: a process that still maps the file (a Spark
    task, a view the gateway handed out) reads zeros, never faults. (Truncating
    instead would kill it with SIGBUS; so the reader runs in a child process.)"""
    path = tmp_path / "freed.term"
    path.write_bytes(b"\x07" * TERM)
    script = textwrap.dedent(
        f"""
        import mmap, os, sys
        from pathlib import Path
        from headgate.log import term
        term.DELETE_PAUSE_SECONDS = 0.0
        term.DELETE_STEP = {TERM // 4}
        path = Path({str(path)!r})
        fd = os.open(path, os.O_RDONLY)
        view = mmap.mmap(fd, {TERM}, access=mmap.ACCESS_READ)
        assert view[:1] == b"\\x07"
        term.delete_gradually(path)
        assert not path.exists()
        data = view[:]
        print(len(data), data.count(0))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.split() == [str(TERM), str(TERM)], "every byte reads as zero"
