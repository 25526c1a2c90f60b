"""A writer's opening: the zero guarantee and the resume Ack, each once, in memory.

As test_lifecycle.py tests the connection's table: the expected table below
is written out by hand from PROTOCOL.md's rules (lifecycle step 4 and "When
the disk is full"), not read from the code's, and every (state, input) pair
is tried. Then the Ack the opening sends is read by the producer's core, as
a reconnecting producer reads it.
"""

from __future__ import annotations

import pytest

from headgate.client.producer_core import StreamBatches
from headgate.protocol import messages as m
from headgate.protocol.opening import (
    RESUME_TRANSITIONS,
    ResumeAnswer,
    ResumeInput,
    ResumeState,
    ResumeStep,
    WriterOpening,
    resume_input,
)

S = ResumeState
I = ResumeInput  # noqa: E741 (the table reads better short)
A = ResumeAnswer

# From the rules in words:
# - asked while the stream holds batches (or cannot store), it waits, and is
#   asked again once they are stored;
# - asked while the producer's stored batches are not all durable, it goes
#   with the commit that makes them so; all durable, it goes now;
# - it goes once: after that, and after the writer left, nothing.
EXPECTED: dict[S, dict[I, tuple[S, A]]] = {
    S.BOUND: {
        I.HELD: (S.WAITING, A.WAIT),
        I.UNDURABLE: (S.RESUMED, A.AFTER_COMMIT),
        I.DURABLE: (S.RESUMED, A.SEND),
        I.LEAVE: (S.GONE, A.NOTHING),
    },
    S.WAITING: {
        I.HELD: (S.WAITING, A.WAIT),
        I.UNDURABLE: (S.RESUMED, A.AFTER_COMMIT),
        I.DURABLE: (S.RESUMED, A.SEND),
        I.LEAVE: (S.GONE, A.NOTHING),
    },
    S.RESUMED: {
        I.HELD: (S.RESUMED, A.NOTHING),
        I.UNDURABLE: (S.RESUMED, A.NOTHING),
        I.DURABLE: (S.RESUMED, A.NOTHING),
        I.LEAVE: (S.GONE, A.NOTHING),
    },
    S.GONE: {
        I.HELD: (S.GONE, A.NOTHING),
        I.UNDURABLE: (S.GONE, A.NOTHING),
        I.DURABLE: (S.GONE, A.NOTHING),
        I.LEAVE: (S.GONE, A.NOTHING),
    },
}


def test_the_expected_table_names_every_state_and_input() -> None:
    assert set(EXPECTED) == set(ResumeState)
    for row in EXPECTED.values():
        assert set(row) == set(ResumeInput)


@pytest.mark.parametrize("state", list(ResumeState))
@pytest.mark.parametrize("input_", list(ResumeInput))
def test_every_state_against_every_input(state: S, input_: I) -> None:
    assert RESUME_TRANSITIONS[state, input_] == EXPECTED[state][input_]


def test_what_the_stream_says_comes_from_its_facts() -> None:
    # Held wins over everything: held batches count for the producer.
    assert resume_input(held=True, undurable_end=640) is I.HELD
    assert resume_input(held=True, undurable_end=None) is I.HELD
    assert resume_input(held=False, undurable_end=640) is I.UNDURABLE
    assert resume_input(held=False, undurable_end=None) is I.DURABLE


def ask(
    opening: WriterOpening, *, held: bool = False, undurable_end: int | None = None
) -> ResumeStep:
    return opening.resume(
        handle=3,
        held=held,
        next_sequence=12,
        undurable_end=undurable_end,
        durable_position=4096,
    )


def test_a_writer_whose_producer_is_all_durable_is_told_at_once() -> None:
    opening = WriterOpening()
    step = opening.resume(
        handle=3, held=False, next_sequence=12, undurable_end=None, durable_position=4096
    )
    assert step.answer is A.SEND
    assert step.ack == m.Ack(handle=3, next_sequence=12, durable_position=4096)
    assert opening.state is S.RESUMED
    again = opening.resume(
        handle=3, held=False, next_sequence=13, undurable_end=None, durable_position=8192
    )
    assert again.answer is A.NOTHING and again.ack is None


def test_a_resume_ack_over_undurable_batches_waits_for_their_commit() -> None:
    opening = WriterOpening()
    step = opening.resume(
        handle=3, held=False, next_sequence=12, undurable_end=5000, durable_position=4096
    )
    assert step.answer is A.AFTER_COMMIT
    assert step.ack is None
    assert (step.next_sequence, step.after) == (12, 5000)
    assert opening.state is S.RESUMED


def test_a_held_stream_makes_the_resume_ack_wait_until_it_is_asked_again() -> None:
    opening = WriterOpening()
    assert ask(opening, held=True).answer is A.WAIT
    assert opening.waiting
    assert ask(opening, held=True).answer is A.WAIT
    step = opening.resume(
        handle=3, held=False, next_sequence=20, undurable_end=None, durable_position=9000
    )
    assert step.ack == m.Ack(handle=3, next_sequence=20, durable_position=9000)
    assert not opening.waiting


def test_a_writer_that_left_is_told_nothing() -> None:
    opening = WriterOpening()
    ask(opening, held=True)
    opening.leave()
    assert not opening.waiting
    assert ask(opening).answer is A.NOTHING
    assert not opening.open_channel()


def test_the_zero_guarantee_goes_out_once_whatever_the_resume_ack() -> None:
    for first_resume in (False, True):
        opening = WriterOpening()
        if first_resume:
            ask(opening)
        assert opening.open_channel()
        assert opening.issuing
        for _ in range(3):
            assert not opening.open_channel()
        # The resume Ack is its own rule: the zero guarantee does not settle it.
        assert opening.state is (S.RESUMED if first_resume else S.BOUND)


def test_the_producer_core_resumes_where_the_opening_says() -> None:
    # A reconnecting producer held batches 10.. (sent, not acknowledged); the
    # gateway stored up to 12 before the connection dropped: the resume Ack
    # says 12, and the core counts 10 and 11 as acknowledged.
    batches = StreamBatches("s")
    batches.resume(10, 0, now=0.0)
    for count in (2, 3):
        batches.enqueue(b"x" * count, count, None, opened_at=0.0)
        front = batches.front(1 << 20)
        assert front is not None
        batches.number(front)
        batches.sent()
    batches.connection_lost()
    assert not batches.ready

    step = WriterOpening().resume(
        handle=0, held=False, next_sequence=12, undurable_end=None, durable_position=64
    )
    assert step.ack is not None
    renumbered = batches.resume(step.ack.next_sequence, step.ack.durable_position, now=1.0)
    assert renumbered == 0
    assert batches.ready
    assert [(b.first_sequence, b.count) for b in batches.queue] == [(12, 3)]
    assert batches.records_acked == 2
