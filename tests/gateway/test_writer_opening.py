"""What a new writer hears first, in which order, under every policy.

The order is PROTOCOL.md's lifecycle step 4 and its "When the disk is
full", and :mod:`headgate.protocol.opening` is its one home: the bind; the
``STORAGE_FULL`` notice if the stream is held; the resume Ack if it is due
at once; at the stream's next rebalance the zero guarantee and then the
policy's first grant; a resume Ack that waited (for durability, or for held
batches) after them. Each frame once. First against a real gateway on
loopback, then played by hand with the stream's steps, where the stream can
be held at will.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from headgate.config import FlowSettings
from headgate.costs import batch_cost
from headgate.gateway.policies import Flow, make_flow
from headgate.gateway.streams import Stream, Writer
from headgate.log import StorageError
from headgate.protocol import messages as m
from headgate.protocol.codec import FrameDecoder
from headgate.protocol.errors import ErrorCode
from headgate.protocol.frames import IssueGuarantees, SendGlobal
from headgate.protocol.records import encode_records
from headgate.protocol.session import (
    AckReceived,
    BatchReceived,
    Event,
    GuaranteesReceived,
    Role,
    Session,
    StreamBound,
)
from tests.helpers import SMALL, RawPeer, gateway, run, send_batches

KiB = 1024
MiB = 1024 * KiB
POLICIES = ["credit", "window", "xonxoff"]


def opening_of(events: list[Event], handle: int) -> list[tuple[str, int]]:
    """The Acks and guarantees a handle got, in arrival order: (kind, value)."""
    said: list[tuple[str, int]] = []
    for e in events:
        if isinstance(e, AckReceived) and e.ack.handle == handle:
            said.append(("Ack", e.ack.next_sequence))
        elif isinstance(e, GuaranteesReceived) and e.handle == handle:
            said.append(("IssueGuarantees", e.amount))
    return said


@pytest.mark.parametrize("policy", POLICIES)
def test_a_new_writer_hears_its_resume_ack_then_the_zero_guarantee_then_its_grant(
    tmp_path: Path, policy: str
) -> None:
    async def scenario() -> None:
        async with gateway(tmp_path, **SMALL, policy=policy, window=4) as gw:
            # A first connection stores three batches, all acknowledged.
            first = RawPeer(producer_id=9)
            await first.connect(gw.address)
            handle = await first.bind("A")
            await send_batches(first, handle, 3)
            await first.close()

            # The same producer id again: its resume Ack says where it continues.
            again = RawPeer(producer_id=9, secret=first.secret)
            await again.connect(gw.address)
            bound = again.session.bind_stream("A")
            assert bound is not None
            await again.send()
            await again.until(lambda: len(opening_of(again.events, bound)) >= 3)
            said = opening_of(again.events, bound)
            assert said[0] == ("Ack", 6)  # three batches of two records
            assert said[1] == ("IssueGuarantees", 0)
            assert said[2][0] == "IssueGuarantees" and said[2][1] > 0
            if policy == "window":
                assert said[2][1] == 4 * batch_cost(16 * KiB)
            # Once each: no second zero guarantee, no second resume Ack.
            await again.pump()
            said = opening_of(again.events, bound)
            assert said.count(("IssueGuarantees", 0)) == 1
            assert [s for s in said if s[0] == "Ack"] == [("Ack", 6)]
            await again.close()

    run(scenario())


# --- played by hand ------------------------------------------------------------------

MAX_MESSAGE = 4 * KiB
RECORDS = encode_records([b"v" * 100])


class Connection:
    """A producer session and its gateway session, joined in memory."""

    def __init__(self, producer_id: int) -> None:
        self.producer = Session(Role.PRODUCER, data_cost=batch_cost)
        self.gateway = Session(Role.GATEWAY, data_cost=batch_cost, max_message_size=MAX_MESSAGE)
        self.producer.send_global(m.Hello(producer_id=producer_id, client_name="hand"))
        self.gateway.receive_data(self.producer.data_to_send())
        self.gateway.send_global(
            m.Welcome(server_name="g", max_message_size=MAX_MESSAGE, idle_timeout_ms=0)
        )
        self.gateway.grant(m.STREAM_CHANNEL, 4096)
        self.producer_id = producer_id
        self.said: list[tuple[object, ...]] = []
        self.down()

    def down(self) -> None:
        """Deliver what the gateway queued, noting its frames in order."""
        data = self.gateway.data_to_send()
        for frame in FrameDecoder(max_payload=1 << 20).feed(data):
            if isinstance(frame, IssueGuarantees) and frame.channel >= 2:
                self.said.append(("IssueGuarantees", frame.amount))
            elif isinstance(frame, SendGlobal):
                message = m.decode_global(frame.payload)
                if isinstance(message, m.Ack):
                    self.said.append(("Ack", message.next_sequence))
                elif isinstance(message, m.Error):
                    self.said.append(("Error", message.code))
        self.producer.receive_data(data)

    def bind(self, stream: Stream, flow: Flow) -> Writer:
        """The producer binds ``stream``; the gateway takes it as the server does."""
        handle = self.producer.bind_stream(stream.name)
        assert handle is not None
        events = self.gateway.receive_data(self.producer.data_to_send())
        assert [e for e in events if isinstance(e, StreamBound)]
        writer = Writer(
            session=self.gateway,
            stream=stream.name,
            flush=lambda: None,
            handle=handle,
            producer_id=self.producer_id,
            last_active=0.0,
        )
        # What the gateway does with StreamBound, then its rebalance soon after.
        stream.add_writer(writer)
        stream.announce_resume(writer)
        self.down()
        return writer

    def send(self, flow: Flow, writer: Writer, sequence: int) -> None:
        assert self.producer.send_batch(writer.handle, sequence, RECORDS)
        for event in self.gateway.receive_data(self.producer.data_to_send()):
            assert isinstance(event, BatchReceived)
            flow.receive(
                writer,
                event.first_sequence,
                event.record_count,
                event.records,
                now=0.0,
                timestamp_us=1,
            )


def open_stream(data_dir: Path, policy: str) -> tuple[Stream, Flow]:
    stream = Stream.open(
        "s", data_dir, capacity=4 * MiB, term_length=64 * KiB, max_message_size=MAX_MESSAGE
    )
    flow = make_flow(
        stream,
        FlowSettings(policy=policy, window=2, xoff=1 * MiB, xon=256 * KiB),
        max_message_size=MAX_MESSAGE,
        mark_dirty=lambda: None,
    )
    return stream, flow


def grants(said: list[tuple[object, ...]]) -> list[tuple[object, ...]]:
    return [s for s in said if s[0] == "IssueGuarantees" and s[1] != 0]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_resume_ack_over_undurable_batches_follows_the_zero_guarantee_and_the_grant(
    tmp_path: Path, policy: str
) -> None:
    stream, flow = open_stream(tmp_path, policy)
    try:
        old = Connection(producer_id=7)
        writer = old.bind(stream, flow)
        flow.rebalance(0.0)
        old.down()
        assert old.said[:2] == [("Ack", 0), ("IssueGuarantees", 0)]
        old.send(flow, writer, 0)
        old.send(flow, writer, 1)
        assert stream.log.durable_position < stream.log.tail_position

        # A new connection of the same producer, before the group commit.
        new = Connection(producer_id=7)
        new_writer = new.bind(stream, flow)
        assert new.said == []  # the resume Ack waits for durability
        flow.rebalance(0.0)
        new.down()
        assert new.said[0] == ("IssueGuarantees", 0)
        assert len(grants(new.said)) == 1
        stream.log.sync()
        stream.on_durable()
        new.down()
        assert new.said[-1] == ("Ack", 2)
        assert [s for s in new.said if s[0] == "Ack"] == [("Ack", 2)]
        flow.rebalance(0.0)
        new.down()
        assert new.said.count(("IssueGuarantees", 0)) == 1
        stream.remove_writer(new_writer)
    finally:
        stream.close()


@pytest.mark.parametrize("policy", POLICIES)
def test_a_held_stream_tells_a_new_writer_first_then_resumes_it_once_stored(
    tmp_path: Path, policy: str
) -> None:
    stream, flow = open_stream(tmp_path, policy)
    try:
        stream.sync_failed(StorageError("no space", tmp_path, errno.ENOSPC))
        conn = Connection(producer_id=7)
        conn.bind(stream, flow)
        assert conn.said == [("Error", ErrorCode.STORAGE_FULL)]  # and no resume Ack
        flow.rebalance(0.0)
        conn.down()
        assert conn.said[1] == ("IssueGuarantees", 0)
        assert not [s for s in conn.said if s[0] == "Ack"]
        opening = conn.said[:]

        # The commit succeeds again, the storage is retried: the resume Ack, once.
        stream.log.sync()
        stream.on_durable()
        assert stream.retry_storage()
        conn.down()
        assert conn.said[len(opening) :] == [("Ack", 0)]
        stream.retry_storage()
        flow.rebalance(0.0)
        conn.down()
        assert [s for s in conn.said if s[0] == "Ack"] == [("Ack", 0)]
        assert conn.said.count(("IssueGuarantees", 0)) == 1
    finally:
        stream.close()


def test_a_writer_that_left_while_its_resume_ack_waited_is_told_nothing(tmp_path: Path) -> None:
    stream, flow = open_stream(tmp_path, "credit")
    try:
        stream.sync_failed(StorageError("no space", tmp_path, errno.ENOSPC))
        gone = Connection(producer_id=7)
        gone_writer = gone.bind(stream, flow)
        stays = Connection(producer_id=8)
        stays.bind(stream, flow)
        stream.remove_writer(gone_writer)
        stream.log.sync()
        stream.on_durable()
        assert stream.retry_storage()
        gone.down()
        stays.down()
        assert [s for s in gone.said if s[0] == "Ack"] == []
        assert [s for s in stays.said if s[0] == "Ack"] == [("Ack", 0)]
    finally:
        stream.close()
