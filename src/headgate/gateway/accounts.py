"""Accounts and loans: the gateway's bound on work in flight per connection.

Every connection has an :class:`Account`. Each unit of work that exists
because of that connection borrows from it (seed
broker-internal-flow-control.txt): a batch in the receive ring waiting for the
log writer, a batch appended but not yet durable, a record waiting to be
delivered to a ``tail`` subscriber. Work caused by other work is charged to
the account of the *cause*: a record fanned out to ten subscribers costs its
producer's connection ten units until each copy is delivered, whoever the
subscribers are.

While its debt is above its threshold a connection stops reading its socket,
so TCP closes the window and the producer slows down; it reads again once the
debt is back down to half the threshold (the gap keeps a connection near its
threshold from pausing and resuming on every unit).

A :class:`Loan` is repaid exactly once, explicitly with :meth:`Loan.repay` or
by leaving its ``with`` block; never by a finaliser, so a leak shows as debt
in the statistics instead of vanishing::

    loan = account.loan(1)          # a subscriber's delivery starts
    ...
    loan.repay()                    # it is done

    ring = account.loan(1)          # a batch enters the ring (then
    ring.grow(1)                    #  another, on the same loan)
    ring.repay_part(2)              # the log writer is done with both

    with account.loan(len(subscribers)):
        deliver(record, subscribers)

:class:`ReadPauses` combines the reasons a connection may stop reading (debt,
a full ring, a peer that does not read what it is sent) so that reading
resumes only when none holds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

from headgate.gateway.turns import TurnShare

__all__ = ["Account", "AccountStatistics", "DurabilityLoans", "Loan", "ReadPauses"]


@dataclass(frozen=True, slots=True)
class AccountStatistics:
    """A snapshot of one account, for metrics and ``headgate top``."""

    #: The account's name (the connection's).
    name: str
    #: Units borrowed and not yet repaid.
    debt: int
    #: Above this debt the connection stops reading.
    threshold: int
    #: The highest debt seen.
    peak_debt: int
    #: Loans taken, and units borrowed, since the account opened.
    loans: int
    borrowed: int
    #: Whether the debt is (still) over the threshold.
    over: bool
    #: How many times the debt went over the threshold.
    overdrafts: int


def _no_turn() -> TurnShare | None:
    return None


class Account:
    """What one connection owes for the work it caused.

    Args:
        name: shown in statistics.
        threshold: the debt above which ``on_over(True)`` is called; once over,
            ``on_over(False)`` is called when the debt is back at or below
            ``threshold // 2``.
        on_over: called on each such crossing (the connection pauses or
            resumes reading).
    """

    __slots__ = (
        "_on_over",
        "borrowed",
        "debt",
        "loans",
        "name",
        "over",
        "overdrafts",
        "peak_debt",
        "resume_at",
        "threshold",
        "turn_of",
    )

    def __init__(
        self, name: str, threshold: int, on_over: Callable[[bool], None] | None = None
    ) -> None:
        if threshold < 1:
            raise ValueError(f"an account threshold must be at least 1, got {threshold}")
        self.name = name
        self.threshold = threshold
        self.resume_at = threshold // 2
        self._on_over = on_over
        self.debt = 0
        self.peak_debt = 0
        self.loans = 0
        self.borrowed = 0
        self.over = False
        self.overdrafts = 0
        #: The turn of the cause that pays for the connection's share of the
        #: loop's time now (it changes at Hello); None: no cause (tests).
        self.turn_of: Callable[[], TurnShare | None] = _no_turn

    def loan(self, units: int = 1) -> Loan:
        """Borrow ``units`` for one piece of work; repay the loan when it is done."""
        self._borrow(units)
        return Loan(self, units)

    def _borrow(self, units: int) -> None:
        if units < 0:
            raise ValueError(f"a loan cannot be negative, got {units}")
        self.debt += units
        self.loans += 1
        self.borrowed += units
        if self.debt > self.peak_debt:
            self.peak_debt = self.debt
        if not self.over and self.debt > self.threshold:
            self.over = True
            self.overdrafts += 1
            if self._on_over is not None:
                self._on_over(True)

    def _repay(self, units: int) -> None:
        self.debt -= units
        if self.over and self.debt <= self.resume_at:
            self.over = False
            if self._on_over is not None:
                self._on_over(False)

    def statistics(self) -> AccountStatistics:
        return AccountStatistics(
            name=self.name,
            debt=self.debt,
            threshold=self.threshold,
            peak_debt=self.peak_debt,
            loans=self.loans,
            borrowed=self.borrowed,
            over=self.over,
            overdrafts=self.overdrafts,
        )


class Loan:
    """Units borrowed from an :class:`Account` for one piece of work."""

    __slots__ = ("account", "units")

    def __init__(self, account: Account, units: int) -> None:
        self.account: Account | None = account
        self.units = units

    @property
    def repaid(self) -> bool:
        return self.account is None

    def grow(self, units: int) -> None:
        """Borrow ``units`` more for work that ends with this loan's (one repayment for all).

        Cheaper than a loan per piece when the pieces are settled together:
        the account is charged the same units at the same moments.
        """
        account = self.account
        if account is None:
            raise RuntimeError("this loan was already repaid")
        account._borrow(units)
        self.units += units

    def repay_part(self, units: int) -> None:
        """``units`` of the work are done: give them back; the loan is repaid at 0 left.

        For a loan that stands for a queue (grown as pieces join it,
        repaid as they leave), which a loan per piece would cost a loan
        object, a borrowing and a repayment each.
        """
        account = self.account
        if account is None or not 0 < units <= self.units:
            raise RuntimeError(f"cannot repay {units} units of a loan of {self.units}")
        self.units -= units
        if not self.units:
            self.account = None
        account._repay(units)

    def repay(self) -> None:
        """The work is done: give the units back. Repaying twice is a bug and raises."""
        account = self.account
        if account is None:
            raise RuntimeError("this loan was already repaid")
        self.account = None
        account._repay(self.units)

    def __enter__(self) -> Loan:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.account is not None:
            self.repay()


class ReadPauses:
    """Why a transport is not being read; it reads again when no reason holds.

    Args:
        pause: stops reading (``transport.pause_reading``).
        resume: starts reading again (``transport.resume_reading``).
    """

    __slots__ = ("_pause", "_resume", "pauses", "reasons")

    def __init__(self, pause: Callable[[], None], resume: Callable[[], None]) -> None:
        self._pause = pause
        self._resume = resume
        self.reasons: set[str] = set()
        #: How many times reading was paused.
        self.pauses = 0

    @property
    def paused(self) -> bool:
        return bool(self.reasons)

    def set(self, reason: str, holds: bool) -> None:
        """Say whether ``reason`` holds now; pause or resume on the edges."""
        reasons = self.reasons
        if holds:
            if reason not in reasons:
                reasons.add(reason)
                if len(reasons) == 1:
                    self.pauses += 1
                    self._pause()
        elif reason in reasons:
            reasons.discard(reason)
            if not reasons:
                self._resume()


class _DurableAt:
    """Loans of :class:`DurabilityLoans`, repaid once their stream is durable up to ``end``."""

    __slots__ = ("end", "loan", "run")

    def __init__(self, end: int, loan: Loan, run: int | None) -> None:
        self.end = end
        self.loan = loan
        self.run = run


class DurabilityLoans:
    """Loans of batches appended to a log and not yet durable, per stream.

    Appends to one stream happen in log order, so each stream's loans are a
    queue ordered by end position; a group commit repays its durable prefix.

    Consecutive batches of one account on one stream appended in one run
    (one pass of the log writer) share one loan, grown by a unit per batch
    and repaid when the last of them is durable: a flood of one-record
    batches would otherwise make, queue and repay a loan per record. A run
    ends with its pass, so a loan never grows past a commit that began
    after the pass: a connection that never stops writing still has its
    units repaid commit by commit.
    """

    __slots__ = ("_streams",)

    def __init__(self) -> None:
        self._streams: dict[str, deque[_DurableAt]] = {}

    def add(self, stream: str, end_position: int, account: Account, run: int | None = None) -> None:
        """A batch of ``account`` is in ``stream`` up to ``end_position``: one unit
        borrowed until the stream is durable up to there. Batches given the same
        ``run`` (not None) one after the other share a loan."""
        queue = self._streams.get(stream)
        if queue is None:
            queue = self._streams[stream] = deque()
        elif run is not None and queue:
            last = queue[-1]
            if last.run == run and last.loan.account is account:
                last.loan.grow(1)
                last.end = end_position
                return
        queue.append(_DurableAt(end_position, account.loan(1), run))

    def settle(self, stream: str, durable_position: int) -> int:
        """Repay the loans of ``stream`` up to ``durable_position``; return how many batches."""
        queue = self._streams.get(stream)
        repaid = 0
        while queue and queue[0].end <= durable_position:
            loan = queue.popleft().loan
            repaid += loan.units
            loan.repay()
        return repaid

    def outstanding(self) -> int:
        """Batches still waiting for the disk."""
        return sum(entry.loan.units for q in self._streams.values() for entry in q)
