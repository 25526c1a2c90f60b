"""The cost model and its budgets, with time as an argument (no clock, no network)."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

from headgate.config import ConfigError, GatewayConfig, load_gateway_config
from headgate.gateway.budget import (
    SHORT_SLICE_UNITS,
    Cost,
    HandshakeBudgets,
    LogLimiter,
    PeerShares,
    WorkBudget,
    address_key,
    token_key,
)
from headgate.gateway.turns import (
    ALONE_SECONDS,
    MAX_DEBT_PASSES,
    QUANTUM_SECONDS,
    TURN_COST,
    TURN_SECONDS,
    Passes,
    SharedWork,
    TurnShare,
    TurnTaker,
)


def test_a_budget_pays_a_burst_at_once_then_its_rate_and_says_how_long_a_debt_waits() -> None:
    budget = WorkBudget(rate=1000, burst=500, now=0.0)
    assert budget.charge(500, now=0.0) == 0.0
    # 100 units in debt at 1000 a second: a tenth of a second to wait.
    assert budget.charge(100, now=0.0) == pytest.approx(0.1)
    assert budget.wait(now=0.05) == pytest.approx(0.05)
    assert budget.wait(now=0.1) == 0.0
    # Idle time refills it, but never beyond its burst.
    budget.charge(0, now=100.0)
    assert budget.balance == 500


def test_the_connections_of_one_cause_share_one_budget_and_the_last_one_closes_it() -> None:
    shares = PeerShares(rate=1000, burst=1000)
    first = shares.join(token_key("t"), now=0.0)
    second = shares.join(token_key("t"), now=0.0)
    other = shares.join(address_key("10.0.0.1"), now=0.0)
    assert first is second and first is not other
    assert first.connections == 2 and len(shares) == 2
    # Sixty connections' worth of Pings from one token: one budget pays, so
    # the second connection waits for what the first spent.
    assert first.charge(1000, now=0.0) == 0.0
    assert second.charge(Cost.CONTROL, now=0.0) > 0
    assert other.charge(Cost.CONTROL, now=0.0) == 0.0
    shares.leave(first, now=0.0)
    assert shares.get(token_key("t")) is second
    shares.leave(second, now=0.0)
    shares.leave(other, now=0.0)
    # Spent shares stay until they have refilled (see the next test); then
    # the registry holds only shares in use.
    shares.prune(now=10.0)
    assert len(shares) == 0, "the registry holds only shares in use"


def test_a_peer_that_reconnects_finds_the_budget_it_left_not_a_full_one() -> None:
    shares = PeerShares(rate=1000, burst=1000, max_idle=2)
    spent = shares.join(address_key("10.0.0.1"), now=0.0)
    spent.charge(3000, now=0.0)  # its burst and two seconds more
    shares.leave(spent, now=0.0)
    again = shares.join(address_key("10.0.0.1"), now=0.5)
    assert again is spent and again.wait(now=0.5) == pytest.approx(1.5)
    shares.leave(again, now=0.5)
    # Refilled (at 3 s), it is forgotten; the registry keeps at most
    # max_idle shares without connections, the oldest forgotten first.
    shares.prune(now=3.0)
    assert shares.get(address_key("10.0.0.1")) is None
    for host in ("10.0.0.2", "10.0.0.3", "10.0.0.4"):
        left = shares.join(address_key(host), now=4.0)
        left.charge(500, now=4.0)
        shares.leave(left, now=4.0)
    assert len(shares) == 2 and shares.get(address_key("10.0.0.2")) is None


def test_handshakes_per_address_are_a_rate_and_quiet_addresses_are_forgotten() -> None:
    handshakes = HandshakeBudgets(rate=2, max_addresses=3)
    flood = address_key("10.0.0.9")
    assert [handshakes.admit(flood, now=0.0) for _ in range(3)] == [True, True, False]
    assert handshakes.admit(address_key("10.0.0.8"), now=0.0), "another address has its own"
    assert not handshakes.admit(flood, now=0.1)
    assert handshakes.admit(flood, now=0.6)
    handshakes.forget_refilled(now=10.0)
    assert len(handshakes) == 0
    # Beyond max_addresses, new addresses share one bucket: bounded memory.
    for i in range(3):
        assert handshakes.admit(address_key(f"10.1.0.{i}"), now=20.0)
    assert handshakes.admit(address_key("10.2.0.1"), now=20.0)
    assert handshakes.admit(address_key("10.2.0.2"), now=20.0)
    assert not handshakes.admit(address_key("10.2.0.3"), now=20.0)
    assert len(handshakes) == 4


def test_a_flood_of_refusals_is_a_few_log_lines_that_count_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("headgate.test.limiter")
    limiter = LogLimiter(logger, lines=3, interval=1.0)
    with caplog.at_level(logging.WARNING, logger=logger.name):
        logged = [limiter.warning(0.001 * i, "refused %d", i) for i in range(100)]
        assert sum(logged) == 3
        assert limiter.suppressed == 97
        assert limiter.warning(1.5, "refused %d", 100)
    lines = [r.getMessage() for r in caplog.records if r.name == logger.name]
    assert lines == [
        "refused 0",
        "refused 1",
        "refused 2",
        "refused 100 (97 more like this not logged)",
    ]


def test_a_handshake_refused_for_the_rate_is_held_until_its_address_may_have_one() -> None:
    """Refused at once, a flood retries at once; held, it tries about as often as it is let in."""
    handshakes = HandshakeBudgets(rate=4, max_hold=1.0, max_held=6)
    flood = address_key("10.0.0.9")
    assert all(handshakes.admit(flood, now=0.0) for _ in range(4))
    assert not handshakes.admit(flood, now=0.0)
    key, seconds = handshakes.hold(flood, now=0.0)
    assert seconds == pytest.approx(0.25), "a quarter second: one handshake at 4 a second"
    assert handshakes.held == 1
    other = address_key("10.0.0.8")
    assert handshakes.hold(other, now=0.0)[1] == 0.0, "it has handshakes: refused otherwise"
    # Those held from one address are let go one by one, at its rate; at
    # most max_held in all, whatever the addresses: the rest are closed at once.
    held = [handshakes.hold(flood, now=0.0)[1] for _ in range(6)]
    assert held == [pytest.approx(0.5), pytest.approx(0.75), 1.0, 1.0, 1.0, 0.0]
    for _ in range(6):
        handshakes.release(key)
    assert handshakes.held == 0
    # Never longer than max_hold, and a held address is not forgotten meanwhile.
    slow = HandshakeBudgets(rate=0.1, max_hold=1.0)
    assert slow.admit(flood, now=0.0)
    assert slow.hold(flood, now=0.0)[1] == 1.0
    slow.forget_refilled(now=100.0)
    assert len(slow) == 1


def test_costs_are_named_and_a_listing_or_a_page_grows_with_what_it_serves() -> None:
    assert Cost.CONTROL == Cost.FRAME + Cost.PING
    assert Cost.FRAME > 0, "an empty frame is charged too"
    assert Cost.of_bytes(1024) == Cost.PER_KIB
    list_200 = Cost.LIST_STREAMS + 200 * Cost.LIST_ENTRY
    assert list_200 > 100 * Cost.CONTROL


async def test_a_turn_of_expensive_frames_ends_after_its_cost_not_its_bytes() -> None:
    """Each slice costs half a turn: two slices a turn, however fast they are."""
    slices: list[int] = []
    pending = {"bytes": 1 << 20}
    turns: list[int] = []

    def step(limit: int) -> int:
        took = min(limit, pending["bytes"])
        pending["bytes"] -= took
        if took:
            slices.append(took)
            taker.spend(TURN_COST / 2)
        return took

    def done() -> None:
        turns.append(len(slices))

    taker = TurnTaker(step, done, lambda backlogged: None, lambda: False)
    taker.received()
    assert turns == [2], "the first turn ended after two expensive slices"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while pending["bytes"] and loop.time() < deadline:
        await asyncio.sleep(0)
    assert not pending["bytes"]
    # No turn took more than two: 1 MiB of cheap bytes would have gone in four.
    assert max(b - a for a, b in zip([0, *turns], turns, strict=False)) == 2


def test_max_control_rate_names_its_replacement(tmp_path: Path) -> None:
    path = tmp_path / "gw.toml"
    path.write_text("[gateway]\nmax_control_rate = 5000\n")
    with pytest.raises(
        ConfigError, match="max_control_rate is no longer a setting: use work_budget_ms"
    ):
        load_gateway_config(path)


def test_fair_share_settings_come_from_the_file_and_default_from_max_connections(
    tmp_path: Path,
) -> None:
    defaults = GatewayConfig(max_connections=64).validate()
    assert defaults.token_connections == 16 and defaults.writer_slots_kept == 8
    assert GatewayConfig(max_connections=4).validate().writer_slots_kept == 1
    path = tmp_path / "gw.toml"
    path.write_text(
        "[gateway]\nwork_budget_ms = 20\nmax_subscriptions = 8\nsubscriptions_per_token = 16\n"
        "connections_per_token = 5\nwriter_slots = 3\nhandshake_rate = 7.5\n"
        "max_pending_handshakes = 9\n"
    )
    cfg = load_gateway_config(path)
    assert (cfg.work_budget_ms, cfg.max_subscriptions, cfg.subscriptions_per_token) == (20, 8, 16)
    assert (cfg.token_connections, cfg.writer_slots_kept) == (5, 3)
    assert (cfg.handshake_rate, cfg.max_pending_handshakes) == (7.5, 9)
    for bad, fragment in [
        ("work_budget_ms = 0", "work_budget_ms"),
        ("writer_slots = 1024", "writer_slots"),
        ("handshake_rate = 0", "handshake_rate"),
        ("max_subscriptions = 0", "max_subscriptions"),
        ('handshake_rate = "fast"', "expected a number per second"),
    ]:
        path.write_text(f"[gateway]\n{bad}\n")
        with pytest.raises(ConfigError, match=fragment):
            load_gateway_config(path)


def test_the_connections_of_a_share_in_debt_wake_in_turn_not_all_at_once() -> None:
    """Sixty connections of one token wake about as often as one does."""
    shares = PeerShares(rate=10_000, burst=10_000)
    alone = shares.join(token_key("one"), now=0.0)
    joined = [shares.join(token_key("sixty"), now=0.0) for _ in range(60)]
    many = joined[0]
    assert all(share is many for share in joined)
    alone.charge(11_000, now=0.0)
    many.charge(11_000, now=0.0)
    # 1,000 units of debt at 10,000 a second: a tenth of a second alone; with
    # sixty, each also waits for a short slice of every other one.
    assert alone.wait(now=0.0) == pytest.approx(0.1)
    assert many.wait(now=0.0) == pytest.approx(0.1 + 59 * SHORT_SLICE_UNITS / 10_000)
    assert many.wait(now=0.1) == 0.0, "out of debt: no wait at all"


class _Backlog:
    """A connection with ``pending`` bytes to decode, cheap ones, in its own TurnTaker."""

    def __init__(self, passes: Passes | None, share: TurnShare | None, pending: int) -> None:
        self.pending = pending
        self.taken = 0
        self.taker = TurnTaker(
            self.step, lambda: None, lambda backlogged: None, lambda: False, passes, lambda: share
        )

    def step(self, limit: int) -> int:
        took = min(limit, self.pending)
        self.pending -= took
        self.taken += took
        return took


async def _run_passes(backlogs: list[_Backlog], passes: int) -> None:
    for backlog in backlogs:
        backlog.taker.received()
    for _ in range(passes):
        await asyncio.sleep(0)


async def test_the_connections_of_one_cause_share_one_turn_a_pass() -> None:
    """Four connections of one token, all busy, get what one connection of another gets."""
    passes = Passes()
    crowd = TurnShare()
    alone = TurnShare()
    many = [_Backlog(passes, crowd, 64 << 20) for _ in range(4)]
    one = _Backlog(passes, alone, 64 << 20)
    await _run_passes([*many, one], 200)
    crowd_took = sum(b.taken for b in many)
    assert one.taken > 0 and crowd_took > 0
    # Per connection they would take four times as much as the one; per cause, about as much.
    assert 0.5 < crowd_took / one.taken < 2.0, (crowd_took, one.taken)
    # Within the cause, every connection has its turns.
    assert min(b.taken for b in many) > crowd_took / 8


class _CountingPasses(Passes):
    """Passes that count how often each cause asked for a turn."""

    __slots__ = ("visits",)

    def __init__(self) -> None:
        super().__init__()
        self.visits: dict[int, int] = {}

    def visit(self, share: TurnShare) -> None:
        self.visits[id(share)] = self.visits.get(id(share), 0) + 1
        super().visit(share)


async def test_the_put_off_connections_of_a_cause_wait_unscheduled() -> None:
    """Sixteen busy connections of one cause cost a pass about one callback, not sixteen.

    Only the first of a cause's put-off connections asks for a turn in each
    pass; the others wait unscheduled until they are next, and every one of
    them still has its turns, also when the first one goes away.
    """
    passes = _CountingPasses()
    crowd, alone = TurnShare(), TurnShare()
    many = [_Backlog(passes, crowd, 64 << 20) for _ in range(16)]
    one = _Backlog(passes, alone, 64 << 20)
    await _run_passes([*many, one], 100)
    assert passes.visits[id(crowd)] < 3 * 100, passes.visits[id(crowd)]
    assert min(b.taken for b in many) > 0, "every connection of the cause has turns"
    # The ones that go away (the first in the queue among them) hand on the turn.
    for backlog in many[:14]:
        backlog.taker.cancel()
    before = [b.taken for b in many[14:]]
    for _ in range(20):
        await asyncio.sleep(0)
    assert all(b.taken > t for b, t in zip(many[14:], before, strict=True))


async def test_a_cause_that_wants_little_makes_nobody_wait() -> None:
    """A Ping every pass from another cause is no reason to hold a busy cause back:
    only causes that both use a fair part of the passes share them."""

    async def busy_pair(with_pinger: bool) -> tuple[int, int]:
        passes = Passes()
        busy, light = TurnShare(), TurnShare()
        heavy = [_Backlog(passes, busy, 64 << 20) for _ in range(2)]
        pinger = _Backlog(passes, light, 0)
        for backlog in heavy:
            backlog.taker.received()
        for _ in range(50):
            if with_pinger:
                pinger.pending += 12
                pinger.taker.received()
            await asyncio.sleep(0)
        for backlog in heavy:
            backlog.taker.cancel()
        return sum(b.taken for b in heavy), pinger.taken

    pinged, pings = await busy_pair(with_pinger=True)
    unpinged, _ = await busy_pair(with_pinger=False)
    assert pinged >= 0.9 * unpinged, (pinged, unpinged)
    assert pings == 50 * 12, "and the light one has every turn it wants"


async def test_a_cause_alone_takes_every_turn_its_connections_want() -> None:
    """Nobody else wants a turn: the four connections of one cause are not held back."""
    passes = Passes()
    crowd = TurnShare()
    shared = [_Backlog(passes, crowd, 64 << 20) for _ in range(4)]
    await _run_passes(shared, 50)
    unshared = [_Backlog(None, None, 64 << 20) for _ in range(4)]
    await _run_passes(unshared, 50)
    assert sum(b.taken for b in shared) >= 0.9 * sum(b.taken for b in unshared)


async def test_a_cause_alone_uses_one_turns_time_a_pass_however_many_connections_it_has() -> None:
    """Sixteen busy connections of one cause, alone: a pass lasts about one turn, not sixteen.

    Whoever comes next (another producer's batch, a Hello) waits for the
    pass under way; so a cause's connections take their turns one after
    another, and every one of them still has turns.
    """
    passes = Passes()
    crowd = TurnShare()
    step_seconds = ALONE_SECONDS / 4
    steps_in: dict[int, int] = {}

    class Dear(_Backlog):
        def step(self, limit: int) -> int:
            until = time.monotonic() + step_seconds
            while time.monotonic() < until:
                pass
            steps_in[passes.number] = steps_in.get(passes.number, 0) + 1
            return super().step(limit)

    many = [Dear(passes, crowd, 64 << 20) for _ in range(16)]
    await _run_passes(list(many), 64)
    for backlog in many:
        backlog.taker.cancel()
    # A turn ends after the slice that reached the time: ALONE_SECONDS / step_seconds
    # steps, and one more (sixteen turns would be 80).
    assert max(steps_in.values()) <= 6, steps_in
    assert min(b.taken for b in many) > 0, "every connection of the cause has turns"


async def test_a_producer_between_its_sends_still_shares_the_loop_with_a_flood() -> None:
    """A cause that wants the loop every few passes (a producer waiting for its
    Acks between sends) keeps the loop shared in between: the flooding cause
    gets its quantum a pass, not a whole turn, so the producer's next send
    never waits for a long pass."""
    passes = Passes()
    flood, producer = TurnShare(), TurnShare()
    step_seconds = QUANTUM_SECONDS / 2
    flood_steps: dict[int, int] = {}

    class Dear(_Backlog):
        def __init__(self, share: TurnShare, pending: int, counts: dict[int, int] | None) -> None:
            super().__init__(passes, share, pending)
            self.counts = counts

        def step(self, limit: int) -> int:
            until = time.monotonic() + step_seconds
            while time.monotonic() < until:
                pass
            if self.counts is not None:
                self.counts[passes.number] = self.counts.get(passes.number, 0) + 1
            return super().step(min(limit, 4096))

    flooders = [Dear(flood, 64 << 20, flood_steps) for _ in range(2)]
    sender = Dear(producer, 0, None)
    for backlog in flooders:
        backlog.taker.received()
    sends_at: list[int] = []
    for i in range(48):
        if i % 4 == 0:  # a send every fourth pass, heavy enough to count
            sends_at.append(passes.number)
            sender.pending += 4096  # one step: heavy, and done in its pass
            sender.taker.received()
        await asyncio.sleep(0)
    for backlog in [*flooders, sender]:
        backlog.taker.cancel()
    between = [n for n in flood_steps if n > sends_at[1]]
    assert between
    # A quantum is two steps (and one that crosses it); a whole turn would be eight.
    assert max(flood_steps[n] for n in between) <= 4, flood_steps


async def test_work_for_several_writers_is_paid_by_their_causes_per_writer() -> None:
    """A stream's Acks for three writers, two of one cause: it pays two thirds.
    What one writer's cause was charged inside it already is not charged again."""
    charged: dict[int, float] = {}

    class Spy(Passes):
        def spent(self, share: TurnShare, seconds: float) -> None:
            charged[id(share)] = charged.get(id(share), 0.0) + seconds
            super().spent(share, seconds)

    passes = Spy()
    many, one = TurnShare(), TurnShare()
    with SharedWork(passes, [many, many, one]):
        until = time.monotonic() + 0.003
        while time.monotonic() < until:
            pass
        passes.spent(one, 0.0015)  # its own write, charged to it at once
    own = 0.0015
    shared = charged[id(many)] * 3 / 2
    assert shared >= 0.003 - own - 1e-4
    assert charged[id(one)] == pytest.approx(own + shared / 3)
    assert passes.turn is None, "the work ended: nothing is excluded from later charges"


async def test_a_cause_whose_batches_cost_more_to_store_gets_fewer_turns() -> None:
    """The log writer's appends are taken from the cause's time too (deficit round robin)."""
    passes = Passes()
    dear, cheap = TurnShare(), TurnShare()
    dear_conn = _Backlog(passes, dear, 64 << 20)
    cheap_conn = _Backlog(passes, cheap, 64 << 20)
    step = dear_conn.step

    def dear_step(limit: int) -> int:
        took = step(limit)
        if took:
            # Each slice's appends cost two whole turns of time, after the turn.
            asyncio.get_running_loop().call_soon(passes.spent, dear, 2 * TURN_SECONDS)
        return took

    dear_conn.taker._step = dear_step
    await _run_passes([dear_conn, cheap_conn], 300)
    assert cheap_conn.taken > 0 and dear_conn.taken > 0
    assert dear_conn.taken < cheap_conn.taken / 2, (dear_conn.taken, cheap_conn.taken)


async def test_a_debt_run_up_while_alone_is_forgiven_when_others_come() -> None:
    """Debts are only between causes: alone, a cause's appends put it in no debt."""
    passes = Passes()
    share = TurnShare()
    passes.visit(share)
    passes.spent(share, 10.0)
    assert share.credit >= -MAX_DEBT_PASSES * QUANTUM_SECONDS
    await asyncio.sleep(0)  # a new pass, still alone
    passes.visit(share)
    assert share.credit == QUANTUM_SECONDS


async def test_time_a_turn_charges_to_other_causes_is_not_charged_to_its_own() -> None:
    """A turn that writes the queued batches of another cause (before a control
    message) charges those appends to that cause only, not to itself as well."""
    import time

    passes = Passes()
    own, other = TurnShare(), TurnShare()
    writes = 0.0

    def step(limit: int) -> int:
        nonlocal writes
        started = time.monotonic()
        while time.monotonic() - started < 0.01:
            pass  # the appends of the other cause's batches
        writes = time.monotonic() - started
        passes.spent(other, writes)
        return 0  # then nothing more to decode

    taker = TurnTaker(
        step, lambda: None, lambda backlogged: None, lambda: False, passes, lambda: own
    )
    taker.received()
    assert writes >= 0.01
    assert other.used == pytest.approx(writes)
    assert own.used < 0.25 * writes, (own.used, writes)
    assert passes.turn is None


def test_a_flood_of_one_record_batches_costs_few_dedup_snapshots() -> None:
    """Each dedup snapshot is two fsyncs on the event loop: 20,000 one-record
    batches (under half a second of a flood) call for none."""
    from headgate.gateway.dedup import snapshot_due
    from headgate.log import frame_cost
    from headgate.protocol.records import encode_records

    one_record = frame_cost(len(encode_records([b"n" * 100])))
    assert not snapshot_due(20_000, 20_000 * one_record)
    assert snapshot_due(40_000, 40_000 * one_record), "but the frames a restart reads stay bounded"
