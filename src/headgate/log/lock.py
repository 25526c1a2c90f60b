"""Exclusive locks on directories, held for the life of a process.

A writer that shares a directory with another writer corrupts it, so each
writer takes an advisory ``flock`` on a lock file in the directory it writes.
The kernel drops the lock when the process dies, however it dies: a crashed
writer never leaves a stale lock behind, and nobody has to delete anything
before starting again.

The gateway locks its whole data directory (:class:`DirectoryLock`); each
stream log also locks its own directory, for tools that open one log alone.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from typing import Final

from headgate.log.errors import LogError

__all__ = ["DirectoryInUse", "DirectoryLock", "try_lock"]

#: What ``flock`` answers, depending on the platform, when another holds the lock.
_HELD: Final = frozenset({errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK})


def try_lock(path: Path) -> int | None:
    """Open ``path`` (created if absent) and lock it exclusively.

    Returns the open descriptor, which holds the lock until it is closed, or
    None when another open file already holds it (in this process or
    another). Never waits.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in _HELD:
            return None
        raise
    return fd


class DirectoryInUse(LogError):
    """Another writer holds the lock of a directory.

    ``pid`` is the holder's process id, as it wrote it into the lock file,
    or None when the file does not say (the holder is still writing it).
    """

    def __init__(self, directory: Path, pid: int | None) -> None:
        holder = "another writer" if pid is None else f"another writer (pid {pid})"
        super().__init__(f"{directory} is in use by {holder}")
        #: The directory that is locked.
        self.directory = directory
        #: The holder's process id, if it is known.
        self.pid = pid


class DirectoryLock:
    """The exclusive right to write a directory, for as long as it is held.

    :meth:`acquire` locks ``<directory>/<name>`` and writes this process's id
    into it, so that a second writer can say who holds it. :meth:`release`
    (or the end of the process) gives it back. The file itself stays: its
    presence means nothing, only the lock does.
    """

    def __init__(self, directory: Path, fd: int) -> None:
        #: The locked directory.
        self.directory = directory
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, directory: Path, name: str) -> DirectoryLock:
        """Lock ``directory`` (created if absent); raises :class:`DirectoryInUse`."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / name
        fd = try_lock(path)
        if fd is None:
            raise DirectoryInUse(directory, _holder(path))
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(directory, fd)

    @property
    def held(self) -> bool:
        """Whether this object still holds the lock."""
        return self._fd is not None

    def release(self) -> None:
        """Give the lock back; a second call does nothing."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _holder(path: Path) -> int | None:
    """The process id written in a lock file, or None if it holds none (yet)."""
    try:
        text = path.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
