"""The per-stream log: term files on disk, read by position through memory maps.

One directory per stream holds fixed-size term files and a metadata page. The
gateway appends with :class:`StreamLog` (the only writer), makes appends
durable in groups with :meth:`StreamLog.sync`, and frees space with
:meth:`StreamLog.release` once Spark is done with it. Spark executors read
with :class:`LogReader` from other processes, without locks. The byte layout,
the ordering argument and the recovery rules are in ``LOG.md``.

This package knows nothing of connections, producers' credit or Spark; a
frame is a payload with a producer id, a first sequence number, a record
count and a timestamp.
"""

from headgate.log.errors import (
    LogCorruptError,
    LogError,
    LogFullError,
    StorageError,
    StorageFull,
)
from headgate.log.frame import (
    FRAME_ALIGNMENT,
    HEADER_LENGTH,
    AppendResult,
    FrameHeader,
    LogFrame,
    frame_cost,
)
from headgate.log.position import (
    compute_position,
    term_id_of,
    term_offset_of,
)
from headgate.log.reader import LogReader
from headgate.log.recovery import RecoveryReport
from headgate.log.stream_log import DEFAULT_TERM_LENGTH, StreamLog

__all__ = [
    "DEFAULT_TERM_LENGTH",
    "FRAME_ALIGNMENT",
    "HEADER_LENGTH",
    "AppendResult",
    "FrameHeader",
    "LogCorruptError",
    "LogError",
    "LogFrame",
    "LogFullError",
    "LogReader",
    "RecoveryReport",
    "StorageError",
    "StorageFull",
    "StreamLog",
    "compute_position",
    "frame_cost",
    "term_id_of",
    "term_offset_of",
]
