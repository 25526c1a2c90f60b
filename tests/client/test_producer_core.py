"""The producer's sans-IO core: sequences, resume and resend, in memory, time as an argument.

A stream's batches are driven against a model of the gateway's rule for one
producer's sequence on one stream: it stores a batch that starts where its
copy ends, drops one that it holds already (a duplicate), and refuses one
that skips ahead. Connections are lost with batches in flight and with
their acknowledgements lost; whatever happens, each record is stored once
and in order.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from headgate.client.batches import encode_blocks, split_block
from headgate.client.producer_core import Batch, StreamBatches, check_resend_order
from headgate.protocol.records import (
    BLOCK_BASE,
    KEYED_BLOCK_BASE,
    block_size,
    decode_records,
    encode_records,
    record_cost,
)


@dataclass
class GatewayCopy:
    """The gateway's copy of one producer's sequence on one stream."""

    values: list[bytes] = field(default_factory=list)
    duplicates: int = 0

    @property
    def end(self) -> int:
        return len(self.values)

    def receive(self, batch: Batch) -> None:
        first, count = batch.first_sequence, batch.count
        assert first >= 0, "a batch goes out numbered"
        if first + count <= self.end:
            self.duplicates += 1
            return
        assert first == self.end, f"batch at {first} skips ahead of {self.end} (or overlaps)"
        values, _ = decode_records(batch.block).to_lists()
        self.values.extend(values)


@dataclass
class Waiter:
    """A Delivery's bookkeeping, without futures."""

    first: int | None = None
    pending: int = 0
    acked: int = 0
    failed: BaseException | None = None

    def _numbered(self, first_sequence: int) -> None:
        if self.first is None:
            self.first = first_sequence

    def _unnumbered(self, first_sequence: int) -> None:
        if self.first == first_sequence:
            self.first = None

    def _acked(self, durable_position: int) -> None:
        self.acked += 1

    def _split(self, extra: int) -> None:
        self.pending += extra

    def _fail(self, error: BaseException) -> None:
        self.failed = error


def batch_of(prefix: str, start: int, count: int) -> bytes:
    return encode_records([f"{prefix}-{i:05d}".encode() for i in range(start, start + count)])


def send_all(stream: StreamBatches, copy: GatewayCopy, limit: int = 1 << 20) -> list[Batch]:
    """Send every queued batch (as the adapter's pump does) into ``copy``."""
    sent = []
    while (batch := stream.front(limit)) is not None:
        stream.number(batch)
        stream.sent()
        copy.receive(batch)
        sent.append(batch)
    return sent


# --- sequences --------------------------------------------------------------------


def test_batches_wait_for_the_initial_ack_then_number_on_from_where_the_gateway_is() -> None:
    stream = StreamBatches("s")
    stream.enqueue(batch_of("a", 0, 3), 3, None, opened_at=0.0)
    stream.enqueue(batch_of("a", 3, 2), 2, None, opened_at=0.0)
    assert stream.front(1 << 20) is None, "nothing goes before the initial Ack"

    copy = GatewayCopy(values=[b"earlier"] * 10)  # an earlier run stored 10 records
    assert stream.resume(copy.end, durable_position=0, now=1.0) == 0
    sent = send_all(stream, copy)
    assert [(b.first_sequence, b.count) for b in sent] == [(10, 3), (13, 2)]
    assert stream.next_sequence == 15
    assert stream.ack(15, durable_position=99, now=2.0) == 2
    assert stream.acked_batches == stream.sealed_batches == 2
    assert stream.buffered == 0 and not stream.unacked and not stream.queue


