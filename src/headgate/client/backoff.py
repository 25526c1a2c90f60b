"""When a client tries its gateway again, and when it gives up.

A gateway that accepts a connection and closes it at once (its storage is
unavailable, it is shutting down, another process holds its directory) must
not be hammered: a session that opens and then dies is a failed attempt like
a refused connection, so the pause before the next attempt keeps growing and
the give-up deadline keeps running. Only a *healthy* session starts afresh:
one that made progress (the producer: the gateway acknowledged a batch), or
stayed open long enough to show that the gateway is serving.

Pure: time is an argument, and so is the source of jitter, so the rule is
tested without a clock or a network. The producer and the release client
both follow it.
"""

from __future__ import annotations

import random
from collections.abc import Callable

__all__ = ["Backoff"]


class Backoff:
    """The reconnection schedule of one client.

    Args:
        now: the time the client starts trying (the deadline counts from it).
        give_up_after: seconds of trying, since the start or the end of the
            last healthy session, before giving up; None: never give up.
        first: the first pause, after the first failure.
        longest: pauses double up to this.
        healthy_after: a session open this long is healthy even without
            progress. At most ``give_up_after`` (but not below ``first``), so
            that a session that outlived the deadline it started under still
            earns a full ``give_up_after`` of attempts after it.
        jitter: each pause is scaled by a random factor within ±jitter, so
            that clients cut off together do not come back together.
        uniform: the source of that factor (``random.uniform``).
    """

    def __init__(
        self,
        now: float,
        *,
        give_up_after: float | None,
        first: float = 0.05,
        longest: float = 2.0,
        healthy_after: float = 5.0,
        jitter: float = 0.2,
        uniform: Callable[[float, float], float] = random.uniform,
    ) -> None:
        if first <= 0 or longest < first:
            raise ValueError(f"pauses must grow from a positive first ({first}) to longest")
        self._give_up_after = give_up_after
        self._first = first
        self._longest = longest
        self._healthy_after = (
            healthy_after
            if give_up_after is None
            else min(healthy_after, max(give_up_after, first))
        )
        self._jitter = jitter
        self._uniform = uniform
        self._delay = first
        self._deadline: float | None = None
        self._restart(now)

    @property
    def deadline(self) -> float | None:
        """When the client gives up, or None if never."""
        return self._deadline

    def failed(self, now: float) -> float | None:
        """An attempt failed: the pause before the next one, or None to give up.

        The pause never runs past the deadline, so the last attempt is made
        right at it.
        """
        if self._deadline is not None and now >= self._deadline:
            return None
        pause = self._delay
        if self._jitter:
            pause *= self._uniform(1 - self._jitter, 1 + self._jitter)
        self._delay = min(self._delay * 2, self._longest)
        if self._deadline is not None:
            pause = min(pause, self._deadline - now)
        return pause

    def ended(self, opened: float, now: float, *, progressed: bool) -> float | None:
        """A session that opened at ``opened`` ended: the pause before the next, or None.

        A healthy session (``progressed``, or open ``healthy_after`` or more)
        starts the schedule afresh and the next attempt comes at once; any
        other counts as a failed attempt.
        """
        if progressed or now - opened >= self._healthy_after:
            self._restart(now)
            return 0.0
        return self.failed(now)

    def _restart(self, now: float) -> None:
        self._delay = self._first
        if self._give_up_after is not None:
            self._deadline = now + self._give_up_after
