"""Every policy bounds what a stream holds in memory while its disk is full.

The gateway's write path is played by hand, with time as an argument: a
producer session and a gateway session joined in memory, a real stream log
on a small disk (tests/_small_disk.py) that the test fills, and the steps the
gateway's loops take (deliver, append, group commit, rebalance, retry the
storage). The producer sends a batch whenever its guarantees allow (the
``xonxoff`` one whenever its connection is not paused), thousands of times.
Whatever the policy, the stream must stop taking batches into memory: the
held bytes stay within what the policy promised before the disk filled, and
no guarantee is issued while the stream is held.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from headgate.client import Producer
from headgate.config import FlowSettings, StreamSettings
from headgate.costs import batch_cost
from headgate.gateway.policies import Flow, make_flow
from headgate.gateway.streams import Stream, Writer
from headgate.log import LogError
from headgate.protocol import messages as m
from headgate.protocol.codec import FrameDecoder
from headgate.protocol.frames import IssueGuarantees
from headgate.protocol.records import encode_records
from headgate.protocol.session import BatchReceived, Role, Session, StreamBound
from tests._small_disk import SmallDisk, small_disk
from tests.helpers import gateway, run

pytestmark = pytest.mark.timeout(120)

KiB = 1024
MiB = 1024 * KiB
MAX_MESSAGE = 4 * KiB
WINDOW = 2
#: Above what the log holds when the disk fills (about two terms), so that
#: ``xonxoff`` has not paused before it.
XOFF = 256 * KiB
XON = 64 * KiB
#: Writes the producer attempts once the disk is full.
ATTEMPTS = 3000
#: Bytes of records in one batch: about 1 KiB, as in the review's reproduction.
RECORDS = encode_records([b"v" * 1000])
COST = batch_cost(m.BATCH_HEADER_SIZE + len(RECORDS))


class Rig:
    """A producer and a gateway stream under ``policy``, driven step by step."""

    def __init__(self, data_dir: Path, policy: str) -> None:
        self.stream = Stream.open(
            "s",
            data_dir,
            capacity=4 * MiB,
            term_length=64 * KiB,
            max_message_size=MAX_MESSAGE,
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
        self.paused = False
        self.writer = Writer(
            session=self.gateway,
            stream="s",
            flush=lambda: None,
            handle=handle,
            producer_id=7,
            last_active=0.0,
            throttle=self._throttle,
        )
        self.stream.add_writer(self.writer)
        self.flow: Flow = make_flow(
            self.stream,
            FlowSettings(policy=policy, window=WINDOW, xoff=XOFF, xon=XON),
            max_message_size=MAX_MESSAGE,
            mark_dirty=lambda: None,
        )
        self.sequence = 0
        self.now = 0.0
        #: Guarantees the gateway issued since :meth:`count_guarantees` was reset.
        self.issued = 0
        self.flow.rebalance(self.now)
        self.deliver_down()

    def _throttle(self, reason: str, pause: bool) -> None:
        self.paused = pause

    def deliver_down(self) -> None:
        data = self.gateway.data_to_send()
        for frame in FrameDecoder(max_payload=1 << 20).feed(data):
            if isinstance(frame, IssueGuarantees):
                self.issued += frame.amount
        self.producer.receive_data(data)

    def step(self) -> None:
        """One turn: maybe a batch, its append, a group commit and a rebalance."""
        self.now += 0.002
        if not self.paused and self.producer.can_send_batch(self.handle, len(RECORDS)):
            assert self.producer.send_batch(self.handle, self.sequence, RECORDS)
            self.sequence += 1
            for event in self.gateway.receive_data(self.producer.data_to_send()):
                assert isinstance(event, BatchReceived)
                self.flow.receive(
                    self.writer,
                    event.first_sequence,
                    event.record_count,
                    event.records,
                    now=self.now,
                    timestamp_us=1,
                )
        self.commit()
        self.deliver_down()

    def commit(self) -> None:
        """The gateway's group commit, then its retry of held storage, then a rebalance."""
        try:
            self.stream.log.sync()
        except LogError as exc:
            self.stream.sync_failed(exc)
        else:
            self.stream.on_durable()
        if self.stream.storage_error is not None:
            self.stream.retry_storage()
        self.flow.rebalance(self.now)

    def held_bytes(self) -> int:
        return self.flow.statistics().held_bytes


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[SmallDisk]:
    with small_disk(tmp_path, 1 * MiB) as disk:
        yield disk


def terms_reserved(data_dir: Path) -> bool:
    return (data_dir / "streams" / "s" / f"{1:016x}.term").exists()


