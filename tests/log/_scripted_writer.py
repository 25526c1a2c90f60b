"""A writer that dies on purpose, leaving appends that were never made durable.

Usage: ``python _scripted_writer.py LOG_DIR TERM_LENGTH SYNCED UNSYNCED``

Appends ``SYNCED`` deterministic frames (see ``_frames``), group-commits, appends
``UNSYNCED`` more, and kills itself with SIGKILL: the state a crash between
two group commits leaves. Before dying it prints the durable position and
the tail.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from headgate.log import StreamLog
from tests.log import _frames


def main() -> None:
    directory, term_length = sys.argv[1], int(sys.argv[2])
    synced, unsynced = int(sys.argv[3]), int(sys.argv[4])
    log = StreamLog.open(directory, term_length=term_length, capacity=1024 * term_length)
    _, seq = _frames.append_many(log, synced)
    durable = log.sync()
    _frames.append_many(log, unsynced, seq)
    print(durable, log.tail_position, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
