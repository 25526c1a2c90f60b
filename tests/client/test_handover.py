"""What a give-up hands back and what resend takes, without I/O: numbered
batches first under their sequences, the open batch last and unnumbered, and
nothing taken that could not be stored exactly once."""

from __future__ import annotations

import pytest

from headgate.client import PendingBatch
from headgate.client.handover import pending_of, resend_by_stream
from headgate.client.open_batch import OpenBatchStream
from headgate.protocol.records import encode_records


def test_a_give_up_hands_back_sent_batches_then_the_queue_then_the_open_batch() -> None:
    s = OpenBatchStream("s")
    s.resume(40, 0, 0.0)  # the gateway's copy of our sequence ends at 40
    for value in (b"sent", b"queued"):
        s.append(value, None, 1 << 20, float("inf"))
        s.seal()
    batch = s.front(1 << 20)
    assert batch is not None
    s.number(batch)
    s.sent()
    s.append(b"open", None, 1 << 20, float("inf"))
    pending = pending_of(s)
    assert [(p.first_sequence, p.record_count) for p in pending] == [(40, 1), (None, 1), (None, 1)]
    assert [p.records()[0] for p in pending] == [[b"sent"], [b"queued"], [b"open"]]
    assert s.values == [b"open"], "handing over takes nothing away"


def block(n: int) -> bytes:
    return encode_records([b"r"] * n)


def test_resend_takes_batches_per_stream_in_order() -> None:
    batches = [
        PendingBatch("a", 10, 2, block(2)),
        PendingBatch("b", None, 1, block(1)),
        PendingBatch("a", 12, 1, block(1)),
        PendingBatch("a", None, 3, block(3)),
    ]
    by_stream = resend_by_stream({"x": batches}, lambda name: False)
    assert [b.first_sequence for b in by_stream["a"]] == [10, 12, None]
    assert [b.first_sequence for b in by_stream["b"]] == [None]
    assert resend_by_stream(batches, lambda name: False) == by_stream


@pytest.mark.parametrize(
    "batches",
    [
        [PendingBatch("a", 10, 2, block(2)), PendingBatch("a", 11, 1, block(1))],  # overlap
        [PendingBatch("a", None, 1, block(1)), PendingBatch("a", 5, 1, block(1))],  # after None
    ],
)
def test_batches_that_could_not_be_stored_exactly_once_are_refused(
    batches: list[PendingBatch],
) -> None:
    with pytest.raises(ValueError, match="must be in sequence order, numbered ones first"):
        resend_by_stream(batches, lambda name: False)


def test_a_stream_already_used_is_refused() -> None:
    with pytest.raises(ValueError, match="stream 'a' was already used by this producer"):
        resend_by_stream([PendingBatch("a", 1, 1, block(1))], lambda name: name == "a")
