"""One logical channel, seen from each end: guarantees, absolution, optimistic sending.

A producer pushes record batches on many streams over one connection. If the
gateway had a single receive buffer, one slow stream would stall all others.
So every stream is an LCMUX *logical channel* with its own buffer at the
receiving end (the *server*), and the sending end (the *client*) sends only
what the server has promised to buffer: its *guarantees*, counted in bytes.

:class:`ServerChannel` keeps the books of the buffer; :class:`ClientChannel`
keeps the books of the guarantees. Both are sans-IO: methods take frame
values or local decisions and return the frames to send. Sizes are explicit
integers chosen by the caller (the gateway charges a batch its log-frame
cost), so a channel is generic over an opaque message type ``T``.

The server's books, in bytes::

    capacity = buffered + free
    free     = issuable + client guarantees      (as the server knows them)

``issuable`` is free space not yet promised. The client's guarantees, as the
server knows them, are ``capacity - buffered - issuable``; they go negative
while the client owes bytes it sent optimistically ("optimistic debt").

Control frames (IssueGuarantees, Plead, Absolve, AnnounceDropping, Apologise,
LimitSending, LimitReceiving) belong to no channel: they never consume
guarantees or buffer space. The seed: "if buffer management required buffer
capacity in the first place, things could quickly go wrong."

Why the client can always tell which of its messages were dropped
-----------------------------------------------------------------
The client queues every message sent optimistically, with the number of its
bytes that no guarantee covered yet, and every later message while the queue
is non-empty. Incoming guarantees pay those bytes in send order. Think of the
guarantees as numbered tokens and of the bytes sent as consuming them in
order; token ``k`` pays byte ``k``.

1. Tokens the client receives before an AnnounceDropping never pay a dropped
   message in full. The server drops a message of size ``s`` when
   ``s > free = issuable + g`` (``g`` the server's view of the client's
   guarantees), or when ``s`` exceeds its receive bound ``r``, and then we keep
   ``issuable <= r - g``. Paying the dropped message in full would take
   ``s - g`` more tokens, but the server issues at most ``issuable < s - g``
   of them before announcing, and announces in the same step as the first
   drop. Tokens issued later travel behind the announcement.
2. Every buffered message is paid before the announcement arrives: in the
   same step as the drop, the server issues at least its optimistic debt
   ``max(0, -g)``, before AnnounceDropping.
3. The first dropped message had bytes no guarantee covered (a covered
   message always fits: ``free = issuable + g >= g >= s``), so it was queued,
   and every message sent after it was queued too. The server drops all of
   them until the apology, which the client sends only after the announcement.

So when AnnounceDropping arrives, the queue holds exactly the dropped messages,
in send order.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar

from headgate.protocol.errors import ErrorCode, FlowControlError
from headgate.protocol.frames import (
    Absolve,
    AnnounceDropping,
    Apologise,
    IssueGuarantees,
    LimitReceiving,
    LimitSending,
    Plead,
)

T = TypeVar("T")

__all__ = [
    "AnnounceIssuance",
    "ClientChannel",
    "ClientChannelStatistics",
    "DropReason",
    "MessageBuffered",
    "MessageDropped",
    "Reception",
    "Sent",
    "ServerChannel",
    "ServerChannelStatistics",
]


_U64_MAX = (1 << 64) - 1


def _check_size(name: str, value: int) -> None:
    # Frames carry unsigned 64-bit integers (a received one is in range by
    # decoding), so a value outside them is a local bug: refused before any
    # book changes, or the frame would fail to encode after they had.
    if value < 0:
        raise ValueError(f"{name} must not be negative, got {value}")
    if value > _U64_MAX:
        raise ValueError(f"{name} must fit in 64 bits, got {value}")


def _tightens(bound: int, current: int | None) -> bool:
    """LCMUX's rule for a new LimitSending or LimitReceiving: it "strictly tightens".

    ``current`` is what the previous bound leaves now (None: no bound yet).
    """
    return current is None or bound < current


def _tightest(*bounds: int | None) -> int | None:
    present = [bound for bound in bounds if bound is not None]
    return min(present) if present else None


# --- outcomes ----------------------------------------------------------------


class AnnounceIssuance(Enum):
    """How many guarantees a server issues in the step that starts dropping.

    The seed requires at least the optimistic debt of what was buffered ("the
    server must issue guarantees for all the optimistic message bytes that it
    did manage to buffer, before informing the client") and allows more ("a
    realistic server would have issued all three issuable guarantees").
    """

    #: Issue everything issuable: the client learns of free space at once.
    ALL = "all"
    #: Issue exactly the optimistic debt, ``max(0, -client_guarantees)``.
    DEBT = "debt"


class DropReason(Enum):
    """Why a server dropped a channel message."""

    #: The server was already dropping, and stays so until an apology.
    DROPPING = "dropping"
    #: The message was larger than the free buffer space.
    NO_SPACE = "no_space"
    #: The message was larger than what the server's LimitReceiving still allows.
    RECEIVE_LIMIT = "receive_limit"


@dataclass(frozen=True, slots=True, kw_only=True)
class MessageBuffered:
    """The server moved a channel message into its buffer."""

    #: The size charged for the message.
    size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class MessageDropped:
    """The server dropped a channel message, whole."""

    #: The size of the dropped message.
    size: int
    #: Why it was dropped.
    reason: DropReason
    #: Frames to send now, in this order. Empty unless this drop started the
    #: dropping; then an optional IssueGuarantees, an optional LimitReceiving
    #: (where the receive bound stands, if bytes counted against it since the
    #: last one), and an AnnounceDropping.
    frames: tuple[IssueGuarantees | LimitReceiving | AnnounceDropping, ...]


Reception = MessageBuffered | MessageDropped


@dataclass(frozen=True, slots=True, kw_only=True)
class Sent:
    """What the client knows about a message it just sent."""

    #: The size charged for the message.
    size: int
    #: How far this message pushed the client into optimistic debt.
    optimistic_bytes: int
    #: True if the message is certain to be buffered (it was covered by
    #: guarantees and nothing before it is in doubt); otherwise it is queued
    #: until guarantees confirm it or AnnounceDropping reports it dropped.
    confirmed: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerChannelStatistics:
    """A snapshot of a server channel's books, for metrics."""

    #: Total buffer size in bytes.
    capacity: int
    #: Bytes of buffered, unprocessed messages.
    buffered_bytes: int
    #: Number of buffered, unprocessed messages.
    buffered_messages: int
    #: Free bytes for which no guarantees were issued yet.
    issuable: int
    #: The client's guarantees as the server knows them (negative in debt).
    client_guarantees: int
    #: Whether the server drops every message until an apology.
    dropping: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientChannelStatistics:
    """A snapshot of a client channel's books, for metrics."""

    #: Guarantees available to the client (negative while in optimistic debt).
    guarantees: int
    #: Messages sent but not yet known to be buffered.
    queued_messages: int
    #: Their total size.
    queued_bytes: int
    #: Optimistic bytes not yet paid by guarantees (equals the debt).
    unconfirmed_bytes: int


# --- server ------------------------------------------------------------------


@dataclass(slots=True)
class _Run(Generic[T]):
    """Consecutive equal buffered messages: the message, how many, their total size."""

    message: T
    count: int
    size: int


class ServerChannel(Generic[T]):
    """The receiving end of one logical channel: a FIFO buffer and its books.

    The gateway keeps one per stream and connection. It grows the buffer as
    log space frees up, issues guarantees for the growth, buffers the batches
    that arrive, and processes them (appends them to the log) at its own
    pace. Every method that must tell the client something returns the frame.

    Args:
        channel: the logical channel number, copied into every frame.
        announce_issuance: how many guarantees to issue in the step that
            starts dropping (see :class:`AnnounceIssuance`).
    """

    def __init__(
        self, channel: int, *, announce_issuance: AnnounceIssuance = AnnounceIssuance.ALL
    ) -> None:
        self._channel = channel
        self._announce_issuance = announce_issuance
        self._capacity = 0
        self._issuable = 0
        # Buffered messages in arrival order, as runs of consecutive equal
        # messages (one run per message unless coalescing, see coalesce()).
        self._buffer: deque[_Run[T]] = deque()
        self._buffered_bytes = 0
        self._buffered_messages = 0
        self._coalescing = False
        self._dropping = False
        # Remaining bytes the server may still accept, under its own
        # LimitReceiving and under the client's LimitSending (None: unlimited).
        self._receive_bound: int | None = None
        self._send_bound: int | None = None
        # The bound of the last LimitReceiving sent (the client's estimate
        # is no lower than what it says minus what counted since).
        self._receive_bound_sent: int | None = None
        self._last_buffered: MessageBuffered | None = None

    # -- read-only view --

    @property
    def channel(self) -> int:
        return self._channel

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def buffered_bytes(self) -> int:
        return self._buffered_bytes

    @property
    def buffered_messages(self) -> int:
        return self._buffered_messages

    @property
    def coalescing(self) -> bool:
        """Whether consecutive equal messages share one buffer entry (see :meth:`coalesce`)."""
        return self._coalescing

    @property
    def free(self) -> int:
        return self._capacity - self._buffered_bytes

    @property
    def issuable(self) -> int:
        return self._issuable

    @property
    def client_guarantees(self) -> int:
        """The client's guarantees as the server knows them (negative in debt)."""
        return self._capacity - self._buffered_bytes - self._issuable

    @property
    def dropping(self) -> bool:
        return self._dropping

    @property
    def receive_bound(self) -> int | None:
        """Bytes the server's own LimitReceiving still lets it accept."""
        return self._receive_bound

    @property
    def send_bound(self) -> int | None:
        """Bytes the client's LimitSending still lets it send."""
        return self._send_bound

    @property
    def closed(self) -> bool:
        """True once a bound reached zero: no byte will ever be accepted again."""
        return self._remaining() == 0

    def statistics(self) -> ServerChannelStatistics:
        return ServerChannelStatistics(
            capacity=self._capacity,
            buffered_bytes=self._buffered_bytes,
            buffered_messages=self._buffered_messages,
            issuable=self._issuable,
            client_guarantees=self.client_guarantees,
            dropping=self._dropping,
        )

    # -- capacity and guarantees --

    @property
    def issue_headroom(self) -> int:
        """The most guarantees the client can still be given: its guarantees stay below 2**64.

        The client refuses guarantees that would take it past 2**64-1 (no
        Absolve could carry them); its own count never exceeds ours, so
        keeping ours within the limit keeps the client's.
        """
        return _U64_MAX - max(0, self.client_guarantees)

    def grow(self, amount: int) -> None:
        """Add ``amount`` bytes of buffer; they become issuable guarantees."""
        _check_size("amount", amount)
        self._capacity += amount
        self._issuable += amount
        self._trim_to_bounds()

    def shrink(self, amount: int) -> None:
        """Remove ``amount`` bytes of buffer that were never promised.

        Only free space that is still issuable can go without the client's
        help: at most ``min(issuable, free)``, since issuable may exceed the
        free space while the client is in optimistic debt. To take back issued
        guarantees, :meth:`plead`, or process without reissuing.
        """
        _check_size("amount", amount)
        if amount > min(self._issuable, self.free):
            raise ValueError(
                f"cannot shrink by {amount}: {self._issuable} issuable, {self.free} free"
            )
        self._capacity -= amount
        self._issuable -= amount

    def issue(self, amount: int | None = None) -> IssueGuarantees | None:
        """Promise the client issuable buffer space.

        With no ``amount``, issue everything issuable (up to
        :attr:`issue_headroom`), or nothing (``None``) if nothing is. An
        explicit ``amount`` may be zero: ``issue(0)`` returns an
        IssueGuarantees of zero, which LCMUX uses as a signal.

        Raises:
            ValueError: an explicit ``amount`` above what is issuable, or above
                the headroom; nothing is issued then.
        """
        if amount is None:
            amount = min(self._issuable, self.issue_headroom)
            if amount == 0:
                return None
        _check_size("amount", amount)
        if amount > self._issuable:
            raise ValueError(f"cannot issue {amount}: only {self._issuable} issuable")
        if amount > self.issue_headroom:
            raise ValueError(f"cannot issue {amount}: the client's guarantees would pass 2**64-1")
        self._issuable -= amount
        return IssueGuarantees(channel=self._channel, amount=amount)

    def plead(self, target: int) -> Plead:
        """Ask the client to absolve guarantees until it holds ``target``."""
        _check_size("target", target)
        return Plead(channel=self._channel, target=target)

    # -- messages --

    def receive(self, message: T, size: int) -> Reception:
        """Buffer a channel message that arrived, or drop it whole.

        Raises:
            FlowControlError: LIMIT_EXCEEDED if accepting the message would
                break the client's own LimitSending promise.
        """
        _check_size("size", size)
        if self._dropping:
            # "it must keep dropping all messages on the same logical channel,
            # until it receives an apology message"
            return MessageDropped(size=size, reason=DropReason.DROPPING, frames=())
        if self._send_bound is not None and size > self._send_bound:
            raise FlowControlError(
                f"channel {self._channel}: {size} bytes beyond the client's "
                f"LimitSending ({self._send_bound} left)",
                code=ErrorCode.LIMIT_EXCEEDED,
            )
        if self._receive_bound is not None and size > self._receive_bound:
            return self._start_dropping(size, DropReason.RECEIVE_LIMIT)
        if size > self.free:
            # A message the books say was covered always fits: covered means
            # size <= client_guarantees, and free = issuable + client_guarantees
            # with issuable >= 0. So only an optimistic message lands here.
            # "the server must never buffer partial messages"
            return self._start_dropping(size, DropReason.NO_SPACE)
        tail = self._buffer[-1] if self._coalescing and self._buffer else None
        if tail is not None and tail.message == message:
            tail.count += 1
            tail.size += size
        else:
            self._buffer.append(_Run(message, 1, size))
        self._buffered_bytes += size
        self._buffered_messages += 1
        if self._receive_bound is not None:
            self._receive_bound -= size
        if self._send_bound is not None:
            self._send_bound -= size
        # Issuable stays as it is, even above the free space: the message
        # consumed the client's guarantees (or pushed it into debt), not ours.
        buffered = self._last_buffered
        if buffered is None or buffered.size != size:
            # (Immutable: the answer to a run of equal sizes is made once.)
            buffered = self._last_buffered = MessageBuffered(size=size)
        return buffered

    def _start_dropping(self, size: int, reason: DropReason) -> MessageDropped:
        # Issue and announce in the same step as the drop. Guarantees issued
        # later stem from processing done after the drop; if they could reach
        # the client before the announcement, they could pay off the dropped
        # message and the client would never learn it was lost.
        # "the server must issue guarantees for all the optimistic message
        # bytes that it did manage to buffer, before informing the client"
        self._dropping = True
        # The debt never exceeds issuable: free >= 0 means issuable >= -guarantees.
        debt = max(0, -self.client_guarantees)
        if self._announce_issuance is AnnounceIssuance.ALL:
            amount = min(self._issuable, self.issue_headroom)  # at least the debt
        else:
            amount = debt
        frames: list[IssueGuarantees | LimitReceiving | AnnounceDropping] = []
        if amount > 0:
            self._issuable -= amount
            frames.append(IssueGuarantees(channel=self._channel, amount=amount))
        if self._receive_bound is not None and self._receive_bound != self._receive_bound_sent:
            # The client counts our LimitReceiving from when it arrived, we
            # from when we sent it: bytes that crossed it count for us and
            # not for the client, whose estimate stays above ours, and a
            # resend it thinks fits would be dropped again and again. Say
            # where we are, now that every message the client sent before
            # the dropped one has arrived and every later one is dropped:
            # the client then knows exactly (ClientChannel.on_limit_receiving).
            self._receive_bound_sent = self._receive_bound
            frames.append(LimitReceiving(channel=self._channel, bound=self._receive_bound))
        frames.append(AnnounceDropping(channel=self._channel))
        return MessageDropped(size=size, reason=reason, frames=tuple(frames))

    def coalesce(self) -> None:
        """From now on, keep consecutive equal messages as one buffer entry.

        The buffer then costs memory per run of messages, not per message: a
        gateway that processes a stream's batches only when the consumer
        releases them would otherwise keep an entry for every small batch of
        a large log. The price is that a run forgets the sizes of its
        messages, so :meth:`process` must be told the size of any part of a
        run it takes. The books do not change: they count bytes and messages.
        """
        self._coalescing = True

    def process(
        self, *, reissue: bool = True, count: int = 1, size: int | None = None
    ) -> tuple[T, int]:
        """Take the ``count`` oldest buffered messages out of the buffer, as one.

        With ``reissue`` their space becomes issuable again; the guarantees
        accumulate until :meth:`issue` ("the server need not communicate this
        immediately"). Without, the buffer shrinks by their size, which is how
        a server reduces capacity without asking the client.

        The messages taken together must be equal (they are one message
        unless the caller processes several batches of one handle at once).
        ``size`` is their total size: the caller's own count, checked against
        the buffer where it can be, and needed where the last message taken
        is part of a coalesced run (whose single sizes are not kept).

        Returns the message and the size taken.

        Raises:
            RuntimeError: fewer than ``count`` messages are buffered.
            ValueError: ``count`` below 1, messages that differ, or a
                ``size`` that disagrees with the buffer or is missing;
                nothing changes then.
        """
        if count < 1:
            raise ValueError(f"channel {self._channel}: cannot process {count} messages")
        if count > self._buffered_messages:
            raise RuntimeError(
                f"channel {self._channel}: {count} to process, {self._buffered_messages} buffered"
            )
        # Check everything before any book changes.
        message = self._buffer[0].message
        whole_runs = 0
        whole_size = 0
        left = count
        for run in self._buffer:
            if run.message != message:
                raise ValueError(f"channel {self._channel}: the messages to process differ")
            if run.count > left:
                break
            whole_runs += 1
            whole_size += run.size
            left -= run.count
            if left == 0:
                break
        if left == 0:
            if size is not None and size != whole_size:
                raise ValueError(
                    f"channel {self._channel}: {count} messages of {whole_size} bytes, not {size}"
                )
            size = whole_size
        else:
            if size is None:
                raise ValueError(
                    f"channel {self._channel}: the size of part of a run must be given"
                )
            part = size - whole_size
            if not 0 <= part <= self._buffer[whole_runs].size:
                raise ValueError(
                    f"channel {self._channel}: {size} bytes do not fit {count} messages "
                    f"of the buffer"
                )
        _check_size("size", size)
        for _ in range(whole_runs):
            self._buffer.popleft()
        if left:
            partial = self._buffer[0]
            partial.count -= left
            partial.size -= size - whole_size
        self._buffered_bytes -= size
        self._buffered_messages -= count
        if reissue:
            self._issuable += size
            self._trim_to_bounds()
        else:
            self._capacity -= size
        return message, size

    # -- frames from the client --

    def on_absolve(self, amount: int) -> None:
        """The client gave up ``amount`` guarantees: shrink the buffer by as much.

        A correct client never absolves more than the server thinks it holds:
        the client absolves out of its own guarantees, and when the Absolve
        arrives the server's view is at least the client's view at sending.
        Between the two, only guarantees in flight to the client (which the
        server already counts) and messages sent before the Absolve (which the
        server has received by then, in order, and either counted or dropped)
        make the views differ.

        Raises:
            FlowControlError: ABSOLVED_TOO_MUCH, or LIMIT_EXCEEDED if the
                absolution breaks the client's LimitSending (it counts too).
        """
        _check_size("amount", amount)
        if amount > self.client_guarantees:
            raise FlowControlError(
                f"channel {self._channel}: absolved {amount}, client holds "
                f"{self.client_guarantees}",
                code=ErrorCode.ABSOLVED_TOO_MUCH,
            )
        if self._send_bound is not None:
            if amount > self._send_bound:
                raise FlowControlError(
                    f"channel {self._channel}: absolved {amount} beyond the client's "
                    f"LimitSending ({self._send_bound} left)",
                    code=ErrorCode.LIMIT_EXCEEDED,
                )
            self._send_bound -= amount
        self._capacity -= amount

    def on_apologise(self) -> None:
        """The client saw AnnounceDropping: accept messages again.

        Raises:
            FlowControlError: UNEXPECTED_APOLOGY if the server was not dropping.
        """
        if not self._dropping:
            raise FlowControlError(
                f"channel {self._channel}: apology while not dropping",
                code=ErrorCode.UNEXPECTED_APOLOGY,
            )
        self._dropping = False

    def on_limit_sending(self, bound: int) -> None:
        """The client promises to send at most ``bound`` more bytes.

        Capacity the client can never use is given up at once.

        Raises:
            FlowControlError: LIMIT_LOOSENED unless the bound strictly
                tightens the one before (LCMUX: new bounds may be sent "only
                if they strictly tighten the limit"). The client's count of
                what is left is never above ours (it charges a message when
                it sends it, we when it arrives), so a correct client's new
                bound is always below ours.
        """
        _check_size("bound", bound)
        if not _tightens(bound, self._send_bound):
            raise FlowControlError(
                f"channel {self._channel}: LimitSending {bound} after {self._send_bound}",
                code=ErrorCode.LIMIT_LOOSENED,
            )
        self._send_bound = bound
        self._trim_to_bounds()

    # -- closing --

    def close_sending(self) -> None:
        """The client will send nothing more here: it freed the channel's handle.

        The same as a LimitSending of zero, which its FreeHandle makes
        needless: what guarantees it held are given up at once, and buffered
        messages stay until processed.
        """
        self._send_bound = 0
        self._trim_to_bounds()

    def limit_receiving(self, bound: int) -> LimitReceiving:
        """Promise to accept at most ``bound`` more bytes; zero closes the channel.

        After accepting ``bound`` bytes every message is dropped, with the
        same announcement as any drop. Issuable space above the bound is
        given up. The bound may not fall below the guarantees the client
        holds (as we know them, messages in flight included): "the server is
        still not allowed to drop messages for which it had previously
        guaranteed buffer capacity". To go lower, plead first, and limit once
        the Absolve has arrived.

        Raises:
            ValueError: the bound does not strictly tighten the one before,
                or lies below the client's guarantees; nothing changes then.
        """
        _check_size("bound", bound)
        if not _tightens(bound, self._receive_bound):
            raise ValueError(
                f"LimitReceiving must strictly tighten: {bound} >= {self._receive_bound}"
            )
        if bound < self.client_guarantees:
            raise ValueError(
                f"LimitReceiving {bound} would drop guaranteed bytes: the client holds "
                f"{self.client_guarantees} guarantees (plead first)"
            )
        self._receive_bound = bound
        self._receive_bound_sent = bound
        self._trim_to_bounds()
        return LimitReceiving(channel=self._channel, bound=bound)

    def _remaining(self) -> int | None:
        return _tightest(self._receive_bound, self._send_bound)

    def _trim_to_bounds(self) -> None:
        # With at most `remaining` more bytes to accept, guarantees beyond it
        # can never be used, and issuing them would break LimitReceiving ("this
        # bound thus also gives an upper bound on how many more guarantees the
        # server might issue"). Give up the capacity behind them. Keeping
        # issuable <= remaining - guarantees is also what stops the issuance
        # before an announcement from paying off a message dropped for the bound.
        remaining = self._remaining()
        if remaining is None:
            return
        excess = max(0, self.client_guarantees - remaining)
        self._capacity -= excess
        excess = max(0, self._issuable - (remaining - self.client_guarantees))
        self._capacity -= excess
        self._issuable -= excess


# --- client ------------------------------------------------------------------


@dataclass(slots=True)
class _InDoubt(Generic[T]):
    """A sent message not yet known to be buffered."""

    message: T
    size: int
    #: Optimistic bytes of this message that no guarantee has paid yet.
    unconfirmed: int
    #: Whether sending it counted against our LimitSending / the LimitReceiving.
    charged_send_bound: bool
    charged_receive_bound: bool


class ClientChannel(Generic[T]):
    """The sending end of one logical channel: guarantees and messages in doubt.

    The producer library keeps one per stream. It sends within its
    guarantees, or optimistically beyond them; it answers Plead with Absolve,
    and AnnounceDropping with Apologise plus the messages to send again.

    Args:
        channel: the logical channel number, copied into every frame.
    """

    def __init__(self, channel: int) -> None:
        self._channel = channel
        self._guarantees = 0
        self._in_doubt: deque[_InDoubt[T]] = deque()
        self._unconfirmed_bytes = 0
        # Remaining bytes under our own LimitSending and under the server's
        # LimitReceiving, counted from when we sent / received it.
        self._send_bound: int | None = None
        self._receive_bound: int | None = None

    # -- read-only view --

    @property
    def channel(self) -> int:
        return self._channel

    @property
    def guarantees(self) -> int:
        """Guarantees available (negative while in optimistic debt)."""
        return self._guarantees

    @property
    def in_doubt(self) -> list[T]:
        """Sent messages not yet known to be buffered, in send order."""
        return [entry.message for entry in self._in_doubt]

    @property
    def unconfirmed_bytes(self) -> int:
        return self._unconfirmed_bytes

    @property
    def send_bound(self) -> int | None:
        return self._send_bound

    @property
    def receive_bound(self) -> int | None:
        return self._receive_bound

    @property
    def closed(self) -> bool:
        """True once a bound reached zero: nothing may be sent any more."""
        return _tightest(self._send_bound, self._receive_bound) == 0

    def statistics(self) -> ClientChannelStatistics:
        return ClientChannelStatistics(
            guarantees=self._guarantees,
            queued_messages=len(self._in_doubt),
            queued_bytes=sum(entry.size for entry in self._in_doubt),
            unconfirmed_bytes=self._unconfirmed_bytes,
        )

    # -- sending --

    def fits_bounds(self, size: int) -> bool:
        """Whether a message of ``size`` bytes is within our LimitSending and the LimitReceiving."""
        remaining = _tightest(self._send_bound, self._receive_bound)
        return remaining is None or size <= remaining

    def can_send(self, size: int) -> bool:
        """Whether a message of ``size`` bytes is covered by guarantees and bounds."""
        return 0 <= size <= self._guarantees and self.fits_bounds(size)

    def send(self, message: T, size: int, *, optimistic: bool = False) -> Sent:
        """Account for sending ``message``; the caller puts it on the wire.

        Raises:
            ValueError: the message exceeds the guarantees (and ``optimistic``
                is false), or exceeds a LimitSending or LimitReceiving bound.
        """
        _check_size("size", size)
        if not self.fits_bounds(size):
            raise ValueError(f"channel {self._channel}: {size} bytes exceed a limit")
        if not optimistic and size > self._guarantees:
            raise ValueError(
                f"channel {self._channel}: {size} bytes exceed {self._guarantees} guarantees"
            )
        debt_before = max(0, -self._guarantees)
        self._guarantees -= size
        optimistic_bytes = max(0, -self._guarantees) - debt_before
        self._unconfirmed_bytes += optimistic_bytes
        if self._send_bound is not None:
            self._send_bound -= size
        if self._receive_bound is not None:
            self._receive_bound -= size
        # Once anything is in doubt, everything after it is too: if that
        # message is dropped, the server drops all later ones until the apology.
        queued = bool(self._in_doubt) or optimistic_bytes > 0
        if queued:
            self._in_doubt.append(
                _InDoubt(
                    message=message,
                    size=size,
                    unconfirmed=optimistic_bytes,
                    charged_send_bound=self._send_bound is not None,
                    charged_receive_bound=self._receive_bound is not None,
                )
            )
        return Sent(size=size, optimistic_bytes=optimistic_bytes, confirmed=not queued)

    def limit_sending(self, bound: int) -> LimitSending:
        """Promise to send at most ``bound`` more bytes; zero closes the channel.

        The bound counts from here, retransmissions included: a message in
        doubt now that turns out dropped is sent again under this bound. So
        a client that wants to resend what is in doubt limits to at least
        ``statistics().queued_bytes``.
        """
        _check_size("bound", bound)
        if not _tightens(bound, self._send_bound):
            raise ValueError(f"LimitSending must strictly tighten: {bound} >= {self._send_bound}")
        self._send_bound = bound
        for entry in self._in_doubt:
            # The server counts what it accepts after this bound arrives; a
            # message sent before it and dropped was never counted, and its
            # retransmission will be charged afresh.
            entry.charged_send_bound = False
        self._clamp_guarantees()
        return LimitSending(channel=self._channel, bound=bound)

    # -- frames from the server --

    def on_issue_guarantees(self, amount: int) -> list[T]:
        """Add guarantees; return the messages they prove were buffered.

        The guarantees pay optimistic bytes in send order (see the module
        docstring for why that identifies buffered messages).
        """
        _check_size("amount", amount)
        if self._guarantees + amount > _U64_MAX:
            # Found by fuzzing: such guarantees cannot be absolved on the
            # wire (an Absolve carries a u64), and no buffer is that large.
            raise FlowControlError(
                f"guarantees on channel {self._channel} would exceed 2**64-1",
                code=ErrorCode.UNEXPECTED_FRAME,
            )
        payment = amount
        confirmed: list[T] = []
        while self._in_doubt:
            head = self._in_doubt[0]
            paid = min(payment, head.unconfirmed)
            head.unconfirmed -= paid
            self._unconfirmed_bytes -= paid
            payment -= paid
            if head.unconfirmed > 0:
                break
            confirmed.append(self._in_doubt.popleft().message)
        self._guarantees += amount
        self._clamp_guarantees()
        return confirmed

    def absolve(self, amount: int) -> Absolve:
        """Give up ``amount`` guarantees unasked (the window policy spends a whole slot per batch).

        Raises:
            ValueError: more than the guarantees held.
        """
        _check_size("amount", amount)
        if amount > self._guarantees:
            raise ValueError(f"cannot absolve {amount}: only {self._guarantees} guarantees")
        self._guarantees -= amount
        if self._send_bound is not None:
            self._send_bound -= amount
        return Absolve(channel=self._channel, amount=amount)

    def on_plead(self, target: int) -> Absolve | None:
        """Absolve down to ``target`` guarantees, or ignore if already below."""
        if self._guarantees <= target:
            return None
        amount = self._guarantees - target
        self._guarantees = target
        if self._send_bound is not None:
            # LCMUX: the bound shrinks "when the client provides absolution".
            self._send_bound -= amount
        return Absolve(channel=self._channel, amount=amount)

    def on_announce_dropping(self) -> tuple[list[T], Apologise]:
        """Every message still in doubt was dropped: take them back.

        Returns the dropped messages in send order, which the caller sends
        again, after the Apologise and before any new message.
        """
        dropped = [entry.message for entry in self._in_doubt]
        for entry in self._in_doubt:
            self._guarantees += entry.size
            if entry.charged_send_bound and self._send_bound is not None:
                self._send_bound += entry.size
            if entry.charged_receive_bound and self._receive_bound is not None:
                self._receive_bound += entry.size
        self._in_doubt.clear()
        self._unconfirmed_bytes = 0
        self._clamp_guarantees()
        return dropped, Apologise(channel=self._channel)

    def on_limit_receiving(self, bound: int) -> None:
        """The server will accept at most ``bound`` more bytes."""
        _check_size("bound", bound)
        # The server counts from when it sent the bound, so messages we sent
        # before it arrived may count against it too: the bound is an upper
        # estimate of what the server will still accept. It replaces our count
        # under an earlier bound (it is at least as tight on the server's
        # side), and it is not checked for loosening, since that count also
        # charges messages in doubt which may yet turn out dropped. As for
        # LimitSending, a retransmission is charged against the new bound.
        # The server sends its bound again just before an AnnounceDropping
        # when bytes that crossed the last one counted against it: every
        # message still in doubt then is dropped, so the estimate is exact.
        self._receive_bound = bound
        for entry in self._in_doubt:
            entry.charged_receive_bound = False
        self._clamp_guarantees()

    def _clamp_guarantees(self) -> None:
        # Guarantees beyond what we may still send are worth nothing; the
        # server gives up the same capacity when it learns of the bound.
        remaining = _tightest(self._send_bound, self._receive_bound)
        if remaining is not None and self._guarantees > remaining:
            self._guarantees = remaining