@pytest.mark.parametrize("policy", ["credit", "window", "xonxoff"])
def test_a_full_disk_bounds_what_every_policy_holds_in_memory(disk: SmallDisk, policy: str) -> None:
    data_dir = disk.directory / "data"
    rig = Rig(data_dir, policy)
    for _ in range(500):  # bounded: until batches reach the log and term 1 is reserved
        rig.step()
        if terms_reserved(data_dir):
            break
    assert terms_reserved(data_dir)
    assert rig.stream.storage_error is None
    try:
        disk.fill(os.getpid())
        for _ in range(ATTEMPTS):
            rig.step()
            if rig.stream.storage_error is not None:
                break
        assert rig.stream.storage_error is not None, "the disk never filled"
        # Held from here on: every guarantee issued now would be memory.
        rig.issued = 0
        sent_before = rig.sequence
        for _ in range(ATTEMPTS):
            rig.step()
        held = rig.held_bytes()
        sent = rig.sequence - sent_before
        assert rig.stream.storage_error is not None
        if policy == "window":
            # No more than the window in memory, and no slot handed back while held.
            bound = WINDOW * batch_cost(MAX_MESSAGE)
        elif policy == "xonxoff":
            # Paused at xoff; what was read before the pause took hold (one batch).
            assert rig.paused
            bound = XOFF + COST
        else:
            bound = rig.stream.log.capacity
        assert held <= bound, (policy, held, bound, sent)
        assert sent * COST <= bound, (policy, sent)
        if policy != "xonxoff":  # xonxoff's guarantees are a formality, topped up freely
            assert rig.issued <= bound, (policy, rig.issued)
    finally:
        disk.free(os.getpid())
    # Space returns: everything held is stored, in order, and flow resumes.
    for _ in range(200):
        rig.step()
        if rig.stream.storage_error is None and rig.held_bytes() == 0:
            break
    assert rig.stream.storage_error is None
    assert rig.held_bytes() == 0
    assert rig.stream.dedup[7] == rig.sequence


# --- the same against a real gateway --------------------------------------------------


@pytest.mark.parametrize("policy", ["window", "xonxoff"])
def test_a_real_gateway_holds_no_more_under_window_or_xonxoff_when_the_disk_fills(
    tmp_path: Path, policy: str
) -> None:
    # In-process, so the disk must be a tmpfs (the fallback would limit the
    # file size of the test process itself).
    with small_disk(tmp_path, 2 * MiB) as disk:
        if disk.mode != "tmpfs":
            pytest.skip(
                "needs a tmpfs to fill (mounting not permitted, or HEADGATE_TEST_DISK=rlimit)"
            )
        run(_real_gateway_scenario(disk, policy), timeout=60)


async def _real_gateway_scenario(disk: SmallDisk, policy: str) -> None:
    data_dir = disk.directory / "data"
    async with gateway(
        data_dir,
        term_length=64 * KiB,
        max_message_size=16 * KiB,
        streams={
            # xoff far above where the disk fills, however fast the producer
            # was when the test filled it: the pause must come from held bytes.
            "s": StreamSettings(
                capacity=4 * MiB, policy=policy, window=WINDOW, xoff=1 * MiB, xon=256 * KiB
            )
        },
    ) as gw:
        producer = Producer(
            gw.address,
            producer_id=7,
            policy="window" if policy == "window" else "wait",
            linger_ms=1,
            max_batch_bytes=2 * KiB,
            max_buffered_bytes=4 * MiB,
        )
        await producer.connect()
        sent = 0

        async def send_forever() -> None:
            nonlocal sent
            for i in range(200_000):  # bounded; cancelled long before
                await producer.send("s", b"%08d" % i + b"v" * 200)
                sent += 1

        sending = asyncio.create_task(send_forever())
        try:
            await until(lambda: terms_reserved(data_dir), 20, "term 1")
            disk.fill(os.getpid())
            await until(
                lambda: producer.statistics().streams["s"].storage_full is not None,
                20,
                "the STORAGE_FULL notice",
            )
            flow = gw.flow(gw.streams["s"])
            await asyncio.sleep(0.5)  # whatever was on its way arrives
            held = flow.statistics().held_bytes
            sent_then = sent
            await asyncio.sleep(1.0)  # the producer keeps trying
            stats = flow.statistics()
            if policy == "window":
                assert stats.peak_held_bytes <= WINDOW * batch_cost(16 * KiB)
            else:
                assert stats.paused
            # Nothing more was taken into memory, whatever the producer tried.
            assert stats.held_bytes == held, (held, stats.held_bytes, sent - sent_then)
        finally:
            sending.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sending
            disk.free(os.getpid())
        await until(lambda: gw.streams["s"].storage_error is None, 20, "recovery")
        await until(lambda: flow.statistics().held_bytes == 0, 20, "the held batches stored")
        await producer.abort()  # what it still buffers would fill the small disk again


async def until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)
