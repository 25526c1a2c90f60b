"""What can go wrong with a stream log, as a small tree of exceptions.

::

    LogError                 misuse, or a log that cannot be opened as asked
    ├── LogFullError         the append does not fit the free capacity or a term
    ├── StorageError         the file system refused (a failed fsync, EIO); names file and errno
    │   └── StorageFull      no space for a new term (ENOSPC, EDQUOT, EFBIG): retry later
    └── LogCorruptError      bytes on disk that recovery cannot explain; names file and offset

``LogFullError`` is the log's own budget (the consumer has not released
space); ``StorageFull`` is the file system's. After either, the log is
unchanged and usable: nothing durable was touched, and the same append
succeeds once space returns.

A torn tail left by a crash is *not* corruption: recovery cuts it off without
an error. Corruption is damage that reaches into history reported durable, or
a file the log needs that is missing or malformed.
"""

from __future__ import annotations

import errno as _errno
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


class StorageError(LogError):
    """The file system refused an operation the log needs; nothing durable was harmed."""

    def __init__(self, message: str, path: str | os.PathLike[str], errno: int) -> None:
        #: The file (or directory) the operation was on.
        self.path = os.fspath(path)
        #: The operating system's error number (``errno.ENOSPC`` and so on).
        self.errno = errno
        self.message = message
        super().__init__(f"{message}: {os.strerror(errno)} [{_errno.errorcode.get(errno, errno)}]")

    def __reduce__(self) -> tuple[type[StorageError], tuple[str, str, int]]:
        return (type(self), (self.message, self.path, self.errno))


class StorageFull(StorageError):
    """No space (or quota, or file size limit) for what the log must allocate.

    Raised before anything is written: the log stays consistent, and the
    operation succeeds when retried after space is freed.
    """


#: Error numbers that mean "no room", as opposed to a failing device.
FULL_ERRNOS = frozenset({_errno.ENOSPC, _errno.EDQUOT, _errno.EFBIG})


def storage_error(message: str, path: str | os.PathLike[str], exc: OSError) -> StorageError:
    """The :class:`StorageError` (or :class:`StorageFull`) for ``exc`` on ``path``."""
    number = exc.errno if exc.errno is not None else _errno.EIO
    cls = StorageFull if number in FULL_ERRNOS else StorageError
    return cls(message, path, number)
