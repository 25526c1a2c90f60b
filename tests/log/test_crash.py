"""Crash safety: a writer killed with SIGKILL at random moments loses nothing it called durable.

A child process (``_crash_writer.py``) appends deterministic frames and a
commit thread reports every durable position to a side file it fsyncs. The
test kills the child at a random moment, reopens the log (recovery), and
checks: every position reported durable is still covered; every frame from the
release position to the recovered tail is intact (checksum, and contents
derived from its sequence number); frames are contiguous with sequences
continuing; and the next append lands exactly at the recovered tail. Then the
next child continues on the same log.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from headgate.log import StreamLog
from tests.log import _frames

WRITER = Path(__file__).with_name("_crash_writer.py")
KILLS = 15
TERM = 64 * 1024


def read_reports(path: Path) -> list[tuple[int, int]]:
    if not path.exists():
        return []
    reports = []
    for line in path.read_text().splitlines(keepends=True):
        if line.endswith("\n"):  # the kill may cut the last line short
            durable, next_seq = line.split()
            reports.append((int(durable), int(next_seq)))
    return reports


def wait_ready(child: subprocess.Popen[str], timeout: float) -> None:
    assert child.stdout is not None
    deadline = time.monotonic() + timeout
    line = child.stdout.readline()  # the child prints one line, then appends
    assert line.strip() == "ready", f"writer did not start: {line!r}"
    assert time.monotonic() < deadline


def verify(directory: Path, reports: list[tuple[int, int]], cuts: list[str]) -> int:
    """Recover, check everything, append one frame at the tail; return the frame count."""
    with StreamLog.open(directory) as log:
        assert log.recovery is not None
        assert log.recovery.positions_trusted
        if log.recovery.cut is not None or log.recovery.zeroed_bytes:
            cuts.append(f"{log.recovery.cut or 'uncommitted'}: {log.recovery.zeroed_bytes} bytes")
        tail = log.tail_position
        release = log.release_position
        frames = log.read(release)
        for frame in frames:
            _frames.check_frame(frame)
        _frames.check_contiguous(frames, TERM)
        ends = {frame.end_position: frame for frame in frames}
        for durable, next_seq in reports:
            assert durable <= tail, f"durable position {durable} lost (tail {tail})"
            if durable > release:
                frame = ends[durable]
                assert frame.first_sequence + frame.record_count == next_seq
        # The next append starts exactly at the recovered tail (or, if it does
        # not fit in the rest of the term, exactly at the next term after it).
        seq = frames[-1].first_sequence + frames[-1].record_count if frames else 0
        if frames:
            log.release(frames[-1].position)  # make room; recovery made everything durable
        cost = log.append_cost(_frames.payload_length(seq))
        result = _frames.append(log, seq)
        assert result.end_position == tail + cost
        assert result.position == tail or (
            result.position % TERM == 0 and result.position - tail < TERM
        )
        assert log.read(log.release_position)[-1].position == result.position
        return len(frames)


def test_sigkill_at_random_moments_loses_nothing_durable(tmp_path: Path) -> None:
    rng = random.Random(20_240_611)
    directory = tmp_path / "log"
    started = time.monotonic()
    verified_frames = 0
    cuts: list[str] = []
    for kill in range(KILLS):
        report = tmp_path / f"report-{kill}"
        child = subprocess.Popen(
            [sys.executable, str(WRITER), str(directory), str(report)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            if kill % 5 == 4 and kill > 0:
                # Now and then, kill it early: during start-up or recovery.
                time.sleep(rng.uniform(0.0, 0.15))
            else:
                wait_ready(child, timeout=15)
                time.sleep(rng.uniform(0.05, 0.5))
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(10)
            assert child.stdout is not None
            child.stdout.close()
        assert child.returncode == -signal.SIGKILL
        if directory.exists() and (directory / "meta").exists():
            verified_frames += verify(directory, read_reports(report), cuts)
    assert verified_frames > 0
    print(f"{verified_frames} frames verified; torn tails cut: {cuts}")
    assert time.monotonic() - started < 60