def test_resume_after_a_reconnect_resends_what_is_in_flight_under_the_same_sequences() -> None:
    """Three batches in flight; the first is acked, the second stored but its Ack lost."""
    stream = StreamBatches("s")
    copy = GatewayCopy()
    stream.resume(0, durable_position=0, now=0.0)
    for i in range(3):
        stream.enqueue(batch_of("r", 4 * i, 4), 4, None, opened_at=0.0)
    first_send = send_all(stream, copy)
    numbers = [b.first_sequence for b in first_send]
    assert numbers == [0, 4, 8]
    stream.ack(4, durable_position=1, now=0.5)  # the only Ack that arrives
    copy.values = copy.values[:8]  # the third batch was lost on the wire

    stream.connection_lost()
    assert [b.first_sequence for b in stream.queue] == [4, 8], "back to the front, in order"
    assert stream.front(1 << 20) is None, "and they wait for the new connection's initial Ack"
    stream.enqueue(batch_of("r", 12, 4), 4, None, opened_at=1.0)  # a new batch behind them

    stream.resume(copy.end, durable_position=2, now=1.0)  # the gateway holds 8
    assert stream.acked_batches == 2, "the batch stored before counts as acknowledged"
    resent = send_all(stream, copy)
    assert [(b.first_sequence, b.count) for b in resent] == [(8, 4), (12, 4)]
    assert copy.values == [f"r-{i:05d}".encode() for i in range(16)]
    assert copy.duplicates == 0


def test_a_resend_of_what_the_gateway_stored_already_is_a_duplicate_it_drops() -> None:
    """The connection is lost before the initial Ack says what is stored: resent, then dropped."""
    stream = StreamBatches("s")
    copy = GatewayCopy()
    stream.resume(0, durable_position=0, now=0.0)
    stream.enqueue(batch_of("d", 0, 5), 5, None, opened_at=0.0)
    (batch,) = send_all(stream, copy)
    stream.connection_lost()
    # The adapter resends on a session whose initial Ack predates the store
    # (a gateway that still recovers the stream says 0): the same sequence goes.
    stream.resume(0, durable_position=0, now=1.0)
    (again,) = send_all(stream, copy)
    assert again is batch and again.first_sequence == 0
    assert copy.duplicates == 1 and len(copy.values) == 5


def test_a_gap_in_numbered_batches_renumbers_from_the_gap_on() -> None:
    waiter = Waiter()
    stream = StreamBatches("s")
    for first, count in ((0, 2), (2, 2), (7, 3)):  # 4..6 missing (a damaged spool entry)
        batch = stream.enqueue(batch_of("g", first, count), count, waiter, opened_at=0.0)
        batch.first_sequence = first
        waiter._numbered(first)
    assert stream.resume(2, durable_position=0, now=0.0) == 1
    assert [b.first_sequence for b in stream.queue] == [2, -1]
    copy = GatewayCopy(values=[b"x", b"y"])
    sent = send_all(stream, copy)
    assert [(b.first_sequence, b.count) for b in sent] == [(2, 2), (4, 3)]
    assert waiter.first == 0


def test_latency_is_measured_from_the_batch_opening_to_the_ack_time_given() -> None:
    stream = StreamBatches("s")
    stream.resume(0, durable_position=0, now=0.0)
    stream.enqueue(batch_of("t", 0, 1), 1, None, opened_at=10.0)
    send_all(stream, GatewayCopy())
    stream.ack(1, durable_position=5, now=10.25)
    summary = stream.latency.summary(10.25)
    assert summary is not None and summary.max == pytest.approx(0.25)


# --- cutting a batch to the gateway's limit ------------------------------------------


