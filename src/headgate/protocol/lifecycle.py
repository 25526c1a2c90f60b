"""The life of one connection: who speaks first, how it ends, and its clocks.

Every end of a headgate connection lives through the same few states::

    gateway:  AWAITING_HELLO ──Hello──▶ OPEN ──our Goodbye──▶ CLOSING
    client:   AWAITING_WELCOME ─Welcome─▶ OPEN        │
                    │                      │           │
                    └──── the peer's Goodbye or unscoped Error, our Error
                          (fail), a timer that ran out ───────▶ CLOSED

Our Goodbye, or our Error that ends the session (:meth:`Session.fail`), is
the last frame this end sends: after it nothing more goes out
(:attr:`Lifecycle.said_last`), not an Ack, not the Pong of a Ping that
arrived meanwhile, whatever the adapter still asks to send. (The peer's
Goodbye or Error is different: this end still sends what it owes for the
frames before it.)

The table :data:`TRANSITIONS` is the whole rule, keyed by (state, input), as
h11 keys its own: a pair that is missing is the peer's protocol error
(``BAD_HELLO``: a session opens with its opener, and only once). Its
:class:`Answer` tells the session what to do with the message; the session
(:mod:`headgate.protocol.session`) feeds every message it decodes through it,
and the adapters (the gateway, the producer, the reader, the release client)
feed it nothing but bytes and time.

The clocks are here too, sans-IO as aioquic has them: time is always an
argument, :meth:`Lifecycle.get_timer` says when the next one is due and
:meth:`Lifecycle.handle_timer` says what it asks for:

* **handshake**: the opener must arrive within ``handshake_timeout`` of the
  connection's start.
* **idle**: on the gateway, :class:`~headgate.protocol.deadlines.ReceiveDeadlines`
  (no complete frame for the idle timeout, or a frame that does not finish);
  on a client, no word from the gateway for the idle timeout its Welcome
  announced (a gateway that stopped answering, a half-open connection).
* **keepalive** (clients): a Ping whenever either direction has been quiet
  for :func:`~headgate.protocol.deadlines.keepalive_interval` (a third of the
  idle timeout), so that the gateway never sees the client idle and the
  client hears from the gateway (its Pong) at least that often.

And the one rule on how often a client may Ping the gateway
(:meth:`Lifecycle.pinged`): a Ping that arrives less than
:data:`PING_GAP_SECONDS` after the peer's previous Ping, with no other frame
between, is a strike; more than :data:`PING_STRIKES` strikes in a row end the
connection with ``RESOURCE_EXHAUSTED``. A keepalive is seconds apart, and a
probe Ping follows the requests it probes, so no headgate client comes near
it; a flood of Pings, which the work budget already slows, would otherwise
hold its connections and keep its sender writing into their buffers for as
long as it likes (HTTP/2 servers cut Ping floods off the same way).
"""

from __future__ import annotations

from enum import Enum

from headgate.protocol.deadlines import ReceiveDeadlines, keepalive_interval
from headgate.protocol.errors import ErrorCode, ProtocolError

#: A Ping less than this after the peer's previous one, nothing between, is a strike.
PING_GAP_SECONDS = 0.01
#: Strikes in a row the gateway lets pass; one more ends the connection.
PING_STRIKES = 16

__all__ = [
    "PING_GAP_SECONDS",
    "PING_STRIKES",
    "TRANSITIONS",
    "Answer",
    "ConnectionState",
    "Input",
    "Lifecycle",
    "TimerAction",
]


class ConnectionState(Enum):
    """Where one end of a connection is in its life."""

    #: Gateway: the connection is up; the peer's Hello has not arrived.
    AWAITING_HELLO = "awaiting Hello"
    #: Client: our Hello is sent; the gateway's Welcome has not arrived.
    AWAITING_WELCOME = "awaiting Welcome"
    #: The opener arrived: everything else may flow.
    OPEN = "open"
    #: We said Goodbye after the session opened. What the peer sent before
    #: it read our Goodbye (Acks, FreeHandles that crossed it) still counts.
    CLOSING = "closing"
    #: Over: the peer's Goodbye or unscoped Error arrived, we failed the
    #: session, or a timer ran out. Nothing more the peer sends is decoded.
    CLOSED = "closed"


