"""Term files: reserved without writing, zeros when new, never fooled by stale frames."""

from __future__ import annotations

import errno
import itertools
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from headgate.log import StreamLog
from headgate.log.metadata import MetadataPage
from headgate.log.term import TermFile
from tests.log import _frames

SCRIPTED = Path(__file__).with_name("_scripted_writer.py")


def test_a_prepared_term_is_reserved_zeros_even_over_leftovers(tmp_path: Path) -> None:
    length = 256 * 1024
    # An earlier, interrupted preparation left garbage under the temporary name.
    (tmp_path / f"{5:016x}.term.preparing").write_bytes(b"\xab" * (length // 2))
    term = TermFile.prepare(tmp_path, 5, length)
    try:
        assert term.size == length
        stat = os.fstat(term.fd)
        assert stat.st_size == length
        # Every block is allocated up front: a store into the map can never
        # find the disk full (SIGBUS), the term's creation would have failed.
        assert stat.st_blocks * 512 >= length
        assert term.view.tobytes() == bytes(length)
        term.install()
        assert term.path.name == f"{5:016x}.term"
        assert not list(tmp_path.glob("*.preparing"))
    finally:
        term.close()


def crash(directory: Path, term_length: int, synced: int, unsynced: int) -> tuple[int, int]:
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPTED),
            str(directory),
            str(term_length),
            str(synced),
            str(unsynced),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == -9, done.stderr
    durable, tail = map(int, done.stdout.split())
    return durable, tail


@pytest.mark.parametrize("term_length", [4096, 64 * 1024], ids=["created", "prepared"])
def test_stale_frames_after_a_cut_are_never_read_again(tmp_path: Path, term_length: int) -> None:
    # A crash leaves valid frames in several terms after the durable one; a
    # torn frame in the first of them moves the tail back before them. Their
    # checksums are seeded by position, so they would pass at those very
    # positions: recovery must delete those terms, and new terms must start
    # as zeros, or the new appends would run into old frames.
    per_term = term_length // 400
    durable, tail = crash(tmp_path, term_length, synced=per_term, unsynced=5 * per_term)
    assert tail // term_length >= durable // term_length + 3
    with StreamLog.open(tmp_path) as probe:
        # Not this clean close's business: keep the crash's durable position.
        old = [(f.position, f.first_sequence) for f in probe.read(durable)]
        probe_durable = probe.durable_position
    assert probe_durable == tail
    cut = next(p for p, _ in old if p // term_length == durable // term_length + 1)
    term_file = tmp_path / f"{cut // term_length:016x}.term"
    with term_file.open("r+b") as f:
        f.seek(cut % term_length + 40)
        byte = f.read(1)
        f.seek(cut % term_length + 40)
        f.write(bytes([byte[0] ^ 0xFF]))
    _store_positions(tmp_path, durable, 0)

    with StreamLog.open(tmp_path) as log:
        assert log.tail_position == cut
        assert not (tmp_path / f"{tail // term_length:016x}.term").exists()
        # New frames of another producer, over the positions the stale ones held.
        while log.tail_position < tail + term_length:
            log.append(
                b"new" * 50, producer_id=99, first_sequence=0, record_count=1, timestamp_us=0
            )
        log.sync()
        after = log.read(cut)
    assert after
    assert {f.producer_id for f in after} == {99}
    assert all(bytes(f.payload) == b"new" * 50 for f in after)
    assert all(
        b.position == a.end_position or b.position % term_length == 0
        for a, b in itertools.pairwise(after)
    )
    # The frames before the cut are the crash's frames, untouched.
    with StreamLog.open(tmp_path) as again:
        kept = again.read(0, cut)
        for frame in kept:
            _frames.check_frame(frame)


def _store_positions(directory: Path, durable: int, release: int) -> None:
    import struct
    import zlib

    pair = struct.pack("<qq", durable, release)
    with (directory / "meta").open("r+b") as f:
        f.seek(128)
        f.write(pair + struct.pack("<I", zlib.crc32(pair)))


def test_the_preparer_makes_the_new_terms_name_durable_so_the_commit_need_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A group commit that enters a new term used to fsync the directory for
    # the term's name, on top of both terms' fdatasyncs; the preparer, which
    # renamed the term into place ahead of need, now makes the name durable.
    term_length = 64 * 1024
    log = StreamLog.open(tmp_path / "log", term_length=term_length, capacity=8 * term_length)
    try:
        log.append(b"x" * 100, producer_id=1, first_sequence=0, record_count=1, timestamp_us=0)
        log.sync()  # term 0's own name, and the preparer of term 1 started
        log._preparer.close()  # wait for it: term 1 installed
        assert (tmp_path / "log" / f"{1:016x}.term").exists()
        synced: list[str] = []
        real_fsync = os.fsync

        def fsync(fd: int) -> None:
            if threading.current_thread() is threading.main_thread():  # the committer's
                synced.append(os.readlink(f"/proc/self/fd/{fd}"))
            real_fsync(fd)

        monkeypatch.setattr(os, "fsync", fsync)
        sequence = 1
        while log.tail_position < term_length + 1024:  # into term 1
            log.append(
                b"y" * 1000, producer_id=1, first_sequence=sequence, record_count=1, timestamp_us=0
            )
            sequence += 1
        log.sync()
        assert str(tmp_path / "log") not in synced  # no directory fsync in the commit
        assert log.durable_position == log.tail_position
    finally:
        log.close()
    with StreamLog.open(tmp_path / "log") as again:  # and everything is there
        assert again.tail_position == log.tail_position


def test_freed_terms_are_deleted_off_the_commits_path_and_gone_after_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Unlinking a 16 MiB term took 5 ms at the median here (discard): a release
    # that frees many terms made one group commit, and its acks, wait for all.
    term_length = 64 * 1024
    directory = tmp_path / "log"
    log = StreamLog.open(directory, term_length=term_length, capacity=16 * term_length)
    log.delete_in_background()
    slow_s = 0.3
    real_unlink = os.unlink

    def slow_unlink(path: str) -> None:
        time.sleep(slow_s)
        real_unlink(path)

    try:
        sequence = 0
        while log.tail_position < 4 * term_length + 100:  # terms 0 to 4
            log.append(
                b"z" * 1000, producer_id=1, first_sequence=sequence, record_count=1, timestamp_us=0
            )
            sequence += 1
        log.release(log.sync())  # frees terms 0 to 3 at the next sync
        monkeypatch.setattr(os, "unlink", slow_unlink)  # the deleter's, and the commit's
        started = time.monotonic()
        log.sync()
        took = time.monotonic() - started
        assert took < slow_s, f"the commit waited {took:.3f} s for the deletions"
    finally:
        log.close()  # waits for them
    left = sorted(int(p.name[:16], 16) for p in directory.glob("*.term"))
    assert left and left[0] == 4  # terms 0 to 3 are gone


def test_the_release_that_frees_terms_is_made_durable_off_the_commits_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The metadata page's fdatasync that a freeing release needs held every
    # ack of that commit for one more fsync; the deleter thread does it now,
    # before it deletes the terms.
    term_length = 64 * 1024
    directory = tmp_path / "log"
    log = StreamLog.open(directory, term_length=term_length, capacity=16 * term_length)
    log.delete_in_background()
    slow_s = 0.3
    real_sync = MetadataPage.sync
    order: list[str] = []

    def slow_sync(page: MetadataPage) -> None:
        time.sleep(slow_s)
        real_sync(page)
        order.append("meta")

    real_unlink = os.unlink

    def unlink(path: str) -> None:
        order.append("unlink")
        real_unlink(path)

    try:
        sequence = 0
        while log.tail_position < 4 * term_length + 100:  # terms 0 to 4
            log.append(
                b"z" * 1000, producer_id=1, first_sequence=sequence, record_count=1, timestamp_us=0
            )
            sequence += 1
        released = log.sync()
        log.release(released)  # frees terms 0 to 3 at the next sync
        monkeypatch.setattr(MetadataPage, "sync", slow_sync)
        monkeypatch.setattr(os, "unlink", unlink)
        started = time.monotonic()
        log.sync()
        took = time.monotonic() - started
        assert took < slow_s, f"the commit waited {took:.3f} s for the metadata's fsync"
    finally:
        log.close()  # waits for the deleter
    assert order[0] == "meta" and order.count("unlink") == 4  # durable first, then deleted
    left = sorted(int(p.name[:16], 16) for p in directory.glob("*.term"))
    assert left and left[0] == 4
    reopened = StreamLog.open(directory, term_length=term_length, capacity=16 * term_length)
    try:
        assert reopened.release_position == released
    finally:
        reopened.close()


def test_a_release_that_cannot_be_made_durable_keeps_its_terms(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    term_length = 64 * 1024
    directory = tmp_path / "log"
    log = StreamLog.open(directory, term_length=term_length, capacity=16 * term_length)
    log.delete_in_background()
    calls = 0

    def failing_sync(page: MetadataPage) -> None:
        nonlocal calls
        calls += 1
        raise OSError(errno.EIO, "injected")

    try:
        sequence = 0
        while log.tail_position < 2 * term_length + 100:  # terms 0 to 2
            log.append(
                b"z" * 1000, producer_id=1, first_sequence=sequence, record_count=1, timestamp_us=0
            )
            sequence += 1
        log.release(log.sync())
        monkeypatch.setattr(MetadataPage, "sync", failing_sync)
        with caplog.at_level(logging.WARNING, logger="headgate.log.deleter"):
            log.sync()
            log._commit.close()  # waits for the deleter thread
        assert calls >= 1
        assert "cannot make a release durable" in caplog.text
        left = sorted(int(p.name[:16], 16) for p in directory.glob("*.term"))
        assert left[:2] == [0, 1]  # the freed terms stay: their release is not durable
    finally:
        monkeypatch.undo()
        log.close()
