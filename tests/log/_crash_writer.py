"""A writer for the crash test, run as a child process and killed with SIGKILL.

Usage: ``python _crash_writer.py LOG_DIR REPORT_FILE``

It reopens (recovers) the log, prints ``ready``, then appends deterministic
frames (see ``_frames``) as fast as it can, while a second thread group-commits
every millisecond and, after each commit, appends ``"<durable> <next_seq>\\n"``
to the report file and fsyncs it: a claim that every frame before
``durable`` is on disk and that the frame ending there was followed by
sequence ``next_seq``. The main thread also releases space behind the durable
position, always keeping the last durable frame, so the log spans many terms
that are created and deleted while it runs.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from headgate.log import LogFullError, StreamLog
from tests.log import _frames

TERM = 64 * 1024
CAPACITY = 64 * TERM


def main() -> None:
    directory, report_path = sys.argv[1], sys.argv[2]
    log = StreamLog.open(directory, term_length=TERM, capacity=CAPACITY)
    headers = list(log.scan_headers(log.release_position, verify=False))
    seq = headers[-1].first_sequence + headers[-1].record_count if headers else 0
    # (start, end, next sequence) of every frame not yet released, oldest first;
    # the commit thread looks up the frame ending at each durable position.
    frames: deque[tuple[int, int, int]] = deque(
        (h.position, h.end_position, h.first_sequence + h.record_count) for h in headers
    )
    ends = {log.tail_position: seq}
    lock = threading.Lock()
    report = os.open(report_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def commit() -> None:
        while True:
            durable = log.sync()
            with lock:
                next_seq = ends.get(durable)
            if next_seq is not None:
                os.write(report, f"{durable} {next_seq}\n".encode())
                os.fsync(report)
            time.sleep(0.001)

    threading.Thread(target=commit, daemon=True).start()
    print("ready", flush=True)
    count = 0
    while True:
        try:
            result = _frames.append(log, seq)
        except LogFullError:
            time.sleep(0.0005)
            release_behind(log, frames, ends, lock)
            continue
        seq += _frames.record_count(seq)
        count += 1
        with lock:
            ends[result.end_position] = seq
        frames.append((result.position, result.end_position, seq))
        if count % 64 == 0:
            release_behind(log, frames, ends, lock)


def release_behind(
    log: StreamLog,
    frames: deque[tuple[int, int, int]],
    ends: dict[int, int],
    lock: threading.Lock,
) -> None:
    """Release up to the start of the last durable frame (which stays readable)."""
    durable = log.durable_position
    target = None
    with lock:
        while len(frames) > 1 and frames[1][1] <= durable:
            ends.pop(frames[0][1], None)
            frames.popleft()
        if frames and frames[0][1] <= durable:
            target = frames[0][0]
    if target is not None and target > log.release_position:
        log.release(target)


if __name__ == "__main__":
    main()