class Input(Enum):
    """What can happen to a connection: the peer's messages, our own acts, time."""

    #: The peer's Hello.
    HELLO = "Hello"
    #: The peer's Welcome.
    WELCOME = "Welcome"
    #: The peer's Goodbye.
    GOODBYE = "Goodbye"
    #: The peer's Error about the whole session (no scope).
    ERROR = "Error"
    #: The peer's FreeHandle; its crossings with ours are the handle table's
    #: rule (:mod:`headgate.protocol.handles`), once the session is open.
    FREE_HANDLE = "FreeHandle"
    #: Any other frame of the peer's: channel messages and controls, Pings,
    #: requests, a scoped Error.
    FRAME = "frame"
    #: We say Goodbye.
    SAY_GOODBYE = "our Goodbye"
    #: We refuse the peer with an Error (:meth:`Session.fail`).
    FAIL = "our Error"
    #: A timer ran out: the handshake, or the idle timeout.
    TIMEOUT = "timeout"


class Answer(Enum):
    """What the session does with an input the table accepts."""

    #: The opener: announce it (HelloReceived, WelcomeReceived).
    OPEN = "open"
    #: Handle the frame as usual.
    HANDLE = "handle"
    #: The gateway refused the session in place of Welcome: deliver its
    #: message; we send nothing more.
    REFUSED = "refused"
    #: The peer ends the session: deliver its message; decode nothing after
    #: it (what this end owes for the frames before it may still be sent).
    END = "end"
    #: Too late to matter: the session is over. Drop it.
    MOOT = "moot"
    #: One of our own acts, or a timer: nothing to deliver.
    NOTHING = "nothing"


_S = ConnectionState
_I = Input
_A = Answer

_PEER_INPUTS = (_I.HELLO, _I.WELCOME, _I.GOODBYE, _I.ERROR, _I.FREE_HANDLE, _I.FRAME)


def _table() -> dict[tuple[ConnectionState, Input], tuple[ConnectionState, Answer]]:
    table: dict[tuple[ConnectionState, Input], tuple[ConnectionState, Answer]] = {
        # A gateway hears Hello first and nothing else.
        (_S.AWAITING_HELLO, _I.HELLO): (_S.OPEN, _A.OPEN),
        # A client hears Welcome, or the gateway's refusal in its place.
        (_S.AWAITING_WELCOME, _I.WELCOME): (_S.OPEN, _A.OPEN),
        (_S.AWAITING_WELCOME, _I.GOODBYE): (_S.CLOSED, _A.REFUSED),
        (_S.AWAITING_WELCOME, _I.ERROR): (_S.CLOSED, _A.REFUSED),
    }
    for state in (_S.OPEN, _S.CLOSING):
        # Hello and Welcome after the session opened are missing: an error.
        table[state, _I.FREE_HANDLE] = (state, _A.HANDLE)
        table[state, _I.FRAME] = (state, _A.HANDLE)
        table[state, _I.GOODBYE] = (_S.CLOSED, _A.END)
        table[state, _I.ERROR] = (_S.CLOSED, _A.END)
    for state in (_S.AWAITING_HELLO, _S.AWAITING_WELCOME, _S.OPEN, _S.CLOSING):
        table[state, _I.FAIL] = (_S.CLOSED, _A.NOTHING)
        table[state, _I.TIMEOUT] = (_S.CLOSED, _A.NOTHING)
        # A Goodbye before the session opened ends it at once: nothing of
        # the peer's can be in flight that would still count.
        table[state, _I.SAY_GOODBYE] = (
            _S.CLOSING if state in (_S.OPEN, _S.CLOSING) else _S.CLOSED,
            _A.NOTHING,
        )
    for input_ in Input:
        table[_S.CLOSED, input_] = (_S.CLOSED, _A.MOOT if input_ in _PEER_INPUTS else _A.NOTHING)
    return table


#: (state, input) -> (next state, answer). A missing pair is a protocol error.
TRANSITIONS = _table()


class TimerAction(Enum):
    """What a timer that came due asks of the session."""

    #: Send a Ping (a client's keepalive).
    PING = "ping"
    #: The connection is over (:attr:`Lifecycle.expired` says why).
    EXPIRE = "expire"


