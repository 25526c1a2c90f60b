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
from headgate.log.group_commit import GroupCommit
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

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        # A test that failed half way leaves no child behind.
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)

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
    with Writer(directory) as writer:
        first = writer("append 250")
        assert first["appended"] == 250 and "error" not in first
        assert writer("sync")["durable"] == first["tail"]

        disk.fill(writer.process.pid)
        full = writer("append 3000")
        assert full["error"] == "StorageFull", full
        assert full["errno"] == disk.full_errno
        assert str(directory) in full["path"]
        # It stops where a new term is needed, with a clear error. (These
        # frames are small, so they are stored into the mapped term, which a
        # file size limit does not bound; see the next test for frames
        # written through the descriptor.)
        assert "cannot reserve" in full["message"] or "cannot create" in full["message"]
        stored = 250 + full["appended"]
        assert full["tail"] > first["tail"]
        # What was appended is whole, and becomes durable: nothing is harmed.
        synced = writer("sync")
        assert "error" not in synced and synced["durable"] == full["tail"]
        assert check_log(directory, stored) == full["tail"]
        # Still full: the probe says so, and an append still fails the same way.
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
    assert check_log(directory, stored + 600) == rest["tail"]
    with StreamLog.open(directory) as reopened:
        assert reopened.tail_position == rest["tail"]
        assert reopened.recovery is not None and reopened.recovery.cut is None


def test_a_frame_write_past_a_file_size_limit_fails_cleanly_and_is_scrubbed(
    tmp_path: Path,
) -> None:
    # Frames of 1 KiB and more go through the descriptor (pwrite), and a file
    # size limit bounds the offsets written even inside a reserved term.
    with small_disk(tmp_path, 1024 * 1024, mount=False) as disk:
        directory = disk.directory / "log"
        with Writer(directory) as writer:
            first = writer("append 250")  # ends about 33 KB into a 64 KiB term
            assert first["appended"] == 250 and writer("sync")["durable"] == first["tail"]
            disk.fill(writer.process.pid)  # no byte past 48 KiB
            full = writer("append-large 40")
            assert full["error"] == "StorageFull" and full["errno"] == errno.EFBIG, full
            assert "cannot write to term file" in full["message"]
            assert 0 < full["appended"] < 40
            tail = full["tail"]
            assert tail % TERM <= 48 * 1024 < tail % TERM + 2048
            # The part of the refused frame that got in was overwritten with zeros.
            term = directory / f"{tail // TERM:016x}.term"
            assert term.read_bytes()[tail % TERM :] == bytes(TERM - tail % TERM)
            assert writer("sync")["durable"] == tail
            disk.free(writer.process.pid)
            rest = writer("append-large 40")
            assert rest["appended"] == 40 and "error" not in rest
            assert writer("sync")["durable"] == rest["tail"]
            assert writer("close") == {"closed": True}
            assert writer.process.wait(timeout=30) == 0
        with StreamLog.open(directory) as reopened:
            assert reopened.tail_position == rest["tail"]
            assert reopened.recovery is not None and reopened.recovery.cut is None
            frames = reopened.read(0)
        assert len(frames) == 250 + full["appended"] + 40
        large = [bytes(f.payload) for f in frames[250:]]
        assert large == [bytes([i % 251]) * 2000 for i in range(len(large))]


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
        real_redirty = GroupCommit._redirty
        rewrites: list[tuple[list[int], int, int]] = []

        def failing_sync(term: TermFile) -> None:
            raise OSError(errno.EIO, "Input/output error", str(term.path))

        def recording_redirty(
            self: GroupCommit, terms: list[TermFile], start: int, end: int
        ) -> None:
            rewrites.append(([t.term_id for t in terms], start, end))
            real_redirty(self, terms, start, end)

        monkeypatch.setattr(GroupCommit, "_redirty", recording_redirty)
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