def test_a_batch_larger_than_the_limit_goes_in_pieces_that_cover_its_sequence_range() -> None:
    waiter = Waiter(pending=1)
    stream = StreamBatches("s")
    block = batch_of("c", 0, 400)
    stream.enqueue(block, 400, waiter, opened_at=0.0)
    stream.resume(100, durable_position=0, now=0.0)
    limit = len(block) // 3
    copy = GatewayCopy(values=[b"old"] * 100)
    sent = send_all(stream, copy, limit)
    assert len(sent) >= 3 and all(len(b.block) <= limit for b in sent)
    assert [b.first_sequence for b in sent] == [
        100 + sum(b.count for b in sent[:i]) for i in range(len(sent))
    ]
    assert copy.values[100:] == decode_records(block).to_lists()[0]
    assert waiter.first == 100 and waiter.pending == len(sent)
    assert stream.buffered == sum(len(b.block) for b in sent)

    # A flush counts the batch as sealed: done only with its last piece.
    stream.ack(sent[-1].first_sequence, durable_position=1, now=1.0)
    assert stream.acked_batches == 0 and waiter.acked == len(sent) - 1
    stream.ack(500, durable_position=2, now=1.0)
    assert stream.acked_batches == stream.sealed_batches == 1 and waiter.acked == len(sent)
    assert stream.buffered == 0


def test_a_numbered_batch_cut_after_a_reconnect_keeps_its_numbers_and_dedups() -> None:
    """Sent whole and stored; after a reconnect the gateway's frames are smaller."""
    stream = StreamBatches("s")
    copy = GatewayCopy()
    stream.resume(0, durable_position=0, now=0.0)
    stream.enqueue(batch_of("n", 0, 60), 60, None, opened_at=0.0)
    stream.enqueue(batch_of("n", 60, 60), 60, None, opened_at=0.0)
    send_all(stream, copy)  # both stored, no Ack arrives
    stream.connection_lost()
    stream.resume(0, durable_position=0, now=1.0)  # its initial Ack is stale: resend all
    resent = send_all(stream, copy, limit=300)
    assert len(resent) > 2
    assert copy.duplicates == len(resent), "every piece falls inside what is stored"
    assert copy.values == [f"n-{i:05d}".encode() for i in range(120)]


def test_a_record_larger_than_the_limit_cannot_be_cut() -> None:
    stream = StreamBatches("s")
    stream.enqueue(encode_records([b"x" * 500]), 1, None, opened_at=0.0)
    stream.resume(0, durable_position=0, now=0.0)
    with pytest.raises(ValueError, match="does not fit"):
        stream.front(200)


@pytest.mark.parametrize("seed", range(20))
def test_any_pattern_of_lost_connections_stores_each_record_once_in_order(seed: int) -> None:
    """Random sends, Acks, lost Acks, lost batches and shrinking limits; exactly once holds."""
    rng = random.Random(seed)
    stream = StreamBatches("s")
    copy = GatewayCopy()
    produced = 0
    broken = False  # TCP: after a batch is lost, the rest of its connection is lost too
    stream.resume(0, durable_position=0, now=0.0)
    for step in range(200):
        action = rng.random()
        if action < 0.4:
            count = rng.randint(1, 30)
            stream.enqueue(batch_of("p", produced, count), count, None, opened_at=float(step))
            produced += count
        elif action < 0.7 and stream.ready:
            limit = rng.choice((1 << 20, 400, 200))
            while (batch := stream.front(limit)) is not None and rng.random() < 0.8:
                stream.number(batch)
                stream.sent()
                broken = broken or rng.random() < 0.1
                if not broken:
                    copy.receive(batch)
        elif action < 0.85 and stream.ready:
            if rng.random() < 0.7:
                stream.ack(copy.end, durable_position=step, now=float(step))
        else:
            stream.connection_lost()
            broken = False
            # Batches lost on the wire are lost for good: the gateway's copy
            # is what it has; the initial Ack says so.
            stream.resume(copy.end, durable_position=step, now=float(step))
    stream.connection_lost()
    stream.resume(copy.end, durable_position=0, now=1e3)
    send_all(stream, copy)
    stream.ack(copy.end, durable_position=0, now=1e3)
    assert copy.values == [f"p-{i:05d}".encode() for i in range(produced)]
    assert stream.acked_batches == stream.sealed_batches
    assert stream.buffered == 0 and stream.next_sequence == produced


# --- the batch builder uses the records module's size rules -----------------------


