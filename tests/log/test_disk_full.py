"""A full disk: a clear StorageFull, nothing durable harmed, and the same log goes on after.

The writer runs in a child process on a small disk (tests/_small_disk.py): a
tmpfs the test mounts and fills, or, where mounting is not permitted, a file
size limit on the child. Both modes run here.
"""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from headgate.log import LogReader, StorageError, StorageFull, StreamLog
from headgate.log.term import TermFile
from tests._small_disk import SmallDisk, small_disk
from tests.log import _frames

pytestmark = pytest.mark.timeout(60)

TERM = 64 * 1024
WRITER = Path(__file__).with_name("_disk_writer.py")


class Writer:
    """The child process and its line protocol."""

    def __init__(self, directory: Path) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(WRITER), str(directory), str(TERM), str(64 * TERM)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def __call__(self, command: str) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        assert line, f"the writer died on {command!r}"
        answer: dict[str, Any] = json.loads(line)
        return answer


@pytest.fixture(params=["tmpfs", "rlimit"])
def disk(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SmallDisk]:
    with small_disk(tmp_path, 1024 * 1024, mount=request.param == "tmpfs") as disk:
        yield disk


def check_log(directory: Path, frames: int) -> int:
    """Every frame ``_frames`` would write, exactly once and in order; returns the tail."""
    with LogReader.open(directory) as reader:
        read = reader.read(reader.start_position(), reader.published_position())
        assert len(read) == frames
        for frame in read:
            _frames.check_frame(frame)
        _frames.check_contiguous(read, TERM)
        assert read[0].first_sequence == 0
        return read[-1].end_position


def test_a_full_disk_stops_appends_cleanly_and_they_resume_when_space_returns(
    disk: SmallDisk,
) -> None:
    directory = disk.directory / "log"
    writer = Writer(directory)
    try:
        first = writer("append 250")
        assert first["appended"] == 250 and "error" not in first
        assert writer("sync")["durable"] == first["tail"]

        disk.fill(writer.process.pid)
        full = writer("append 3000")
        assert full["error"] == "StorageFull", full
        assert full["errno"] == disk.full_errno
        assert str(directory) in full["path"]
        if disk.mode == "tmpfs":
            # It stops where a new term is needed, with a clear error.
            assert "cannot reserve" in full["message"] or "cannot create" in full["message"]
        else:
            # A file size limit also bounds the offsets written inside a term
            # reserved earlier (frames are written with pwrite): it stops at
            # the first frame that would cross the limit, with a clear error.
            assert "cannot write to term file" in full["message"], full
        stored = 250 + full["appended"]
        assert full["tail"] > first["tail"]
        # Nothing of the frame that failed is left after the tail: a write cut
        # short by the limit is scrubbed with zeros.
        term = directory / f"{full['tail'] // TERM:016x}.term"
        assert term.read_bytes()[full["tail"] % TERM :] == bytes(TERM - full["tail"] % TERM)
        # What was appended is whole, and becomes durable: nothing is harmed.
        synced = writer("sync")
        assert "error" not in synced and synced["durable"] == full["tail"]
        assert check_log(directory, stored) == full["tail"]
        # Still full: an append still fails the same way, and on the full
        # tmpfs the probe (reserving the next term) says so too. (Under the
        # file size limit the next term may already be reserved, by the
        # preparer, before the limit came down: the probe then succeeds.)
        if disk.mode == "tmpfs":
            assert writer("retry")["error"] == "StorageFull"
        again = writer("append 1")
        assert again["error"] == "StorageFull" and again["appended"] == 0
        assert again["tail"] == full["tail"]

        disk.free(writer.process.pid)
        assert "error" not in writer("retry")
        rest = writer("append 600")
        assert rest["appended"] == 600 and "error" not in rest
        done = writer("sync")
        assert done["durable"] == rest["tail"]
        assert writer("close") == {"closed": True}
        assert writer.process.wait(timeout=30) == 0
    finally:
        if writer.process.poll() is None:
            writer.process.kill()
            writer.process.wait(timeout=30)
    assert check_log(directory, stored + 600) == rest["tail"]
    with StreamLog.open(directory) as reopened:
        assert reopened.tail_position == rest["tail"]
        assert reopened.recovery is not None and reopened.recovery.cut is None


def test_storage_errors_name_the_file_and_errno_and_survive_pickling(tmp_path: Path) -> None:
    import pickle

    error = StorageFull("cannot reserve 65536 bytes for /x/0001.term", "/x/0001.term", errno.ENOSPC)
    assert isinstance(error, StorageError)
    assert "ENOSPC" in str(error) and "/x/0001.term" in str(error)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is StorageFull
    assert (copy.path, copy.errno, str(copy)) == (error.path, error.errno, str(error))


def test_a_failed_fsync_is_a_storage_error_and_the_retry_writes_everything_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with StreamLog.open(tmp_path, term_length=4096, capacity=64 * 4096) as log:
        _frames.append_many(log, 10)
        log.sync()
        durable = log.durable_position
        _frames.append_many(log, 20, 10**6)
        tail = log.tail_position
        real_sync = TermFile.sync
        real_redirty = StreamLog._redirty
        rewrites: list[tuple[list[int], int, int]] = []

        def failing_sync(term: TermFile) -> None:
            raise OSError(errno.EIO, "Input/output error", str(term.path))

        def recording_redirty(self: StreamLog, terms: list[TermFile], start: int, end: int) -> None:
            rewrites.append(([t.term_id for t in terms], start, end))
            real_redirty(self, terms, start, end)

        monkeypatch.setattr(StreamLog, "_redirty", recording_redirty)
        monkeypatch.setattr(TermFile, "sync", failing_sync)
        with pytest.raises(StorageError) as caught:
            log.sync()
        assert caught.value.errno == errno.EIO
        assert not isinstance(caught.value, StorageFull)
        assert log.durable_position == durable  # nothing acknowledged that is not durable
        assert rewrites == []

        # Linux may have marked the failed pages clean: the next commit stores
        # everything since the last good one again before it syncs.
        monkeypatch.setattr(TermFile, "sync", real_sync)
        assert log.sync() == tail
        assert rewrites == [(list(range(durable // 4096, tail // 4096 + 1)), durable, tail)]
        _frames.append_many(log, 1, 2 * 10**6)
        log.sync()
        assert len(rewrites) == 1  # only after a failure
        frames = log.read(0)
        assert len(frames) == 31
        for frame in frames:
            _frames.check_frame(frame)
