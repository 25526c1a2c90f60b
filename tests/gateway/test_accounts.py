"""Accounts and loans (seed broker-internal-flow-control.txt), alone and in the gateway."""

from __future__ import annotations

import asyncio
import random
import socket
from pathlib import Path

import pytest

from headgate.gateway import Gateway
from headgate.gateway.accounts import Account, DurabilityLoans, Loan, ReadPauses
from headgate.protocol import messages as m
from headgate.protocol.records import encode_records
from headgate.protocol.session import MessageReceived
from tests.helpers import RawPeer, config, ping_pairs, stored

pytestmark = pytest.mark.timeout(60)


def test_loans_always_balance() -> None:
    """Whatever is borrowed and repaid, in any order, the debt is what is
    still out, and nothing out means no debt."""
    rng = random.Random(3)
    account = Account("a", threshold=50)
    out: list[Loan] = []
    for _ in range(2000):
        if out and rng.random() < 0.5:
            out.pop(rng.randrange(len(out))).repay()
        else:
            out.append(account.loan(rng.randint(0, 5)))
        assert account.debt == sum(loan.units for loan in out)
    for loan in out:
        loan.repay()
    assert account.debt == 0 and not account.over
    assert account.statistics().loans == account.loans >= 1000


def test_a_loan_is_repaid_once_by_hand_or_by_its_with_block() -> None:
    account = Account("a", threshold=10)
    with account.loan(3) as loan:
        assert account.debt == 3 and not loan.repaid
    assert account.debt == 0 and loan.repaid
    with pytest.raises(RuntimeError, match="already repaid"):
        loan.repay()
    with pytest.raises(KeyError), account.loan(2):
        raise KeyError("the work failed")
    assert account.debt == 0, "a failed piece of work is still done"
    early = account.loan(4)
    with early:
        early.repay()  # repaid inside the block: leaving it repays nothing more
    assert account.debt == 0


def test_fan_out_is_charged_to_the_cause_until_each_copy_is_delivered() -> None:
    # The seed's example: one record routed to ten subscribers costs its
    # producer's connection ten units until each subscriber has its copy.
    producer = Account("producer", threshold=5)
    subscribers = [Account(f"subscriber {i}", threshold=5) for i in range(10)]
    deliveries = [producer.loan(1) for _ in subscribers]
    assert producer.debt == 10 and producer.over
    assert all(s.debt == 0 for s in subscribers), "the subscribers owe nothing"
    for loan in deliveries[:5]:
        loan.repay()
    assert producer.debt == 5 and producer.over, "over until back at half the threshold"
    deliveries[5].repay()
    deliveries[6].repay()
    assert producer.debt == 3 and producer.over
    deliveries[7].repay()
    assert producer.debt == 2 and not producer.over
    for loan in deliveries[8:]:
        loan.repay()
    assert producer.debt == 0


def test_crossing_the_threshold_pauses_and_half_of_it_resumes() -> None:
    calls: list[bool] = []
    account = Account("a", threshold=4, on_over=calls.append)
    loans = [account.loan(1) for _ in range(4)]
    assert calls == [], "at the threshold is not above it"
    loans.append(account.loan(1))
    assert calls == [True]
    loans.append(account.loan(1))
    assert calls == [True], "only edges are reported"
    for loan in loans[:3]:
        loan.repay()
    assert calls == [True]
    loans[3].repay()
    assert calls == [True, False] and account.debt == 2
    assert account.statistics().overdrafts == 1 and account.peak_debt == 6
    with pytest.raises(ValueError):
        Account("b", threshold=0)
    with pytest.raises(ValueError):
        account.loan(-1)


def test_reading_resumes_only_when_no_reason_to_pause_holds() -> None:
    log: list[str] = []
    reads = ReadPauses(lambda: log.append("pause"), lambda: log.append("resume"))
    reads.set("writing", True)
    reads.set("debt", True)
    reads.set("writing", True)
    assert log == ["pause"] and reads.paused
    reads.set("writing", False)
    assert log == ["pause"], "debt still holds"
    reads.set("debt", False)
    assert log == ["pause", "resume"] and not reads.paused and reads.pauses == 1
    reads.set("ring", False)
    assert log == ["pause", "resume"]


def test_durability_loans_are_repaid_in_log_order_as_the_log_becomes_durable() -> None:
    account = Account("a", threshold=100)
    loans = DurabilityLoans()
    for end in (64, 128, 192):
        loans.add("s", end, account)
    loans.add("t", 64, account)
    assert loans.settle("s", 130) == 2 and account.debt == 2
    assert loans.settle("missing", 1000) == 0
    assert loans.outstanding() == 2
    assert loans.settle("s", 192) == 1 and loans.settle("t", 64) == 1
    assert account.debt == 0 and loans.outstanding() == 0


