"""Which streams a starting gateway still has to recover, and in what order.

A gateway listens before it recovers its streams (issue 15: restart time
must not grow with what is stored). The streams found on disk at start are
*recovering* until their log is reopened and their dedup state rebuilt,
which :class:`~headgate.gateway.server.Gateway` does off the event loop, a
few streams at a time, each in one worker thread. Meanwhile:

* a writer's bind of a recovering stream is refused with ``RECOVERING``,
  scoped to the stream (try again soon); the producer binds again after a
  pause from its backoff;
* reader requests (Fetch, Subscribe, ListStreams) and Releases that need a
  recovering stream wait in the gateway, in order, and are served once it is
  recovered;
* a stream that a peer asks for moves to the front of the queue, so the
  streams in use come back first.

A stream whose recovery fails is *failed*: its binds are refused with
``STORAGE_UNAVAILABLE`` and the gateway reports the error as a start that
failed (``headgate serve`` exits with status 1, as before it listened first).

Only the bookkeeping lives here, with no thread and no event loop: the
gateway asks :meth:`StreamRecovery.next_name`, opens that stream off the
loop, and reports :meth:`StreamRecovery.recovered` or
:meth:`StreamRecovery.failed` on the loop. So a stream's log is never opened
twice, and nothing appends to a stream before it is recovered.
"""

from __future__ import annotations

from collections.abc import Iterable

from headgate.protocol.errors import ErrorCode, ProtocolError

__all__ = ["StreamRecovery"]


class StreamRecovery:
    """The recovery queue of one gateway start: pending, in progress, failed."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        # Insertion order is recovery order; a wanted stream moves to the front.
        self._pending: dict[str, None] = dict.fromkeys(names)
        self._wanted: dict[str, None] = {}
        #: The streams being opened now.
        self.in_progress: set[str] = set()
        #: Streams whose recovery failed, with the error.
        self.failures: dict[str, Exception] = {}
        #: Streams recovered so far.
        self.done = 0

    @property
    def total(self) -> int:
        """Streams to recover at this start, recovered or not."""
        return self.done + len(self.failures) + self.count

    @property
    def count(self) -> int:
        """Streams not recovered yet (pending or in progress)."""
        return len(self._pending) + len(self.in_progress)

    @property
    def finished(self) -> bool:
        """Every stream found at start is recovered or failed."""
        return self.count == 0

    def recovering(self, name: str) -> bool:
        """Whether ``name`` is a stream on disk that is not recovered yet."""
        return name in self.in_progress or name in self._pending

    def refusal(self, name: str) -> ProtocolError | None:
        """The ``RECOVERING`` refusal of a request that needs ``name`` now, or None.

        The one text and code of "still recovering, try again soon", for a
        writer's bind (scoped to its stream) and a consumer request (which
        ends the connection) alike. Being asked for, the stream moves to the
        front of the queue.
        """
        if not self.recovering(name):
            return None
        self.want(name)
        return ProtocolError(
            f"stream {name!r} is still being recovered after the gateway's restart; try again soon",
            code=ErrorCode.RECOVERING,
        )

    def names(self) -> list[str]:
        """The streams not recovered yet."""
        return [*sorted(self.in_progress), *self._pending]

    def failure(self, name: str) -> Exception | None:
        """Why ``name`` could not be recovered, or None."""
        return self.failures.get(name)

    def want(self, name: str) -> None:
        """A peer asked for ``name``: recover it before the streams nobody asked for."""
        if name in self._pending:
            self._wanted[name] = None

    def next_name(self) -> str | None:
        """Take the next stream to recover (the first wanted one, else the first on disk)."""
        if self._wanted:
            name = next(iter(self._wanted))
            del self._wanted[name]
        elif self._pending:
            name = next(iter(self._pending))
        else:
            return None
        del self._pending[name]
        self.in_progress.add(name)
        return name

    def recovered(self, name: str) -> None:
        """``name`` is open and serving."""
        self.in_progress.remove(name)
        self.done += 1

    def failed(self, name: str, error: Exception) -> None:
        """``name`` could not be recovered."""
        self.in_progress.remove(name)
        self.failures[name] = error

    def abandon(self) -> None:
        """The gateway stops: nothing more will be recovered."""
        self._pending.clear()
        self._wanted.clear()
