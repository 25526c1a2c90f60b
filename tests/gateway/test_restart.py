"""A restarted stream rebuilds its dedup state from a snapshot and the frames after it.

The life before the restart runs in a child process (tests/gateway/_restart_child.py)
that appends through ``Stream.append`` as the gateway does, and then SIGKILLs
itself or closes cleanly. The restart is ``Stream.open`` here, on the same
files. ``Stream.recovered_frames`` counts the frame headers the restart read:
the work that used to grow with everything stored.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from headgate.gateway.streams import AppendOutcome, Stream
from headgate.log import LogReader, StreamLog, frame_cost
from tests.gateway._restart_child import (
    PRODUCER,
    SYNC_EVERY,
    make_writer,
    open_stream,
    send,
)

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
#: A snapshot every 4 KiB of durable log: every few dozen of the child's frames.
EVERY = 4096


def live(data_dir: Path, batches: int, *, unsynced: int = 0, end: str = "kill") -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.gateway._restart_child",
            str(data_dir),
            str(batches),
            str(EVERY),
            str(unsynced),
            end,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == (-9 if end == "kill" else 0), done.stderr


def snapshot_position(data_dir: Path) -> int:
    state = json.loads((data_dir / "state" / "s.producers.json").read_text())
    return int(state["position"])


def frames_after(data_dir: Path, position: int) -> int:
    reader = LogReader.open(data_dir / "streams" / "s")
    try:
        return len(reader.read(position, reader.published_position()))
    finally:
        reader.close()


def test_after_a_crash_only_frames_after_the_snapshot_are_read_and_resends_are_still_caught(
    tmp_path: Path,
) -> None:
    live(tmp_path, 300, unsynced=25)
    position = snapshot_position(tmp_path)
    after = frames_after(tmp_path, position)
    # The snapshot is older than the tail: the last commits, and the frames
    # never committed (a killed process leaves them in the page cache).
    assert 25 <= after < 300
    stream = open_stream(tmp_path)
    try:
        assert stream.recovered_frames == after
        assert stream.dedup[PRODUCER] == 300
        writer = make_writer()
        # Resends of batches after the snapshot, and one before it, are
        # duplicates; the next sequence is stored.
        for sequence in (299, 300 - after, 10):
            assert send(stream, writer, sequence) is AppendOutcome.DUPLICATE
        assert send(stream, writer, 300) is AppendOutcome.STORED
    finally:
        stream.close()


def test_after_a_clean_stop_no_frame_is_read(tmp_path: Path) -> None:
    live(tmp_path, 300, end="close")
    stream = open_stream(tmp_path)
    try:
        assert stream.recovered_frames == 0
        assert stream.dedup[PRODUCER] == 300
        assert send(stream, make_writer(), 299) is AppendOutcome.DUPLICATE
    finally:
        stream.close()


def test_start_up_reads_no_more_frames_with_ten_times_as_many_stored(tmp_path: Path) -> None:
    # At most a snapshot interval of frames, plus the last commit's, plus the
    # frames never committed: whatever is stored before them.
    bound = EVERY // frame_cost(16) + 2 * SYNC_EVERY + 10
    read = []
    for batches in (300, 3000):
        data_dir = tmp_path / str(batches)
        live(data_dir, batches, unsynced=10)
        stream = open_stream(data_dir)
        try:
            assert stream.dedup[PRODUCER] == batches
            assert stream.log.tail_position > batches * frame_cost(16) > EVERY
            read.append(stream.recovered_frames)
        finally:
            stream.close()
    assert all(10 <= count <= bound for count in read), (read, bound)


@pytest.mark.parametrize(
    "damage",
    [
        b"{not json",
        b'{"position": 16, "producers": {"7": "x"}}',
        b'{"position": -8, "producers": {}}',
    ],
)
def test_a_damaged_snapshot_means_reading_every_frame_with_a_warning(
    tmp_path: Path, damage: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    live(tmp_path, 300, end="close")
    (tmp_path / "state" / "s.producers.json").write_bytes(damage)
    with caplog.at_level(logging.WARNING, logger="headgate.gateway"):
        stream = open_stream(tmp_path)
    try:
        assert stream.recovered_frames == 300
        assert stream.dedup[PRODUCER] == 300
        assert "producer state unreadable" in caplog.text
        assert send(stream, make_writer(), 150) is AppendOutcome.DUPLICATE
    finally:
        stream.close()


@pytest.mark.parametrize("where", ["beyond the tail", "inside a frame"])
def test_a_snapshot_position_the_log_does_not_have_means_reading_every_frame(
    tmp_path: Path, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    live(tmp_path, 300, end="close")
    state = tmp_path / "state" / "s.producers.json"
    tail = snapshot_position(tmp_path)
    position = tail + 4096 if where == "beyond the tail" else 8
    # A producer only the snapshot knows (its frames released) stays known.
    state.write_text(json.dumps({"position": position, "producers": {"7": 5, "9": 40}}))
    with caplog.at_level(logging.WARNING, logger="headgate.gateway"):
        stream = open_stream(tmp_path)
    try:
        assert stream.recovered_frames == 300
        assert stream.dedup == {PRODUCER: 300, 9: 40}
        assert "reading every frame header" in caplog.text
    finally:
        stream.close()


def test_without_a_snapshot_every_frame_is_read_once_and_then_saved(tmp_path: Path) -> None:
    live(tmp_path, 300, end="close")
    (tmp_path / "state" / "s.producers.json").unlink()
    stream = open_stream(tmp_path)
    try:
        assert stream.recovered_frames == 300
        assert stream.dedup[PRODUCER] == 300
    finally:
        stream.close()
    # The clean close saved it: the next start reads nothing.
    stream = open_stream(tmp_path)
    try:
        assert stream.recovered_frames == 0
        assert stream.dedup[PRODUCER] == 300
    finally:
        stream.close()


def test_few_big_frames_read_at_open_are_saved_too(tmp_path: Path) -> None:
    # 80 frames of 256 KiB: far below the 1024 headers that alone would call
    # for a snapshot at open, but cold each header is a disk read, and the
    # next start after a crash must not read them all again.
    directory = tmp_path / "streams" / "s"
    log = StreamLog.open(directory, term_length=4 * 1024 * 1024, capacity=64 * 1024 * 1024)
    try:
        payload = bytes(256 * 1024)
        for sequence in range(80):
            log.append(
                payload, producer_id=7, first_sequence=sequence, record_count=1, timestamp_us=0
            )
        log.sync()
    finally:
        log.close()

    def reopen() -> Stream:
        return Stream.open(
            "s",
            tmp_path,
            capacity=64 * 1024 * 1024,
            term_length=4 * 1024 * 1024,
            max_message_size=512 * 1024,
        )

    first = reopen()
    assert first.recovered_frames == 80 and first.dedup == {7: 80}
    first.log.close()  # a crash: no clean close, no snapshot from it
    again = reopen()
    try:
        assert again.recovered_frames == 0 and again.dedup == {7: 80}
    finally:
        again.close()