def test_a_run_of_one_accounts_batches_shares_a_loan_repaid_when_the_run_is_durable() -> None:
    """One loan per run (not per batch), and a run never grows past its pass."""
    account = Account("a", threshold=100)
    other = Account("b", threshold=100)
    loans = DurabilityLoans()
    for end in (64, 128, 192):
        loans.add("s", end, account, run=1)
    assert account.debt == 3 and loans.outstanding() == 3
    loans.add("s", 256, other, run=1)  # another account: a loan of its own
    loans.add("s", 320, account, run=1)  # after it: not merged into the first run
    loans.add("s", 384, account, run=2)  # the next pass: a loan of its own
    assert account.debt == 5 and other.debt == 1
    assert loans.settle("s", 130) == 0 and account.debt == 5  # the run ends at 192
    assert loans.settle("s", 256) == 4 and account.debt == 2 and other.debt == 0
    assert loans.settle("s", 320) == 1 and loans.settle("s", 384) == 1
    assert account.debt == 0 and loans.outstanding() == 0
    assert account.statistics().loans == 5  # a unit per batch, as before


# --- in the gateway, over real sockets ------------------------------------------


def only_connection(gateway: Gateway) -> object:
    (conn,) = gateway.connections.values()
    return conn


async def test_a_connection_over_its_threshold_stops_being_read_and_resumes(
    tmp_path: Path,
) -> None:
    # No automatic group commit: batches wait for the disk until the test
    # commits, so each one keeps a unit of debt.
    gw = Gateway(config(tmp_path, group_commit_interval_ms=600_000.0, max_connection_debt=8))
    await gw.start()
    try:
        peer = RawPeer()
        await peer.connect(gw.address)
        h = await peer.bind("p")
        await peer.until(lambda: peer.session.outbound(m.data_channel(h)).guarantees > 1000)
        (conn,) = gw.connections.values()
        for i in range(12):
            assert peer.session.send_batch(h, i, encode_records([b"x"]))
        await peer.send()
        await peer.until(lambda: conn.account.debt > 8)
        stats = gw.connection_statistics()[0]
        assert stats.paused and stats.pause_reasons == ("debt",)
        assert stats.account.debt == 12
        assert conn.transport is not None and not conn.transport.is_reading()

        # A client that keeps writing fills the socket buffers, then blocks:
        # TCP pushes back, since the gateway reads nothing.
        sock = peer.writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        blob = ping_pairs(4096, nonce=7)  # Pings alone would be cut off (the Ping rule)
        pings = 0
        blocked = False
        for _ in range(2000):  # at most ~70 MB: far beyond any loopback buffer
            peer.writer.write(blob)
            pings += 4096
            try:
                await asyncio.wait_for(peer.writer.drain(), 0.3)
            except TimeoutError:
                blocked = True
                break
        assert blocked, "the gateway kept reading"
        assert pings * len(blob) // 4096 < 32 << 20
        assert conn.reads.paused and conn.ring.statistics().in_use < 1 << 20

        # The disk catches up: the debt is repaid, reading resumes, and every
        # ping written meanwhile is answered.
        await gw.commit()
        assert conn.account.debt <= 4 and not conn.reads.paused

        def pongs() -> int:
            return sum(
                1
                for e in peer.events
                if isinstance(e, MessageReceived) and isinstance(e.message, m.Pong)
            )

        await peer.until(lambda: pongs() == pings, timeout=30)
        await peer.until(lambda: peer.acked(h) == 12)
        assert len(stored(tmp_path / "data", "p")) == 12
        # No work in flight: no debt.
        await gw.commit()
        assert conn.account.debt == 0
        assert gw.connection_statistics()[0].pauses >= 1
        await peer.close()
    finally:
        await gw.stop()


async def test_a_connection_with_no_work_in_flight_owes_nothing(tmp_path: Path) -> None:
    gw = Gateway(config(tmp_path))
    await gw.start()
    try:
        peers = [RawPeer(producer_id=i + 1) for i in range(3)]
        for n, peer in enumerate(peers):
            await peer.connect(gw.address)
            h = await peer.bind(f"s{n}")
            await peer.until(
                lambda p=peer, h=h: p.session.outbound(m.data_channel(h)).guarantees > 0
            )
            for i in range(30):
                await peer.until(lambda p=peer, h=h: p.session.can_send_batch(h, 20))
                peer.session.send_batch(h, i, encode_records([b"y" * 10]))
                await peer.send()
            await peer.until(lambda p=peer, h=h: p.acked(h) == 30)
        for stats in gw.connection_statistics():
            assert stats.account.debt == 0 and stats.account.loans >= 60
            assert stats.ring.messages == 0
        assert gw.durability.outstanding() == 0 and len(gw.queue) == 0
        for peer in peers:
            await peer.close()
    finally:
        await gw.stop()


def test_a_loan_for_a_queue_grows_and_is_repaid_in_parts() -> None:
    """One loan stands for the batches of a connection in its ring: a unit each."""
    account = Account("a", threshold=2)
    ring = account.loan(1)
    ring.grow(2)
    assert account.debt == 3 and account.over
    ring.repay_part(2)
    assert account.debt == 1 and not account.over and not ring.repaid
    with pytest.raises(RuntimeError):
        ring.repay_part(2)  # more than it holds
    ring.repay_part(1)
    assert ring.repaid and account.debt == 0
    with pytest.raises(RuntimeError):
        ring.grow(1)  # a repaid loan is not reused: take a new one
