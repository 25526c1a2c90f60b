"""A stream's duplicate-detection state on disk: per producer, the next sequence.

The log keeps each batch's producer id and sequences in its frame header, so
the state can always be rebuilt by reading every header from the release
position on. That costs a few microseconds per stored frame warm, and a disk
read per frame cold: it grows with what is stored. Two things bound it:

* Frames that Spark released are deleted, so their producers' state can only
  come from a snapshot written before the release (without it, a resend of a
  released batch would be stored again).
* The snapshot names the log position it covers: every frame that ends at or
  before ``position`` is in ``producers``. On start the gateway loads it and
  reads only the headers after ``position``, so the work is proportional to
  what was appended since the last snapshot, not to what is stored.

A snapshot holds only durable state (a batch that a crash loses must be
accepted again when the producer resends it), and ``position`` is always a
frame boundary at or below the durable position when it is written.

The file is JSON, written to a temporary file, fsynced, renamed into place,
and the directory fsynced, so a crash leaves the old snapshot or the new one.
``{"position": P, "producers": {"<id>": next_sequence}}``; a file written
before positions were recorded is a plain ``{"<id>": next_sequence}`` and
covers no position (the whole log is read).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

#: After this many frames became durable since the last snapshot, a stream
#: writes a new one: a restart then reads at most about this many frame
#: headers per stream (plus those appended after the last group commit),
#: about a tenth of a second warm. Each snapshot costs two fsyncs, on the
#: event loop (about 5 ms on the test machine): at 4,096 a flood of
#: one-record batches (50,000 a second) made it wait about 60 ms a second.
SNAPSHOT_EVERY_FRAMES: Final = 32768
#: ... or after this many bytes, whichever comes first: a cold restart reads
#: a page per header, and big frames bring more pages through readahead.
SNAPSHOT_EVERY_BYTES: Final = 64 * 1024 * 1024
#: A start that read at least this many headers saves a snapshot at once, so
#: that the next start after a crash does not read them again.
SNAPSHOT_AT_OPEN_FRAMES: Final = 1024
#: ... or headers spread over at least this many bytes of log: cold, each one
#: is a disk read (160 streams of 240 frames of 256 KiB took 7.6 s to recover
#: again at every cold restart, under the frame count alone).
SNAPSHOT_AT_OPEN_BYTES: Final = 16 * 1024 * 1024


def snapshot_due(frames: int, nbytes: int) -> bool:
    """Whether ``frames`` frames of ``nbytes`` bytes since the last snapshot call for a new one."""
    return frames >= SNAPSHOT_EVERY_FRAMES or nbytes >= SNAPSHOT_EVERY_BYTES


def snapshot_due_at_open(frames: int, nbytes: int) -> bool:
    """Whether a start that read ``frames`` headers over ``nbytes`` of log saves a snapshot."""
    return frames >= SNAPSHOT_AT_OPEN_FRAMES or (frames > 0 and nbytes >= SNAPSHOT_AT_OPEN_BYTES)


class SnapshotUnreadable(ValueError):
    """The snapshot file exists but cannot be used (damaged, or not a snapshot)."""


@dataclass(frozen=True, slots=True)
class DedupSnapshot:
    """Per producer id, the next sequence, for every frame ending at or before ``position``."""

    #: A frame boundary of the log, or None where the file named none (old format).
    position: int | None
    #: producer id -> next sequence.
    producers: dict[int, int]


def load_snapshot(path: Path) -> DedupSnapshot | None:
    """The snapshot at ``path``; None if there is none.

    Raises:
        SnapshotUnreadable: the file is there but damaged or of another shape.
    """
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise SnapshotUnreadable(f"{path}: {exc}") from None
    try:
        if isinstance(raw, dict) and "producers" in raw:
            position = int(raw["position"])
            producers = raw["producers"]
            if position < 0 or position % 8:
                raise ValueError(f"position {position} is not a frame boundary")
        else:
            position, producers = None, raw
        if not isinstance(producers, dict):
            raise ValueError("producers is not an object")
        table = {int(k): int(v) for k, v in producers.items()}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise SnapshotUnreadable(f"{path}: {exc}") from None
    if any(k < 0 or v < 0 for k, v in table.items()):
        raise SnapshotUnreadable(f"{path}: a negative producer id or sequence")
    return DedupSnapshot(position, table)


def write_snapshot(path: Path, snapshot: DedupSnapshot) -> None:
    """Replace the snapshot at ``path`` atomically and durably (raises OSError)."""
    body = {
        "position": snapshot.position,
        "producers": {str(k): v for k, v in snapshot.producers.items()},
    }
    write_json_durably(path, body)


def write_json_durably(path: Path, body: object) -> None:
    """Replace the JSON file at ``path`` so that a crash leaves the old one or the new one.

    The one home of the gateway's crash rule for its state files (producer
    state, consumers): a temporary file, fsynced, renamed into place, then the
    directory fsynced. Raises OSError (a full disk) with the old file intact.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(body, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
