"""A reader for the cross-process test, run as a child process next to a live writer.

Usage: ``python _reader_child.py LOG_DIR LAST_SEQ TIMEOUT``

Opens the log with :class:`LogReader` and reads everything up to the published
position, again and again, while the writer appends, until it has seen the
frame whose sequences reach ``LAST_SEQ``. Every frame's checksum is checked by
the read itself; here its contents are checked against its sequence number and
its sequence against the previous frame's. Prints one JSON line of counts and
exits 0, or prints what went wrong and exits 1.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from headgate.log import LogReader
from tests.log import _frames


def main() -> int:
    directory, last_seq, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    deadline = time.monotonic() + timeout
    reader = LogReader.open(directory)
    position = reader.start_position()
    next_seq = 0
    frames = reads = empty = 0
    payload_bytes = 0
    while next_seq < last_seq:
        if time.monotonic() > deadline:
            print(f"timed out at sequence {next_seq}, position {position}")
            return 1
        batch = reader.read(position, max_bytes=256 * 1024)
        reads += 1
        if not batch:
            empty += 1
            time.sleep(0.0005)
            continue
        for frame in batch:
            if frame.first_sequence != next_seq:
                print(f"sequence {frame.first_sequence} at {frame.position}, expected {next_seq}")
                return 1
            _frames.check_frame(frame)
            next_seq += frame.record_count
            payload_bytes += len(frame.payload)
        frames += len(batch)
        position = batch[-1].end_position
    reader.close()
    print(json.dumps({"frames": frames, "reads": reads, "empty": empty, "bytes": payload_bytes}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
