"""The receive deadlines of a connection: idle, and a frame that does not finish.

A peer can hold a connection open while sending almost nothing: one byte a
second of a frame that never ends (slowloris), or complete frames dripped a
byte at a time, each byte just inside the idle timeout. Bytes are therefore
not what keeps a connection alive; frames are:

* **idle**: the connection is idle from the end of its last *complete*
  frame that arrived promptly: whole, or within :data:`WHOLE_FRAME_GRACE`
  of its first byte, or at :data:`FRAME_ALLOWANCE_RATE` or faster. A trickle
  of bytes that completes no frame within ``idle_timeout`` is no activity,
  whatever its rate; nor are two-byte frames dripped a byte at a time (a
  sender writes a frame at once, so only a large one, or one that straddles
  a packet, takes any time to arrive).
* **frame**: a frame whose first bytes arrived must be complete within
  ``frame_timeout``, plus one second per :data:`FRAME_ALLOWANCE_RATE` bytes
  of the frame's known length (so a large frame on a slow link gets the time
  that its size, at a modest rate, needs).

The frame clock runs only while the receiver reads: while it has paused
reading the connection (its own backpressure), the frame cannot progress,
and the clock starts again when reading resumes. The idle clock stops too
while the receiver does not read the connection for reasons of its own (the
receiver says so with :meth:`ReceiveDeadlines.excuse`): a producer whose
bytes wait for the gateway's turn or disk is not idle. A pause the peer
causes (it does not read what it is sent, or it spent its work budget) is
not excused: the idle clock runs on.

Like the rest of :mod:`headgate.protocol` this never reads a clock: every
method takes ``now`` (seconds, any monotonic origin), and the adapter asks
:meth:`ReceiveDeadlines.expired` whenever it likes (the gateway does on
each pass of its 0.1 s housekeeping loop).
"""

from __future__ import annotations

__all__ = [
    "FRAME_ALLOWANCE_RATE",
    "KEEPALIVE_FLOOR",
    "WHOLE_FRAME_GRACE",
    "ReceiveDeadlines",
    "keepalive_interval",
]

#: Bytes per second that a frame's length buys it beyond ``frame_timeout``;
#: a frame that arrives at least this fast counts as activity.
FRAME_ALLOWANCE_RATE = 64 * 1024
#: Seconds a frame may take from its first byte to its last and still count
#: as activity, whatever its size (a frame split across packets).
WHOLE_FRAME_GRACE = 0.5


#: The shortest pause between a client's keepalive Pings, in seconds, however
#: short the gateway's idle timeout (a Ping per loop pass would be a flood).
KEEPALIVE_FLOOR = 0.05


def keepalive_interval(idle_timeout_ms: int) -> float | None:
    """Seconds between a client's Pings for the idle timeout a Welcome announced.

    A third of the timeout (PROTOCOL.md advises it), so that two Pings can be
    late or lost before the gateway's idle clock runs out; never less than
    :data:`KEEPALIVE_FLOOR`. ``None`` when the gateway has no idle timeout
    (0): no Pings are needed. The one rule every client (producer, reader,
    release client) keeps alive by.
    """
    if idle_timeout_ms <= 0:
        return None
    return max(KEEPALIVE_FLOOR, idle_timeout_ms / 3000.0)