class Lifecycle:
    """The state and the clocks of one end of one connection.

    Args:
        opener: which message opens this end's session: ``Input.HELLO`` for
            the gateway, ``Input.WELCOME`` for a client.
        now: when the connection started (seconds, any monotonic origin).
        handshake_timeout: seconds the opener may take (0: no limit).
        deadlines: the gateway's receive deadlines (its idle rule), or None
            for a client, whose idle rule is the Welcome's idle timeout.
    """

    __slots__ = (
        "_handshake_deadline",
        "_heard_at",
        "_idle_timeout",
        "_interval",
        "_peer_ping_at",
        "_peer_ping_frame",
        "_ping_strikes",
        "_pinged_at",
        "_sent_at",
        "deadlines",
        "ended",
        "expired",
        "opened",
        "said_last",
        "state",
    )

    def __init__(
        self,
        opener: Input,
        *,
        now: float,
        handshake_timeout: float = 0.0,
        deadlines: ReceiveDeadlines | None = None,
    ) -> None:
        if opener is Input.HELLO:
            self.state = ConnectionState.AWAITING_HELLO
        elif opener is Input.WELCOME:
            self.state = ConnectionState.AWAITING_WELCOME
        else:
            raise ValueError(f"a session opens with Hello or Welcome, not {opener.value}")
        if handshake_timeout < 0:
            raise ValueError("the handshake timeout must not be negative")
        #: Whether the opener arrived (it stays true once the session ends).
        self.opened = False
        #: Whether the state is CLOSED (a plain field: the session asks per frame).
        self.ended = False
        #: Whether we sent our last frame (our Goodbye, or our Error that
        #: ended the session): nothing more may go out (a plain field: the
        #: session asks per frame it sends).
        self.said_last = False
        #: Why a timer ended the connection, or None.
        self.expired: ProtocolError | None = None
        self.deadlines = deadlines
        self._handshake_deadline = now + handshake_timeout if handshake_timeout else None
        self._heard_at = now
        self._sent_at = now
        self._pinged_at = now
        # The peer's last Ping: its frame number, when it arrived, and the
        # strikes in a row it ended (see pinged).
        self._peer_ping_frame = -2
        self._peer_ping_at = now
        self._ping_strikes = 0
        # A client's idle timeout and Ping interval, from the Welcome.
        self._idle_timeout = 0.0
        self._interval: float | None = None

    # -- the table ---------------------------------------------------------------

    def receive(self, input_: Input, *, name: str = "") -> Answer:
        """Apply ``input_``; return what to do with it.

        Args:
            name: the frame's or message's name, for the error's text.

        Raises:
            ProtocolError: ``BAD_HELLO``: the peer's input has no place in
                the current state (the state does not change).
        """
        found = TRANSITIONS.get((self.state, input_))
        if found is None:
            name = name or input_.value
            if self.state is ConnectionState.AWAITING_HELLO:
                text = f"the session must open with Hello, got {name}"
            elif self.state is ConnectionState.AWAITING_WELCOME:
                text = f"the session must open with Welcome, got {name}"
            else:
                text = f"{name} after the session opened"
            raise ProtocolError(text, code=ErrorCode.BAD_HELLO)
        self.state, answer = found
        if answer is Answer.OPEN:
            self.opened = True
        elif input_ is Input.SAY_GOODBYE or input_ is Input.FAIL:
            self.said_last = True
        self.ended = self.state is ConnectionState.CLOSED
        return answer

    def would_open(self, input_: Input) -> bool:
        """Whether ``input_`` is the opener this state waits for (its version is checked first)."""
        found = TRANSITIONS.get((self.state, input_))
        return found is not None and found[1] is Answer.OPEN

    def welcomed(self, idle_timeout_ms: int, now: float) -> None:
        """A client's Welcome arrived: its idle timeout sets the client's clocks."""
        self._idle_timeout = max(0, idle_timeout_ms) / 1000.0
        self._interval = keepalive_interval(idle_timeout_ms)
        self._heard_at = max(self._heard_at, now)
        self._pinged_at = now

    # -- the clocks --------------------------------------------------------------

    def stale(self, now: float) -> bool:
        """Whether a client's open session, whose clocks stood still, may be closed by now.

        A client that runs no timers between its calls (a ``SyncReader``)
        sent no Pings meanwhile, so the gateway may have closed the
        connection as idle: once half the idle timeout has passed since it
        last sent, it is stale, and a new connection is safer. (A session
        that ended is not stale: its end is what the next call reports.)
        """
        if not self.opened or self.ended or not self._idle_timeout:
            return False
        return now - self._sent_at >= self._idle_timeout / 2

    def pinged(self, now: float, frame: int) -> ProtocolError | None:
        """The peer's Ping, its ``frame``-th frame, arrived at ``now``; an error if too often.

        Only the gateway enforces it (a lifecycle with receive deadlines): a
        client is nobody else's resource. The strikes start again with any
        other frame between two Pings, or a gap of :data:`PING_GAP_SECONDS`.
        """
        if self.deadlines is None:
            return None
        if frame == self._peer_ping_frame + 1 and now - self._peer_ping_at < PING_GAP_SECONDS:
            self._ping_strikes += 1
        else:
            self._ping_strikes = 0
        self._peer_ping_frame = frame
        self._peer_ping_at = now
        if self._ping_strikes > PING_STRIKES:
            return ProtocolError(
                f"Pings too often: {self._ping_strikes + 1} in a row, each less than "
                f"{PING_GAP_SECONDS * 1000:g} ms after the one before with no other frame "
                f"between (at most {PING_STRIKES + 1}; a keepalive Ping every few seconds "
                "is plenty)",
                code=ErrorCode.RESOURCE_EXHAUSTED,
            )
        return None

    def heard(self, now: float) -> None:
        """Bytes from the peer arrived at ``now`` (a client's sign of life)."""
        self._heard_at = max(self._heard_at, now)

    def sent(self, now: float) -> None:
        """Bytes went to the peer at ``now``."""
        self._sent_at = max(self._sent_at, now)

    def get_timer(self) -> float | None:
        """When :meth:`handle_timer` has something to do next, or None.

        The gateway's receive deadlines move with what it reads and excuses,
        so it asks :meth:`handle_timer` on a regular pass instead.
        """
        state = self.state
        if state is ConnectionState.CLOSED:
            return None
        if not self.opened:
            return self._handshake_deadline
        if self.deadlines is not None or not self._idle_timeout:
            return None
        due = self._heard_at + self._idle_timeout
        if state is ConnectionState.OPEN and self._interval is not None:
            due = min(due, self._ping_due(self._interval))
        return due

    def _ping_due(self, interval: float) -> float:
        # Whichever direction has been quiet the longer, but never two Pings
        # within one interval (no answer yet is what the idle timer is for).
        quiet_since = min(self._sent_at, self._heard_at)
        return max(quiet_since, self._pinged_at) + interval

    def handle_timer(self, now: float) -> TimerAction | None:
        """What the clocks ask for at ``now``: a Ping, the end, or nothing.

        On EXPIRE the state is CLOSED and :attr:`expired` holds the
        ``TIMEOUT`` error (the gateway sends it to the peer; a client, whose
        gateway is silent, just closes).
        """
        state = self.state
        if state is ConnectionState.CLOSED:
            return None
        reason: str | None = None
        if not self.opened:
            deadline = self._handshake_deadline
            if deadline is not None and now >= deadline:
                if state is ConnectionState.AWAITING_HELLO:
                    reason = "no Hello in time"
                else:
                    reason = "no Welcome from the gateway in time"
        if reason is None and self.deadlines is not None:
            # The idle clock starts with the session; before, the handshake's runs.
            reason = self.deadlines.expired(now, idle=self.opened)
        elif reason is None and self.opened and self._idle_timeout:
            silent = now - self._heard_at
            if silent >= self._idle_timeout:
                reason = f"no word from the gateway for {self._idle_timeout:g} s"
        if reason is not None:
            self.expired = ProtocolError(reason, code=ErrorCode.TIMEOUT)
            self.receive(Input.TIMEOUT)
            return TimerAction.EXPIRE
        interval = self._interval
        if (
            state is ConnectionState.OPEN
            and self.deadlines is None
            and interval is not None
            and now >= self._ping_due(interval)
        ):
            self._pinged_at = now
            self._sent_at = max(self._sent_at, now)
            return TimerAction.PING
        return None
