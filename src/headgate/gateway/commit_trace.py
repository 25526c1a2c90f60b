"""A trace of every group commit, to find where a slow ack's time went.

The ack latency histogram (``headgate_ack_latency_seconds``) says *that* a
batch waited; this trace says *on what*. It is off unless the environment
variable ``HEADGATE_COMMIT_TRACE`` names a file when the gateway is made; it
then writes one JSON object per line to that file (``bench/acktrace.py``
reads it and attributes each slow ack):

``{"trace": 1, "interval_s": ..., "term_length": ..., "switch_interval_s": ..., "pid": ...}``
    first, what the gateway ran with.
``{"commit": N, "due": t, "woke": t, "thread": t, "synced": t, "resumed": t, "done": t,``
``"streams": [[name, tail, seconds], ...]}``
    one group commit: when its wait was meant to end (``due``; None for a
    commit that did not wait, as at stop), when the event loop ran it
    (``woke``: loop lag), when the fsync thread began (``thread``: the
    hand-off to the thread, which needs the GIL), when it ended
    (``synced``), when the loop resumed after it (``resumed``: the hand-off
    back), when every ack of the commit was written (``done``); per stream,
    its tail when synced and how long its ``sync`` took on the thread.
``{"acks": N, "stream": name, "at": t, "arrived": [t, ...]}``
    acks that commit N wrote for ``stream`` at ``at``, and when each acked
    batch arrived: its latency is ``at - arrived``.
``{"gc": generation, "at": t, "seconds": s, "collected": n}``
    a garbage collection in the gateway process (``gc.callbacks``): the loop
    could run nothing meanwhile.
``{"stall": t, "seconds": s, "since": t0, "cpu": c, "runqueue": w}``
    the event loop ran a 1 ms timer ``s`` late (more than ``STALL_S``): from
    ``t`` on it was busy, or not scheduled; since its previous tick ``t0``,
    the loop thread ran ``c`` seconds and waited ``w`` for a CPU (see
    :meth:`CommitTrace.watch_loop`).
``{"appends": t, "seconds": s, "connections": n}``
    one pass of the log writer over queued batches that took more than
    ``STALL_S`` on the loop (the appends themselves: copies, page faults,
    ``pwritev`` into the page cache, which can wait for write-back).

Times are ``time.monotonic()``: one clock for every process on the machine,
so a benchmark can join its own timings to these. Lines are buffered and
written by :meth:`CommitTrace.flush` (the gateway's housekeeping loop, every
0.1 s, and at stop). The trace costs the loop a dict and a list append per
event, one write of about 200 bytes per commit every 0.1 s, and the watcher's
1,000 timer callbacks a second (about 1% of a core here): a diagnostic, not
for production.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import sys
import time
from typing import Any

__all__ = ["TRACE_ENV", "CommitTrace", "from_environment"]

#: The environment variable that turns the trace on (its value: the file).
TRACE_ENV = "HEADGATE_COMMIT_TRACE"
#: How often the loop watcher's timer fires, and the lateness (or the writer
#: pass) above which the trace records a stall, in seconds.
WATCH_INTERVAL_S = 0.001
STALL_S = 0.002


class CommitTrace:
    """Buffers trace events and appends them to ``path`` as JSON lines."""

    __slots__ = ("_file", "_gc_started", "_lines", "commits", "path")

    def __init__(self, path: str, interval_s: float, term_length: int) -> None:
        self.path = path
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        self._lines: list[dict[str, Any]] = [
            {
                "trace": 1,
                "interval_s": interval_s,
                "term_length": term_length,
                "switch_interval_s": sys.getswitchinterval(),
                "pid": os.getpid(),
            }
        ]
        #: Group commits so far (each one's number in the trace).
        self.commits = 0
        self._gc_started = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        now = time.monotonic()
        if phase == "start":
            self._gc_started = now
        else:
            self._lines.append(
                {
                    "gc": info.get("generation"),
                    "at": self._gc_started,
                    "seconds": now - self._gc_started,
                    "collected": info.get("collected"),
                }
            )

    def commit(
        self,
        due: float | None,
        woke: float,
        thread: float,
        synced: float,
        resumed: float,
        done: float,
        streams: list[tuple[str, int, float | None]],
    ) -> int:
        """One group commit's times (see the module docstring); returns its number."""
        self.commits += 1
        self._lines.append(
            {
                "commit": self.commits,
                "due": due,
                "woke": woke,
                "thread": thread,
                "synced": synced,
                "resumed": resumed,
                "done": done,
                "streams": streams,
            }
        )
        return self.commits

    def acks(self, stream: str, at: float, arrivals: list[float]) -> None:
        """Acks of the commit under way (number ``commits + 1``) were written at ``at``."""
        self._lines.append(
            {"acks": self.commits + 1, "stream": stream, "at": at, "arrived": list(arrivals)}
        )

    def appends(self, started: float, ended: float, connections: int) -> None:
        """A pass of the log writer ran from ``started`` to ``ended`` (recorded if long)."""
        if ended - started > STALL_S:
            self._lines.append(
                {"appends": started, "seconds": ended - started, "connections": connections}
            )

    async def watch_loop(self) -> None:
        """Record each time the loop runs a 1 ms timer more than STALL_S late, until cancelled.

        With each stall, what the loop thread did meanwhile, from the
        kernel's scheduler statistics (``/proc/thread-self/schedstat``): the
        seconds it ran (``cpu``) and the seconds it was ready but waited for
        a CPU (``runqueue``: other processes had them). The rest of the time
        since the previous tick it slept: in ``epoll`` (at most the 1 ms
        timer) or blocked in the kernel (a write waiting for the disk, a
        page fault, a lock).
        """
        schedstat = _open_schedstat()
        try:
            before = time.monotonic()
            ran, waited = _read_schedstat(schedstat)
            while True:
                await asyncio.sleep(WATCH_INTERVAL_S)
                now = time.monotonic()
                late = now - before - WATCH_INTERVAL_S
                if late > STALL_S:
                    now_ran, now_waited = _read_schedstat(schedstat)
                    self._lines.append(
                        {
                            "stall": before + WATCH_INTERVAL_S,
                            "seconds": late,
                            "since": before,
                            "cpu": (now_ran - ran) / 1e9,
                            "runqueue": (now_waited - waited) / 1e9,
                        }
                    )
                    ran, waited = now_ran, now_waited
                else:
                    ran, waited = _read_schedstat(schedstat)
                before = time.monotonic()
        finally:
            if schedstat is not None:
                os.close(schedstat)

    def flush(self) -> None:
        """Write what is buffered (a failing write ends the trace, not the gateway)."""
        if not self._lines or self._file.closed:
            return
        lines, self._lines = self._lines, []
        try:
            self._file.write("".join(json.dumps(line) + "\n" for line in lines))
            self._file.flush()
        except OSError:
            self.close()

    def close(self) -> None:
        with_callback = self._on_gc in gc.callbacks
        if with_callback:
            gc.callbacks.remove(self._on_gc)
        if not self._file.closed:
            self._lines, lines = [], self._lines
            with contextlib.suppress(OSError):
                self._file.write("".join(json.dumps(line) + "\n" for line in lines))
            self._file.close()


def _open_schedstat() -> int | None:
    try:
        return os.open("/proc/thread-self/schedstat", os.O_RDONLY)
    except OSError:
        return None


def _read_schedstat(fd: int | None) -> tuple[int, int]:
    """Nanoseconds this thread ran, and waited to run, so far ((0, 0) if unknown)."""
    if fd is None:
        return 0, 0
    try:
        fields = os.pread(fd, 128, 0).split()
        return int(fields[0]), int(fields[1])
    except (OSError, ValueError, IndexError):
        return 0, 0


def from_environment(interval_s: float, term_length: int) -> CommitTrace | None:
    """The trace ``HEADGATE_COMMIT_TRACE`` asks for, or None (the default)."""
    path = os.environ.get(TRACE_ENV, "")
    if not path:
        return None
    try:
        return CommitTrace(path, interval_s, term_length)
    except OSError as exc:
        # A diagnostic that cannot be written is not a reason to stop serving.
        logging.getLogger("headgate.gateway").warning(
            "%s=%s: cannot write the commit trace (%s); serving without it",
            TRACE_ENV,
            path,
            exc.strerror or exc,
        )
        return None
