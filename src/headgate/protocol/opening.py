"""How a writer's channel opens on the gateway: the zero guarantee and the resume Ack.

A producer binds a stream; if the gateway accepts the bind, that handle on
that connection is a *writer*, and two things must be said to it before
its data flows, each exactly once:

* **The zero guarantee.** The gateway's first frame on the writer's data
  channel ``2 + h`` is IssueGuarantees(0): LCMUX's convention by which a
  server says that it issues guarantees in advance there, so that a client
  that never sends optimistically knows it will not wait forever. Only then
  does the stream's flow-control policy grant what it grants
  (:meth:`WriterOpening.open_channel`; the policies never issue it
  themselves). A refused bind gets none: its channel never gets a guarantee.

* **The resume Ack.** An Ack that answers no batch: where the producer's
  sequence continues on this stream (the next sequence after everything
  the stream *stored* for its producer id) and the log's durable position.
  The producer numbers its records from there, sends nothing before it,
  drops the batches it covers and resends the rest
  (:meth:`headgate.client.producer_core.StreamBatches.resume` reads it: on
  a bound handle, the first Ack is this one). So it must never count a
  batch a crash could still take away, nor miss one the stream holds:

  ========================  ==========================================
  the stream ...            the resume Ack ...
  ========================  ==========================================
  holds batches, or its     waits (``WAIT``): the held batches are not
  storage fails             stored yet but count for the producer
  has stored batches of     goes out with the group commit that makes
  the producer that are     them durable (``AFTER_COMMIT``), as the
  not durable yet           Ack of those batches would
  has all of them durable   goes out now (``SEND``)
  ========================  ==========================================

  :data:`RESUME_TRANSITIONS` is the rule, keyed by (state, what the stream
  says), as :mod:`headgate.protocol.lifecycle` keys the connection's; the
  gateway (:meth:`headgate.gateway.streams.Stream.announce_resume`) asks it
  at the bind and again whenever the held batches are stored, and sends
  what it answers.

On the wire, for a bind the gateway accepts, that makes the order: the
bind, then (the stream being held) its ``STORAGE_FULL`` notice, then the
resume Ack if it is due at once, then, at the stream's next rebalance, the
zero guarantee and the policy's first grant; a resume Ack that waits comes
after them. Nothing here reads a clock or touches a socket.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from headgate.protocol import messages as m

__all__ = [
    "RESUME_TRANSITIONS",
    "ResumeAnswer",
    "ResumeInput",
    "ResumeState",
    "ResumeStep",
    "WriterOpening",
    "resume_input",
]


class ResumeState(Enum):
    """Where a writer's resume Ack is."""

    #: The bind was accepted; nobody asked about the resume Ack yet.
    BOUND = "bound"
    #: Asked while the stream held batches: it waits for them to be stored.
    WAITING = "waiting"
    #: Sent, or queued for the group commit that makes it true: done.
    RESUMED = "resumed"
    #: The writer is gone (freed, or its connection closed): nothing more.
    GONE = "gone"


class ResumeInput(Enum):
    """What the stream says when it asks, or that the writer left."""

    #: The stream holds batches, or its storage fails.
    HELD = "held"
    #: Some batches stored for the producer id are not durable yet.
    UNDURABLE = "undurable"
    #: Everything stored for the producer id is durable.
    DURABLE = "durable"
    #: The writer left.
    LEAVE = "leave"


class ResumeAnswer(Enum):
    """What the gateway does about the resume Ack."""

    #: Send it now.
    SEND = "send"
    #: Queue it as the Ack of the producer's last undurable batch.
    AFTER_COMMIT = "after commit"
    #: Ask again once the stream's held batches are stored.
    WAIT = "wait"
    #: Nothing: it went out already, or the writer is gone.
    NOTHING = "nothing"


_S = ResumeState
_I = ResumeInput
_A = ResumeAnswer


