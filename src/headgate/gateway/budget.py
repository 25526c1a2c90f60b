"""A token bucket for what a peer can make the gateway do without credit.

Guarantees bound the data a peer sends, but not its control frames: a
Ping, a FreeHandle, an Absolve or a message sent where nothing is
guaranteed costs the gateway a few microseconds each, and a peer can send
hundreds of thousands a second. Each connection therefore has a budget of
such frames (control frames, plus data messages that were dropped). Spent,
the connection is not read from until the budget has refilled: the peer is
slowed down, never buffered for, and the other connections keep their time.
"""

from __future__ import annotations

__all__ = ["FrameBudget"]


class FrameBudget:
    """``rate`` frames per second, with bursts of up to ``burst``.

    Args:
        rate: frames per second refilled.
        burst: the most frames the bucket holds (and starts with).
    """

    __slots__ = ("_burst", "_last", "_rate", "_tokens")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError("rate and burst must be positive")
        self._rate = rate
        self._burst = burst
        self._tokens = burst
        self._last = now

    def charge(self, frames: int, now: float) -> float:
        """Spend ``frames``; return how long to wait before reading on (0: at once)."""
        self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
        self._last = now
        self._tokens -= frames
        if self._tokens >= 0:
            return 0.0
        return -self._tokens / self._rate
