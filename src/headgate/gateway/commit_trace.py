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

Times are ``time.monotonic()``: one clock for every process on the machine,
so a benchmark can join its own timings to these. Lines are buffered and
written by :meth:`CommitTrace.flush` (the gateway's housekeeping loop, every
0.1 s, and at stop): the trace costs the loop a dict and a list append per
event, and one write of about 200 bytes per commit every 0.1 s.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
from typing import Any

__all__ = ["TRACE_ENV", "CommitTrace", "from_environment"]

#: The environment variable that turns the trace on (its value: the file).
TRACE_ENV = "HEADGATE_COMMIT_TRACE"


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


def from_environment(interval_s: float, term_length: int) -> CommitTrace | None:
    """The trace ``HEADGATE_COMMIT_TRACE`` asks for, or None (the default)."""
    path = os.environ.get(TRACE_ENV, "")
    return CommitTrace(path, interval_s, term_length) if path else None
