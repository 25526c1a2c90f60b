"""What can go wrong with a stream log, as a small tree of exceptions.

::

    LogError                 misuse, or a log that cannot be opened as asked
    ├── LogFullError         the append does not fit the free capacity or a term
    └── LogCorruptError      bytes on disk that recovery cannot explain; names file and offset

A torn tail left by a crash is *not* corruption: recovery cuts it off without
an error. Corruption is damage that reaches into history reported durable, or
a file the log needs that is missing or malformed.
"""

from __future__ import annotations

import os


class LogError(Exception):
    """A stream log operation failed; the message says which rule was broken."""


class LogFullError(LogError):
    """An append needs more log space than the log can give it now (or ever)."""


class LogCorruptError(LogError):
    """Bytes on disk are damaged in a way that cannot be repaired without losing history."""

    def __init__(self, path: str | os.PathLike[str], offset: int, reason: str) -> None:
        #: The file holding the damaged bytes.
        self.path = os.fspath(path)
        #: Byte offset of the damage inside :attr:`path`.
        self.offset = offset
        #: What was expected at that offset and was not there.
        self.reason = reason
        super().__init__(f"{self.path} at byte offset {offset}: {reason}")

    def __reduce__(self) -> tuple[type[LogCorruptError], tuple[str, int, str]]:
        # The default pickling replays ``args`` (the message) into __init__,
        # which takes three fields; Spark and multiprocessing pickle errors.
        return (type(self), (self.path, self.offset, self.reason))
