"""A disk that a test fills up and frees again, for the disk-full tests.

Preferred: a small tmpfs mounted by the test (we run as root here and in CI);
:meth:`SmallDisk.fill` writes a filler file until the file system says
``ENOSPC`` and :meth:`SmallDisk.free` deletes it. Where mounting is not
permitted, a plain directory stands in and "full" is the file size limit
``RLIMIT_FSIZE`` of the process under test, lowered and raised again with
``prlimit``: no byte may be written past it, so reserving a new term fails
with ``EFBIG``, and so does a frame written past it inside a term reserved
earlier (the log writes frames with ``pwrite``); CPython ignores SIGXFSZ, so
the process gets the error instead of the signal. Because a limit applies
to a whole process, whatever is under test runs in a child process, in both
modes, and the test passes its pid.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import subprocess
from collections.abc import Iterator
from pathlib import Path

#: File size limit while "full" in the fallback mode: below any term length
#: the tests use (64 KiB), above the metadata page and the state files.
#: Above where the disk-full tests' first appends end in their term (about
#: 33 KB into a 64 KiB term), so that later appends get some way before the
#: limit stops them.
RLIMIT_FULL = 48 * 1024


class SmallDisk:
    """A directory on a file system the test can fill and free."""

    def __init__(self, directory: Path, mode: str) -> None:
        #: Where the code under test keeps its files.
        self.directory = directory
        #: ``"tmpfs"`` or ``"rlimit"`` (see the module docstring).
        self.mode = mode
        #: The errno a full disk gives in this mode.
        self.full_errno = errno.ENOSPC if mode == "tmpfs" else errno.EFBIG
        self._filler = directory / "filler"

    def fill(self, pid: int) -> None:
        """Leave no room for another term for process ``pid``."""
        if self.mode == "rlimit":
            _, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (RLIMIT_FULL, hard))
            return
        fd = os.open(self._filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            for chunk in (bytes(64 * 1024), bytes(4096)):
                for _ in range(100_000):  # bounded: the disk is a few MiB
                    try:
                        os.write(fd, chunk)
                    except OSError as exc:
                        if exc.errno != errno.ENOSPC:
                            raise
                        break
        finally:
            os.close(fd)
        assert os.statvfs(self.directory).f_bavail == 0

    def free(self, pid: int) -> None:
        """Give the room back."""
        if self.mode == "rlimit":
            _, hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (hard, hard))
            return
        self._filler.unlink()


@contextlib.contextmanager
def small_disk(base: Path, size: int, *, mount: bool = True) -> Iterator[SmallDisk]:
    """A tmpfs of ``size`` bytes at ``base/disk``, or the fallback; unmounted afterwards.

    ``mount=False`` takes the fallback even where mounting works, so that
    both modes are tested here; so does the environment variable
    ``HEADGATE_TEST_DISK=rlimit``, for every test that uses this.
    """
    if os.environ.get("HEADGATE_TEST_DISK") == "rlimit":
        mount = False
    mount_point = base / "disk"
    mount_point.mkdir()
    mounted = False
    if mount:
        try:
            mounted = (
                subprocess.run(
                    ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
                    capture_output=True,
                    timeout=30,
                    check=False,
                ).returncode
                == 0
            )
        except FileNotFoundError:  # no mount command at all
            mounted = False
    try:
        yield SmallDisk(mount_point, "tmpfs" if mounted else "rlimit")
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mount_point)], timeout=30, check=False)
