"""When a failed query of ``headgate pipeline`` is started again, and when the pipeline gives up.

A query that fails once (a Spark race, an executor lost, a gateway
restarting under a read-through pipeline) usually runs again from its
checkpoint without losing or repeating anything: the checkpoint fixes what
each batch covers and the sink replaces a batch's files. Exiting the whole
pipeline for that one failure stops every stream's producers until someone
starts it again. A failure that keeps coming back, though, is a real problem
(a full disk, a broken output directory), and restarting forever would hide
it: past a bound the pipeline exits as it did before.

Pure: time is an argument, so the rule is tested without clocks or Spark.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

#: Failures of one query allowed within :attr:`RestartPolicy.window` before the pipeline exits.
MAX_RESTARTS = 3
#: Seconds over which failures are counted.
RESTART_WINDOW = 600.0
#: Seconds to wait before the 1st, 2nd, 3rd ... restart within the window.
RESTART_BACKOFF = (1.0, 5.0, 15.0)


@dataclass
class RestartPolicy:
    """Counts each stream's query failures and says when to restart it, or that it is time to stop.

    ``max_restarts`` failures of one stream's query within ``window`` seconds
    are restarted, each after the next delay of ``backoff`` (the last one
    repeats); the next failure within the window is final.
    """

    max_restarts: int = MAX_RESTARTS
    window: float = RESTART_WINDOW
    backoff: tuple[float, ...] = RESTART_BACKOFF
    _failures: dict[str, deque[float]] = field(default_factory=dict)

    def failed(self, stream: str, now: float) -> float | None:
        """Record that ``stream``'s query failed at ``now``; return the delay before restarting it.

        None: it failed more than ``max_restarts`` times within ``window``;
        do not restart it.
        """
        times = self._failures.setdefault(stream, deque())
        while times and now - times[0] >= self.window:
            times.popleft()
        times.append(now)
        if len(times) > self.max_restarts:
            return None
        if not self.backoff:
            return 0.0
        return self.backoff[min(len(times), len(self.backoff)) - 1]

    def recent(self, stream: str) -> int:
        """How many failures of ``stream`` were counted in the window at the last failure."""
        return len(self._failures.get(stream, ()))
