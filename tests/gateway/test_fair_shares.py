"""Sharing a stream among its writers, and the Plead deadline, without a network.

``fair_shares`` is a pure function of the writers and ``now``; the Plead
deadline is a pure function of a stream's state and ``now``. Both are
tested here with time as an argument; tests/gateway/test_sharing.py runs
the same rules against a real gateway.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from headgate.costs import batch_cost
from headgate.gateway.streams import (
    ASK_INTERVAL_S,
    IDLE_AFTER_S,
    USE_HALF_LIFE_S,
    Stream,
    Writer,
    fair_shares,
)
from headgate.protocol import messages as m
from headgate.protocol.records import encode_records
from headgate.protocol.session import Role, Session, StreamBound

FLOOR = 1000


def writers_of(layout: Sequence[tuple[str | None, int]], now: float = 0.0) -> list[Writer]:
    """Writers for ``layout``: one connection per entry, (party, handles on the stream).

    Each connection is a gateway session that a producer session really
    bound the stream on, ``handles`` times (a share counts what each
    handle's channel holds).
    """
    out = []
    for party, handles in layout:
        session = Session(Role.GATEWAY, data_cost=batch_cost)
        producer = Session(Role.PRODUCER, data_cost=batch_cost)
        producer.send_global(m.Hello(producer_id=1, client_name="t"))
        session.receive_data(producer.data_to_send())
        session.send_global(m.Welcome(server_name="g", max_message_size=4096, idle_timeout_ms=0))
        session.grant(m.STREAM_CHANNEL, 1 << 20)
        producer.receive_data(session.data_to_send())
        bound = [producer.bind_stream("s") for _ in range(handles)]
        events = session.receive_data(producer.data_to_send())
        assert len([e for e in events if isinstance(e, StreamBound)]) == handles
        for handle in bound:
            assert handle is not None
            out.append(
                Writer(
                    session=session,
                    stream="s",
                    flush=lambda: None,
                    handle=handle,
                    producer_id=0,
                    last_active=now,
                    party=party,
                )
            )
    return out


def per_connection(writers: list[Writer], shares: dict[int, int]) -> dict[int, int]:
    sums: dict[int, int] = {}
    for w in writers:
        sums[id(w.session)] = sums.get(id(w.session), 0) + shares[id(w)]
    return sums


def test_a_thousand_handles_on_one_connection_take_one_connections_part() -> None:
    good, *flood = writers_of([(None, 1), (None, 1000)])
    shares = fair_shares(1_000_000, FLOOR, [good, *flood], now=0.0)
    assert shares[id(good)] == 500_000
    assert sum(shares[id(w)] for w in flood) <= 500_000


def test_connections_of_one_token_share_that_tokens_part() -> None:
    good, *many = writers_of([("good", 1)] + [("attacker", 1)] * 60)
    shares = fair_shares(600_000, FLOOR, [good, *many], now=0.0)
    assert shares[id(good)] == 300_000
    assert sum(shares[id(w)] for w in many) <= 300_000


def test_an_idle_connection_keeps_a_floor_and_its_part_moves_to_the_active_ones() -> None:
    stale = writers_of([(None, 3)], now=0.0)
    [busy] = writers_of([(None, 1)], now=IDLE_AFTER_S + 1)
    shares = fair_shares(100_000, FLOOR, [*stale, busy], now=IDLE_AFTER_S + 1)
    assert sum(shares[id(w)] for w in stale) <= FLOOR
    assert shares[id(busy)] == 100_000 - FLOOR


@given(
    total=st.integers(0, 1 << 32),
    floor=st.integers(0, 1 << 20),
    layout=st.lists(
        st.tuples(st.sampled_from([None, "a", "b", "c"]), st.integers(1, 30)),
        min_size=1,
        max_size=12,
    ),
    idle=st.lists(st.booleans(), min_size=12, max_size=12),
)
def test_shares_never_exceed_the_total_and_each_connection_gets_an_equal_part(
    total: int,
    floor: int,
    layout: list[tuple[str | None, int]],
    idle: list[bool],
) -> None:
    """The shares never sum to more than the stream's capacity minus its reserve
    (``total``); and with everyone active and no tokens, every connection gets
    an equal part however many handles it bound (short only of rounding)."""
    now = 10.0
    writers: list[Writer] = []
    for (party, handles), quiet in zip(layout, idle, strict=False):
        writers += writers_of([(party, handles)], now=0.0 if quiet else now)
    shares = fair_shares(total, floor, writers, now=now)
    assert set(shares) == {id(w) for w in writers}
    assert all(share >= 0 for share in shares.values())
    assert sum(shares.values()) <= total

    anonymous = writers_of([(None, handles) for _, handles in layout], now=now)
    parts = per_connection(anonymous, fair_shares(total, floor, anonymous, now=now))
    equal = total // len(layout)
    for (_, handles), part in zip(layout, parts.values(), strict=True):
        assert equal - handles < part <= equal


# --- credit follows use --------------------------------------------------------------

START = 10_000


def test_a_writer_that_used_nothing_gets_the_first_grant_and_the_rest_stays_unassigned() -> None:
    [idle] = writers_of([(None, 1)])
    limited: set[int] = set()
    shares = fair_shares(1_000_000, FLOOR, [idle], now=0.0, start=START, limited=limited)
    assert shares[id(idle)] == START
    assert limited == {id(idle)}


def test_use_earns_twice_itself_up_to_the_fair_part() -> None:
    a, b = writers_of([(None, 1), (None, 1)])
    a.note_sent(50_000, 0.0)
    b.note_sent(900_000, 0.0)
    limited: set[int] = set()
    shares = fair_shares(1_000_000, FLOOR, [a, b], now=0.0, start=START, limited=limited)
    # a wants START + 2 x 50,000; b wants more than all: b gets what a leaves.
    assert shares[id(a)] == START + 100_000
    assert shares[id(b)] == 1_000_000 - shares[id(a)]
    assert limited == {id(a)}


def test_use_halves_every_half_life() -> None:
    [w] = writers_of([(None, 1)])
    w.note_sent(500_000, 0.0)
    assert w.recent_use(0.0) == 500_000
    assert w.recent_use(USE_HALF_LIFE_S) == 250_000
    assert w.recent_use(3 * USE_HALF_LIFE_S) == 62_500
    w.note_sent(1_000, USE_HALF_LIFE_S)
    assert w.recent_use(USE_HALF_LIFE_S) == 251_000
    assert w.recent_use(None) == 251_000  # as last noted
    assert w.recent_use(20.0) < 1


def test_a_thousand_unused_handles_take_one_first_grant_not_a_thousand() -> None:
    good, *flood = writers_of([(None, 1), (None, 1000)])
    good.note_sent(10_000_000, 0.0)
    shares = fair_shares(1_000_000, FLOOR, [good, *flood], now=0.0, start=START)
    assert sum(shares[id(w)] for w in flood) <= START
    assert shares[id(good)] >= 1_000_000 - START


@given(
    total=st.integers(0, 1 << 32),
    start=st.integers(0, 1 << 24),
    use=st.lists(st.integers(0, 1 << 30), min_size=1, max_size=20),
    parties=st.lists(st.sampled_from([None, "a", "b"]), min_size=20, max_size=20),
)
def test_shares_that_follow_use_never_exceed_the_total_or_the_fair_part_of_the_greedy(
    total: int, start: int, use: list[int], parties: list[str | None]
) -> None:
    """Caps by use only ever leave space unassigned or move it to who wants it:
    the sum stays within ``total``, nobody gets more than it wants, and a
    writer whose every level wants more than an equal part is not cut below
    what it would get with no caps at all."""
    writers = [w for party, u in zip(parties, use, strict=False) for w in writers_of([(party, 1)])]
    for w, u in zip(writers, use, strict=True):
        w.note_sent(u, 0.0)
    limited: set[int] = set()
    shares = fair_shares(total, FLOOR, writers, now=0.0, start=start, limited=limited)
    plain = fair_shares(total, FLOOR, writers, now=0.0)
    assert sum(shares.values()) <= total
    for w, u in zip(writers, use, strict=True):
        assert shares[id(w)] <= start + 2 * u or w.party is not None
        if id(w) not in limited:
            assert shares[id(w)] >= plain[id(w)]


# --- the Plead deadline, with time as an argument ------------------------------------


def bound_writer(stream: Stream, producer_id: int, now: float) -> tuple[Writer, Session]:
    """A gateway session with the stream bound by a producer session, and its Writer."""
    gateway = Session(Role.GATEWAY, data_cost=batch_cost)
    producer = Session(Role.PRODUCER, data_cost=batch_cost)
    producer.send_global(m.Hello(producer_id=producer_id, client_name="t"))
    gateway.receive_data(producer.data_to_send())
    gateway.send_global(m.Welcome(server_name="g", max_message_size=4096, idle_timeout_ms=0))
    gateway.grant(m.STREAM_CHANNEL, 1024)
    producer.receive_data(gateway.data_to_send())
    handle = producer.bind_stream(stream.name)
    assert handle is not None
    events = gateway.receive_data(producer.data_to_send())
    assert StreamBound(handle=handle, stream=stream.name) in events
    writer = Writer(
        session=gateway,
        stream=stream.name,
        flush=lambda: None,
        handle=handle,
        producer_id=producer_id,
        last_active=now,
    )
    stream.add_writer(writer)
    return writer, producer


def busy(writer: Writer, now: float) -> None:
    """The writer sends as if it used all it could get: its use earns it all of its share."""
    writer.note_sent(1 << 30, now)


def open_stream(tmp_path: Path) -> Stream:
    return Stream.open(
        "s", tmp_path, capacity=256 * 1024, term_length=64 * 1024, max_message_size=4096
    )


def test_a_writer_that_ignores_a_plead_is_overdue_at_the_deadline(tmp_path: Path) -> None:
    stream = open_stream(tmp_path)
    try:
        first, first_peer = bound_writer(stream, 1, now=0.0)
        busy(first, 0.0)
        stream.rebalance_credit(0.0)
        first_peer.receive_data(first.session.data_to_send())  # it holds everything
        held = first.session.inbound(first.channel).client_guarantees
        assert held > 0
        bound_writer(stream, 2, now=1.0)
        stream.rebalance_credit(1.0)  # the second starves: the first is pleaded
        assert first.pleaded is not None and first.pleaded_at == 1.0
        assert stream.overdue_pleas(5.99, 5.0) == []
        # The Plead never reaches the first writer's peer (it ignores it).
        [(late, amount)] = stream.overdue_pleas(6.0, 5.0)
        assert late is first and amount == held - first.pleaded > 0
    finally:
        stream.close()


def test_a_writer_that_absolves_as_pleaded_is_never_overdue(tmp_path: Path) -> None:
    stream = open_stream(tmp_path)
    try:
        first, first_peer = bound_writer(stream, 1, now=0.0)
        busy(first, 0.0)
        stream.rebalance_credit(0.0)
        first_peer.receive_data(first.session.data_to_send())
        bound_writer(stream, 2, now=1.0)
        stream.rebalance_credit(1.0)
        # The producer's session absolves at once when pleaded.
        first_peer.receive_data(first.session.data_to_send())
        first.session.receive_data(first_peer.data_to_send())
        assert first.session.inbound(first.channel).client_guarantees <= (first.pleaded or 0)
        assert stream.overdue_pleas(100.0, 5.0) == []
        assert first.pleaded_at is None
    finally:
        stream.close()


def test_use_asks_for_a_rebalance_at_most_once_per_interval_for_the_whole_stream(
    tmp_path: Path,
) -> None:
    stream = open_stream(tmp_path)
    try:
        pairs = [bound_writer(stream, producer, now=0.0) for producer in (1, 2)]
        stream.rebalance_credit(0.0)
        for writer, peer in pairs:
            assert writer.wants_more, "held to a first grant for want of use"
            peer.receive_data(writer.session.data_to_send())
            # Use more than half of it: the batches wait in the channel.
            held = peer.outbound(writer.channel).guarantees
            block = encode_records([b"x" * 1000])
            sequence = 0
            while peer.outbound(writer.channel).guarantees > held // 2 - 2000:
                assert peer.send_batch(writer.handle, sequence, block)
                sequence += 1
            writer.session.receive_data(peer.data_to_send())
        (first, _), (second, _) = pairs
        assert stream.wants_credit(first, 1.0)
        assert not stream.wants_credit(first, 1.0), "once per rebalance"
        assert not stream.wants_credit(second, 1.0 + ASK_INTERVAL_S / 2), "once per interval"
        assert stream.wants_credit(second, 1.0 + ASK_INTERVAL_S)
    finally:
        stream.close()
