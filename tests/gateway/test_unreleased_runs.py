"""Released space comes back a run of batches at a time, to the byte.

A real stream log and a gateway session fed by a producer session in memory
(the gateway's write path played by hand, as in test_held_batches). The
producer sends small batches under the credit policy; the consumer releases
in steps that end inside runs and at their ends. The writer's channel must
free exactly the bytes of the runs a release covers, nothing of a run it
ends inside, and that run's bytes at the next release covering its end.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from headgate.config import FlowSettings
from headgate.costs import batch_cost
from headgate.gateway.policies import make_flow
from headgate.gateway.streams import RUN_CAPACITY_FRACTION, Stream, Writer
from headgate.protocol import messages as m
from headgate.protocol.records import encode_records
from headgate.protocol.session import BatchReceived, Role, Session, StreamBound

pytestmark = pytest.mark.timeout(60)

KiB = 1024
MiB = 1024 * KiB
MAX_MESSAGE = 4 * KiB
RECORDS = encode_records([b"v" * 200])
COST = batch_cost(m.BATCH_HEADER_SIZE + len(RECORDS))


class Rig:
    """One producer, one gateway stream under the credit policy, stepped by hand."""

    def __init__(self, data_dir: Path) -> None:
        self.stream = Stream.open(
            "s", data_dir, capacity=8 * MiB, term_length=256 * KiB, max_message_size=MAX_MESSAGE
        )
        self.producer = Session(Role.PRODUCER, data_cost=batch_cost)
        self.gateway = Session(Role.GATEWAY, data_cost=batch_cost, max_message_size=MAX_MESSAGE)
        self.producer.send_global(m.Hello(producer_id=7, client_name="rig"))
        self.gateway.receive_data(self.producer.data_to_send())
        self.gateway.send_global(
            m.Welcome(server_name="g", max_message_size=MAX_MESSAGE, idle_timeout_ms=0)
        )
        self.gateway.grant(m.STREAM_CHANNEL, 4096)
        self.producer.receive_data(self.gateway.data_to_send())
        handle = self.producer.bind_stream("s")
        assert handle is not None
        self.handle = handle
        events = self.gateway.receive_data(self.producer.data_to_send())
        assert [e for e in events if isinstance(e, StreamBound)]
        self.writer = Writer(
            session=self.gateway,
            stream="s",
            flush=lambda: None,
            handle=handle,
            producer_id=7,
            last_active=0.0,
        )
        self.stream.add_writer(self.writer)
        self.flow = make_flow(
            self.stream,
            FlowSettings(policy="credit", window=4, xoff=MiB, xon=KiB),
            max_message_size=MAX_MESSAGE,
            mark_dirty=lambda: None,
        )
        self.flow.rebalance(0.0)
        self.producer.receive_data(self.gateway.data_to_send())
        self.sequence = 0
        #: Where each batch sent ends in the log, in order.
        self.ends: list[int] = []

    def send(self, batches: int) -> None:
        """Send and store ``batches`` batches (within guarantees), then make them durable."""
        for _ in range(batches):
            assert self.producer.can_send_batch(self.handle, len(RECORDS))
            assert self.producer.send_batch(self.handle, self.sequence, RECORDS)
            self.sequence += 1
            for event in self.gateway.receive_data(self.producer.data_to_send()):
                assert isinstance(event, BatchReceived)
                self.flow.receive(
                    self.writer,
                    event.first_sequence,
                    event.record_count,
                    event.records,
                    now=0.0,
                    timestamp_us=1,
                )
                self.ends.append(self.stream.log.tail_position)
        self.stream.log.sync()
        self.stream.on_durable()


def test_a_release_frees_whole_runs_and_a_partial_run_at_the_next_release(
    tmp_path: Path,
) -> None:
    rig = Rig(tmp_path / "data")
    channel = rig.writer.inbound
    limit = channel.capacity // RUN_CAPACITY_FRACTION
    per_run = limit // COST
    assert per_run >= 4, "the rig wants runs of several batches"
    rig.send(4 * per_run)
    sent = len(rig.ends) * COST
    assert channel.buffered_bytes == sent
    # Runs, not batches: a handful of entries in the writer's books and one
    # in the channel's buffer.
    assert len(rig.writer.unreleased) <= 2 * sent // limit + 1
    capacity = channel.capacity
    issuable = channel.issuable

    # Runs fill to the limit: ``per_run`` batches each, while the capacity
    # stays as it is. A release that ends inside the second run frees the
    # first, whole, and nothing of the second.
    rig.stream.release(rig.ends[per_run + per_run // 2])
    assert sent - channel.buffered_bytes == per_run * COST
    assert channel.issuable - issuable == per_run * COST, "what is freed is reissued"
    assert channel.capacity == capacity
    # Still inside it: nothing more.
    rig.stream.release(rig.ends[2 * per_run - 2])
    assert sent - channel.buffered_bytes == per_run * COST
    # The release that covers its last batch frees all of it.
    rig.stream.release(rig.ends[2 * per_run - 1])
    assert sent - channel.buffered_bytes == 2 * per_run * COST
    assert channel.issuable - issuable == 2 * per_run * COST

    # The next release past the run's end frees it: at the tail, everything.
    rig.stream.release(rig.ends[-1])
    assert channel.buffered_bytes == 0
    assert channel.buffered_messages == 0
    assert channel.issuable - issuable == sent
    assert channel.capacity == capacity
    assert len(rig.writer.unreleased) == 0

    # The producer's books agree with the gateway's, to the byte.
    rig.flow.rebalance(0.0)
    rig.producer.receive_data(rig.gateway.data_to_send())
    assert rig.producer.outbound(m.data_channel(rig.handle)).guarantees == (
        channel.client_guarantees
    )
    # And the credit goes on: the writer sends again.
    rig.send(per_run)
    rig.stream.release(rig.ends[-1])
    assert channel.buffered_bytes == 0


def test_a_writer_above_its_share_gets_back_only_up_to_its_share(tmp_path: Path) -> None:
    rig = Rig(tmp_path / "data")
    channel = rig.writer.inbound
    rig.send(64)
    sent = 64 * COST
    # Its share drops below what it holds (a newcomer, or a smaller log).
    share = channel.capacity - sent // 2
    rig.stream.shares = lambda now, limited=None: {id(rig.writer): share}  # type: ignore[method-assign]
    issuable = channel.issuable
    rig.stream.release(rig.ends[-1])
    assert channel.buffered_bytes == 0
    assert channel.capacity == share, "the buffer shrank to the share, not below"
    assert channel.issuable - issuable == sent - sent // 2
