"""A StreamLog writer driven line by line over stdin, for the disk-full tests.

Usage: ``python _disk_writer.py LOG_DIR TERM_LENGTH CAPACITY``

It runs in its own process so that a test can limit its file sizes (see
tests/_small_disk.py). Each command line gets one JSON line back:

* ``append N`` appends up to N frames (``tests.log._frames``, sequences
  continuing), stopping at the first error;
* ``append-large N`` appends up to N frames of 2,000 bytes (large enough to
  be written through the descriptor): payload ``bytes([i % 251]) * 2000``
  for the i-th such frame of the process, counted across calls;
* ``sync`` runs a group commit; ``retry`` runs ``ensure_next_term``;
* ``close`` closes the log and exits.

Every answer carries ``tail`` and ``durable``; a failed command carries the
error's class, message, path and errno.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from headgate.log import LogError, StorageError, StreamLog
from tests.log import _frames


def main() -> None:
    directory, term_length, capacity = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    log = StreamLog.open(directory, term_length=term_length, capacity=capacity)
    seq = 0
    large = 0
    for line in sys.stdin:
        command, *args = line.split()
        answer: dict[str, object] = {}
        try:
            if command == "append":
                appended = 0
                try:
                    for _ in range(int(args[0])):
                        _frames.append(log, seq)
                        seq += _frames.record_count(seq)
                        appended += 1
                finally:
                    answer["appended"] = appended
            elif command == "append-large":
                appended = 0
                try:
                    for _ in range(int(args[0])):
                        log.append(
                            bytes([large % 251]) * 2000,
                            producer_id=_frames.PRODUCER_ID,
                            first_sequence=seq,
                            record_count=1,
                            timestamp_us=0,
                        )
                        seq += 1
                        large += 1
                        appended += 1
                finally:
                    answer["appended"] = appended
            elif command == "sync":
                log.sync()
            elif command == "retry":
                log.ensure_next_term()
            elif command == "close":
                log.close()
                print(json.dumps({"closed": True}), flush=True)
                return
            else:
                raise SystemExit(f"unknown command {command!r}")
        except LogError as exc:
            answer["error"] = type(exc).__name__
            answer["message"] = str(exc)
            if isinstance(exc, StorageError):
                answer["path"] = exc.path
                answer["errno"] = exc.errno
        answer["tail"] = log.tail_position
        answer["durable"] = log.durable_position
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
