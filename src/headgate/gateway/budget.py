"""What each request costs the gateway, and the budgets that pay for it.

Guarantees bound the data a peer sends, but not the rest of what it can ask
for: a Ping, an Absolve, a ListStreams, a Fetch page, a Subscribe, a bind, a
Hello or a TLS handshake each cost the gateway's one event loop some time,
and a peer can ask for hundreds of thousands a second. So every such piece
of work is charged, as the broker seed's accounts charge fan-out, to the
peer that caused it (:class:`Cost` names the price of each kind), and the
charges are paid from a :class:`WorkBudget`: a token bucket of gateway time.

Budgets are shared per *cause*, not per connection (:class:`PeerShares`):
all the connections of one token (by the Rights' name) pay from one budget,
so sixty connections get what one gets. A connection pays from its peer
address's budget until its Hello is accepted, and for good when there is no
tokens file. A spent budget pauses reading the connection (its turns are
held), and a reader's serving waits: the peer is slowed, never buffered for,
and everyone else keeps their time.

Costs are in *units* of about one microsecond of the gateway's work, as
measured on a 2-core development machine: decoding and acting on one small
control frame is a few units, a Ping and its Pong about eleven, listing
one stream about seven. They need only be right relative to each other and
to ``work_budget_ms``.

Data batches within guarantees cost nothing here: credit already bounds
them, and a producer must never be slowed by its own data. A batch beyond
its guarantees (dropped) is charged, as is every other frame, empty ones
included (a one-byte SendChannel with no payload costs no credit at all).

Everything here takes time as an argument, so it is tested without a clock.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from headgate.gateway.turns import TurnShare

__all__ = [
    "Cost",
    "HandshakeBudgets",
    "LogLimiter",
    "PeerShare",
    "PeerShares",
    "WorkBudget",
    "address_key",
    "token_key",
]

#: Units a budget holds per millisecond of ``work_budget_ms``.
UNITS_PER_MS = 1000.0
#: What a short slice of received bytes may cost (the gateway hands a
#: connection low on budget slices of ``turns.MIN_SLICE`` bytes, at the
#: dearest bytes' price).
SHORT_SLICE_UNITS = 1024.0


class Cost:
    """The price of each kind of work a peer can ask for, in units (about 1 µs)."""

    #: Any frame decoded that is not a batch within guarantees (a control
    #: frame, a global message, an empty or refused channel message).
    FRAME = 3.0
    #: A Ping: the Pong it is answered with (on top of FRAME).
    PING = 8.0
    #: Any frame that needs no credit (a global message or a control frame).
    #: The session answers some on its own (a Ping with a Pong, a Plead with
    #: an Absolve), unseen by the gateway, so each is priced as the dearest
    #: of those: a Ping and its Pong.
    CONTROL = FRAME + PING
    #: An Absolve received, or a Plead answered (the Absolve sent back).
    ABSOLVE = 4.0
    PLEAD = 4.0
    #: A batch dropped beyond its guarantees (plus PER_KIB of its bytes).
    DROPPED = 4.0
    #: Bytes moved for the peer, per KiB (dropped batches, fetch pages, deliveries).
    PER_KIB = 0.25
    #: A ListStreams, plus LIST_ENTRY per stream it lists.
    LIST_STREAMS = 10.0
    LIST_ENTRY = 7.0
    #: A Fetch request, plus FETCH_FRAME per frame served (and PER_KIB).
    FETCH = 20.0
    FETCH_FRAME = 6.0
    #: Each frame read from the log to serve a fetch or a catch-up, sent or not.
    READ_FRAME = 1.0
    #: A Subscribe, plus DELIVERY per batch delivered to it (and PER_KIB).
    SUBSCRIBE = 40.0
    DELIVERY = 6.0
    #: A bind, accepted or refused (a refusal also costs a log line).
    BIND = 20.0
    #: A Hello: the token's hash, the Welcome.
    HELLO = 50.0
    #: A new producer id's claim: a line appended to the owners' table on the
    #: event loop, and an fsync of it in the group commit's thread
    #: (``headgate.gateway.identity``).
    CLAIM = 1000.0
    #: A DeclareConsumer that creates a consumer, a reset or a delete: the
    #: stream's consumers file rewritten and fsynced on the event loop
    #: (``headgate.gateway.consumers``; the answer waits for it).
    CONSUMER_WRITE = 1000.0
    #: A Release that moves a consumer: the commit in memory, plus its share
    #: of the loop's work for a save (the file's records taken, a thread
    #: woken, the log freed at its end). The write and fsync run in a thread
    #: and coalesce every Release that arrives meanwhile, so the loop's part
    #: of a save is small (the book's work measured 3.4 µs with 4 consumers;
    #: the task and thread hand-off add some tens of µs), shared by the
    #: Releases it stores; the dearest case, one Release per save, is
    #: charged here.
    CONSUMER_RELEASE = 50.0
    #: A TLS handshake (public-key operations; charged once it is done).
    TLS_HANDSHAKE = 2000.0

    #: About the most one received byte can cost (an empty frame, a refused
    #: bind, a Subscribe): a connection whose budget runs low is handed no
    #: more bytes at once than its balance pays for at this price.
    DEAREST_BYTE = 4.0

    @staticmethod
    def of_bytes(count: int) -> float:
        """What moving ``count`` bytes costs."""
        return count * (Cost.PER_KIB / 1024)


class WorkBudget:
    """A token bucket of gateway work: ``rate`` units a second, at most ``burst`` held.

    It may go into debt (a charge is never refused: the work was already
    done); the debt is what the payer waits for.
    """

    __slots__ = ("_burst", "_last", "_rate", "balance")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError("rate and burst must be positive")
        self._rate = rate
        self._burst = burst
        #: Units available now (negative: in debt), as of the last call.
        self.balance = burst
        self._last = now

    @property
    def rate(self) -> float:
        return self._rate

    def _refill(self, now: float) -> None:
        if now > self._last:
            self.balance = min(self._burst, self.balance + (now - self._last) * self._rate)
            self._last = now

    def charge(self, units: float, now: float) -> float:
        """Pay ``units``; return how long the payer should wait (0: not at all)."""
        self._refill(now)
        self.balance -= units
        if self.balance >= 0:
            return 0.0
        return -self.balance / self._rate

    def wait(self, now: float) -> float:
        """Seconds until the budget is out of debt (0: it is not in debt)."""
        return self.charge(0.0, now)

    def full(self, now: float) -> bool:
        """Whether the budget has refilled to its burst."""
        self._refill(now)
        return self.balance >= self._burst


def token_key(name: str) -> str:
    """The share of the peers of the token called ``name``."""
    return "token:" + name


def address_key(host: str) -> str:
    """The share of the peers at ``host`` (an IP address, or ``unix``), whatever their port."""
    return "address:" + host


@dataclass(eq=False)
class PeerShare:
    """What the connections of one cause (a token, or an address) share."""

    #: ``token:<name>`` or ``address:<host>``.
    key: str
    #: The work they may cause.
    budget: WorkBudget
    #: Connections that pay from it now.
    connections: int = 0
    #: Live subscriptions they hold together.
    subscriptions: int = 0
    #: Units charged since the share was opened (for statistics and tests).
    charged: float = 0.0
    #: The turn its connections take together in a pass of the loop.
    turn: TurnShare = field(default_factory=TurnShare)

    def charge(self, units: float, now: float) -> float:
        """Pay ``units`` from the budget; the seconds to wait (0: none). See :meth:`wait`."""
        self.charged += units
        return self._spread(self.budget.charge(units, now))

    def wait(self, now: float) -> float:
        """Seconds a connection of this share should wait before it costs more (0: none).

        Not only until the debt is paid: when it is, each of the share's
        connections that waited would take a slice at once, sixty wake-ups
        for one budget's worth of work. So each waits also for the time the
        budget takes to pay one short slice for every other connection of
        the share, and the wake-ups per second stay the same however many
        connections a token opens.
        """
        return self._spread(self.budget.wait(now))

    def _spread(self, wait: float) -> float:
        if wait <= 0:
            return 0.0
        return wait + (self.connections - 1) * SHORT_SLICE_UNITS / self.budget.rate


class PeerShares:
    """Every share, by key, counted by the connections that pay from it.

    A share outlives its last connection until its budget has refilled: a
    peer that spends its burst, closes and reconnects must not find a full
    budget waiting (a plain TCP connection costs it almost nothing, so that
    would make every budget a burst per reconnection). Shares left by all
    their connections are forgotten once refilled (:meth:`prune`, called on
    each join and leave and by the gateway's housekeeping loop), and at most
    ``max_idle`` of them are kept, the oldest forgotten first; so the
    registry is bounded by the connections plus ``max_idle``.

    Args:
        rate: units a second each share earns.
        burst: the most units a share holds (and starts with).
        max_idle: the most shares kept with no connection.
    """

    def __init__(self, rate: float, burst: float, *, max_idle: int = 4096) -> None:
        self.rate = rate
        self.burst = burst
        self._max_idle = max_idle
        self._shares: dict[str, PeerShare] = {}
        # Keys of the shares without connections, oldest first.
        self._idle: dict[str, None] = {}

    def join(self, key: str, now: float) -> PeerShare:
        """One more connection pays from ``key``'s share (opened if needed)."""
        self.prune(now)
        share = self._shares.get(key)
        if share is None:
            share = self._shares[key] = PeerShare(key, WorkBudget(self.rate, self.burst, now))
        self._idle.pop(key, None)
        share.connections += 1
        return share

    def leave(self, share: PeerShare, now: float) -> None:
        """A connection stops paying from ``share``; the last one leaves it to refill."""
        share.connections -= 1
        if share.connections <= 0 and self._shares.get(share.key) is share:
            self._idle[share.key] = None
        self.prune(now)

    def prune(self, now: float) -> None:
        """Forget the shares without connections whose budget has refilled."""
        while len(self._idle) > self._max_idle:
            self._forget(next(iter(self._idle)))
        for key in list(self._idle)[:8]:  # the oldest few: amortised, never a scan
            if self._shares[key].budget.full(now):
                self._forget(key)

    def _forget(self, key: str) -> None:
        del self._idle[key]
        del self._shares[key]

    def get(self, key: str) -> PeerShare | None:
        return self._shares.get(key)

    def __len__(self) -> int:
        return len(self._shares)


class HandshakeBudgets:
    """How many TLS handshakes each peer address may start: ``rate`` a second.

    Checked when a connection is accepted, before its handshake starts: a
    handshake is the dearest thing a peer can ask for before it has said
    anything, so a flood of them is cut off at the door. An address's
    bucket outlives its connections (a flood opens and closes them), and is
    forgotten once it has refilled; at most ``max_addresses`` are tracked,
    beyond which new addresses share one bucket.

    A connection refused for the rate is not closed at once but *held*
    (:meth:`hold`): unread, until its address could have had a handshake,
    then closed. Refused at once, a flood retries at once: each try costs
    the flooder a key share and a ClientHello, and on a machine it shares
    with others that CPU is theirs (a flood of 8 connections at a time spent
    half a core on tries refused at the door). Held, each in its place in
    the address's queue, it tries about as often as it would be let in. At
    most ``max_held`` are held at a time (their sockets are the cost);
    beyond, refused at once.

    Args:
        rate: handshakes a second per address, in bursts of as many.
        max_addresses: the most buckets held.
        max_hold: the longest a refused connection is held (seconds).
        max_held: the most refused connections held at once.
    """

    OVERFLOW = "address:(others)"

    def __init__(
        self,
        rate: float,
        *,
        max_addresses: int = 4096,
        max_hold: float = 1.0,
        max_held: int = 256,
    ) -> None:
        self._rate = rate
        self._burst = max(1.0, rate)
        self._max = max_addresses
        self._max_hold = max_hold
        self._max_held = max_held
        self._buckets: dict[str, WorkBudget] = {}
        #: Refused connections held now, by key.
        self._held: dict[str, int] = {}
        #: Refused connections held now, in all.
        self.held = 0

    def _bucket(self, key: str, now: float) -> tuple[str, WorkBudget]:
        """``key``'s bucket (opened if needed), and the key it is kept under."""
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= self._max:
                self.forget_refilled(now)
            if len(self._buckets) >= self._max:
                key = self.OVERFLOW
                bucket = self._buckets.get(key)
            if bucket is None:
                bucket = self._buckets[key] = WorkBudget(self._rate, self._burst, now)
        return key, bucket

    def admit(self, key: str, now: float) -> bool:
        """Whether a handshake from ``key`` may start now (it is counted if so)."""
        _, bucket = self._bucket(key, now)
        if bucket.wait(now) > 0 or bucket.balance < 1:
            return False
        bucket.charge(1.0, now)
        return True

    def hold(self, key: str, now: float) -> tuple[str, float]:
        """How long to hold a connection from ``key`` that was refused, before closing it.

        Returns the key to :meth:`release` it under, and the seconds: until
        ``key``'s bucket has a whole handshake again for it and for each
        connection from ``key`` held already (they are let go one by one, as
        the rate allows them to try again), at most ``max_hold``;
        0 (close at once) when it has one now (refused for another reason),
        or when ``max_held`` connections are held already. A held connection
        must be released.
        """
        key, bucket = self._bucket(key, now)
        bucket.wait(now)  # (refills it to now)
        queued = self._held.get(key, 0)
        seconds = min(self._max_hold, max(0.0, (queued + 1.0 - bucket.balance) / self._rate))
        if seconds <= 0 or self.held >= self._max_held:
            return key, 0.0
        self._held[key] = self._held.get(key, 0) + 1
        self.held += 1
        return key, seconds

    def release(self, key: str) -> None:
        """A connection held under ``key`` (:meth:`hold`) is closed."""
        left = self._held.get(key, 0) - 1
        if left > 0:
            self._held[key] = left
        else:
            self._held.pop(key, None)
        self.held = max(0, self.held - 1)

    def forget_refilled(self, now: float) -> None:
        """Drop the buckets that are full again (their addresses are quiet)."""
        for key in [
            k
            for k, b in self._buckets.items()
            if b.wait(now) == 0 and b.balance >= self._burst and k not in self._held
        ]:
            del self._buckets[key]

    def __len__(self) -> int:
        return len(self._buckets)


class LogLimiter:
    """At most ``lines`` log lines per ``interval`` seconds for one kind of event.

    Logging costs the event loop too, so a flood of refusals must not become
    a flood of lines: beyond the allowance they are counted, and the next
    line that gets through says how many were left out.
    """

    __slots__ = ("_interval", "_lines", "_logger", "_suppressed", "_used", "_window")

    def __init__(self, logger: logging.Logger, *, lines: int = 10, interval: float = 1.0) -> None:
        self._logger = logger
        self._lines = lines
        self._interval = interval
        self._window = -float("inf")
        self._used = 0
        self._suppressed = 0

    def warning(self, now: float, message: str, *args: object) -> bool:
        """Log ``message % args`` as a warning unless over the allowance; whether it was."""
        if now - self._window >= self._interval:
            self._window = now
            self._used = 0
        if self._used >= self._lines:
            self._suppressed += 1
            return False
        self._used += 1
        if self._suppressed:
            message += " (%d more like this not logged)"
            args = (*args, self._suppressed)
            self._suppressed = 0
        self._logger.warning(message, *args)
        return True

    @property
    def suppressed(self) -> int:
        """Lines left out and not yet reported."""
        return self._suppressed