class ReceiveDeadlines:
    """When a receiving connection has been silent, or slow in a frame, too long.

    Args:
        idle_timeout: seconds without a complete frame after which the
            connection is idle (0: never).
        frame_timeout: seconds a started frame has to finish, before its
            length's allowance (0: no limit).
        now: when the connection opened.
    """

    __slots__ = (
        "_checked_at",
        "_frame_need",
        "_frame_since",
        "_frames",
        "_last_frame_at",
        "_partial",
        "_paused",
        "_reading_since",
        "frame_timeout",
        "idle_timeout",
    )

    def __init__(self, *, idle_timeout: float, frame_timeout: float, now: float) -> None:
        if idle_timeout < 0 or frame_timeout < 0:
            raise ValueError("timeouts must not be negative")
        self.idle_timeout = idle_timeout
        self.frame_timeout = frame_timeout
        self._last_frame_at = now
        self._frames = 0
        self._partial = False
        self._paused = False
        self._reading_since = now
        # When the clock of the incomplete frame started, or None.
        self._frame_since: float | None = None
        self._frame_need = 0
        # When the receiver last said whether it excused the time before.
        self._checked_at = now

    @property
    def last_frame_at(self) -> float:
        """When the last complete frame arrived (or the connection opened)."""
        return self._last_frame_at

    def decoded(self, now: float, *, frames: int, partial: bool, need: int = 0) -> None:
        """The receiver decoded what it had.

        ``now`` is when the bytes just decoded arrived (a backlog decoded
        later is not news).

        Args:
            frames: complete frames received so far in all (a running count).
            partial: whether an incomplete frame's bytes wait for the rest.
            need: the incomplete frame's length in all, where known (else 0).
        """
        if frames != self._frames:
            if frames - self._frames > 1 or self._prompt(now):
                # (Of two or more, at least one arrived whole just now.) Never
                # back: a backlog decoded after a pause the receiver excused
                # arrived before it, and the pause was still no silence.
                self._last_frame_at = max(self._last_frame_at, now)
            self._frames = frames
            # Whatever is partial now is a new frame.
            self._frame_since = now if partial and not self._paused else None
        elif not partial:
            self._frame_since = None
        elif self._frame_since is None and not self._paused:
            self._frame_since = now
        self._partial = partial
        self._frame_need = need if partial else 0

    def _prompt(self, now: float) -> bool:
        """Whether the one frame that just completed arrived promptly enough to count."""
        if self._frame_since is None:
            return True  # it arrived whole (or while we could not time it)
        took = now - self._frame_since
        return took <= WHOLE_FRAME_GRACE or self._frame_need >= took * FRAME_ALLOWANCE_RATE

    def paused(self, now: float, paused: bool) -> None:
        """The receiver stopped (True) or started again (False) reading the connection."""
        if paused == self._paused:
            return
        self._paused = paused
        if paused:
            self._frame_since = None
            return
        self._reading_since = now
        if self._partial:
            self._frame_since = now

    def excuse(self, now: float, excused: bool) -> None:
        """Whether the time since the last call was the receiver's own pause.

        The receiver calls this now and then (the gateway on each pass of its
        housekeeping loop), with ``excused`` true when it has not been
        reading the connection for reasons of its own: that time is then not
        silence (the idle clock moves forward by it, never past ``now``).
        """
        if excused and now > self._checked_at:
            self._last_frame_at = min(now, self._last_frame_at + (now - self._checked_at))
        self._checked_at = max(self._checked_at, now)

    def reading_for(self, now: float) -> float:
        """How long the receiver has been reading without a pause (0 while paused).

        Other deadlines that wait for the peer's answer (the gateway's Plead
        deadline) use it: an answer the receiver has not read is not late.
        """
        return 0.0 if self._paused else now - self._reading_since

    def frame_deadline(self) -> float | None:
        """When the incomplete frame must be complete, or None if none is timed."""
        if self._frame_since is None or not self.frame_timeout:
            return None
        return self._frame_since + self.frame_timeout + self._frame_need / FRAME_ALLOWANCE_RATE

    def expired(self, now: float, *, idle: bool = True) -> str | None:
        """Why the connection must close now, or None.

        Args:
            idle: whether the idle timeout applies yet (the gateway applies it
                once the session opened; the handshake has its own timeout).
        """
        if idle and self.idle_timeout:
            silent = now - self._last_frame_at
            if silent >= self.idle_timeout:
                return f"no complete frame received for {silent:.1f} s"
        deadline = self.frame_deadline()
        if deadline is not None and now >= deadline:
            assert self._frame_since is not None
            size = f"of {self._frame_need} bytes " if self._frame_need else ""
            return f"a frame {size}was not finished within {now - self._frame_since:.1f} s"
        return None