def _table() -> dict[tuple[ResumeState, ResumeInput], tuple[ResumeState, ResumeAnswer]]:
    table: dict[tuple[ResumeState, ResumeInput], tuple[ResumeState, ResumeAnswer]] = {}
    for state in (_S.BOUND, _S.WAITING):
        table[state, _I.HELD] = (_S.WAITING, _A.WAIT)
        table[state, _I.UNDURABLE] = (_S.RESUMED, _A.AFTER_COMMIT)
        table[state, _I.DURABLE] = (_S.RESUMED, _A.SEND)
    for input_ in ResumeInput:
        # Once: a writer is told where it resumes one time, however often asked.
        table[_S.RESUMED, input_] = (_S.RESUMED, _A.NOTHING)
        table[_S.GONE, input_] = (_S.GONE, _A.NOTHING)
    for state in ResumeState:
        table[state, _I.LEAVE] = (_S.GONE, _A.NOTHING)
    return table


#: (state, input) -> (next state, answer): every pair is there.
RESUME_TRANSITIONS = _table()


def resume_input(*, held: bool, undurable_end: int | None) -> ResumeInput:
    """What the stream says, from its facts.

    Args:
        held: the stream holds batches (or its storage fails).
        undurable_end: where the producer's last stored batch that is not
            durable yet ends, or None if all of them are durable.
    """
    if held:
        return ResumeInput.HELD
    if undurable_end is not None:
        return ResumeInput.UNDURABLE
    return ResumeInput.DURABLE


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumeStep:
    """The answer about one writer's resume Ack, with what to send or queue."""

    #: What to do.
    answer: ResumeAnswer
    #: ``SEND``: the Ack to send now.
    ack: m.Ack | None = None
    #: ``AFTER_COMMIT``: the Ack's next sequence and the log position whose
    #: durability it waits for (the end of the producer's last stored batch).
    next_sequence: int = 0
    after: int = 0


class WriterOpening:
    """The opening of one writer (one bound stream handle of one connection) on the gateway.

    The gateway keeps one per writer, from the accepted bind until the
    writer leaves, and asks it what to say: :meth:`open_channel` for the
    zero guarantee, :meth:`resume` for the resume Ack.
    """

    __slots__ = ("issuing", "state")

    def __init__(self) -> None:
        #: Where the resume Ack is.
        self.state = ResumeState.BOUND
        #: Whether the zero guarantee went out (the policy may grant).
        self.issuing = False

    @property
    def waiting(self) -> bool:
        """Whether the resume Ack waits for the stream's held batches to be stored."""
        return self.state is ResumeState.WAITING

    def open_channel(self) -> bool:
        """Whether the zero guarantee goes out now: True the first time only.

        The caller sends IssueGuarantees(0) on the writer's channel, then
        lets the policy grant. Never after the writer left.
        """
        if self.issuing or self.state is ResumeState.GONE:
            return False
        self.issuing = True
        return True

    def resume(
        self,
        *,
        handle: int,
        held: bool,
        next_sequence: int,
        undurable_end: int | None,
        durable_position: int,
    ) -> ResumeStep:
        """What to do about the resume Ack now (see the module's table).

        Args:
            handle: the writer's stream handle (the producer's).
            held: the stream holds batches, or its storage fails.
            next_sequence: the producer id's next sequence over what the
                stream stored (nothing held: the producer numbers on from it).
            undurable_end: where the producer's last stored batch that is
                not durable yet ends, or None.
            durable_position: the log's durable end now.
        """
        input_ = resume_input(held=held, undurable_end=undurable_end)
        self.state, answer = RESUME_TRANSITIONS[self.state, input_]
        if answer is ResumeAnswer.SEND:
            ack = m.Ack(
                handle=handle, next_sequence=next_sequence, durable_position=durable_position
            )
            return ResumeStep(answer=answer, ack=ack)
        if answer is ResumeAnswer.AFTER_COMMIT:
            assert undurable_end is not None
            return ResumeStep(answer=answer, next_sequence=next_sequence, after=undurable_end)
        return ResumeStep(answer=answer)

    def leave(self) -> None:
        """The writer left: nothing more is said to it."""
        self.state, _ = RESUME_TRANSITIONS[self.state, ResumeInput.LEAVE]