@pytest.mark.parametrize("keyed", [False, True])
def test_blocks_are_cut_within_the_limit_and_the_size_rule_bounds_them(keyed: bool) -> None:
    rng = random.Random(7)
    values = [bytes(rng.randrange(256) for _ in range(rng.randint(0, 90))) for _ in range(500)]
    keys = (
        [None if rng.random() < 0.3 else b"k" * rng.randint(0, 9) for _ in values]
        if keyed
        else None
    )
    blocks = encode_blocks(values, keys, 1000)
    assert sum(count for _, count in blocks) == 500
    joined: list[bytes] = []
    for block, count in blocks:
        assert len(block) <= 1000
        view = decode_records(block)
        assert view.record_count == count
        joined.extend(view.to_lists()[0])
        chunk_values, chunk_keys = view.to_lists()
        exact = block_size(
            count,
            sum(map(len, chunk_values)),
            None if chunk_keys is None else sum(len(k) for k in chunk_keys if k is not None),
        )
        assert exact == len(block), "block_size is the layout's exact total"
        estimate = (KEYED_BLOCK_BASE if keyed else BLOCK_BASE) + sum(
            record_cost(
                len(v),
                None if chunk_keys is None or chunk_keys[i] is None else len(chunk_keys[i] or b""),
                keyed=keyed,
            )
            for i, v in enumerate(chunk_values)
        )
        assert estimate >= len(block), "the per-record rule never under-estimates"
    assert joined == values
    assert [
        b
        for piece, _ in split_block(encode_records(values, keys), 1000)
        for b in decode_records(piece).to_lists()[0]
    ] == values


def test_a_batch_the_gateway_holds_a_prefix_of_sends_only_the_rest() -> None:
    """A spooled batch went in pieces before a crash; the gateway stored the first pieces.

    The producer that recovers the spool holds it whole, under its numbers:
    the initial Ack falls inside it, and only the records after it go.
    """
    stream = StreamBatches("s")
    recovered = stream.enqueue(batch_of("w", 0, 50), 50, None, opened_at=0.0)
    recovered.first_sequence = 0
    stream.enqueue(batch_of("w", 50, 10), 10, None, opened_at=0.0)
    copy = GatewayCopy(values=[f"w-{i:05d}".encode() for i in range(30)])  # pieces of 0..29
    assert stream.resume(copy.end, durable_position=0, now=0.0) == 0
    sent = send_all(stream, copy)
    assert [(b.first_sequence, b.count) for b in sent] == [(30, 20), (50, 10)]
    assert copy.values == [f"w-{i:05d}".encode() for i in range(60)]
    assert copy.duplicates == 0
    stream.ack(60, durable_position=1, now=1.0)
    assert stream.acked_batches == stream.sealed_batches == 2
    assert stream.records_acked == 60 and stream.buffered == 0


def test_adopted_batches_keep_their_numbers_and_must_come_in_order() -> None:
    check_resend_order("s", [(0, 5), (5, 3), (None, 4), (None, 1)])
    for wrong in ([(5, 3), (0, 5)], [(None, 4), (9, 1)], [(0, 5), (3, 5)]):
        with pytest.raises(ValueError, match="sequence order"):
            check_resend_order("s", wrong)

    waiter = Waiter()
    stream = StreamBatches("s")
    assert not stream.used
    stream.adopt(batch_of("o", 0, 5), 5, waiter, opened_at=0.0, first_sequence=0)
    stream.adopt(batch_of("o", 5, 2), 2, waiter, opened_at=0.0, first_sequence=None)
    assert stream.used and waiter.first == 0
    copy = GatewayCopy(values=[f"o-{i:05d}".encode() for i in range(3)])  # a lost Ack's worth
    stream.resume(copy.end, durable_position=0, now=0.0)
    # The gateway holds 3 of the first batch's 5: the rest and the unnumbered one go.
    sent = send_all(stream, copy)
    assert [(b.first_sequence, b.count) for b in sent] == [(3, 2), (5, 2)]
    assert copy.values == [f"o-{i:05d}".encode() for i in range(7)]
